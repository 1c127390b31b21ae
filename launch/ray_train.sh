#!/usr/bin/env bash
# Elastic mode, step 3: starts the elastic driver on the head, in the background.
#
# Runs the trainer in elastic mode (`--config.dipaco.mode=elastic`, `--config.elastic.address=auto`,
# `--config.elastic.num_workers` = the chips in the pool, one actor per chip with
# `--config.elastic.worker_resources='{"TPU": 1}'`) as root on the head (worker.sh start
# --no-distributed, logging to NODE_DIR/driver.log); trainer flags after `--` come last. A driver
# that already runs is left alone (--restart replaces it); a new one resumes the workdir.
# Example: launch/ray_train.sh --project=my-proj --name=dipaco-ray \
#   --accelerator-type=v5litepod-4 --pool-size=2 --config=configs/dipaco_2x4.py \
#   --workdir=gs://my-bucket/runs/2x4-elastic -- --config.routing.discriminative_at_outer_step=-1

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

parse_flags "$@"
validate_ray
require_head
start_driver
