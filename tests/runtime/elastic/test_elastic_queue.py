"""The elastic task queue (the coordinator): rounds, requeues, the task log, re-shards."""
# pylint: disable=invalid-name

import importlib.util
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from etils import epath

from dipaco_jax import routing
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage

import helpers


def _queue(cfg, workdir: str) -> coord_lib.Coordinator:
  """The coordinator of `cfg`'s run, as the driver builds it (its plan from the grid)."""
  return coord_lib.Coordinator(grid_lib.Grid(cfg).queue_plan(), workdir)


# ---- The queue. ----


def test_a_task_whose_previous_phase_was_forgotten_waits_for_it(tmp_path):
  """After a repair takes (0, 0) off the results, a restored (1, 0) is not leased before it."""
  cfg = helpers.elastic_config(**{"elastic.task_timeout_s": 1000.0})
  wd = str(tmp_path)
  q = _queue(cfg, wd)
  for _ in range(4):
    q.complete(*q.lease(0), {})
  q.modules_updated(0, ["embed/0", "block_0/0", "block_1/0", "head/0"])
  assert q.pending == [(1, 0)]  # Worker 0's modules at version 1 (as in the test above).
  # repair.forget_lost_outputs: (0, 0)'s outputs were moved aside, so it leaves the results.
  results = storage.root(wd) / coord_lib.RESULTS / "results00000.json"
  storage.save_json(results, {w: r for w, r in storage.load_json(results).items() if w != "0"})
  restored = _queue(cfg, wd)
  assert restored.pending == [(1, 0), (0, 0)]  # The snapshot's task, then the forgotten one.
  assert restored.lease(0) == (0, 0)  # (1, 0) would read (0, 0)'s outputs: it waits.
  assert restored.lease(1) is None
  restored.complete(0, 0, {})
  assert restored.lease(1) == (1, 0)


def test_queue_rounds_requeue_idempotence_and_snapshot(tmp_path):
  cfg = helpers.elastic_config(**{"elastic.task_timeout_s": 1000.0})
  wd = str(tmp_path)
  q = _queue(cfg, wd)
  assert q.pending == [(0, 0), (0, 1), (0, 2), (0, 3)]
  a, b = q.lease(0), q.lease(1)  # Two actors, four tasks: rounds.
  assert (a, b) == ((0, 0), (0, 1))
  assert q.failed(*a) and q.pending[0] == (0, 0)  # Dead actor: back to the front.
  assert q.complete(0, 1, {"loss": [1.0, 0.5], "val_loss": 2.0})
  assert not q.complete(0, 1, {"loss": [2.0]})  # Accepted once.
  assert q.done["0/1"] == {"last_loss": 0.5, "val_loss": 2.0}  # Per-step losses: done.json's.
  for t in [q.lease(0), q.lease(1), q.lease(0)]:
    q.complete(*t, {})
  assert q.lease(0) is None  # Phase 1 waits for the outer step.
  # Worker 0 (path 0-0-0) reads embed/0, block_0/0, block_1/0, head/0.
  q.modules_updated(0, ["embed/0", "block_0/0", "head/0"])
  assert q.pending == []
  q.modules_updated(0, ["block_1/0"])
  assert q.pending == [(0 + 1, 0)]  # Only worker 0's modules are all at version 1.
  leased = q.lease(3)
  restored = _queue(cfg, wd)  # A restarted coordinator: the lease is requeued.
  assert restored.pending == [leased] and restored.done == q.done
  assert restored.unreported() == [(0, 1), (0, 2), (0, 3)]
  # With a quorum, worker 0's phase-0 delta may still be owed to a later step: re-reported too.
  quorum = _queue(helpers.elastic_config(**{"elastic.quorum": 0.5}), wd)
  assert quorum.unreported() == [(0, 0), (0, 1), (0, 2), (0, 3)]
  # The snapshot holds the queue; results are per phase, whatever the run's length.
  assert "done" not in storage.load_json(storage.root(wd) / "coordinator.json")
  assert coord_lib.read_results(wd) == q.done and len(q.done) == 4
  # Killed between a result's two writes: its result file is written, the snapshot still
  # leases the task. The next coordinator takes it as done, not as a task to run again.
  task = restored.lease(2)

  def killed():
    raise OSError("SIGKILL")

  restored._save = killed
  with pytest.raises(OSError):
    restored.complete(*task, {"loss": [0.3, 0.25]})
  again = _queue(cfg, wd)
  assert again.done[f"{task[0]}/{task[1]}"] == {"last_loss": 0.25} and again.pending == []
  # A snapshot of the earlier layout (results inside coordinator.json) moves into the new one.
  old = {"versions": again.versions, "pending": [], "leased": [], "reshards": []}
  storage.save_json(
    storage.root(str(tmp_path / "old")) / "coordinator.json",
    {**old, "done": {"0/2": {"loss": [1.0, 2.0]}}},
  )
  moved = _queue(cfg, str(tmp_path / "old"))
  assert moved.done == {"0/2": {"last_loss": 2.0}}
  assert coord_lib.read_results(str(tmp_path / "old")) == moved.done


