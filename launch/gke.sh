#!/usr/bin/env bash
# The spmd run on GKE: one JobSet, one Job per TPU slice (--node-count), one pod per TPU host.
#
# Idempotent. Fetches --cluster's credentials; uploads this checkout to --code-url (default
# WORKDIR/code/dipaco_jax.tar.gz; --repo-url clones instead); writes the JobSet manifest to
# TMPDIR/NAME-jobset.yaml and applies it, unless a JobSet NAME exists (--restart deletes it
# first; the run resumes from its checkpoint in --workdir). Each pod installs the code and the
# pinned stack with uv (launch/worker.sh install, as on TPU VMs) and runs the trainer with
# DIPACO_DISTRIBUTED=1; with several slices the MEGASCALE_* variables join them over DCN, the
# `path` mesh axis. The cluster needs JobSet and one multi-host TPU node pool of
# --accelerator-type per slice (--spot: Spot node pools). Example:
#   launch/gke.sh --project=my-proj --zone=us-west4-a --cluster=tpu-cluster --name=dipaco-2x4 \
#     --accelerator-type=v5litepod-16 --node-count=2 --config=configs/dipaco_2x4.py \
#     --workdir=gs://my-bucket/runs/2x4 -- --config.dipaco.init_from=gs://my-bucket/runs/dense

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$LAUNCH_DIR/actions.sh"

# GKE's node labels of a TPU generation.
gke_accelerator() {
  case $1 in
    v4) echo tpu-v4-podslice ;;
    v5litepod) echo tpu-v5-lite-podslice ;;
    v5p) echo tpu-v5p-slice ;;
    v6e) echo tpu-v6e-slice ;;
  esac
}

# The slice's chip topology, as GKE's node pools name it: v5e/v6e 2D (4 chips 2x2, 8 2x4, 16 4x4,
# ...), v4/v5p 3D (4 chips 2x2x1, 8 2x2x2, 16 2x2x4, ...): the last of the smallest sides doubles.
# Empty for a chip count that is not a power of two (v4-1536, v5p-6144, v5p-12288).
gke_topology() {
  local gen=$1 chips=$2 dims i low n=1
  ((chips > 0 && (chips & (chips - 1)) == 0)) || return 0
  case $gen in
    v4 | v5p) dims=(2 2 1) ;;
    *) dims=(1 1) ;;
  esac
  for i in "${dims[@]}"; do n=$((n * i)); done
  while ((n < chips)); do
    low=0
    for i in "${!dims[@]}"; do ((dims[i] <= dims[low])) && low=$i; done
    dims[low]=$((dims[low] * 2))
    n=$((n * 2))
  done
  (IFS=x && echo "${dims[*]}")
}

