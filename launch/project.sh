#!/usr/bin/env bash
# Step 0, once per project: enable the APIs, make the bucket, let the TPU VMs use it.
#
# Enables the Cloud TPU and Compute Engine APIs; creates the bucket (--bucket, default: the bucket
# of --workdir) in --location (default: the region of --zone) with uniform bucket-level access,
# unless it exists; grants roles/storage.objectAdmin on it to the TPU VMs' service account
# (--service-account, default: the project's Compute Engine default service account
# PROJECT_NUMBER-compute@developer.gserviceaccount.com, which TPU VMs run as unless create.sh is
# given another). Idempotent. Example:
#   launch/project.sh --project=my-proj --zone=us-west4-a --bucket=gs://my-bucket

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DRY_RUN_ASSUME=absent
source "$LAUNCH_DIR/actions.sh"

parse_flags "$@"
validate_project
if [[ -z $BUCKET && $WORKDIR == gs://?* ]]; then
  BUCKET=${WORKDIR#gs://}
  BUCKET="gs://${BUCKET%%/*}"
fi
[[ -n $BUCKET ]] || die "no bucket: pass --bucket=gs://NAME (or --workdir=gs://NAME/RUN)"
BUCKET="gs://${BUCKET#gs://}"
BUCKET=${BUCKET%/}
[[ ${BUCKET#gs://} =~ ^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$ ]] ||
  die "--bucket=$BUCKET: a bucket name is 3-63 lowercase letters, digits, dots, hyphens, underscores"
LOCATION=${LOCATION:-${ZONE%-*}}

run gcloud services enable tpu.googleapis.com compute.googleapis.com "--project=$PROJECT"

if ((DRY_RUN)); then
  run gcloud storage buckets describe "$BUCKET" "--project=$PROJECT" '--format=value(name)'
  note "dry run: assuming $BUCKET does not exist"
  exists=""
else
  err=$(mktemp)
  if run gcloud storage buckets describe "$BUCKET" "--project=$PROJECT" '--format=value(name)' \
    >/dev/null 2>"$err"; then
    exists=1
  elif grep -qi 'not.found\|404' "$err"; then
    exists=""
  else
    cat "$err" >&2
    rm -f "$err"
    die "gcloud could not describe $BUCKET (see above)"
  fi
  rm -f "$err"
fi
if [[ -n $exists ]]; then
  note "$BUCKET exists: using it"
else
  run gcloud storage buckets create "$BUCKET" "--project=$PROJECT" "--location=$LOCATION" \
    --uniform-bucket-level-access
fi

if [[ -z $SERVICE_ACCOUNT ]]; then
  if ((DRY_RUN)); then
    run gcloud projects describe "$PROJECT" '--format=value(projectNumber)'
    number=PROJECT_NUMBER
    note "dry run: PROJECT_NUMBER stands for the number the command above prints"
  else
    number=$(run gcloud projects describe "$PROJECT" '--format=value(projectNumber)')
    [[ $number =~ ^[0-9]+$ ]] || die "gcloud printed no project number for $PROJECT: '$number'"
  fi
  SERVICE_ACCOUNT="$number-compute@developer.gserviceaccount.com"
  note "the TPU VMs run as the Compute Engine default service account $SERVICE_ACCOUNT"
fi
run gcloud storage buckets add-iam-policy-binding "$BUCKET" "--project=$PROJECT" \
  "--member=serviceAccount:$SERVICE_ACCOUNT" --role=roles/storage.objectAdmin
note "done: $PROJECT can run TPU VMs that read and write $BUCKET"
