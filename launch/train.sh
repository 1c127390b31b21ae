#!/usr/bin/env bash
# Starts the trainer on every worker of every slice, in the background, logging to --log-file.
#
# Every worker of every slice runs the same command; jax.distributed finds its peers. A worker
# where the trainer already runs is left alone (--restart replaces it). The trainer resumes from
# the workdir's last checkpoint, so running this again after an interruption continues the run.
# Example: launch/train.sh --project=my-proj --node-count=2 --config=configs/dipaco_2x4.py \
#            --workdir=gs://my-bucket/runs/2x4 \
#            -- --config.dipaco.init_from=gs://my-bucket/runs/dense_150m_24k

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
source "$LAUNCH_DIR/actions.sh"

parse_flags "$@"
validate_resource
validate_train
require_ready
train_workers
