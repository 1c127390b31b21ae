#!/usr/bin/env bash
# Elastic mode, step 1: the Ray head, a CPU VM that runs `ray start --head` and the driver.
#
# Idempotent. Makes the firewall rule NAME-ray (TCP between the cluster's VMs only: Ray has no
# authentication) unless it exists; creates the head VM (--head-name, default NAME-head;
# --head-machine-type) unless it exists, after uploading this checkout to --code-url (default
# WORKDIR/code/dipaco_jax.tar.gz; --repo-url clones instead); a stopped head is started. Its
# startup script installs the code in --node-dir and keeps `ray start --head` running on its
# internal IP, dashboard off. Example:
#   launch/ray_head.sh --project=my-proj --zone=us-west4-a --name=dipaco-ray \
#     --workdir=gs://my-bucket/runs/2x4-elastic

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DRY_RUN_ASSUME=absent
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

parse_flags "$@"
validate_ray
ensure_firewall
ensure_head
note "the pool joins the head's internal IP at port $RAY_PORT: launch/ray_workers.sh looks it up"
