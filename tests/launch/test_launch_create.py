"""Tests for launch/*.sh: a fake gcloud on PATH records every call; no cloud, no JAX."""

import datetime
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_LAUNCH = _ROOT / "launch"
_FAKE_GCLOUD = _ROOT / "tests" / "testdata" / "launch" / "gcloud"
_WHERE = ["--zone=us-west4-a", "--project=my-proj"]
_BASE = ["--project=my-proj", "--zone=us-west4-a", "--name=r"]
_MULTI = _BASE + ["--accelerator-type=v5litepod-16", "--node-count=2"]
_TRAIN = ["--config=configs/dipaco_2x4.py", "--workdir=gs://b/run"]


class Sandbox:
  """A HOME, a fake gcloud and date first on PATH, gcloud's call log and state, a tiny git repo."""

  def __init__(self, tmp: pathlib.Path):
    self.tmp = tmp
    self.bin = tmp / "bin"
    self.bin.mkdir()
    # The fake gcloud runs on this interpreter: `env python3` may be a slow pyenv shim.
    fake = _FAKE_GCLOUD.read_text().split("\n", 1)[1]
    (self.bin / "gcloud").write_text(f"#!{sys.executable}\n{fake}")
    (self.bin / "gcloud").chmod(0o755)
    shutil.copy(_FAKE_GCLOUD.parent / "date", self.bin / "date")
    self.clock = tmp / "clock"
    self.log = tmp / "calls.jsonl"
    self.state = tmp / "state.json"
    self.repo = tmp / "repo"
    (self.repo / "configs").mkdir(parents=True)
    (self.repo / "configs" / "dipaco_2x4.py").write_text("# config\n")
    (self.repo / ".gitignore").write_text(".venv/\n")
    (self.repo / ".venv").mkdir()
    (self.repo / ".venv" / "big").write_text("left out\n")
    subprocess.run(["git", "init", "-q", str(self.repo)], check=True)
    subprocess.run(["git", "-C", str(self.repo), "add", "."], check=True)
    (self.repo / "untracked.txt").write_text("copied too\n")
    self.env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
    self.env.update(
      PATH=f"{self.bin}:{os.environ['PATH']}",
      HOME=str(tmp),
      TMPDIR=str(tmp),
      FAKE_GCLOUD_LOG=str(self.log),
      FAKE_GCLOUD_STATE=str(self.state),
      FAKE_CLOCK=str(self.clock),
      REAL_DATE=shutil.which("date"),
      DIPACO_LOCAL_REPO=str(self.repo),
      DIPACO_POLL_SECONDS="0",
    )

  def set_states(self, states: dict[str, list[str]]):
    self.state.write_text(json.dumps(states))

  def run(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
      ["bash", str(_LAUNCH / script), *args],
      capture_output=True,
      text=True,
      env={**self.env, **env},
      timeout=60,
      check=False,
    )

  def ok(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
    proc = self.run(script, *args, **env)
    assert proc.returncode == 0, proc.stderr
    return proc

  def calls(self) -> list[list[str]]:
    if not self.log.exists():
      return []
    return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def box(tmp_path):
  return Sandbox(tmp_path)


def _printed(stdout: str, prefix: str = "") -> list[list[str]]:
  """The commands a run printed (dry run: bare lines; real run: '+ ' lines), as argv lists."""
  out = []
  for line in stdout.splitlines():
    if line.startswith("#") or not line.startswith(prefix):
      continue
    out.append(shlex.split(line[len(prefix) :]))
  return out


def _gcloud(cmds):
  return [c[1:] for c in cmds if c[0] == "gcloud"]


def _dry_and_real(box, script, *args):
  """Runs a script as a dry run and for real; checks both print the same commands."""
  dry = box.ok(script, "--dry-run", *args)
  assert box.calls() == [], "a dry run must not call gcloud"
  real = box.ok(script, *args)
  assert _printed(real.stdout, "+ ") == _printed(dry.stdout)
  return _printed(dry.stdout), box.calls()


def _describe(group, name, fmt="state"):
  return ["compute", "tpus", group, "describe", name, *_WHERE, f"--format=value({fmt})"]


_QR_DESCRIBE = _describe("queued-resources", "r", "state.state")
_VM_DESCRIBE = _describe("tpu-vm", "r")
_MULTI_READY = [_QR_DESCRIBE, _describe("tpu-vm", "r-0"), _describe("tpu-vm", "r-1")]


def _ssh(node, command, worker="all"):
  return [
    "compute",
    "tpus",
    "tpu-vm",
    "ssh",
    node,
    *_WHERE,
    f"--worker={worker}",
    f"--command={command}",
  ]


# --- shellcheck --------------------------------------------------------------------------------


def test_scripts_pass_shellcheck():
  # Each file on its own (following `source` takes 8x longer), so SC1091 (a sourced file not
  # followed) goes; settings are assigned by name from one table (printf -v), which shellcheck
  # cannot follow: SC2034 (assigned, unused) and SC2153 (used, never assigned) are false alarms.
  shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
  fakes = [_FAKE_GCLOUD.parent / tool for tool in ("uv", "curl", "date")]
  proc = subprocess.run(
    [shellcheck, "-S", "warning", "-e", "SC1091,SC2034,SC2153"]
    + sorted(_LAUNCH.glob("*.sh"))
    + fakes,
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout


# --- create.sh -------------------------------------------------------------------------------


def test_create_single_host_spot(box):
  dry, real = _dry_and_real(box, "create.sh", *_BASE, "--accelerator-type=v4-8", "--spot")
  create = [
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    "r",
    *_WHERE,
    "--accelerator-type=v4-8",
    "--version=tpu-ubuntu2204-base",
    "--spot",
  ]
  assert _gcloud(dry) == real == [_VM_DESCRIBE, create]


def test_create_preemptible_and_version_flag(box):
  box.ok(
    "create.sh", *_BASE, "--accelerator-type=v6e-8", "--preemptible", "--runtime-version=v2-custom"
  )
  assert box.calls()[-1][-3:] == [
    "--accelerator-type=v6e-8",
    "--version=v2-custom",
    "--preemptible",
  ]


def test_create_multislice_queued_resource(box):
  dry, real = _dry_and_real(box, "create.sh", *_MULTI, "--spot")
  create = [
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "r",
    *_WHERE,
    "--accelerator-type=v5litepod-16",
    "--runtime-version=v2-alpha-tpuv5-lite",
    "--node-count=2",
    "--node-prefix=r",
    "--spot",
  ]
  assert _gcloud(dry) == real == [_QR_DESCRIBE, create]


def test_create_single_queued_resource_names_its_node(box):
  box.ok("create.sh", *_BASE, "--accelerator-type=v5p-8", "--queued")
  assert box.calls()[-1][5:] == [
    *_WHERE,
    "--accelerator-type=v5p-8",
    "--runtime-version=v2-alpha-tpuv5",
    "--node-id=r",
  ]


def test_create_reuses_an_active_resource(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  proc = box.ok("create.sh", *_MULTI)
  assert [c[3] for c in box.calls()] == ["describe"] * 3
  assert "is ACTIVE: using it" in proc.stdout


def test_create_refuses_a_failed_resource_without_recreate(box):
  box.set_states({"queued-resources/r": ["FAILED"]})
  proc = box.run("create.sh", *_MULTI)
  assert proc.returncode != 0
  assert "is FAILED" in proc.stderr and "--recreate" in proc.stderr
  assert box.calls() == [_QR_DESCRIBE]


def test_create_recreate_deletes_then_creates(box):
  box.set_states({"tpu-vm/r": ["PREEMPTED"]})
  box.ok("create.sh", *_BASE, "--recreate")
  assert [c[2:5] for c in box.calls()] == [
    ["tpu-vm", "describe", "r"],
    ["tpu-vm", "delete", "r"],
    ["tpu-vm", "create", "r"],
  ]
  assert box.calls()[1] == ["compute", "tpus", "tpu-vm", "delete", "r", *_WHERE, "--quiet"]


def test_create_wait_polls_until_active(box):
  box.set_states(
    {
      "queued-resources/r": ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"],
      "tpu-vm/r-0": ["READY"],
      "tpu-vm/r-1": ["READY"],
    }
  )
  box.ok("create.sh", *_MULTI, "--wait")
  assert [c[2:5] for c in box.calls()] == [["queued-resources", "describe", "r"]] * 3 + [
    ["tpu-vm", "describe", "r-0"],
    ["tpu-vm", "describe", "r-1"],
  ]


def test_describe_error_other_than_not_found_stops(box):
  (box.bin / "gcloud").write_text("#!/bin/sh\necho 'ERROR: PERMISSION_DENIED' >&2\nexit 1\n")
  proc = box.run("create.sh", *_BASE)
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
  proc = box.run("create.sh", *_BASE, *args, **env)
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
    ([*_BASE, "--node-count=0"], "--node-count=0"),
    ([*_BASE, "--accelerator-type=v5e-8"], "unknown accelerator type 'v5e-8'"),
  ],
)
def test_every_script_validates_first(box, script, args, message):
  proc = box.run(script, *args, *_TRAIN)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config=configs/dipaco_2x4.py"], "no workdir"),
    (["--config=configs/dipaco_2x4.py", "--workdir=/tmp/run"], "must be a gs:// path"),
    (["--config=configs/nope.py", "--workdir=gs://b/r"], "--config=configs/nope.py: no such"),
    ([*_TRAIN, "--env=1BAD"], "--env=1BAD: need KEY=VALUE"),
  ],
)
def test_bad_train_argument_stops_before_gcloud(box, args, message):
  proc = box.run("train.sh", *_BASE, *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


def test_help_lists_flags_and_accelerators(box):
  out = box.ok("train.sh", "--help").stdout
  assert "Starts the trainer on every worker" in out
  assert "--node-count=..." in out and "v6e" in out and "v2-alpha-tpuv6e" in out


# --- setup.sh, train.sh, logs.sh ---------------------------------------------------------------

_INSTALL = (
  "bash dipaco_jax.new/launch/worker.sh install --remote-dir=dipaco_jax "
  "--venv=dipaco_venv --log-file=dipaco_train.log --python-version=3.11 --uv-version=0.13.9"
)


def test_setup_copies_the_tree_to_every_node(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  dry, real = _dry_and_real(box, "setup.sh", *_MULTI)
  tarball = f"{box.tmp}/r-code.tar.gz"
  assert [c for c in dry if c[0] == "tar"] == [
    ["tar", "-czf", tarball, "-C", str(box.repo), "-T", f"{tarball}.files"]
  ]
  unpack = (
    "rm -rf dipaco_jax.new && mkdir -p dipaco_jax.new && "
    f"tar -xzf dipaco_jax.tar.gz -C dipaco_jax.new && {_INSTALL}"
  )
  scp = lambda node: [
    "compute",
    "tpus",
    "tpu-vm",
    "scp",
    tarball,
    f"{node}:dipaco_jax.tar.gz",
    *_WHERE,
    "--worker=all",
  ]
  # The slices are set up at once: each one's calls keep their order, the two interleave.
  per_slice = [scp("r-0"), _ssh("r-0", unpack), scp("r-1"), _ssh("r-1", unpack)]
  assert _gcloud(dry) == [*_MULTI_READY, *per_slice]
  assert real[:3] == _MULTI_READY and sorted(real[3:]) == sorted(per_slice)
  assert [c for c in real[3:] if _steps([c])[0].endswith(" r-0")] == per_slice[:2]
  with tarfile.open(tarball) as tar:
    assert sorted(tar.getnames()) == [".gitignore", "configs/dipaco_2x4.py", "untracked.txt"]


def test_setup_git_clone_mode(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  box.ok(
    "setup.sh",
    *_BASE,
    "--repo-url=https://example.com/d.git",
    "--branch=dev",
    "--pip-args=-f https://example.com/libtpu.html",
  )
  clone = (
    "rm -rf dipaco_jax.new && git clone --depth=1 --branch=dev "
    "https://example.com/d.git dipaco_jax.new && "
    + _INSTALL
    + " --pip-args='-f https://example.com/libtpu.html'"
  )
  assert box.calls() == [_VM_DESCRIBE, _ssh("r", clone)]


def test_setup_refuses_a_resource_that_is_not_ready(box):
  box.set_states({"tpu-vm/r": ["CREATING"]})
  proc = box.run("setup.sh", *_BASE)
  assert proc.returncode == 2 and "is CREATING, not ready" in proc.stderr
  assert box.calls() == [_VM_DESCRIBE]


def test_train_starts_the_same_command_on_every_worker(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  args = [
    *_MULTI,
    *_TRAIN,
    "--data-dir=gs://b/tfds",
    "--vocab-path=gs://b/spm.model",
    "--env=TPU_STDERR_LOG_LEVEL=0",
    "--",
    "--config.mesh.data=4",
    "--config.note=a b",
  ]
  dry, real = _dry_and_real(box, "train.sh", *args)
  start = (
    "bash dipaco_jax/launch/worker.sh start --venv=dipaco_venv "
    "--log-file=dipaco_train.log --env=TPU_STDERR_LOG_LEVEL=0 -- "
    "--config=configs/dipaco_2x4.py --workdir=gs://b/run "
    "--config.data.tfds_data_dir=gs://b/tfds --config.data.vocab_path=gs://b/spm.model "
    "--config.mesh.data=4 --config.note='a b'"
  )
  assert _gcloud(dry) == real == [*_MULTI_READY, _ssh("r-0", start), _ssh("r-1", start)]
  assert shlex.split(start)[-1] == "--config.note=a b"


def test_logs_follows_worker_zero_by_default(box):
  box.ok("logs.sh", *_MULTI)
  assert box.calls() == [_ssh("r-0", "tail -n 100 -F dipaco_train.log", worker="0")]


def test_logs_every_slice_without_follow(box):
  box.ok("logs.sh", *_MULTI, "--node=all", "--worker=all", "--no-follow", "--lines=5")
  assert box.calls() == [_ssh(n, "tail -n 5 dipaco_train.log") for n in ("r-0", "r-1")]
  proc = box.run("logs.sh", *_MULTI, "--node=all")
  assert proc.returncode == 2 and "--no-follow" in proc.stderr


# --- delete.sh ---------------------------------------------------------------------------------


def test_delete_queued_resource(box):
  box.set_states({"queued-resources/r": ["SUSPENDED"]})
  dry, real = _dry_and_real(box, "delete.sh", *_MULTI)
  delete = ["compute", "tpus", "queued-resources", "delete", "r", *_WHERE, "--force", "--quiet"]
  assert _gcloud(dry) == real == [_QR_DESCRIBE, delete]


def test_delete_is_a_no_op_when_absent(box):
  proc = box.ok("delete.sh", *_BASE)
  assert box.calls() == [_VM_DESCRIBE] and "nothing to delete" in proc.stdout


# --- watch.sh: the preemption story ------------------------------------------------------------


def _steps(calls):
  """Each call as 'verb name' (ssh: start/install, +restart when it replaces; ls: metrics)."""
  out = []
  for c in calls:
    if c[:3] == ["storage", "ls", "-l"]:
      out.append(f"ls {c[3]}")
      continue
    verb, name = c[3], c[4]
    if verb == "scp":
      name = c[5].split(":")[0]
    elif verb == "ssh":
      command = next(a for a in c if a.startswith("--command="))
      verb = "start" if " start " in command else "install"
      verb += "+restart" if "--restart" in command else ""
    out.append(f"{verb} {name}")
  return out


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
  box.ok("watch.sh", *_MULTI, "--spot", *_TRAIN, "--max-polls=3")
  ready = ["describe r", "describe r-0", "describe r-1"]
  assert _in_any_order(_steps(box.calls())) == [
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
  box.ok("watch.sh", *_MULTI, *_TRAIN, "--max-polls=1")
  assert _steps(box.calls()) == [
    "describe r",
    "describe r-0",
    "describe r-1",
    "delete r",
    "create r",
  ]


def test_watch_waits_through_provisioning_and_repair(box):
  box.set_states({"tpu-vm/r": ["WAITING_FOR_RESOURCES", "READY", "REPAIRING", "READY"]})
  box.ok("watch.sh", *_BASE, *_TRAIN, "--repo-url=https://example.com/d.git", "--max-polls=5")
  assert _steps(box.calls()) == [
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
  dry = box.ok("watch.sh", "--dry-run", *_BASE, *_TRAIN, "--repo-url=https://example.com/d.git")
  box.ok("watch.sh", *_BASE, *_TRAIN, "--repo-url=https://example.com/d.git", "--max-polls=2")
  assert _steps(box.calls()) == [
    "describe r",
    "create r",
    "describe r",
    "install+restart r",
    "start+restart r",
  ]
  assert _steps(_gcloud(_printed(dry.stdout))) == ["describe r", "create r", "install r", "start r"]


def test_watch_survives_a_failed_call_and_retries(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  proc = box.ok(
    "watch.sh",
    *_BASE,
    *_TRAIN,
    "--repo-url=https://example.com/d.git",
    "--max-polls=3",
    FAKE_GCLOUD_FAIL_ONCE="ssh",
  )
  assert "poll 1 failed" in proc.stdout and "connection reset" in proc.stderr
  assert _steps(box.calls()) == [
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
  proc = box.run("watch.sh", *_BASE, *_TRAIN, "--max-failures=2")
  assert proc.returncode == 2 and "2 polls in a row failed" in proc.stderr


# --- worker.sh, run locally with a fake python ---------------------------------------------------


def _new_tree(box):
  """A fresh tree as setup.sh unpacks it on a worker: launch/ and constraints.txt."""
  new = box.tmp / "dipaco_jax.new"
  shutil.copytree(_LAUNCH, new / "launch")
  shutil.copy(_ROOT / "constraints.txt", new / "constraints.txt")
  return new


def test_worker_install_and_start_are_idempotent(box):
  shutil.copy(_FAKE_GCLOUD.parent / "curl", box.bin / "curl")
  shutil.copy(_FAKE_GCLOUD.parent / "uv", box.bin / "uv")  # what the fake installer copies
  new = _new_tree(box)
  worker = lambda tree, *args: (
    subprocess.run(
      ["bash", str(tree / "launch" / "worker.sh"), *args],
      capture_output=True,
      text=True,
      env=box.env,
      timeout=60,
      check=True,
    ).stdout
  )

  def wait_for_calls(n):
    """The fake trainer's recorded calls, once there are n."""
    calls_file = box.tmp / "python.calls"
    for _ in range(100):
      calls = calls_file.read_text().splitlines() if calls_file.exists() else []
      if len(calls) >= n:
        return calls
      time.sleep(0.05)
    raise AssertionError(f"the fake trainer started {len(calls)} times, not {n}")

  out = worker(new, "install", "--remote-dir=dipaco_jax", "--venv=v")
  tree = box.tmp / "dipaco_jax"
  assert not new.exists() and (tree / "launch" / "worker.sh").exists()
  venv = box.tmp / "v"
  install = f"pip install -q --python {venv}/bin/python -c {tree}/constraints.txt -e {tree}[tpu]"
  uv_calls = lambda: (box.tmp / "uv.calls").read_text().splitlines()
  assert (box.tmp / "curl.calls").read_text() == "-LsSf https://astral.sh/uv/0.13.9/install.sh\n"
  assert uv_calls() == [f"venv -q --python 3.11 {venv}", install]
  assert "installed" in out
  pids = []
  try:
    start = ["start", "--venv=v", "--log-file=logs/t.log", "--env=EXTRA=x"]
    trainer = ["--", "--workdir=gs://b"]
    worker(tree, *start, *trainer)
    pids.append(int((box.tmp / "logs" / "t.pid").read_text()))
    wait_for_calls(1)  # until then the pid may still be the forked worker.sh
    assert "already runs" in worker(tree, *start, *trainer)
    _new_tree(box)
    assert "left as is" in worker(
      new, "install", "--remote-dir=dipaco_jax", "--venv=v", "--log-file=logs/t.log"
    )
    assert not new.exists()
    worker(tree, *start, "--restart", *trainer)
    pids.append(int((box.tmp / "logs" / "t.pid").read_text()))
    assert pids[0] != pids[1]
    assert wait_for_calls(2) == ["1 x -m dipaco_jax.main --workdir=gs://b"] * 2
    assert (box.tmp / "logs" / "t.log").read_text().count("=== ") == 2
    # The elastic driver on the Ray head is one process: no jax.distributed.
    worker(tree, *start, "--restart", "--no-distributed", *trainer)
    pids.append(int((box.tmp / "logs" / "t.pid").read_text()))
    assert wait_for_calls(3)[2] == "0 x -m dipaco_jax.main --workdir=gs://b"
    worker(tree, "stop", "--log-file=logs/t.log")
    assert "no trainer running" in worker(tree, "stop", "--log-file=logs/t.log")
    # Installing again reuses uv and a venv that has the wanted Python; a venv with another one
    # (made by an older setup with the image's 3.10) is made again.
    _new_tree(box)
    assert "reusing it" in worker(
      new, "install", "--remote-dir=dipaco_jax", "--venv=v", "--extras=tpu,elastic"
    )
    assert uv_calls()[2:] == [install.replace("[tpu]", "[tpu,elastic]")]
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.10.12\n")
    _new_tree(box)
    assert "making venv" in worker(new, "install", "--remote-dir=dipaco_jax", "--venv=v")
    assert uv_calls()[3:] == [f"venv -q --python 3.11 {venv}", install]
    assert len((box.tmp / "curl.calls").read_text().splitlines()) == 1
  finally:
    for pid in pids:
      try:
        os.kill(pid, signal.SIGTERM)
      except ProcessLookupError:
        pass


# --- step 0, service account, internal IPs, slices in parallel, the stall check ---------------

_SA = "tpu@my-proj.iam.gserviceaccount.com"
_ENABLE = [
  "services",
  "enable",
  "tpu.googleapis.com",
  "compute.googleapis.com",
  "--project=my-proj",
]


def _bucket(verb, bucket, *flags):
  return ["storage", "buckets", verb, bucket, "--project=my-proj", *flags]


def _grant(bucket, account):
  return _bucket(
    "add-iam-policy-binding",
    bucket,
    f"--member=serviceAccount:{account}",
    "--role=roles/storage.objectAdmin",
  )


def test_project_enables_apis_makes_the_bucket_and_grants_the_tpu_account(box):
  args = ["--project=my-proj", "--zone=us-west4-a", "--workdir=gs://my-bucket/runs/x"]
  describe = _bucket("describe", "gs://my-bucket", "--format=value(name)")
  create = _bucket(
    "create", "gs://my-bucket", "--location=us-west4", "--uniform-bucket-level-access"
  )
  number = ["projects", "describe", "my-proj", "--format=value(projectNumber)"]
  dry = box.ok("project.sh", "--dry-run", *args)
  assert box.calls() == []
  default_account = "PROJECT_NUMBER-compute@developer.gserviceaccount.com"
  assert _gcloud(_printed(dry.stdout)) == [
    _ENABLE,
    describe,
    create,
    number,
    _grant("gs://my-bucket", default_account),
  ]
  real = box.ok("project.sh", *args)
  default_account = "123456789012-compute@developer.gserviceaccount.com"  # the fake's number
  assert box.calls() == [
    _ENABLE,
    describe,
    create,
    number,
    _grant("gs://my-bucket", default_account),
  ]
  assert _gcloud(_printed(real.stdout, "+ ")) == box.calls()


def test_project_reuses_a_bucket_and_grants_the_given_account(box):
  box.set_states({"buckets/gs://team-b": ["team-b"]})
  proc = box.ok("project.sh", "--project=my-proj", "--bucket=team-b/", f"--service-account={_SA}")
  assert box.calls() == [
    _ENABLE,
    _bucket("describe", "gs://team-b", "--format=value(name)"),
    _grant("gs://team-b", _SA),
  ]
  assert "gs://team-b exists: using it" in proc.stdout


@pytest.mark.parametrize(
  "args, message",
  [
    ([], "no bucket: pass --bucket=gs://NAME"),
    (["--bucket=gs://My_Bucket"], "--bucket=gs://My_Bucket: a bucket name is"),
    (["--bucket=b", "--service-account=me"], "--service-account=me is not a service account"),
    (["--bucket=bb", "--zone=west"], "--zone=west is not a zone name"),
  ],
)
def test_project_bad_argument_stops_before_gcloud(box, args, message):
  proc = box.run("project.sh", "--project=my-proj", *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


def test_create_with_service_account_and_internal_ips(box):
  flags = [f"--service-account={_SA}", "--internal-ip"]
  box.ok("create.sh", *_BASE, "--accelerator-type=v4-8", *flags, "--spot")
  assert box.calls()[-1][5:] == [
    *_WHERE,
    "--accelerator-type=v4-8",
    "--version=tpu-ubuntu2204-base",
    f"--service-account={_SA}",
    "--internal-ips",
    "--spot",
  ]
  box.ok("create.sh", *_MULTI, "--name=q", *flags)
  assert box.calls()[-1][2:5] == ["queued-resources", "create", "q"]
  assert box.calls()[-1][-4:] == [
    "--node-count=2",
    "--node-prefix=q",
    f"--service-account={_SA}",
    "--internal-ips",
  ]


def test_internal_ip_reaches_the_workers_by_internal_ip(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  box.ok("setup.sh", *_BASE, "--internal-ip")
  box.ok("logs.sh", *_BASE, "--internal-ip", "--no-follow")
  scp, ssh, tail = [c for c in box.calls() if c[3] in ("scp", "ssh")]
  assert scp[3:] == [
    "scp",
    f"{box.tmp}/r-code.tar.gz",
    "r:dipaco_jax.tar.gz",
    *_WHERE,
    "--worker=all",
    "--internal-ip",
  ]
  assert ssh[-1] == tail[-1] == "--internal-ip"
  assert tail[:-1] == _ssh("r", "tail -n 100 dipaco_train.log", worker="0")


def test_setup_runs_the_slices_at_once_and_names_the_ones_that_failed(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  # Each slice's ssh waits until the other's has begun: in turn, the first would wait alone.
  proc = box.ok("setup.sh", *_MULTI, FAKE_GCLOUD_BARRIER="r-0,r-1")
  logs = box.tmp / "r-setup"
  assert f"setup on 2 slices in parallel; logs: {logs}/<slice>.log" in proc.stdout
  for node in ("r-0", "r-1"):
    assert f"tpu-vm ssh {node} " in (logs / f"{node}.log").read_text()
  proc = box.run("setup.sh", *_MULTI, FAKE_GCLOUD_FAIL_NODE="r-1")
  assert proc.returncode == 2
  assert f"setup failed on 1 of 2 slices: r-1 (exit 1); see the logs in {logs}" in proc.stderr
  assert "scp to r-1 failed" in proc.stdout  # its log, shown after the others
  assert "--- setup of r-0 (exit 0;" in proc.stdout
  assert _steps(box.calls())[-3:] in (
    ["scp r-0", "scp r-1", "install r-0"],
    ["scp r-1", "scp r-0", "install r-0"],
  )


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
    *_BASE,
    *_TRAIN,
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
  assert _steps(box.calls()) == [
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
    *_BASE,
    *_TRAIN,
    "--repo-url=https://example.com/d.git",
    "--max-polls=5",
    FAKE_CLOCK_STEP="600",
  )
  # No news is not taken for a stall: polls 2-5 fail (4 < --max-failures=5), nothing restarts.
  assert (
    _steps(box.calls())
    == ["describe r", "install r", "start r"]
    + [
      "describe r",
      _LS_METRICS,
    ]
    * 4
  )
  assert "poll 5 failed (exit 2); 4 in a row" in proc.stdout and "403" in proc.stderr


# --- ray_*.sh: elastic mode on a head CPU VM and a pool of spot TPU VMs ------------------------

_RAY = [*_BASE, "--accelerator-type=v5litepod-4", "--pool-size=2", *_TRAIN]
_HEAD_STATUS = [
  "compute",
  "instances",
  "describe",
  "r-head",
  *_WHERE,
  "--format=value(status)",
]
_HEAD_IP = [*_HEAD_STATUS[:-1], "--format=value(networkInterfaces[0].networkIP)"]
_FIREWALL = ["compute", "firewall-rules", "describe", "r-ray", "--project=my-proj"]
_FIREWALL += ["--format=value(name)"]


def _tpu_create(name, *flags):
  return [
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    name,
    *_WHERE,
    "--accelerator-type=v5litepod-4",
    "--version=v2-alpha-tpuv5-lite",
    *flags,
  ]


def _ray_start(script: str) -> list[str]:
  """The `ray start` line of a startup script's wrapper, as argv."""
  (line,) = [ln for ln in script.splitlines() if ln.startswith("exec ") and " start " in ln]
  return shlex.split(line)[1:]


def _check_script(path):
  """A generated startup script parses and passes shellcheck."""
  subprocess.run(["bash", "-n", str(path)], check=True)
  shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
  proc = subprocess.run(
    [shellcheck, "-S", "warning", str(path)], capture_output=True, text=True, check=False
  )
  assert proc.returncode == 0, proc.stdout


def test_ray_head_creates_firewall_code_and_head_once(box):
  dry, real = _dry_and_real(box, "ray_head.sh", *_RAY, "--internal-ip")
  tarball = f"{box.tmp}/r-code.tar.gz"
  startup = box.tmp / "r-ray-head.sh"
  firewall = ["compute", "firewall-rules", "create", "r-ray", "--project=my-proj"]
  firewall += ["--network=default", "--direction=INGRESS", "--action=ALLOW", "--rules=tcp"]
  firewall += ["--source-tags=r-ray", "--target-tags=r-ray"]
  upload = ["storage", "cp", tarball, "gs://b/run/code/dipaco_jax.tar.gz", "--project=my-proj"]
  create = ["compute", "instances", "create", "r-head", *_WHERE, "--machine-type=e2-standard-8"]
  create += ["--image-family=debian-12", "--image-project=debian-cloud", "--boot-disk-size=50GB"]
  create += ["--network=default", "--tags=r-ray", f"--metadata-from-file=startup-script={startup}"]
  create += ["--scopes=cloud-platform", "--no-address"]
  assert _gcloud(dry) == real == [_FIREWALL, firewall, _HEAD_STATUS, upload, create]
  with tarfile.open(tarball) as tar:
    assert "configs/dipaco_2x4.py" in tar.getnames()
  script = startup.read_text()
  _check_script(startup)
  assert "gcloud storage cp gs://b/run/code/dipaco_jax.tar.gz /opt/dipaco/code.tar.gz" in script
  assert "--venv=/opt/dipaco/venv" in script and "--extras=elastic\n" in script
  assert _ray_start(script) == [
    "/opt/dipaco/venv/bin/ray",
    "start",
    "--block",
    "--head",
    "--port=6379",
    "--include-dashboard=false",
    "--disable-usage-stats",
    "--node-ip-address=$ip",
  ]
  assert "computeMetadata/v1/instance/network-interfaces/0/ip" in script
  assert "Restart=always" in script and "systemctl restart dipaco-ray.service" in script
  # Again: both exist, nothing is created and no code is uploaded over the running cluster's.
  proc = box.ok("ray_head.sh", *_RAY)
  assert box.calls()[len(real) :] == [_FIREWALL, _HEAD_STATUS]
  assert "firewall rule r-ray exists" in proc.stdout and "RUNNING: using it" in proc.stdout


def test_ray_head_starts_a_stopped_head(box):
  box.set_states({"firewall-rules/r-ray": ["r-ray"], "instances/r-head": ["TERMINATED"]})
  box.ok("ray_head.sh", *_RAY)
  assert box.calls()[-1] == ["compute", "instances", "start", "r-head", *_WHERE]


def test_ray_workers_join_the_head_with_their_chips(box):
  box.set_states({"instances/r-head": ["RUNNING"], "ip/r-head": ["10.1.2.3"]})
  dry, real = _dry_and_real(box, "ray_workers.sh", *_RAY, "--spot")
  startup = box.tmp / "r-ray-worker.sh"
  flags = ["--spot", "--network=default", "--tags=r-ray"]
  flags += [f"--metadata-from-file=startup-script={startup}"]
  vm = lambda name: [_describe("tpu-vm", name), _tpu_create(name, *flags)]
  assert _gcloud(dry) == real == [_HEAD_IP, *vm("r-0"), *vm("r-1")]
  script = startup.read_text()
  _check_script(startup)
  assert "--extras=tpu,elastic\n" in script
  start = _ray_start(script)
  assert start[:4] == ["/opt/dipaco/venv/bin/ray", "start", "--block", "--address=10.1.2.3:6379"]
  (resources,) = [a for a in start if a.startswith("--resources=")]
  assert json.loads(resources.split("=", 1)[1]) == {"TPU": 4}  # v5litepod-4: 4 chips, 1 host
  # The driver asks for one chip per worker actor and as many actors as the pool has chips.
  box.ok("ray_train.sh", *_RAY)
  command = box.calls()[-1][-1]
  assert "--config.elastic.num_workers=8" in command
  assert "'--config.elastic.worker_resources={\"TPU\": 1}'" in command
  # Again: every VM is there; nothing is created twice.
  box.ok("ray_workers.sh", *_RAY, "--spot")
  again = [_HEAD_IP, _describe("tpu-vm", "r-0"), _describe("tpu-vm", "r-1")]
  assert box.calls()[len(real) + 2 :] == again


@pytest.mark.parametrize(
  "accelerator, pool, chips, workers",
  [
    ("v5litepod-1", 8, 1, 8),
    ("v5litepod-8", 1, 8, 8),
    ("v5litepod-16", 2, 4, 32),  # 4 hosts of 4 chips each
    ("v4-8", 2, 4, 8),  # v4 and v5p sizes count cores, 2 per chip
    ("v5p-16", 1, 4, 8),
  ],
)
def test_ray_resources_follow_the_accelerator_type(box, accelerator, pool, chips, workers):
  box.set_states({"instances/r-head": ["RUNNING"]})
  args = [*_BASE, f"--accelerator-type={accelerator}", f"--pool-size={pool}", *_TRAIN]
  box.ok("ray_workers.sh", "--dry-run", *args, "--head-address=head.internal")
  start = _ray_start((box.tmp / "r-ray-worker.sh").read_text())
  assert start[3:5] == ["--address=head.internal:6379", f'--resources={{"TPU": {chips}}}']
  box.ok("ray_train.sh", *args)
  assert f"--config.elastic.num_workers={workers} " in box.calls()[-1][-1]


def test_ray_train_starts_the_elastic_driver_on_the_head(box):
  box.set_states({"instances/r-head": ["RUNNING"]})
  args = [*_RAY, "--restart", "--internal-ip", "--", "--config.elastic.num_workers=6"]
  dry, real = _dry_and_real(box, "ray_train.sh", *args)
  start = (
    "sudo bash /opt/dipaco/dipaco_jax/launch/worker.sh start --venv=/opt/dipaco/venv "
    "--log-file=/opt/dipaco/driver.log --no-distributed --restart -- "
    "--config=configs/dipaco_2x4.py --workdir=gs://b/run --config.dipaco.mode=elastic "
    "--config.elastic.address=auto --config.elastic.num_workers=8 "
    "'--config.elastic.worker_resources={\"TPU\": 1}' --config.elastic.num_workers=6"
  )
  ssh = ["compute", "ssh", "r-head", *_WHERE, f"--command={start}", "--internal-ip"]
  assert _gcloud(dry) == real == [_HEAD_STATUS, ssh]


@pytest.mark.parametrize(
  "script, args, message, calls",
  [
    (
      "ray_workers.sh",
      [],
      "no head address: the head VM r-head does not exist. Run ray_head.sh first, or pass "
      "--head-address=HOST",
      [_HEAD_IP],
    ),
    ("ray_workers.sh", ["--head-address=10.0.0.2:6379"], "give the host only", []),
    ("ray_workers.sh", ["--pool-size=0"], "--pool-size=0: need a whole number >= 1", []),
    ("ray_workers.sh", ["--node-count=2"], "the Ray pool is --pool-size single TPU VMs", []),
    ("ray_head.sh", ["--node-dir=opt/dipaco"], "--node-dir=opt/dipaco: need an absolute", []),
    ("ray_head.sh", ["--code-url=/tmp/c.tgz"], "--code-url=/tmp/c.tgz must be a gs://", []),
    ("ray_train.sh", [], "head r-head is absent, not RUNNING: run ray_head.sh", [_HEAD_STATUS]),
  ],
)
def test_ray_bad_input_gives_one_clear_error(box, script, args, message, calls):
  proc = box.run(script, *_RAY, *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert proc.stderr.count("error:") == 1
  assert box.calls() == calls


def test_ray_watch_recreates_a_preempted_vm_and_leaves_the_driver_alone(box):
  box.set_states(
    {
      "firewall-rules/r-ray": ["r-ray"],
      "instances/r-head": ["RUNNING"],
      "tpu-vm/r-0": ["READY", "PREEMPTED"],
      "tpu-vm/r-1": ["READY"],
    }
  )
  box.ok("ray_watch.sh", *_RAY, "--spot", "--max-polls=3")
  steps = []
  for c in box.calls():
    if c[:2] == ["compute", "tpus"]:
      steps.append(f"{c[3]} {c[4]}")
    elif c[:2] == ["compute", "ssh"]:
      steps.append("start driver" + (" --restart" if " --restart " in c[-1] else ""))
    elif c[:2] == ["storage", "ls"]:
      steps.append(f"ls {c[3]}")
    else:
      steps.append(f"{c[1]} {c[2]}")
  poll = ["instances describe", "instances describe", "describe r-0", "describe r-1"]
  assert steps == [
    "firewall-rules describe",
    *poll,
    "start driver",
    *poll[:3],
    "delete r-0",
    "create r-0",  # with the same startup script: it joins the head at boot
    "describe r-1",
    "ls gs://b/run/elastic/tasks.jsonl",  # the driver is left alone: no restart
    *poll,
    "ls gs://b/run/elastic/tasks.jsonl",
  ]
  (create,) = [c for c in box.calls() if c[3:4] == ["create"]]
  startup = box.tmp / "r-ray-worker.sh"
  assert create == _tpu_create(
    "r-0",
    "--spot",
    "--network=default",
    "--tags=r-ray",
    f"--metadata-from-file=startup-script={startup}",
  )
  assert "--address=10.128.0.2:6379" in _ray_start(startup.read_text())


def test_ray_delete_removes_the_pool_then_the_head(box):
  box.set_states({"instances/r-head": ["RUNNING"], "tpu-vm/r-1": ["PREEMPTED"]})
  box.ok("ray_delete.sh", *_RAY)
  assert box.calls() == [
    _describe("tpu-vm", "r-0"),
    _describe("tpu-vm", "r-1"),
    ["compute", "tpus", "tpu-vm", "delete", "r-1", *_WHERE, "--quiet"],
    _HEAD_STATUS,
    ["compute", "instances", "delete", "r-head", *_WHERE, "--quiet"],
  ]
