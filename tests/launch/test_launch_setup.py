"""launch/setup.sh, train.sh, logs.sh and delete.sh against a fake gcloud."""

import shlex
import tarfile

from launch_sandbox import BASE
from launch_sandbox import MULTI
from launch_sandbox import MULTI_READY
from launch_sandbox import QR_DESCRIBE
from launch_sandbox import TRAIN
from launch_sandbox import VM_DESCRIBE
from launch_sandbox import WHERE
from launch_sandbox import call_steps
from launch_sandbox import dry_and_real
from launch_sandbox import gcloud_calls
from launch_sandbox import ssh_call

# --- setup.sh, train.sh, logs.sh ---------------------------------------------------------------

_INSTALL = (
  "bash dipaco_jax.new/launch/worker.sh install --remote-dir=dipaco_jax "
  "--venv=dipaco_venv --log-file=dipaco_train.log --python-version=3.11 --uv-version=0.13.9"
)


def test_setup_copies_the_tree_to_every_node(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  dry, real = dry_and_real(box, "setup.sh", *MULTI)
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
    *WHERE,
    "--worker=all",
  ]
  # The slices are set up at once: each one's calls keep their order, the two interleave.
  per_slice = [scp("r-0"), ssh_call("r-0", unpack), scp("r-1"), ssh_call("r-1", unpack)]
  assert gcloud_calls(dry) == [*MULTI_READY, *per_slice]
  assert real[:3] == MULTI_READY and sorted(real[3:]) == sorted(per_slice)
  assert [c for c in real[3:] if call_steps([c])[0].endswith(" r-0")] == per_slice[:2]
  with tarfile.open(tarball) as tar:
    assert sorted(tar.getnames()) == [".gitignore", "configs/dipaco_2x4.py", "untracked.txt"]


def test_setup_git_clone_mode(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  box.ok(
    "setup.sh",
    *BASE,
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
  assert box.calls() == [VM_DESCRIBE, ssh_call("r", clone)]


def test_setup_refuses_a_resource_that_is_not_ready(box):
  box.set_states({"tpu-vm/r": ["CREATING"]})
  proc = box.run("setup.sh", *BASE)
  assert proc.returncode == 2 and "is CREATING, not ready" in proc.stderr
  assert box.calls() == [VM_DESCRIBE]


def test_train_starts_the_same_command_on_every_worker(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  args = [
    *MULTI,
    *TRAIN,
    "--data-dir=gs://b/tfds",
    "--vocab-path=gs://b/spm.model",
    "--env=TPU_STDERR_LOG_LEVEL=0",
    "--",
    "--config.mesh.data=4",
    "--config.note=a b",
  ]
  dry, real = dry_and_real(box, "train.sh", *args)
  start = (
    "bash dipaco_jax/launch/worker.sh start --venv=dipaco_venv "
    "--log-file=dipaco_train.log --env=TPU_STDERR_LOG_LEVEL=0 -- "
    "--config=configs/dipaco_2x4.py --workdir=gs://b/run "
    "--config.data.tfds_data_dir=gs://b/tfds --config.data.vocab_path=gs://b/spm.model "
    "--config.mesh.data=4 --config.note='a b'"
  )
  assert gcloud_calls(dry) == real == [*MULTI_READY, ssh_call("r-0", start), ssh_call("r-1", start)]
  assert shlex.split(start)[-1] == "--config.note=a b"


def test_logs_follows_worker_zero_by_default(box):
  box.ok("logs.sh", *MULTI)
  assert box.calls() == [ssh_call("r-0", "tail -n 100 -F dipaco_train.log", worker="0")]


def test_logs_every_slice_without_follow(box):
  box.ok("logs.sh", *MULTI, "--node=all", "--worker=all", "--no-follow", "--lines=5")
  assert box.calls() == [ssh_call(n, "tail -n 5 dipaco_train.log") for n in ("r-0", "r-1")]
  proc = box.run("logs.sh", *MULTI, "--node=all")
  assert proc.returncode == 2 and "--no-follow" in proc.stderr


# --- delete.sh ---------------------------------------------------------------------------------


def test_delete_queued_resource(box):
  box.set_states({"queued-resources/r": ["SUSPENDED"]})
  dry, real = dry_and_real(box, "delete.sh", *MULTI)
  delete = ["compute", "tpus", "queued-resources", "delete", "r", *WHERE, "--force", "--quiet"]
  assert gcloud_calls(dry) == real == [QR_DESCRIBE, delete]


def test_delete_is_a_no_op_when_absent(box):
  proc = box.ok("delete.sh", *BASE)
  assert box.calls() == [VM_DESCRIBE] and "nothing to delete" in proc.stdout


def test_setup_runs_the_slices_at_once_and_names_the_ones_that_failed(box):
  box.set_states(
    {"queued-resources/r": ["ACTIVE"], "tpu-vm/r-0": ["READY"], "tpu-vm/r-1": ["READY"]}
  )
  # Each slice's ssh waits until the other's has begun: in turn, the first would wait alone.
  proc = box.ok("setup.sh", *MULTI, FAKE_GCLOUD_BARRIER="r-0,r-1")
  logs = box.tmp / "r-setup"
  assert f"setup on 2 slices in parallel; logs: {logs}/<slice>.log" in proc.stdout
  for node in ("r-0", "r-1"):
    assert f"tpu-vm ssh {node} " in (logs / f"{node}.log").read_text()
  proc = box.run("setup.sh", *MULTI, FAKE_GCLOUD_FAIL_NODE="r-1")
  assert proc.returncode == 2
  assert f"setup failed on 1 of 2 slices: r-1 (exit 1); see the logs in {logs}" in proc.stderr
  assert "scp to r-1 failed" in proc.stdout  # its log, shown after the others
  assert "--- setup of r-0 (exit 0;" in proc.stdout
  assert call_steps(box.calls())[-3:] in (
    ["scp r-0", "scp r-1", "install r-0"],
    ["scp r-1", "scp r-0", "install r-0"],
  )
