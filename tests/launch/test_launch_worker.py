"""launch/worker.sh, run locally with a fake python."""

import os
import shutil
import signal
import subprocess
import time

from launch_sandbox import FAKE_GCLOUD
from launch_sandbox import LAUNCH
from launch_sandbox import ROOT

# --- worker.sh, run locally with a fake python ---------------------------------------------------


def _new_tree(box):
  """A fresh tree as setup.sh unpacks it on a worker: launch/ and constraints.txt."""
  new = box.tmp / "dipaco_jax.new"
  shutil.copytree(LAUNCH, new / "launch")
  shutil.copy(ROOT / "constraints.txt", new / "constraints.txt")
  return new


def test_worker_install_and_start_are_idempotent(box):
  shutil.copy(FAKE_GCLOUD.parent / "curl", box.bin / "curl")
  shutil.copy(FAKE_GCLOUD.parent / "uv", box.bin / "uv")  # what the fake installer copies
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