def test_task_log_continues_across_runs_and_loses_only_a_torn_line(tmp_path):
  wd = str(tmp_path)
  log = storage.TaskLog(wd)
  log.append({"event": "start", "phase": 0})
  log.append({"event": "done", "phase": 0})
  log.close()
  with storage.task_log_part(wd, 0).open("ab") as f:  # A kill in the middle of a line.
    f.write(b'{"event": "sta')
  again = storage.TaskLog(wd)  # The rerun's driver.
  again.append({"event": "start", "phase": 1})
  again.close()
  assert [e["event"] for e in storage.read_task_log(wd)] == ["start", "done", "start"]


def test_benchmark_splits_actor_seconds_from_the_task_log(tmp_path):
  """benchmarks/elastic.py's goodput breakdown, on a hand-made log of 2 actors, T=1, 20 s."""
  spec = importlib.util.spec_from_file_location(
    "elastic_benchmark", os.path.join(helpers.ROOT, "benchmarks", "elastic.py")
  )
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  wd = str(tmp_path)
  log = storage.TaskLog(wd)
  for t, event, actor, phase, worker in [
    (2.0, "start", 0, 0, 0),
    (3.0, "start", 1, 0, 1),
    (5.0, "failed", 1, 0, 1),  # Killed: 2 s lost, then 2 s until it runs again.
    (7.0, "start", 1, 0, 1),
    (8.0, "done", 0, 0, 0),
    (9.0, "start", 0, 1, 0),  # Evaluation only (phase T).
    (10.0, "done", 0, 1, 0),
    (15.0, "done", 1, 0, 1),
    (15.5, "start", 1, 1, 1),
    (16.0, "done", 1, 1, 1),
  ]:
    log.append({"t": 100.0 + t, "event": event, "actor": actor, "phase": phase, "worker": worker})
  log.close()
  results = {"0/0": {"clock": {"steps": 5.0}}, "0/1": {"clock": {"steps": 7.0}}}
  got = bench._actor_seconds(storage.read_task_log(wd), results, 100.0, 20.0, A=2, T=1)
  want = {
    "startup": 2.0 + 3.0,  # Launch -> each actor's first task.
    "task_steps": 5.0 + 7.0,
    "task_eval_only": 1.0 + 0.5,
    "task_other": (6.0 - 5.0) + (8.0 - 7.0),
    "task_failed": 2.0,
    "scoring": 0.0,
    "restart": 2.0,
    "wait": (9.0 - 8.0) + (15.5 - 15.0),
    "tail": (20.0 - 10.0) + (20.0 - 16.0),
  }
  assert got["seconds"] == pytest.approx(want)
  assert sum(got["seconds"].values()) == pytest.approx(got["actor_seconds"]) == 40.0
  assert got["fraction"]["tail"] == pytest.approx(14.0 / 40.0)


def test_queue_holds_the_reshard_phase_until_its_shards_are_written(tmp_path):
  cfg = helpers.elastic_config(
    **{"routing.discriminative_at_outer_step": 1, "dipaco.outer_steps": 3}
  )
  q = _queue(cfg, str(tmp_path))
  assert q.reshard_due() == (None, [])
  for _ in range(4):
    q.complete(*q.lease(0), {})
  keys = sorted(q.versions)
  q.modules_updated(0, keys[:-1])
  assert q.reshard_due() == (None, [])  # One module still at version 0.
  q.modules_updated(0, keys[-1:])
  assert q.pending == [] and q.reshard_due() == (1, [])  # Every module at 1: the barrier.
  q.resharded(1)
  assert q.pending == [(1, 0), (1, 1), (1, 2), (1, 3)] and q.reshard_due() == (None, [1])
  assert _queue(cfg, str(tmp_path)).reshards == [1]  # Snapshotted.


