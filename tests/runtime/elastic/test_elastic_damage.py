"""Damaged elastic storage end to end on Ray: one line from the driver, then the move and a rerun.

A compressed run (so workers keep error-feedback residuals and executors write
updates) is stopped after 6 accepted tasks; on copies of it, files a later task
reads are damaged as the audit did (a residual truncated, one byte of a module
version flipped, one digit of the queue's results changed). Each rerun stops in
the damage's one line (the error itself, never Ray's traceback); the move it names,
then the same command again, ends with the bytes of the run that met no damage.
"""

import os
import re
import shutil

import jax
import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax import train
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import driver as elastic_driver
from dipaco_jax.runtime.elastic import storage

import helpers
import test_damaged_files
from failure_rows import Row

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_cluster():
  ray = pytest.importorskip("ray")
  elastic_driver.start_local_ray(num_cpus=3)
  yield ray
  elastic_driver.stop_local_ray()


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
  """(config, the clean run's workdir, a run stopped after 6 accepted tasks)."""
  del ray_cluster
  shards = str(tmp_path_factory.mktemp("shards"))
  over = {
    "model.vocab_size": 8192,
    "dipaco.mode": "elastic",
    "early_stopping.enabled": False,
    "elastic.num_workers": 2,
    "outer.compression": "int8",  # Residuals (ef_*.npz) and updates (u*.npz) are stored too.
    "data.shard_dir": shards,
  }
  cfg = lambda **kw: helpers.micro_config(**{**over, **kw})
  clean = tmp_path_factory.mktemp("clean") / "run"
  train.train_and_evaluate(cfg(), str(clean))
  part = tmp_path_factory.mktemp("part") / "run"
  out = train.train_and_evaluate(cfg(), str(part), faults_lib.Faults(stop_after_tasks=6))
  assert out["stopped"]
  return cfg(), clean, part


def _same(a, b) -> None:
  x, y = checkpoint.restore_numpy(str(a)), checkpoint.restore_numpy(str(b))
  for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _rerun_until_done(cfg, w) -> list[str]:
  """Reruns the command, doing each line's move, until the run ends; the lines it said."""
  said = []
  for _ in range(4):
    try:
      train.train_and_evaluate(cfg, str(w))
      return said
    except errors.DamagedFileError as e:
      assert type(e) is errors.DamagedFileError, type(e)  # The error itself, not Ray's.
      msg = str(e)
      assert "\n" not in msg and "Traceback" not in msg, msg
      said.append(msg)
      moved = re.search(r"\(mv (\S+) (\S+)\)", msg)
      os.rename(moved[1], moved[2])
  raise AssertionError(f"still damaged after {said}")


def test_damaged_task_outputs_and_module_versions_are_one_line_and_the_rerun_is_clean(
  runs, tmp_path
):
  cfg, clean, part = runs
  w = tmp_path / "run"
  shutil.copytree(part, w)
  done = coord_lib.read_results(str(w))
  # A worker whose phase-1 task has not run: it reads its residual and its modules at v1.
  worker = next(k for k in range(4) if f"1/{k}" not in done)
  ef = storage.ef_file(str(w), worker, 1, "block_0")
  helpers.truncate(ef)  # The audit's case: a 75-line Ray traceback at every rerun.
  v1 = storage.module_file(str(w), "block_1", 0, 1)
  data = bytearray(v1.read_bytes())
  data[len(data) // 2] ^= 0xFF  # A byte of the arrays' data (most of the file): a CRC-32 fails.
  v1.write_bytes(bytes(data))
  said = _rerun_until_done(cfg, w)
  out = storage.worker_out_dir(str(w), worker, 1)
  want = {
    str(ef): (
      f"move {out} aside (mv {out} {out}.damaged) and rerun the same command: task (phase 0, "
      f"worker {worker}) runs again and writes the same bytes."
    ),
    str(v1): (
      f"move {v1} aside (mv {v1} {v1}.damaged) and rerun the same command: the driver rebuilds "
      "it from version 0 and phase 0's deltas."
    ),
  }
  assert len(said) == 2, said
  for msg in said:
    path = re.match(r"elastic storage file (\S+) is damaged", msg)[1]
    assert msg.endswith(want.pop(path)), msg
  _same(w, clean)


def test_damaged_queue_results_are_one_line_before_ray_and_the_rerun_is_clean(runs, tmp_path):
  cfg, clean, part = runs
  w = tmp_path / "run"
  shutil.copytree(part, w)
  results = storage.root(str(w)) / coord_lib.RESULTS / "results00000.json"
  test_damaged_files._flip(results)  # pylint: disable=protected-access
  said = _rerun_until_done(cfg, w)
  assert len(said) == 1 and said[0].startswith(
    f"elastic storage file {results} is damaged (crc32 "
  ), said
  assert said[0].endswith("that phase's tasks run again and write the same bytes.")
  _same(w, clean)


# The rows this file adds to docs/failures.md (tests/project/test_failure_table.py).
_T = "tests/runtime/elastic/test_elastic_damage.py"
TABLE = [
  Row(
    "elastic, end to end: a worker's residual truncated (the audit's 75-line Ray traceback)",
    "main (elastic)",
    "DamagedFileError: elastic storage file …/ef_block_0.npz is damaged "
    "(BadZipFile …); move …/out00001 aside (mv …) and rerun the same command: task (phase 0, "
    "worker W) runs again and writes the same bytes.",
    1,
    "after the move, the rerun's final checkpoint equals the undamaged run's, bit for bit",
    _T,
  ),
  Row(
    "elastic, end to end: one byte of a module version flipped",
    "main (elastic)",
    "DamagedFileError: elastic storage file …/v00001.npz is damaged (BadZipFile …); "
    "move it aside (mv …) and rerun the same command: the driver rebuilds it from version 0 "
    "and phase 0's deltas.",
    1,
    "after the move, the rerun's final checkpoint equals the undamaged run's, bit for bit",
    _T,
  ),
  Row(
    "elastic, end to end: one digit of the queue's results changed",
    "main (elastic)",
    "DamagedFileError: elastic storage file …/results00000.json is damaged (crc32 … read, … "
    "written); move it aside (mv …) and rerun the same command: that phase's tasks run again "
    "and write the same bytes.",
    1,
    "said before Ray starts; after the move, the final checkpoint equals the undamaged run's",
    _T,
  ),
]
