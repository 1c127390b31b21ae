"""launch/create.sh's capacity flags for queued resources: reserved, guaranteed, valid until."""

import os
import pathlib
import shlex
import subprocess

import pytest

_LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"
_BASE = ["--project=my-proj", "--zone=us-west4-a", "--name=r"]
_MULTI = [*_BASE, "--accelerator-type=v5litepod-16", "--node-count=2"]
_CREATE = "gcloud compute tpus queued-resources create r --zone=us-west4-a --project=my-proj"


def create(tmp_path, *args) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
  env.update(HOME=str(tmp_path), TMPDIR=str(tmp_path))
  return subprocess.run(
    ["bash", str(_LAUNCH / "create.sh"), "--dry-run", *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
    check=False,
  )


def created(proc) -> list[str]:
  """The create command a dry run printed."""
  assert proc.returncode == 0, proc.stderr
  (line,) = [l for l in proc.stdout.splitlines() if " create " in l and not l.startswith("#")]
  return shlex.split(line)


@pytest.mark.parametrize(
  "args, tail",
  [
    (["--reserved"], ["--reserved"]),
    (["--guaranteed", "--valid-until-duration=6h"], ["--guaranteed", "--valid-until-duration=6h"]),
    (["--spot", "--valid-until-time=2026-12-01T09:00:00Z"],
     ["--spot", "--valid-until-time=2026-12-01T09:00:00Z"]),
    (["--valid-until-duration=1h30m"], ["--valid-until-duration=1h30m"]),
  ],
)  # fmt: skip
def test_a_multislice_queued_resource_takes_the_capacity_flags(tmp_path, args, tail):
  want = shlex.split(_CREATE) + [
    "--accelerator-type=v5litepod-16",
    "--runtime-version=v2-alpha-tpuv5-lite",
    "--node-count=2",
    "--node-prefix=r",
  ]
  assert created(create(tmp_path, *_MULTI, *args)) == want + tail


def test_a_single_queued_slice_takes_them_too(tmp_path):
  got = created(create(tmp_path, *_BASE, "--queued", "--reserved", "--valid-until-duration=2d"))
  assert got[-3:] == ["--node-id=r", "--reserved", "--valid-until-duration=2d"]


@pytest.mark.parametrize(
  "args, message",
  [
    (["--reserved"], "--reserved is a queued resource's: add --queued (or --node-count > 1)"),
    (["--valid-until-duration=6h"], "--valid-until-duration is a queued resource's"),
    (["--queued", "--spot", "--reserved"], "--spot, --reserved and --guaranteed each name the"),
    (["--queued", "--reserved", "--guaranteed"], "pick one"),
    (["--queued", "--valid-until-duration=6h", "--valid-until-time=2026-12-01T09:00:00Z"],
     "both set the expiry: pick one"),
    (["--queued", "--valid-until-duration=six hours"], "need a duration like 6h, 2d or 1h30m"),
    (["--queued", "--valid-until-time=tomorrow"], "need an RFC 3339 time"),
  ],
)  # fmt: skip
def test_bad_capacity_flags_stop_before_any_command(tmp_path, args, message):
  proc = create(tmp_path, *_BASE, *args)
  assert proc.returncode == 2 and proc.stdout == ""
  assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
