#!/usr/bin/env bash
# Keeps a synchronous run alive on preemptible TPUs, with no manual step after a preemption.
#
# Polls the TPU VM / queued resource (and its nodes) every --poll-seconds. Absent: create it.
# Preempted, failed or suspended: delete and re-create it. Provisioning or repairing: wait.
# Ready: set it up and start the run if it is new, or if it was not ready at the last poll (a
# repaired or re-created slice has lost its processes: the survivors are restarted too, since a
# synchronous run needs every worker). The same command resumes from the workdir's last
# checkpoint. While it is up: when the run's metrics (WORKDIR/metrics*.jsonl) got no new record
# for --stall-minutes since the last start, restart the trainer on every worker (it died or hangs
# on a healthy slice). Ctrl-C stops the watching, not the run. Example:
#   launch/watch.sh --project=my-proj --zone=us-west4-a --accelerator-type=v5litepod-16 \
#     --node-count=2 --spot --config=configs/dipaco_2x4.py --workdir=gs://my-bucket/runs/2x4 \
#     -- --config.dipaco.init_from=gs://my-bucket/runs/dense_150m_24k

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DRY_RUN_ASSUME=absent
source "$LAUNCH_DIR/actions.sh"

parse_flags "$@"
validate_resource
validate_train

# One poll in a subshell, so that a failed gcloud call (a network blip, an ssh to a worker that is
# still booting) costs one poll instead of the watcher. Exit 0: ready (and started if needed);
# 3: not ready; 4: ready, and the trainer was restarted for want of new metrics.
poll_once() {
  (
    set -e
    ensure_resource 1
    ((RESOURCE_READY)) || exit 3
    if ((START_NEEDED)); then
      setup_workers
      train_workers
    else
      restart_if_stalled
      ((!STALL_RESTARTED)) || exit 4
    fi
  )
}

watch_polls
