#!/usr/bin/env bash
# Elastic mode, step 2: the pool of spot TPU VMs NAME-0 .. NAME-<N-1> (--pool-size) that join Ray.
#
# Idempotent, one look at each VM (create.sh's step): absent ones are created with --spot (if
# given), the tag of the firewall rule and a startup script that installs the pinned stack
# (constraints.txt) and keeps `ray start --address=HEAD:PORT --resources='{"TPU": chips}'` running.
# A re-created VM runs it again at boot and joins by itself. A preempted VM is re-created only with
# --recreate (ray_watch.sh does it for you). HEAD is --head-address, by default the head VM's
# internal IP. Example:
#   launch/ray_workers.sh --project=my-proj --zone=us-west4-a --name=dipaco-ray \
#     --accelerator-type=v5litepod-4 --pool-size=2 --spot --workdir=gs://my-bucket/runs/2x4-elastic

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DRY_RUN_ASSUME=absent
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

parse_flags "$@"
validate_ray
ensure_pool "$RECREATE"
