"""A checkpoint save that fails stops the run in one line, at once; the rerun resumes bit-exactly.

The slow tests run the real command (`python -m dipaco_jax.main`) in a child
process: a run that checkpointed step 2 goes on, its save of step 4 fails, and
the child must exit 1 within the timeout (orbax's commit threads once kept it
alive for 20 minutes) with one stderr line naming the cause, the path and the
fix; step 2 must be untouched, and the same command, rerun once the storage
is fixed, must end where an uninterrupted run ends. The fast ones check the
Checkpointer in process: `check` reports a failed background save without
waiting, `save` or `close` the last one, and orbax's threads are released.

Tests may run as root, where a read-only directory still takes writes, so the
storage faults come from a stub (a sitecustomize module on the child's
PYTHONPATH, or monkeypatch): a directory the step cannot be created in
(EACCES, what a read-only checkpoints directory gives) and files that cannot
be written (ENOSPC). Where unprivileged user namespaces are allowed, one more
test fills a real size-limited tmpfs, so TensorStore's own error stops the run.
"""

import builtins
import errno
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from dipaco_jax.core import experiment
from dipaco_jax.io import checkpoint

import helpers

TINY = "configs/tiny.py"
_SMALL = helpers.SMALL_RUN
_TIMEOUT_S = 240  # A stuck child (orbax's threads wait 20 minutes) fails the test here.

# DIPACO_TEST_STORAGE_FAULT=EACCES:N or ENOSPC:N: checkpoint step N cannot be written.
_STUB = """
import builtins
import errno
import os

_FAULT = os.environ.get("DIPACO_TEST_STORAGE_FAULT")
if _FAULT:
  _CODE, _STEP = _FAULT.split(":")
  _TMP = _STEP + ".orbax-checkpoint-tmp"  # orbax's directory for the step until it commits.

  def _fail(path):
    code = getattr(errno, _CODE)
    raise (PermissionError if code == errno.EACCES else OSError)(code, os.strerror(code), path)

  if _CODE == "EACCES":  # As a read-only checkpoints directory: the step's directory is refused.
    _mkdir = os.mkdir

    def _stub_mkdir(path, *args, **kwargs):
      if os.path.basename(os.fspath(path)) == _TMP:
        _fail(os.fspath(path))
      return _mkdir(path, *args, **kwargs)

    os.mkdir = _stub_mkdir
  else:  # As a full disk: no file of the step can be written.
    _open = builtins.open

    def _stub_open(file, mode="r", *args, **kwargs):
      if any(c in mode for c in "wax+") and os.sep + _TMP in os.fspath(file):
        _fail(os.fspath(file))
      return _open(file, mode, *args, **kwargs)

    builtins.open = _stub_open
"""


