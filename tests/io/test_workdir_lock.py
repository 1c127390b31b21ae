"""The workdir lock (io/lock.py) and Ctrl-C: a live run is never touched, a stopped one resumes.

A holder is a real process (a child that takes the lock and sleeps, or a real trainer);
the second command stops in one line before it writes anything; a holder killed with
SIGKILL leaves a lock file that the next command takes over with one INFO line. A
trainer stopped by Ctrl-C says in one line where, that its checkpoint is intact and
the command that resumes it; both real trainers end with the bytes of the run alone.
"""

import errno
import fcntl
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import flags
from etils import epath

from dipaco_jax import cli
from dipaco_jax import evaluate
from dipaco_jax import saved_config
from dipaco_jax import train
from dipaco_jax.io import checkpoint
from dipaco_jax.io import lock
from dipaco_jax.routing import phases

import helpers
from failure_rows import Row
from test_failures import message_lines

_HOLD = (
  "import sys, time\n"
  "from dipaco_jax.io import lock\n"
  "with lock.workdir(sys.argv[1], sys.argv[2]):\n"
  "  print('held', flush=True)\n"
  "  time.sleep(600)\n"
)


def _holder(workdir, command="train") -> subprocess.Popen:
  """A child process holding `workdir`'s lock as `command` until it is killed."""
  child = subprocess.Popen(
    [sys.executable, "-c", _HOLD, str(workdir), command],
    cwd=helpers.ROOT,
    env={**os.environ, "PYTHONPATH": helpers.ROOT},
    stdout=subprocess.PIPE,
    text=True,
  )
  assert child.stdout.readline().strip() == "held"
  return child


def _kill(child: subprocess.Popen) -> None:
  child.send_signal(signal.SIGKILL)
  child.wait()


def test_a_live_holder_refuses_every_writer_in_one_line_and_nothing_is_touched(tmp_path):
  w = tmp_path / "run"
  child = _holder(w)
  try:
    (w / "config.json").write_text("{}")  # A file of the live run: never moved, never read.
    before = helpers.tree_bytes(w)
    holder = json.loads((w / lock.LOCK_FILE).read_text())
    assert holder["pid"] == child.pid and holder["command"] == "train"
    want = (
      f"{w} is in use by train (pid {child.pid} on {holder['host']}, since {holder['since']}): "
      f"wait for it to end, stop it (kill {child.pid}), or give another --workdir; nothing in "
      "it was changed."
    )
    # Either runtime, any field (a longer run set aside the live run's files before), route
    # and evaluate: refused before anything is read or written.
    cfg = lambda **kw: helpers.micro_config(**{"model.vocab_size": 8192, **kw})
    cfgs = [cfg(), cfg(**{"dipaco.outer_steps": 5, "model.d_model": 48})]
    cfgs.append(cfg(**{"dipaco.mode": "elastic"}))
    for cfg in cfgs:
      with pytest.raises(lock.WorkdirBusyError) as e:
        train.train_and_evaluate(cfg, str(w))
      assert str(e.value) == want
    with pytest.raises(lock.WorkdirBusyError, match="in use by train"):
      phases.route_run(cfgs[0], str(w))
    with pytest.raises(lock.WorkdirBusyError, match="in use by train"):
      evaluate.evaluate_and_write(cfgs[0], str(w))
    assert helpers.tree_bytes(w) == before
  finally:
    _kill(child)


def test_a_lock_left_by_a_killed_process_is_taken_over_with_one_info_line(tmp_path, caplog):
  w = tmp_path / "run"
  child = _holder(w, "route")
  _kill(child)  # SIGKILL: no cleanup ran; the kernel dropped its flock.
  assert json.loads((w / lock.LOCK_FILE).read_text())["pid"] == child.pid
  with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
    with lock.workdir(str(w), "train"):
      assert json.loads((w / lock.LOCK_FILE).read_text())["pid"] == os.getpid()
      with lock.workdir(str(w), "evaluate"):  # Re-entrant: the same process holds it.
        pass
      assert (w / lock.LOCK_FILE).exists()
  said = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith(f"{w}: took over the lock of route (pid {child.pid}")
  assert said[0].endswith("which is no longer running.")
  assert not (w / lock.LOCK_FILE).exists()  # Removed as it lets go.


