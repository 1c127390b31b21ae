#!/usr/bin/env bash
# Shows the Ray cluster (`ray status`: nodes, TPU chips in use) and the driver's log on the head.
#
# Follows the log by default; --no-follow prints the last --lines and exits. The task log is in
# the workdir: gcloud storage cat WORKDIR/elastic/tasks.jsonl. Example:
#   launch/ray_status.sh --project=my-proj --name=dipaco-ray --workdir=gs://my-bucket/runs/x

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

parse_flags "$@"
validate_ray
_is_count "$TAIL_LINES" || die "--lines=$TAIL_LINES: need a whole number"
tail_cmd=(sudo tail -n "$TAIL_LINES")
((FOLLOW)) && tail_cmd+=(-F)
tail_cmd+=("$NODE_DIR/driver.log")
head_ssh "sudo $(shell_quote "$NODE_DIR/venv/bin/ray") status; $(shell_join "${tail_cmd[@]}")"