def _main(workdir, cache, *args, fault=None, stub=None, timeout=_TIMEOUT_S):
  """`python -m dipaco_jax.main` of the small tiny run (plus `args`) in a child process."""
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(stub)] * (stub is not None) + [helpers.ROOT]),
    "JAX_PLATFORMS": "cpu",
    "DIPACO_CACHE_DIR": str(cache),  # One shard cache for this file's runs.
  }
  if fault:
    env["DIPACO_TEST_STORAGE_FAULT"] = fault
  cmd = [sys.executable, "-m", "dipaco_jax.main", f"--config={TINY}", f"--workdir={workdir}"]
  return subprocess.run(
    [*cmd, *_SMALL, *args],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(a run stopped after its step-2 checkpoint, the same run uninterrupted, the shard cache)."""
  cache = tmp_path_factory.mktemp("dipaco_cache")
  part = tmp_path_factory.mktemp("part") / "run"
  full = tmp_path_factory.mktemp("full") / "run"
  for workdir, args in ((part, ["--config.stop_at_step=2"]), (full, [])):
    r = _main(workdir, cache, *args)
    assert r.returncode == 0, r.stderr[-3000:]
  assert checkpoint.steps(part) == [2] and checkpoint.steps(full) == [4, 6]
  return part, full, cache


def _assert_stopped_in_one_line(r, ckpts, reason: str, path: str, fix: str):
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 1, lines[-20:]
  want = (
    rf"CheckpointSaveError: checkpoint step 4 could not be saved in {re.escape(str(ckpts))}: "
    rf"{reason} \({path}\); {fix}, then rerun the same command to resume from step 2, the "
    r"last saved checkpoint\."
  )
  assert re.fullmatch(want, lines[-1]), lines[-1]
  # One line: no other line names the error, no traceback, no error records, no echoes.
  assert [l for l in lines if "CheckpointSaveError" in l] == [lines[-1]], lines[-20:]
  assert not [l for l in lines if re.match(r"E\d{4} ", l)], lines[-20:]
  for noise in ("Traceback", "Exception ignored", "never awaited", "RESOURCE_EXHAUSTED"):
    assert noise not in r.stderr, (noise, lines[-20:])


def _assert_same_final_state(workdir, full):
  assert checkpoint.steps(workdir) == [4, 6]
  a, b = checkpoint.restore_numpy(workdir), checkpoint.restore_numpy(full)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  for item in ("data", checkpoint.CHECKSUMS):  # The same bytes: positions, records, sums.
    path = os.path.join("checkpoints", "6", item, "metadata")
    with open(os.path.join(workdir, path), "rb") as f, open(os.path.join(full, path), "rb") as g:
      assert f.read() == g.read(), item


FAULTS = [
  # (fault, the line's cause, the path it names under checkpoints/, the fix it gives).
  (
    "EACCES",
    "Permission denied",
    r"4\.orbax-checkpoint-tmp",
    "make {ckpts} writable (fix its permissions, or its mount if read-only)",
  ),
  (
    "ENOSPC",
    "No space left on device",
    r"4\.orbax-checkpoint-tmp/\S+",
    "free space on the disk of {ckpts}",
  ),
]


@pytest.mark.slow  # Runs of the trainer in child processes: about a minute.
@pytest.mark.parametrize("fault,reason,path,fix", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_failed_save_stops_the_run_in_one_line_and_the_rerun_resumes(
  runs, tmp_path, fault, reason, path, fix
):
  part, full, cache = runs
  workdir = tmp_path / "run"
  shutil.copytree(part, workdir)
  ckpts = workdir / "checkpoints"
  before = helpers.tree_bytes(ckpts / "2")
  stub = tmp_path / "stub"
  stub.mkdir()
  (stub / "sitecustomize.py").write_text(_STUB)
  start = time.monotonic()
  r = _main(workdir, cache, fault=f"{fault}:4", stub=stub)
  took = time.monotonic() - start
  esc = re.escape(str(ckpts))
  _assert_stopped_in_one_line(r, ckpts, reason, f"{esc}/{path}", re.escape(fix.format(ckpts=ckpts)))
  assert took < _TIMEOUT_S / 2, took  # It exited on its own (a normal run takes ~15 s).
  assert checkpoint.steps(workdir) == [2]
  assert helpers.tree_bytes(ckpts / "2") == before
  # The storage fixed, the same command resumes from step 2 and ends as if never stopped.
  r = _main(workdir, cache)
  assert r.returncode == 0, r.stderr[-3000:]
  _assert_same_final_state(workdir, full)


def _can_mount_tmpfs(tmp_path) -> bool:
  """Whether this user may mount a tmpfs in its own user and mount namespaces."""
  if shutil.which("unshare") is None:
    return False
  target = tmp_path / "probe"
  target.mkdir()
  probe = subprocess.run(
    ["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=1m none {target}"],
    capture_output=True,
  )
  return probe.returncode == 0


@pytest.mark.cli
@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_rerun_resumes(runs, tmp_path):
  if not _can_mount_tmpfs(tmp_path):
    pytest.skip("no unprivileged user namespaces here (unshare -Urm): no tmpfs to fill")
  part, full, cache = runs
  workdir = tmp_path / "run"
  shutil.copytree(part, workdir)
  ckpts = workdir / "checkpoints"
  saved, after = tmp_path / "saved", tmp_path / "after"
  os.rename(ckpts, saved)
  ckpts.mkdir()
  # Room for step 2 and half of another: the save of step 4 fills the disk.
  size_k = sum(len(b) for b in helpers.tree_bytes(saved).values()) * 3 // 2 // 1024
  env = {
    **os.environ,
    "PYTHONPATH": helpers.ROOT,
    "JAX_PLATFORMS": "cpu",
    "DIPACO_CACHE_DIR": str(cache),
  }
  cmd = " ".join(
    [sys.executable, "-m", "dipaco_jax.main", f"--config={TINY}", f"--workdir={workdir}", *_SMALL]
  )
  script = (
    f"mount -t tmpfs -o size={size_k}k none {ckpts} && cp -a {saved}/. {ckpts}/ && "
    f"{{ timeout {_TIMEOUT_S} {cmd}; echo $? > {tmp_path}/rc; }} && cp -a {ckpts}/. {after}/"
  )
  after.mkdir()
  start = time.monotonic()
  r = subprocess.run(
    ["unshare", "-Urm", "sh", "-c", script],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env=env,
    timeout=_TIMEOUT_S + 60,
  )
  took = time.monotonic() - start
  r.returncode = int((tmp_path / "rc").read_text())
  esc = re.escape(str(ckpts))
  _assert_stopped_in_one_line(
    r,
    ckpts,
    "No space left on device",
    rf"{esc}/4\.orbax-checkpoint-tmp/\S+",
    re.escape(f"free space on the disk of {ckpts}"),
  )
  assert took < _TIMEOUT_S / 2, took
  assert helpers.tree_bytes(after / "2") == helpers.tree_bytes(saved / "2")
  # Space freed (here: the same files on the big disk), the same command resumes.
  shutil.copytree(after, ckpts, dirs_exist_ok=True)
  assert checkpoint.steps(workdir) == [2]
  r = _main(workdir, cache)
  assert r.returncode == 0, r.stderr[-3000:]
  _assert_same_final_state(workdir, full)


# In process: the Checkpointer's own contract, with the same faults patched in.


@pytest.fixture(scope="module")
def micro_state():
  exp = experiment.Experiment(helpers.micro_config())
  return exp.init_state(0)


def _refuse_step_dir(monkeypatch, step: int):
  """os.mkdir of the step's temporary directory fails as on a read-only directory."""
  mkdir = os.mkdir

  def refuse(path, *args, **kwargs):
    if os.path.basename(os.fspath(path)) == f"{step}.orbax-checkpoint-tmp":
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
    return mkdir(path, *args, **kwargs)

  monkeypatch.setattr(os, "mkdir", refuse)


def _fill_disk(monkeypatch, step: int):
  """Every file written into the step's temporary directory fails with ENOSPC."""
  real_open = builtins.open

  def full(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and f"{os.sep}{step}.orbax-checkpoint-tmp" in os.fspath(file):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
    return real_open(file, mode, *args, **kwargs)

  monkeypatch.setattr(builtins, "open", full)


def _orbax_waiters() -> list[threading.Thread]:
  return [
    t for t in threading.enumerate() if type(t).__name__ == "_SignalingThread" and t.is_alive()
  ]


def test_check_reports_a_failed_background_save_without_waiting(micro_state, tmp_path, monkeypatch):
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=True)
  ck.save(2, micro_state, {"train": {}})
  ck.check()  # Step 2's save may still run: check never waits, and it succeeds.
  _refuse_step_dir(monkeypatch, 4)
  ck.save(4, micro_state, {"train": {}})  # Waits for step 2, starts step 4 in the background.
  calls, deadline = [], time.monotonic() + 60
  with pytest.raises(checkpoint.CheckpointSaveError) as e:
    while time.monotonic() < deadline:
      start = time.monotonic()
      try:
        ck.check()
      finally:
        calls.append(time.monotonic() - start)
      time.sleep(0.01)
  root = tmp_path / "checkpoints"
  assert str(e.value) == (
    f"checkpoint step 4 could not be saved in {root}: Permission denied "
    f"({root}/4.orbax-checkpoint-tmp); make {root} writable (fix its permissions, or its "
    "mount if read-only), then rerun the same command to resume from step 2, the last saved "
    "checkpoint."
  )
  assert max(calls[:-1], default=0) < 0.05, calls  # The polls before the failure: no waiting.
  assert not _orbax_waiters()  # Released: nothing keeps the process alive.
  ck.close()  # After a failure: neither waits nor raises again.
  assert checkpoint.steps(str(tmp_path)) == [2]


@pytest.mark.parametrize("async_save", [True, False])
def test_the_last_saves_failure_is_raised_by_save_or_close(
  micro_state, tmp_path, monkeypatch, async_save
):
  _fill_disk(monkeypatch, 2)
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=async_save)
  with pytest.raises(checkpoint.CheckpointSaveError) as e:
    ck.save(2, micro_state, {"train": {}})  # Sync: fails here; async: at close.
    ck.close()
  root = tmp_path / "checkpoints"
  assert re.fullmatch(
    rf"checkpoint step 2 could not be saved in {re.escape(str(root))}: No space left on device "
    rf"\({re.escape(str(root))}/2\.orbax-checkpoint-tmp/\S+\); free space on the disk of "
    rf"{re.escape(str(root))}, then rerun the same command to start over from step 0 \(no "
    r"checkpoint was saved yet\)\.",
    str(e.value),
  ), str(e.value)
  ck.close()
  assert not _orbax_waiters()
  assert checkpoint.steps(str(tmp_path)) == []


def test_a_bug_in_a_save_keeps_its_traceback(micro_state, tmp_path, monkeypatch):
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  monkeypatch.setattr(checkpoint, "save_args", lambda state: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    ck.save(2, micro_state, {"train": {}})
  ck.close()
