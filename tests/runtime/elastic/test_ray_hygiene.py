"""The command's own Ray cluster ends with the command: SIGKILL, Ctrl-C, and its files.

An elastic run of the real command in a child process (its own cluster), stopped
once a task is accepted: killed with SIGKILL (nothing of its cluster runs a few
seconds later, none of it listens, its owner-only session folder is gone), then
resumed and stopped with Ctrl-C (one line, exit status 130, the same clean-up).
"""

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from dipaco_jax.runtime.elastic import reaper

import helpers
from failure_rows import Row
from test_failures import message_lines

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.cli]

_RUN = [
  "--config=configs/tiny.py",
  *helpers.SMALL_RUN,
  "--config.data.subsample=16",
  "--config.dipaco.mode=elastic",
  "--config.elastic.num_workers=1",
  "--config.early_stopping.enabled=False",
]


# The command itself (python -m dipaco_jax.main, its argv[0] main.py), its trainer handed a
# fault plan: tasks of ~1 s, so the stops land mid-run (faults are no config field).
_COMMAND = (
  "import runpy\n"
  "from dipaco_jax import train\n"
  "from dipaco_jax.runtime import faults\n"
  "run = train.train_and_evaluate\n"
  "train.train_and_evaluate = lambda c, w: run(c, w, faults.Faults(step_delay_s=(0.5,)))\n"
  "runpy.run_module('dipaco_jax.main', run_name='__main__', alter_sys=True)\n"
)


# What Ray and Python print on every elastic start, not a message: Ray's own log records (token
# authentication, "Started a local Ray instance"), and Python's warning about os.fork in a
# threaded process (JAX's) when Ray starts its processes, with its source line.
_RAY_NOISE = re.compile(
  r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\t[A-Z]+ |\S+:\d+: RuntimeWarning: os\.fork\(\)|"
  r"  self\.pid = _fork_exec\()"
)


@pytest.fixture(name="temp_root")
def _temp_root():
  """The command's own TMPDIR (short: Ray's socket paths): no other run's folder is counted."""
  root = tempfile.mkdtemp(prefix="rh")
  yield root
  shutil.rmtree(root, ignore_errors=True)


def _folders(root: str) -> set[str]:
  return {d for d in os.listdir(root) if d.startswith(reaper.PREFIX)}


def _start(workdir, shards, root: str) -> tuple[subprocess.Popen, str]:
  """The command, started in its own process group, once a task is accepted: (it, its folder)."""
  psutil = pytest.importorskip("psutil")
  pytest.importorskip("ray")
  before = _folders(root)
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu", "DIPACO_PROGRESS": "0"}
  env["TMPDIR"] = root
  run = subprocess.Popen(
    [
      sys.executable,
      "-c",
      _COMMAND,
      f"--workdir={workdir}",
      *_RUN,
      f"--config.data.shard_dir={shards}",
      "--verbosity=-1",
    ],
    cwd=helpers.ROOT,
    env=env,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )
  log = workdir / "elastic" / "tasks.jsonl"
  accepted = log.read_text().count('"done"') if log.exists() else 0
  while not log.exists() or log.read_text().count('"done"') <= accepted:
    assert run.poll() is None, run.stderr.read()[-3000:]
    time.sleep(0.2)
  (folder,) = _folders(root) - before
  assert stat.S_IMODE(os.stat(os.path.join(root, folder)).st_mode) == 0o700
  del psutil
  return run, folder


def _cluster(run) -> list:
  """The command's descendants now: its Ray cluster (GCS, raylet, agents, actors, the watcher)."""
  import psutil  # pylint: disable=g-import-not-at-top

  return psutil.Process(run.pid).children(recursive=True)


def _gone(procs, folder: str, root: str, within_s: float = 20.0) -> None:
  """None of `procs` runs (or listens) within `within_s`, and `folder` is removed."""
  import psutil  # pylint: disable=g-import-not-at-top

  end = time.time() + within_s
  while time.time() < end:
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if not alive and folder not in _folders(root):
      return
    time.sleep(0.2)
  listening = []
  for p in alive:
    try:
      listening += [(p.name(), c.laddr) for c in p.net_connections() if c.status == "LISTEN"]
    except psutil.Error:
      pass
  raise AssertionError(f"alive: {[(p.pid, p.name()) for p in alive]}, listening {listening}")


def test_a_killed_or_interrupted_command_leaves_nothing_of_its_cluster(tmp_path, temp_root):
  workdir, shards = tmp_path / "run", tmp_path / "shards"
  run, folder = _start(workdir, shards, temp_root)
  cluster = _cluster(run)
  assert {"raylet", "gcs_server"} <= {p.name() for p in cluster}, cluster
  run.send_signal(signal.SIGKILL)  # No clean-up of its own runs.
  run.wait()
  _gone(cluster, folder, temp_root)

  run, folder = _start(
    workdir, shards, temp_root
  )  # The same command resumes (the lock taken over).
  cluster = _cluster(run)
  os.killpg(run.pid, signal.SIGINT)  # A terminal's Ctrl-C: the whole foreground group.
  _, err = run.communicate(timeout=300)
  assert run.returncode == 130, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  lines = [l for l in message_lines(err) if not _RAY_NOISE.match(l)]
  assert len(lines) == 1, err[-3000:]
  assert re.fullmatch(
    r"Interrupted: stopped by Ctrl-C with (\d+) of 16 tasks accepted \(every worker past inner "
    r"step \d+ of 6\), each one's outputs stored whole: the run resumes from them; to go on, run "
    r"python -m dipaco_jax\.main .+",
    lines[0],
  ), lines[0]
  _gone(cluster, folder, temp_root)


# The rows this file adds to docs/failures.md (tests/project/test_failure_table.py).
TABLE = [
  Row(
    "the elastic command killed (SIGKILL)",
    "main (elastic)",
    "(killed: no line) its Ray cluster (GCS, raylet, agents, actors) is gone within seconds, "
    "none of it listens, its owner-only session folder is removed",
    -9,
    "the rerun takes the lock over and resumes from the stored tasks",
    "tests/runtime/elastic/test_ray_hygiene.py",
    "tolerated",
  ),
  Row(
    "Ctrl-C during an elastic run",
    "main (elastic)",
    "Interrupted: stopped by Ctrl-C with A of 16 tasks accepted (every worker past inner step S "
    "of 6), each one's outputs stored whole: the run resumes from them; to go on, run python -m "
    "dipaco_jax.main …",
    130,
    "the stored tasks; the cluster and its folder are gone",
    "tests/runtime/elastic/test_ray_hygiene.py",
  ),
]