validate_gke() {
  validate_resource
  validate_train
  [[ $CLUSTER =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]] ||
    die "--cluster=$CLUSTER: give the GKE cluster's name (lowercase letters, digits, hyphens)"
  ((!PREEMPTIBLE && !RESERVED && !GUARANTEED)) && [[ -z $VALID_UNTIL_DURATION$VALID_UNTIL_TIME ]] ||
    die "--preemptible, --reserved, --guaranteed and --valid-until-* are for TPU VMs and queued" \
      "resources; on GKE the node pools hold the capacity (--spot: Spot node pools)"
  [[ $NODE_DIR =~ ^/[A-Za-z0-9_./-]+$ ]] || die "--node-dir=$NODE_DIR: need an absolute path"
  NODE_DIR=${NODE_DIR%/}
  CODE_URL=${CODE_URL:-${WORKDIR%/}/code/dipaco_jax.tar.gz}
  [[ $CODE_URL == gs://?* ]] || die "--code-url=$CODE_URL must be a gs:// object the pods can read"
  local gen=${ACCELERATOR_TYPE%-*} size=${ACCELERATOR_TYPE##*-}
  CHIPS=$size
  [[ $gen == v4 || $gen == v5p ]] && CHIPS=$((size / 2))
  TOPOLOGY=$(gke_topology "$gen" "$CHIPS")
  [[ -n $TOPOLOGY ]] ||
    die "--accelerator-type=$ACCELERATOR_TYPE: $CHIPS chips have no GKE topology here; pick a power-of-two size"
  HOST_CHIPS=$(chips_per_host)
  HOSTS=$((CHIPS / HOST_CHIPS))
  if ((NODE_COUNT > 1 && HOSTS == 1)); then
    die "--accelerator-type=$ACCELERATOR_TYPE is one host: GKE joins multi-host slices only" \
      "(e.g. v5litepod-16); use --node-count=1 or a larger slice"
  fi
}

# The pod's command: fetch the code, install it (worker.sh install), run the trainer in front.
pod_script() {
  local install
  install=(bash "$NODE_DIR/dipaco_jax.new/launch/worker.sh" install "--remote-dir=$NODE_DIR/dipaco_jax"
    "--venv=$NODE_DIR/venv" "--python-version=$PYTHON_VERSION" "--uv-version=$UV_VERSION"
    "--extras=$EXTRAS")
  [[ -n $PIP_ARGS ]] && install+=("--pip-args=$PIP_ARGS")
  trainer_args
  echo "set -euo pipefail"
  echo "mkdir -p $(shell_quote "$NODE_DIR")"
  fetch_code_lines
  shell_join "${install[@]}"
  echo
  echo "cd $(shell_quote "$NODE_DIR/dipaco_jax")"
  shell_join exec env ${TRAIN_ENV_LIST[@]+"${TRAIN_ENV_LIST[@]}"} "$NODE_DIR/venv/bin/python" -m \
    dipaco_jax.main "${TRAINER_LINE[@]}"
  echo
}

# A YAML double-quoted string: backslashes, quotes, newlines and tabs escaped.
yaml_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/\\t}
  printf '"%s"' "$s"
}

# The JobSet: replicated job `slice` x NODE_COUNT, each HOSTS pods on one node pool (exclusive
# topology); pod 0 of slice 0 is the coordinator.
jobset_manifest() {
  local spot=""
  ((SPOT)) && spot=$'\n              cloud.google.com/gke-spot: "true"'
  cat <<EOF
# dipaco_jax spmd run on GKE (launch/gke.sh): $NODE_COUNT x $ACCELERATOR_TYPE, $HOSTS host(s) per slice.
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: $NAME
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
spec:
  failurePolicy:
    maxRestarts: 3  # A failed pod restarts every slice; the trainer resumes from its checkpoint.
  replicatedJobs:
  - name: slice
    replicas: $NODE_COUNT
    template:
      spec:
        parallelism: $HOSTS
        completions: $HOSTS
        backoffLimit: 0
        template:
          spec:
            restartPolicy: Never
            hostNetwork: true
            dnsPolicy: ClusterFirstWithHostNet
            nodeSelector:
              cloud.google.com/gke-tpu-accelerator: $(gke_accelerator "${ACCELERATOR_TYPE%-*}")
              cloud.google.com/gke-tpu-topology: $TOPOLOGY$spot
            containers:
            - name: dipaco
              image: $IMAGE
              ports:
              - containerPort: 8471  # TPU runtime (ICI)
              - containerPort: 8080  # MegaScale (DCN between slices)
              - containerPort: 8476  # jax.distributed's coordinator
              env:
              - name: DIPACO_DISTRIBUTED
                value: "1"
EOF
  if ((NODE_COUNT > 1)); then
    cat <<EOF
              - name: MEGASCALE_NUM_SLICES
                value: "$NODE_COUNT"
              - name: MEGASCALE_SLICE_ID
                valueFrom:
                  fieldRef:
                    fieldPath: metadata.annotations['jobset.sigs.k8s.io/job-index']
              - name: MEGASCALE_COORDINATOR_ADDRESS
                value: "$NAME-slice-0-0.$NAME"
EOF
  fi
  cat <<EOF
              command: ["bash", "-c"]
              args:
              - $(yaml_str "$(pod_script)")
              resources:
                limits:
                  google.com/tpu: $HOST_CHIPS
EOF
}

# Prints the JobSet's name when it exists, nothing when it does not; dies on other errors.
jobset_exists() {
  local err out
  if ((DRY_RUN)); then
    run kubectl get jobset "$NAME" -o name
    return 0
  fi
  err=$(mktemp)
  if out=$(run kubectl get jobset "$NAME" -o name 2>"$err"); then
    rm -f "$err"
    printf '%s\n' "$out"
    return 0
  fi
  if grep -qi 'not.found' "$err"; then
    rm -f "$err"
    return 0
  fi
  cat "$err" >&2
  rm -f "$err"
  die "kubectl could not look up jobset $NAME (see above)"
}

parse_flags "$@"
validate_gke
run gcloud container clusters get-credentials "$CLUSTER" "--location=$ZONE" "--project=$PROJECT"
if [[ -n $(jobset_exists) ]]; then
  if ((!RESTART)); then
    note "jobset $NAME already exists: left alone (--restart deletes and re-applies it)"
    exit 0
  fi
  note "jobset $NAME exists: deleting it (--restart)"
  run kubectl delete jobset "$NAME" --wait=true
fi
if [[ -z $REPO_URL ]]; then
  pack_tree
  run gcloud storage cp "$TARBALL" "$CODE_URL" "--project=$PROJECT"
fi
MANIFEST="${TMPDIR:-/tmp}/$NAME-jobset.yaml"
jobset_manifest >"$MANIFEST"
note "JobSet manifest: $MANIFEST"
run kubectl apply -f "$MANIFEST"
note "pods: kubectl get pods -l jobset.sigs.k8s.io/jobset-name=$NAME; logs: kubectl logs -f $NAME-slice-0-0-<suffix>"