def test_reshard_fits_on_the_pools_scores_refits_after_a_cut_save_reloads_a_saved_router(tmp_path):
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  class Plan:  # ShardPlan's part the driver calls.
    alpha_W = np.asarray([1.0, 0.5, 0.25, 0.75], np.float32)
    calls = []

    def reshard(self, step, params, scores_NxP=None):
      self.calls.append((step, params, scores_NxP))

    def shard_record(self):
      return {"shards/phase": len(self.calls)}

  cfg = helpers.elastic_config(
    **{"routing.discriminative_at_outer_step": 1, "dipaco.outer_steps": 3}
  )
  wd, plan, logs = str(tmp_path), Plan(), []
  directory = epath.Path(routing.router_dir(wd, 1))
  directory.mkdir(parents=True)
  (directory / router_lib.ARRAYS_FILE).write_bytes(b"cut short")  # No router.json: not saved.
  resharder = driver._Resharder(None, grid_lib.Grid(cfg), wd, plan, lambda **kw: logs.append(kw))
  col = lambda p, n=3: np.arange(n, dtype=np.float32) - 10.0 * p  # Path p's scores of n docs.
  for p in (0, 2):  # Scored before a restart.
    storage.save_array(storage.scores_file(wd, 1, p), col(p))
  resharder.begin(1)
  assert resharder.due == 1 and resharder.todo == [1, 3]  # Only the missing paths go out.
  storage.save_array(storage.scores_file(wd, 1, 1), col(1))
  storage.save_array(storage.scores_file(wd, 1, 3), col(3, n=2))  # Another config's count.
  with pytest.raises(ValueError, match="different document counts"):
    resharder.finish()
  storage.save_array(storage.scores_file(wd, 1, 3), col(3))
  assert resharder.finish() == 1 and resharder.due is None
  # Fitted on the 4 columns, in path order (outer step 1 = inner step 2); the half save dropped.
  ((step, params, scores),) = plan.calls
  assert step == 2 and params is None and not (directory / router_lib.ARRAYS_FILE).exists()
  np.testing.assert_array_equal(scores, [[0, -10, -20, -30], [1, -9, -19, -29], [2, -8, -18, -28]])
  assert storage.load_json(storage.alpha_file(wd, 1)) == [1.0, 0.5, 0.25, 0.75]
  assert resharder.records == {2: {"shards/phase": 1}}
  (directory / router_lib.META_FILE).write_text("{}")  # Saved: a rerun reloads it, scores none.
  storage.root(wd).joinpath("scores_phase1").rmtree()
  resharder.begin(1)
  assert resharder.todo == []
  resharder.finish()
  assert plan.calls[-1] == (2, None, None)
  assert [e["fitted"] for e in logs if e["event"] == "reshard"] == [True, False]


def test_coordinator_process_imports_no_jax():
  """The queue actor starts in a fraction of a second: its module and its plan need no JAX."""
  code = (
    "import pickle, sys\n"
    "from dipaco_jax.runtime.elastic import coordinator\n"
    "pickle.loads(sys.stdin.buffer.read())\n"
    "print(sorted(m for m in ('jax', 'flax', 'tensorboard') if m in sys.modules))"
  )
  plan = pickle.dumps(
    grid_lib.Grid(helpers.elastic_config()).queue_plan()
  )  # What Ray sends the actor.
  out = subprocess.run([sys.executable, "-c", code], input=plan, capture_output=True, check=True)
  assert out.stdout.decode().strip() == "[]"


def test_queue_timeout_requeues(tmp_path):
  q = _queue(helpers.elastic_config(**{"elastic.task_timeout_s": 1e-9}), str(tmp_path))
  task = q.lease(0)
  assert q.expired() == [(task, 0)] and q.pending[0] == task
