#!/usr/bin/env bash
# Deletes the Ray pool's TPU VMs, then the head; the gs:// workdir and the firewall rule stay.
#
# Idempotent: what does not exist is skipped. The run resumes from its workdir on a new cluster
# (ray_head.sh, ray_workers.sh, ray_train.sh). Example:
#   launch/ray_delete.sh --project=my-proj --name=dipaco-ray --pool-size=2 --workdir=gs://b/run

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

parse_flags "$@"
validate_ray
delete_pool
state=$(head_state)
((DRY_RUN)) && note "dry run: assuming head $HEAD_NAME is $state"
if [[ -n $state ]]; then
  note "head $HEAD_NAME is $state: deleting it"
  instances delete "$HEAD_NAME" --quiet
else
  note "head $HEAD_NAME does not exist: nothing to delete"
fi
