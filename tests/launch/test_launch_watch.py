"""launch/watch.sh: the preemption story and the stall check."""

import datetime

import pytest

from launch_sandbox import BASE
from launch_sandbox import MULTI
from launch_sandbox import TRAIN
from launch_sandbox import call_steps
from launch_sandbox import gcloud_calls
from launch_sandbox import printed

# --- watch.sh: the preemption story ------------------------------------------------------------


_LS_METRICS = "ls gs://b/run/metrics*.jsonl"


def _in_any_order(steps):
  """Steps with each run of setup calls (scp, install) sorted: slices are set up at once."""
  out, run = [], []
  for step in steps + ["end"]:
    if step.startswith(("scp ", "install")):
      run.append(step)
    else:
      out += sorted(run) + [step]
      run = []
  return out[:-1]


def test_watch_recreates_a_preempted_multislice_and_restarts(box):
  box.set_states(
    {
      "queued-resources/r": ["ACTIVE", "SUSPENDED"],
      "tpu-vm/r-0": ["READY"],
      "tpu-vm/r-1": ["READY"],
    }
  )
  box.ok("watch.sh", *MULTI, "--spot", *TRAIN, "--max-polls=3")
  ready = ["describe r", "describe r-0", "describe r-1"]
  assert _in_any_order(call_steps(box.calls())) == [
    *ready,
    "install r-0",
    "install r-1",
    "scp r-0",
    "scp r-1",
    "start r-0",
    "start r-1",
    "describe r",
    "delete r",
    "create r",
    *ready,
    "install+restart r-0",
    "install+restart r-1",
    "scp r-0",
    "scp r-1",
    "start+restart r-0",
    "start+restart r-1",
  ]
  assert "--spot" in box.calls()[11]


def test_watch_recreates_when_one_slice_was_preempted(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["PREEMPTED"]}
  )
  box.ok("watch.sh", *MULTI, *TRAIN, "--max-polls=1")
  assert call_steps(box.calls()) == [
    "describe r",
    "describe r-0",
    "describe r-1",
    "delete r",
    "create r",
  ]


def test_watch_waits_through_provisioning_and_repair(box):
  box.set_states({"tpu-vm/r": ["WAITING_FOR_RESOURCES", "READY", "REPAIRING", "READY"]})
  box.ok("watch.sh", *BASE, *TRAIN, "--repo-url=https://example.com/d.git", "--max-polls=5")
  assert call_steps(box.calls()) == [
    "describe r",
    "describe r",
    "install+restart r",
    "start+restart r",
    "describe r",
    "describe r",
    "install+restart r",
    "start+restart r",
    "describe r",
    _LS_METRICS,  # up, started at the previous poll: the stall check looks at the metrics
  ]


def test_watch_creates_a_missing_vm_and_starts(box):
  dry = box.ok("watch.sh", "--dry-run", *BASE, *TRAIN, "--repo-url=https://example.com/d.git")
  box.ok("watch.sh", *BASE, *TRAIN, "--repo-url=https://example.com/d.git", "--max-polls=2")
  assert call_steps(box.calls()) == [
    "describe r",
    "create r",
    "describe r",
    "install+restart r",
    "start+restart r",
  ]
  assert call_steps(gcloud_calls(printed(dry.stdout))) == [
    "describe r",
    "create r",
    "install r",
    "start r",
  ]


def test_watch_survives_a_failed_call_and_retries(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  proc = box.ok(
    "watch.sh",
    *BASE,
    *TRAIN,
    "--repo-url=https://example.com/d.git",
    "--max-polls=3",
    FAKE_GCLOUD_FAIL_ONCE="ssh",
  )
  assert "poll 1 failed" in proc.stdout and "connection reset" in proc.stderr
  assert call_steps(box.calls()) == [
    "describe r",
    "install r",
    "describe r",
    "install r",
    "start r",
    "describe r",
    _LS_METRICS,
  ]


def test_watch_gives_up_after_repeated_failures(box):
  (box.bin / "gcloud").write_text("#!/bin/sh\necho 'ERROR: PERMISSION_DENIED' >&2\nexit 1\n")
  proc = box.run("watch.sh", *BASE, *TRAIN, "--max-failures=2")
  assert proc.returncode == 2 and "2 polls in a row failed" in proc.stderr


_T0 = 1_700_000_000  # the fake clock at the watcher's first reading; each reading adds 10 min


def _iso(seconds):
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime(
    "%Y-%m-%dT%H:%M:%SZ"
  )


@pytest.mark.parametrize(
  "metrics, stall_minutes, restarted",
  [
    ([_iso(_T0 - 3600)], 30, True),  # older than the start: 30 min after the start, restart
    ([], 30, True),  # no metrics yet: likewise
    ([_iso(_T0 - 60), _iso(_T0 + 1200)], 30, False),  # the newest record is 20 min later
    ([], 0, False),  # the check is off
  ],
)
def test_watch_restarts_a_trainer_whose_metrics_stalled(box, metrics, stall_minutes, restarted):
  box.clock.write_text(str(_T0))
  states = {"tpu-vm/r": ["READY"]}
  if metrics:
    states["objects/gs://b/run/metrics*.jsonl"] = metrics
  box.set_states(states)
  proc = box.ok(
    "watch.sh",
    *BASE,
    *TRAIN,
    "--repo-url=https://example.com/d.git",
    "--max-polls=5",
    f"--stall-minutes={stall_minutes}",
    FAKE_CLOCK_STEP="600",
  )
  # Clock readings: poll 1 starts (start = T0); polls 2, 3, 4 look at T0 + 10, 20, 30 min. With
  # nothing newer than the start, poll 4 sees 30 min >= 30: restart (start = T0 + 40 min), and
  # poll 5 (T0 + 50 min) sees 10 min. A record at T0 + 20 min is 10 min old at poll 4, 20 at 5.
  look = ["describe r", _LS_METRICS] if stall_minutes else ["describe r"]
  restart = ["start+restart r"] if restarted else []
  assert call_steps(box.calls()) == [
    "describe r",
    "install r",
    "start r",
    *look,
    *look,
    *look,
    *restart,
    *look,
  ]
  stalled = "no new metrics record in gs://b/run/metrics*.jsonl for 30 minutes"
  assert (stalled in proc.stdout) == restarted


def test_watch_counts_a_failed_metrics_listing_as_a_failed_poll(box):
  box.clock.write_text(str(_T0))
  box.set_states({"tpu-vm/r": ["READY"], "objects/gs://b/run/metrics*.jsonl": ["DENIED"]})
  proc = box.ok(
    "watch.sh",
    *BASE,
    *TRAIN,
    "--repo-url=https://example.com/d.git",
    "--max-polls=5",
    FAKE_CLOCK_STEP="600",
  )
  # No news is not taken for a stall: polls 2-5 fail (4 < --max-failures=5), nothing restarts.
  assert (
    call_steps(box.calls())
    == ["describe r", "install r", "start r"]
    + [
      "describe r",
      _LS_METRICS,
    ]
    * 4
  )
  assert "poll 5 failed (exit 2); 4 in a row" in proc.stdout and "403" in proc.stderr
