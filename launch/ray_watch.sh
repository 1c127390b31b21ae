#!/usr/bin/env bash
# Keeps an elastic run going on spot TPU VMs: the head, the pool and the driver, no manual step.
#
# Every --poll-seconds: the firewall rule and the head as ray_head.sh (created if absent, started
# if stopped); every TPU VM of the pool as ray_workers.sh --recreate (a preempted one is deleted
# and re-created; its startup script joins it to the head at boot, and the driver gives it tasks).
# The driver is started (ray_train.sh) at the first poll that finds the head running and after the
# head was away; while it runs, when the task log (WORKDIR/elastic/tasks.jsonl, --metrics-file)
# got no line for --stall-minutes since the last start, the driver is restarted (it resumes from
# the workdir). A preempted VM costs only its tasks in flight: nothing is restarted for it. Ctrl-C
# stops the watching, not the run; after the run ends, stop it and run ray_delete.sh. Example:
#   launch/ray_watch.sh --project=my-proj --zone=us-west4-a --name=dipaco-ray \
#     --accelerator-type=v5litepod-4 --pool-size=2 --spot --config=configs/dipaco_2x4.py \
#     --workdir=gs://my-bucket/runs/2x4-elastic -- --config.routing.discriminative_at_outer_step=-1

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DRY_RUN_ASSUME=absent
source "$LAUNCH_DIR/actions.sh"
source "$LAUNCH_DIR/ray_actions.sh"

# The elastic driver appends to the task log at every task start and end; metrics.jsonl gets a
# record per phase only.
export DIPACO_METRICS_FILE=${DIPACO_METRICS_FILE-elastic/tasks.jsonl}
parse_flags "$@"
validate_ray

# One poll in a subshell, so that a failed gcloud call costs one poll instead of the watcher.
# Exit 0: head running (driver started if needed); 3: head not running; 4: driver restarted.
poll_once() {
  (
    set -e
    ((firewall_done)) || ensure_firewall
    ensure_head
    ((HEAD_READY)) || exit 3
    ensure_pool 1
    if ((START_NEEDED)); then
      start_driver
    else
      restart_if_stalled start_driver "the driver on the head"
      ((!STALL_RESTARTED)) || exit 4
    fi
  )
}

firewall_done=0
poll_reached() { firewall_done=1; }  # A poll got past ensure_firewall: it is not redone.
watch_polls