def test_a_command_that_stops_leaves_no_lock_and_no_folder_it_made(tmp_path):
  w = tmp_path / "new" / "run"
  with pytest.raises(RuntimeError):
    with lock.workdir(str(w), "train"):
      assert (w / lock.LOCK_FILE).exists()
      raise RuntimeError("bad input")
  assert not (tmp_path / "new").exists()
  (tmp_path / "kept").mkdir()
  with lock.workdir(str(tmp_path / "kept"), "train"):
    (tmp_path / "kept" / "config.json").write_text("{}")
  assert os.listdir(tmp_path / "kept") == ["config.json"]


def test_an_unopenable_lock_file_and_a_filesystem_without_locks_are_one_line(
  tmp_path, monkeypatch, caplog
):
  w = tmp_path / "run"
  (w / lock.LOCK_FILE).mkdir(parents=True)  # Not a file: cannot be opened (even by root).
  with pytest.raises(lock.LockError) as e:
    with lock.workdir(str(w), "train"):
      pass
  assert str(e.value) == (
    f"the workdir {w}'s lock file {w / lock.LOCK_FILE} cannot be opened (Is a directory): if "
    f"no command is using {w}, remove it (rm -r {w / lock.LOCK_FILE}) and rerun."
  )
  (w / lock.LOCK_FILE).rmdir()

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(fcntl, "flock", no_locks)
  with pytest.raises(lock.LockError, match=r"has no file locks \(No locks available\).*"):
    with lock.workdir(str(w), "train"):
      pass
  assert os.listdir(w) == []
  monkeypatch.setenv(lock.ENV, "off")  # The documented way on such a filesystem.
  with caplog.at_level(logging.WARNING):
    with lock.workdir(str(w), "train"):
      assert not (w / lock.LOCK_FILE).exists()


def test_an_object_store_workdir_takes_no_lock(caplog):
  with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
    with lock.workdir("gs://bucket/run", "train"):
      pass
  assert any("no lock keeps a second command off it" in r.getMessage() for r in caplog.records)


def test_setting_an_earlier_attempt_aside_keeps_the_lock_in_place(tmp_path):
  w = tmp_path / "run"
  old = helpers.micro_config(**{"model.d_model": 48})
  with lock.workdir(str(w), "train"):
    saved_config.write(epath.Path(w), old)
    saved_config.set_aside_earlier_attempt(epath.Path(w), helpers.micro_config())
    assert sorted(os.listdir(w)) == ["earlier_attempt_1", lock.LOCK_FILE]
    assert os.listdir(w / "earlier_attempt_1") == ["config.json"]


def test_ctrl_c_in_any_other_command_is_one_line_with_status_130(capsys):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

  def main(argv):
    raise KeyboardInterrupt

  with pytest.raises(SystemExit) as e:
    cli.guard(main)(["evaluate"])
  assert e.value.code == 130
  assert capsys.readouterr().err == (
    "Interrupted: stopped by Ctrl-C: every file is written whole, so nothing written is "
    "damaged; rerun the same command to do it again.\n"
  )


def test_waiters_on_a_shared_cache_lock_take_it_one_at_a_time(tmp_path):
  """Two processes and this one on one cache lock: never two holders at once."""
  path = str(tmp_path / "cache" / ".fill.lock")
  code = (
    "import sys, time\n"
    "from dipaco_jax.io import lock\n"
    "with lock.exclusive(sys.argv[1], 'the cache'):\n"
    "  open(sys.argv[2], 'a').write('in\\n'); time.sleep(0.5)\n"
    "  open(sys.argv[2], 'a').write('out\\n')\n"
  )
  log = tmp_path / "log"
  env = {**os.environ, "PYTHONPATH": helpers.ROOT}
  kids = [
    subprocess.Popen([sys.executable, "-c", code, path, str(log)], cwd=helpers.ROOT, env=env)
    for _ in range(2)
  ]
  time.sleep(0.3)
  with lock.exclusive(path, "the cache"):
    log.open("a").write("in\nout\n")
  assert [k.wait() for k in kids] == [0, 0]
  assert log.read_text() == "in\nout\n" * 3  # Never "in" twice in a row.
  assert not os.path.exists(path)


