"""launch/create.sh, and the bad arguments every script stops on before gcloud."""

import pathlib
import subprocess
import sys

import pytest

from launch_sandbox import BASE
from launch_sandbox import FAKE_GCLOUD
from launch_sandbox import LAUNCH
from launch_sandbox import MULTI
from launch_sandbox import QR_DESCRIBE
from launch_sandbox import TRAIN
from launch_sandbox import VM_DESCRIBE
from launch_sandbox import WHERE
from launch_sandbox import dry_and_real
from launch_sandbox import gcloud_calls

# --- shellcheck --------------------------------------------------------------------------------


def test_scripts_pass_shellcheck():
  # Each file on its own (following `source` takes 8x longer), so SC1091 (a sourced file not
  # followed) goes; settings are assigned by name from one table (printf -v), which shellcheck
  # cannot follow: SC2034 (assigned, unused) and SC2153 (used, never assigned) are false alarms.
  shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
  fakes = [FAKE_GCLOUD.parent / tool for tool in ("uv", "curl", "date")]
  proc = subprocess.run(
    [shellcheck, "-S", "warning", "-e", "SC1091,SC2034,SC2153"]
    + sorted(LAUNCH.glob("*.sh"))
    + fakes,
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout


# --- create.sh -------------------------------------------------------------------------------


def test_create_single_host_spot(box):
  dry, real = dry_and_real(box, "create.sh", *BASE, "--accelerator-type=v4-8", "--spot")
  create = [
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    "r",
    *WHERE,
    "--accelerator-type=v4-8",
    "--version=tpu-ubuntu2204-base",
    "--spot",
  ]
  assert gcloud_calls(dry) == real == [VM_DESCRIBE, create]


def test_create_preemptible_and_version_flag(box):
  box.ok(
    "create.sh", *BASE, "--accelerator-type=v6e-8", "--preemptible", "--runtime-version=v2-custom"
  )
  assert box.calls()[-1][-3:] == [
    "--accelerator-type=v6e-8",
    "--version=v2-custom",
    "--preemptible",
  ]


def test_create_multislice_queued_resource(box):
  dry, real = dry_and_real(box, "create.sh", *MULTI, "--spot")
  create = [
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "r",
    *WHERE,
    "--accelerator-type=v5litepod-16",
    "--runtime-version=v2-alpha-tpuv5-lite",
    "--node-count=2",
    "--node-prefix=r",
    "--spot",
  ]
  assert gcloud_calls(dry) == real == [QR_DESCRIBE, create]


def test_create_single_queued_resource_names_its_node(box):
  box.ok("create.sh", *BASE, "--accelerator-type=v5p-8", "--queued")
  assert box.calls()[-1][5:] == [
    *WHERE,
    "--accelerator-type=v5p-8",
    "--runtime-version=v2-alpha-tpuv5",
    "--node-id=r",
  ]


def test_create_reuses_an_active_resource(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  proc = box.ok("create.sh", *MULTI)
  assert [c[3] for c in box.calls()] == ["describe"] * 3
  assert "is ACTIVE: using it" in proc.stdout


def test_create_refuses_a_failed_resource_without_recreate(box):
  box.set_states({"queued-resources/r": ["FAILED"]})
  proc = box.run("create.sh", *MULTI)
  assert proc.returncode != 0
  assert "is FAILED" in proc.stderr and "--recreate" in proc.stderr
  assert box.calls() == [QR_DESCRIBE]


def test_create_recreate_deletes_then_creates(box):
  box.set_states({"tpu-vm/r": ["PREEMPTED"]})
  box.ok("create.sh", *BASE, "--recreate")
  assert [c[2:5] for c in box.calls()] == [
    ["tpu-vm", "describe", "r"],
    ["tpu-vm", "delete", "r"],
    ["tpu-vm", "create", "r"],
  ]
  assert box.calls()[1] == ["compute", "tpus", "tpu-vm", "delete", "r", *WHERE, "--quiet"]


def test_create_wait_polls_until_active(box):
  box.set_states(
    {
      "queued-resources/r": ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"],
      "tpu-vm/r-0": ["READY"],
      "tpu-vm/r-1": ["READY"],
    }
  )
  box.ok("create.sh", *MULTI, "--wait")
  assert [c[2:5] for c in box.calls()] == [["queued-resources", "describe", "r"]] * 3 + [
    ["tpu-vm", "describe", "r-0"],
    ["tpu-vm", "describe", "r-1"],
  ]


def test_describe_error_other_than_not_found_stops(box):
  (box.bin / "gcloud").write_text("#!/bin/sh\necho 'ERROR: PERMISSION_DENIED' >&2\nexit 1\n")
  proc = box.run("create.sh", *BASE)
  assert proc.returncode != 0 and "PERMISSION_DENIED" in proc.stderr


# --- bad arguments stop before any gcloud call ------------------------------------------------


@pytest.mark.parametrize(
  "args, env, message",
  [
    (["--accelerator-type=v9-8"], {}, "unknown accelerator type 'v9-8'"),
    (["--accelerator-type=v4-7"], {}, "v5litepod-{1,4,8,16,32,64,128,256}"),
    (["--node-count=0"], {}, "--node-count=0: need a whole number >= 1"),
    (["--node-count=two"], {}, "--node-count=two"),
    (["--project="], {}, "no project: pass --project"),
    (["--spot", "--preemptible"], {}, "exclude each other"),
    (["--preemptible", "--node-count=2"], {}, "queued resources"),
    (["--zonee=x"], {}, "unknown flag --zonee"),
    (["--name=My_TPU"], {}, "--name=My_TPU"),
    (["stray"], {}, "unexpected argument 'stray'"),
    ([], {"DIPACO_SPOT": "yes"}, "DIPACO_SPOT must be 0 or 1"),
  ],
)
def test_bad_argument_stops_before_gcloud(box, args, env, message):
  proc = box.run("create.sh", *BASE, *args, **env)
  assert proc.returncode == 2
  assert message in proc.stderr
  assert box.calls() == []


@pytest.mark.parametrize(
  "script",
  ["setup.sh", "train.sh", "logs.sh", "delete.sh", "watch.sh"]
  + [f"ray_{s}.sh" for s in ("head", "workers", "train", "watch", "status", "delete")],
)
@pytest.mark.parametrize(
  "args, message",
  [
    (["--zone=us-west4-a"], "no project"),
    ([*BASE, "--node-count=0"], "--node-count=0"),
    ([*BASE, "--accelerator-type=v5e-8"], "unknown accelerator type 'v5e-8'"),
  ],
)
def test_every_script_validates_first(box, script, args, message):
  proc = box.run(script, *args, *TRAIN)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config=configs/dipaco_2x4.py"], "no workdir"),
    (["--config=configs/dipaco_2x4.py", "--workdir=/tmp/run"], "must be a gs:// path"),
    (["--config=configs/nope.py", "--workdir=gs://b/r"], "--config=configs/nope.py: no such"),
    ([*TRAIN, "--env=1BAD"], "--env=1BAD: need KEY=VALUE"),
  ],
)
def test_bad_train_argument_stops_before_gcloud(box, args, message):
  proc = box.run("train.sh", *BASE, *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


def test_help_lists_flags_and_accelerators(box):
  out = box.ok("train.sh", "--help").stdout
  assert "Starts the trainer on every worker" in out
  assert "--node-count=..." in out and "v6e" in out and "v2-alpha-tpuv6e" in out