# One small run (tests/helpers.py's SMALL_RUN on a sixteenth of the corpus), 24 steps long so
# that a second command or a Ctrl-C lands while it trains.
_RUN = [
  "--config=configs/tiny.py",
  *helpers.SMALL_RUN,
  "--config.data.subsample=16",
  "--config.dipaco.outer_steps=12",
  "--config.ckpt.every_steps=4",
  "--config.eval.every_steps=8",
]


def _env(cache) -> dict:
  """The runs' environment: one cache folder for this file's runs (the corpus prepared once)."""
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu", "DIPACO_PROGRESS": "0"}
  return {**env, "DIPACO_CACHE_DIR": str(cache)}


def _main(workdir, cache, *flags, **kw) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", "dipaco_jax.main", f"--workdir={workdir}", *_RUN, *flags],
    cwd=helpers.ROOT,
    env=_env(cache),
    stderr=subprocess.PIPE,
    text=True,
    **kw,
  )


def _same_state(a, b) -> None:
  x, y = (checkpoint.restore_numpy(str(d)) for d in (a, b))
  for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def alone(tmp_path_factory, cache):
  """The small run, uninterrupted and alone: what the others must end as, bit for bit."""
  workdir = tmp_path_factory.mktemp("alone") / "run"
  run = _main(workdir, cache)
  assert run.wait(timeout=900) == 0, run.stderr.read()[-3000:]
  return workdir


def _wait_for(path, run: subprocess.Popen) -> None:
  while not path.exists():
    assert run.poll() is None, run.stderr.read()[-3000:]
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.ci  # CI runs it: the end-to-end check of what it guards.
def test_two_trainers_on_one_workdir_leave_the_first_whole_and_refuse_the_second(
  alone, cache, tmp_path
):
  """The audit's case: a second trainer with more outer steps once moved the first's files."""
  first = _main(tmp_path / "run", cache)
  lock_file = tmp_path / "run" / lock.LOCK_FILE
  _wait_for(lock_file, first)  # Held from the first thing the trainer does on.
  second = _main(tmp_path / "run", cache, "--config.dipaco.outer_steps=15", "--verbosity=-1")
  _, err = second.communicate(timeout=600)
  assert first.poll() is None, "the first run ended before the second was refused: no test"
  lines = message_lines(err)
  assert second.returncode == 1, err[-3000:]
  assert len(lines) == 1 and lines[0].startswith(
    f"WorkdirBusyError: {tmp_path / 'run'} is in use by train (pid {first.pid} on "
  ), lines
  assert first.wait(timeout=900) == 0, first.stderr.read()[-3000:]
  # Whole: the bytes of the same run alone, each logged step once, nothing set aside.
  _same_state(tmp_path / "run", alone)
  steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").open()]
  assert steps == [json.loads(l)["step"] for l in (alone / "metrics.jsonl").open()]
  names = lambda d: sorted(n for n in os.listdir(d) if not n.startswith("events.out"))
  assert names(tmp_path / "run") == names(alone) and lock.LOCK_FILE not in names(alone)


@pytest.mark.slow
@pytest.mark.cli
def test_ctrl_c_is_one_line_the_last_checkpoint_is_intact_and_its_command_resumes(
  alone, cache, tmp_path
):
  w = tmp_path / "run"
  run = _main(w, cache, "--verbosity=-1", start_new_session=True)
  _wait_for(w / "checkpoints" / "4", run)  # Finished steps only appear under their number.
  os.killpg(run.pid, signal.SIGINT)  # What a terminal's Ctrl-C sends: the whole group.
  _, err = run.communicate(timeout=600)
  assert run.returncode == 130, err[-3000:]
  lines = message_lines(err)
  assert len(lines) == 1, lines
  m = re.fullmatch(
    r"Interrupted: stopped by Ctrl-C at inner step (\d+) of 24: its last checkpoint, step "
    r"(\d+), is intact and the run resumes from it; to go on, run (python -m dipaco_jax\.main .+)",
    lines[0],
  )
  assert m, lines[0]
  reached, saved = int(m[1]), int(m[2])
  assert saved == checkpoint.steps(str(w))[-1] and 4 <= saved <= reached < 24
  checkpoint.restore_numpy(str(w))  # Intact: every row matches its checksum.
  command = shlex.split(m[3])
  assert command[3:] == [f"--workdir={w}", *_RUN, "--verbosity=-1"], command
  rerun = subprocess.run(
    [sys.executable, *command[1:]],
    cwd=helpers.ROOT,
    env=_env(cache),
    capture_output=True,
    text=True,
  )
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  _same_state(w, alone)


# The rows this file adds to docs/failures.md (tests/project/test_failure_table.py).
_T = "tests/io/test_workdir_lock.py"
_BUSY = (
  "WorkdirBusyError: WORKDIR is in use by train (pid N on HOST, since T): wait for it to end, "
  "stop it (kill N), or give another --workdir; nothing in it was changed."
)
_WHOLE = "the live run's every file; a real second trainer: the first ends as the run alone, bits"
TABLE = [
  Row("a second trainer, the same command, on a live workdir", "main", _BUSY, 1, _WHOLE, _T),
  Row(
    "a second trainer with a larger dipaco.outer_steps on a live workdir",
    "main",
    _BUSY,
    1,
    _WHOLE,
    _T,
  ),
  Row("a second trainer of another model on a live workdir", "main", _BUSY, 1, _WHOLE, _T),
  Row("an elastic trainer on a live spmd workdir", "main (elastic)", _BUSY, 1, _WHOLE, _T),
  Row("route on a live workdir", "route", _BUSY, 1, _WHOLE, _T),
  Row("evaluate on a live workdir", "evaluate", _BUSY, 1, _WHOLE, _T),
  Row(
    "a lock left by a SIGKILLed command",
    "main, route, evaluate",
    "INFO: WORKDIR: took over the lock of route (pid N on HOST, since T), which is no longer "
    "running.",
    0,
    "the command runs; the lock file is removed at its end",
    _T,
    "tolerated",
  ),
  Row(
    "a lock file that cannot be opened (a folder in its place)",
    "main, route, evaluate",
    "LockError: the workdir WORKDIR's lock file WORKDIR/lock.json cannot be opened (Is a "
    "directory): if no command is using WORKDIR, remove it (rm -r WORKDIR/lock.json) and rerun.",
    1,
    "nothing written (the workdir's files byte for byte)",
    _T,
  ),
  Row(
    "a workdir on a filesystem without locks",
    "main, route, evaluate",
    "LockError: the filesystem of WORKDIR has no file locks (No locks available), so two "
    "commands on it cannot be kept apart: use a folder on a local disk, or set "
    "DIPACO_LOCKS=off to run without locks …",
    1,
    "nothing written, no folder made",
    _T,
  ),
  Row(
    "DIPACO_LOCKS=off on a filesystem without locks",
    "main, route, evaluate",
    "WARNING: DIPACO_LOCKS=off: no locks are taken (a workdir or cache is yours).",
    0,
    "the command runs",
    _T,
    "tolerated",
  ),
  Row(
    "a gs:// workdir (no locks on an object store)",
    "main, route, evaluate",
    "INFO: gs://…: no lock keeps a second command off it (docs/storage.md).",
    0,
    "the command runs; the limit is documented",
    _T,
    "tolerated",
  ),
  Row(
    "a shared cache lock held by one process while two others wait",
    "corpus, shards",
    "each waits (INFO: waiting for … to finish …), then finds the cache filled",
    0,
    "one holder at a time, the lock file removed",
    _T,
    "tolerated",
  ),
  Row(
    "Ctrl-C while training (spmd)",
    "main",
    "Interrupted: stopped by Ctrl-C at inner step S of N: its last checkpoint, step K, is "
    "intact and the run resumes from it; to go on, run python -m dipaco_jax.main …",
    130,
    "the checkpoint restores with every checksum; the printed command ends as the run alone, "
    "bit for bit",
    _T,
  ),
]
