"""Elastic mode: queue, executors (order, restarts), bad input, and end to end on Ray with kills."""
# pylint: disable=invalid-name

import contextlib
import importlib.util
import itertools
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import outer_oracle
import pytest
from etils import epath

from dipaco_jax import data as data_lib
from dipaco_jax import errors
from dipaco_jax import evaluate
from dipaco_jax import routing
from dipaco_jax import serve
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.core import paths
from dipaco_jax.io import checkpoint
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import driver as elastic_driver
from dipaco_jax.runtime.elastic import errors as elastic_errors
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import jit_cache
from dipaco_jax.runtime.elastic import storage

import helpers
import routing_testlib


def _config(**kw):
  over = {"model.vocab_size": 8192, "early_stopping.enabled": False, "dipaco.mode": "elastic"}
  over.update(kw)
  return helpers.micro_config(**over)


# ---- Outer executors: order of arrival, restarts, the outer.py math. ----


def _random_phase(workdir, grid, rng):
  """Version 0 of every module (+ zero momentum) and random phase-0 outputs of every worker."""
  store = {}
  for s in grid.groups:
    t = grid.module_template(s.name)
    mods = [
      jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), t)
      for _ in range(s.num_modules)
    ]
    for e, m in enumerate(mods):
      storage.save_tree(storage.module_file(workdir, s.name, e, 0), m)
      storage.save_tree(
        storage.module_file(workdir, s.name, e, 0, "opt"),
        jax.tree.map(np.zeros_like, grid.recipe.outer_tx.init(m)),
      )
    store[s.name] = jax.tree.map(lambda *xs: np.concatenate(xs), *[m[s.name] for m in mods])
  params = paths.assemble(store, grid.topo)
  params = jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(np.float32), params)
  start = paths.assemble(store, grid.topo)  # What each worker started from: its modules.
  for w in range(grid.W):
    for s in grid.groups:
      delta = jax.tree.map(lambda a, b, w=w: a[w : w + 1] - b[w : w + 1], start, params)
      storage.save_tree(storage.delta_file(workdir, w, 1, s.name), {s.name: delta[s.name]})
  return store, params


def _stepped(workdir, grid):
  return {
    (s.name, e): storage.module_file(workdir, s.name, e, 1).read_bytes()
    for s in grid.groups
    for e in range(s.num_modules)
  }


def test_executor_result_does_not_depend_on_arrival_order_and_matches_outer_step(tmp_path):
  cfg = _config()
  grid = grid_lib.Grid(cfg)
  alpha = [1.0, 0.5, 0.25, 0.75]
  base = str(tmp_path / "base")
  store, params = _random_phase(base, grid, np.random.default_rng(0))
  results = []
  for n, order in enumerate([(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]):
    wd = str(tmp_path / f"order{n}")
    shutil.copytree(base, wd)
    owned = exec_lib.assign_groups([s.name for s in grid.groups], 2)
    exs = [exec_lib.OuterExecutor(cfg, wd, j, owned[j], alpha) for j in range(2)]
    for w in order:
      for ex in exs:
        ex.report(0, w)
    assert sorted(sum((ex.report(0, order[-1])[0] for ex in exs), [])) == sorted(
      grid_lib.module_key(g, e) for g, e in grid.used_modules()
    )
    results.append(_stepped(wd, grid))
  assert results[0] == results[1] == results[2]  # Bytes: the sum is taken in worker order.
  # The same math as the synchronous outer step over all workers at once.
  full, _, _, _ = outer_oracle.outer_step(
    store,
    grid.recipe.outer_tx.init(store),
    params,
    jnp.asarray(alpha, jnp.float32),
    topo=grid.topo,
    cfg=grid.recipe.outer_cfg,
  )
  wd = str(tmp_path / "order0")
  for s in grid.groups:
    for e in range(s.num_modules):
      got = storage.load_tree(storage.module_file(wd, s.name, e, 1), grid.module_template(s.name))
      for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(full[s.name])):
        # One device sums in worker order; the [K, W] einsum may associate differently.
        np.testing.assert_allclose(x[0], np.asarray(y)[e], rtol=0, atol=1e-6)


def test_executor_restarted_mid_phase_applies_every_delta_once(tmp_path):
  cfg = _config()
  grid = grid_lib.Grid(cfg)
  alpha = [1.0, 1.0, 1.0, 1.0]
  ref = str(tmp_path / "ref")
  _random_phase(ref, grid, np.random.default_rng(1))
  wd = str(tmp_path / "killed")
  shutil.copytree(ref, wd)
  groups = [s.name for s in grid.groups]
  one = exec_lib.OuterExecutor(cfg, ref, 0, groups, alpha)
  for w in range(4):
    one.report(0, w)
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, alpha)
  ex.report(0, 0)
  ex.report(0, 2)  # No module has all its workers yet: only recorded.
  del ex  # Killed: memory lost; its snapshot stays.
  again = exec_lib.OuterExecutor(cfg, wd, 0, groups, alpha)
  assert again.received[0] == {0, 2}
  for w in (1, 2, 3, 1, 0):  # Duplicates included: each worker counts once.
    again.report(0, w)
  assert _stepped(wd, grid) == _stepped(ref, grid)


def test_executor_forgets_settled_phases_and_still_answers_for_them(tmp_path):
  cfg = _config(**{"dipaco.outer_steps": 4})
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  _random_phase(wd, grid, np.random.default_rng(2))
  for t in (1, 2):
    _constant_phase(wd, grid, t, {w: 0.5 * w for w in range(4)})
  groups = [s.name for s in grid.groups]
  everything = sorted(grid_lib.module_key(g, e) for g, e in grid.used_modules())
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)
  for t in range(3):
    for w in range(4):
      ex.report(t, w)
  # Phases 0, 1, 2 complete: 0 and 1 settled (their next phase is complete too), 2 kept.
  snap = storage.load_json(exec_lib.snapshot_file(wd, 0))
  assert snap["settled"] == 2 and set(snap["received"]) == {"2"}
  assert {t for t, keys in snap["applied"].items() if keys} == {"2"}
  written = {
    p: p.read_bytes() for p in (storage.root(wd) / "store").glob("*/*/*.npz")
  }  # Versions 0..3 of every module and momentum.
  assert len(written) == 2 * 4 * len(everything)
  again = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)  # Restarted from the snapshot.
  assert again.report(0, 1) == {0: everything, 1: everything}  # A re-report: all stepped.
  assert again.report(2, 3) == {2: everything, 3: []}
  assert again.received == {2: {0, 1, 2, 3}}
  assert {p: p.read_bytes() for p in written} == written  # Nothing stepped again.


def _constant_phase(workdir, grid, phase: int, values) -> None:
  """Worker w's phase-`phase` outputs if its params ended at values[w] in every leaf.

  Its delta of each group: the module version `phase` it started from (one value, read
  here; NaN where that version does not exist yet) minus values[w].
  """
  for w, v in values.items():
    for s, (g, e) in zip(grid.groups, grid.modules_of_worker(w)):
      exists = storage.module_file(workdir, g, e, phase).exists()
      theta = _value(workdir, grid, g, e, phase) if exists else np.nan
      t = grid.module_template(s.name)
      storage.save_tree(
        storage.delta_file(workdir, w, phase + 1, s.name),
        jax.tree.map(lambda x, d=theta - v: np.full(x.shape, d, x.dtype), t),
      )


def _value(workdir, grid, group, module, version) -> float:
  """The one value every leaf of a module version holds (checked)."""
  tree = storage.load_tree(
    storage.module_file(workdir, group, module, version), grid.module_template(group)
  )
  vals = np.unique(np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]))
  assert len(vals) == 1, vals
  return float(vals[0])


@pytest.mark.parametrize("late", ["next", "drop"])
def test_quorum_steps_without_the_slow_worker_and_handles_its_late_delta(tmp_path, late):
  # Plain averaging (outer lr 1, no momentum, no √P): θ_{t+1} = θ_t − mean_w(θ_t − p_w).
  cfg = _config(
    **{
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
      "outer.sqrt_paths": "none",
      "dipaco.outer_steps": 3,
      "elastic.quorum": 0.5,
      "elastic.late_deltas": late,
    }
  )
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  for s in grid.groups:  # Version 0 of every module: zeros.
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), grid.module_template(s.name))
      storage.save_tree(storage.module_file(wd, s.name, e, 0), m)
      storage.save_tree(storage.module_file(wd, s.name, e, 0, "opt"), grid.recipe.outer_tx.init(m))
  _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
  groups = [s.name for s in grid.groups]
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)
  # Phase 0: embed (all 4 workers, α 1 each) needs 2 reports; block_0/0 (workers 0, 1) needs 1.
  assert ex.report(0, 0)[0] == ["block_0/0", "block_1/0"]
  assert "embed/0" in ex.report(0, 1)[0]  # Stepped with workers 0 and 1.
  ex.report(0, 2)
  ex.report(0, 3)  # Late for embed; workers 2, 3 (and 1 for block_0/0) missed their steps.
  assert _value(wd, grid, "embed", 0, 1) == (1.0 + 2.0) / 2  # Not 2.5: no slow worker in it.
  assert _value(wd, grid, "block_0", 0, 1) == 1.0  # Worker 0 alone.
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)  # Restart: state from the snapshot.
  assert ex.used[0]["embed/0"] == [0, 1]
  ex.report(0, 3)  # A duplicate: no effect.
  _constant_phase(wd, grid, 1, {0: 2.5, 1: 3.5})  # From the versions phase 0 made.
  # Phase 1: workers 0 (2.5) and 1 (3.5) report; θ1 = 1.5 for embed, 1.0 for block_0/0.
  ex.report(1, 0)
  assert ex.report(1, 1)[1] == ["block_0/0", "block_1/0", "block_1/1", "embed/0", "head/0"]
  if late == "next":
    # The late phase-0 deltas (θ0 − p = −3, −4) join: Δ = mean(−1, −2, −3, −4) = −2.5.
    assert _value(wd, grid, "embed", 0, 2) == 1.5 + 2.5
    # block_0/0: on time 1 − 2.5 = −1.5; late worker 1: 0 − 2 = −2 -> Δ = −1.75.
    assert _value(wd, grid, "block_0", 0, 2) == 1.0 + 1.75
  else:  # Dropped: Δ = mean(−1, −2) = −1.5; block_0/0: −1.5.
    assert _value(wd, grid, "embed", 0, 2) == 1.5 + 1.5
    assert _value(wd, grid, "block_0", 0, 2) == 1.0 + 1.5
  _constant_phase(wd, grid, 2, {0: 9.0})
  # The last step (phase 2): in "next" mode it waits for every report (no later step). In
  # "drop" mode block_0/0 steps with worker 0; block_1/0 (workers 0, 2) waits for worker 2's
  # phase-1 report first (staleness is bounded to one phase).
  stepped = ex.report(2, 0)[2]
  assert stepped == ([] if late == "next" else ["block_0/0"])


def test_quorum_grace_window_runs_from_the_quorum(tmp_path, monkeypatch):
  cfg = _config(
    **{
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
      "outer.sqrt_paths": "none",
      "elastic.quorum": 0.5,
      "elastic.grace_s": 10.0,
    }
  )
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  for s in grid.groups:
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), grid.module_template(s.name))
      storage.save_tree(storage.module_file(wd, s.name, e, 0), m)
      storage.save_tree(storage.module_file(wd, s.name, e, 0, "opt"), grid.recipe.outer_tx.init(m))
  _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
  clock = [100.0]
  monkeypatch.setattr(exec_lib.time, "time", lambda: clock[0])
  ex = exec_lib.OuterExecutor(cfg, wd, 0, ["embed"], [1.0] * 4)
  ex.report(0, 0)
  assert ex.report(0, 1) == {0: [], 1: []}  # Quorum at t=100; the window runs to t=110.
  clock[0] = 105.0
  assert ex.poll() == ({}, True)
  clock[0] = 106.0
  ex.report(0, 2)  # Joins within the window (3 of 4: still not all).
  clock[0] = 110.0
  assert ex.poll() == ({0: ["embed/0"]}, False)
  assert _value(wd, grid, "embed", 0, 1) == (1.0 + 2.0 + 3.0) / 3


def _queue(cfg, workdir: str) -> coord_lib.Coordinator:
  """The coordinator of `cfg`'s run, as the driver builds it (its plan from the grid)."""
  return coord_lib.Coordinator(grid_lib.Grid(cfg).queue_plan(), workdir)


# ---- The queue. ----


def test_queue_rounds_requeue_idempotence_and_snapshot(tmp_path):
  cfg = _config(**{"elastic.task_timeout_s": 1000.0})
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
  quorum = _queue(_config(**{"elastic.quorum": 0.5}), wd)
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
  cfg = _config(**{"routing.discriminative_at_outer_step": 1, "dipaco.outer_steps": 3})
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

  cfg = _config(**{"routing.discriminative_at_outer_step": 1, "dipaco.outer_steps": 3})
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


# ---- Workers: mid-task progress saves (elastic.progress_every_steps). ----


class _Killed(Exception):
  """Raised in place of the worker's SIGKILL of itself (fault injection, in process)."""


def _task_outputs(workdir, worker, phase) -> dict:
  """Task (phase - 1, worker)'s output bytes by path under the workdir (done.json aside)."""
  out = storage.worker_out_dir(workdir, worker, phase)
  files = {out / k: v for k, v in helpers.tree_bytes(out).items() if k != "done.json"}
  for path in (
    storage.worker_opt_file(workdir, worker, phase),
    storage.worker_data_file(workdir, worker, phase),
  ):
    files[path] = path.read_bytes()
  return files


def _watch_progress(w, monkeypatch) -> list:
  """Worker `w`'s progress() as the driver would read it, before each of its inner steps."""
  seen, step = [], w._step  # pylint: disable=protected-access

  def watched(*args):
    seen.append(w.progress())
    return step(*args)

  monkeypatch.setattr(w, "_step", watched)
  return seen


def test_worker_resumes_from_its_progress_save_with_the_same_bytes(tmp_path, monkeypatch):
  """A task killed after a save resumes there; a save cut short is skipped; the same bytes."""
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  six = {"dipaco.inner_steps": 6, "eval.every_steps": 6, "ckpt.every_steps": 6}
  cfg = _config(**{"data.shard_dir": str(tmp_path / "s"), "elastic.progress_every_steps": 2, **six})
  wd = str(tmp_path / "wd")
  grid = grid_lib.Grid(cfg)
  driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
  for s in grid.groups:  # Version 1 = version 0: task (1, w) reads it (and evaluates it).
    for e in range(s.num_modules):
      for kind in ("v", "opt"):
        src = storage.module_file(wd, s.name, e, 0, kind)
        src.copy(storage.module_file(wd, s.name, e, 1, kind))
  w = worker_lib.PathWorker(cfg, wd, 0)
  watched = _watch_progress(w, monkeypatch)
  ref = {0: w.run(0, 1)}
  assert "resumed_at_step" not in ref[0] and len(ref[0]["loss"]) == 6
  # What the driver reads when a lease expires: steps done so far (before each step's call).
  assert [p["steps"] for p in watched] == [0, 1, 2, 3, 4, 5], watched
  assert {(p["phase"], p["worker"], p["of"]) for p in watched} == {(0, 1, 6)}
  assert watched[0]["since_step_s"] is None and all(p["since_step_s"] >= 0 for p in watched[1:])
  assert all(b["elapsed_s"] >= a["elapsed_s"] > 0 for a, b in itertools.pairwise(watched))
  assert w.progress() is None  # No task running.
  watched.clear()
  assert not storage.progress_dir(wd, 1, 0).exists()  # Removed once the task is done.
  ref[1] = w.run(1, 1)
  assert np.isfinite(ref[1]["val_loss"])
  want = {t: _task_outputs(wd, 1, t + 1) for t in (0, 1)}

  def kill(pid, sig):
    assert pid == os.getpid() and sig == faults_lib.signal.SIGKILL
    raise _Killed

  monkeypatch.setattr(faults_lib.os, "kill", kill)
  files = len(grid.modules_of_worker(1)) + 3  # Its groups, AdamW state, data, at.json.
  for t in (0, 1):
    storage.worker_dir(wd, 1).rmtree()
    if t == 1:  # Task 1's inputs: task 0's outputs.
      for path, data in want[0].items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with pytest.raises(_Killed):  # Cut short before at.json: nothing to resume from.
      w.run(t, 1, faults={"die_in_progress": files - 1})
    at = storage.progress_dir(wd, 1, t) / "at.json"
    assert not at.exists()
    with pytest.raises(_Killed):  # Killed right after its first save (step 2) is complete.
      w.run(t, 1, faults={"die_in_progress": files})
    assert storage.load_json(at)["step"] == 2
    with pytest.raises(_Killed):  # Resumed at 2, then cut short inside the save of step 4.
      w.run(t, 1, faults={"die_in_progress": 2})
    assert storage.load_json(at)["step"] == 2
    watched.clear()
    out = w.run(t, 1)
    assert out["resumed_at_step"] == 2
    assert [(p["steps"], p["of"]) for p in watched] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert out["loss"] == ref[t]["loss"] and out["grad_norm"] == ref[t]["grad_norm"]
    assert out.get("val_loss") == ref[t].get("val_loss")  # Task 1's evaluation, from the save.
    assert _task_outputs(wd, 1, t + 1) == want[t]
    assert not storage.progress_dir(wd, 1, t).exists()

  # A shard too small to spare a held-out document: early stopping's loss reads NaN, as spmd's
  # padding-only batches give (data.Feed), rather than an error.
  w._heldout = data_lib.Holdout(docs=64, fraction=0.0, part="heldout")  # pylint: disable=protected-access
  assert np.isnan(w._evaluate(jax.device_get(w._load_params(1, 1)), 1, 0, "heldout"))  # pylint: disable=protected-access

  # A save of another H is refused with one error, and left where it is.
  storage.save_json(storage.progress_dir(wd, 1, 0) / "at.json", {"H": 4, "step": 2})
  with pytest.raises(ValueError, match="dipaco.inner_steps is 6"):
    w.run(0, 1)
  assert storage.progress_dir(wd, 1, 0).exists()


def test_scoring_tasks_give_the_drivers_scores_and_router(tmp_path, monkeypatch):
  """A re-shard's scoring tasks (one path each, on a worker) = the driver's own scoring."""
  from dipaco_jax.routing import phases  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  routing_testlib.small_corpus(monkeypatch, 200)
  cfg = _config(
    **{
      "data.shard_dir": str(tmp_path / "s"),
      "routing.router": "kmeans",
      "routing.kmeans_restarts": 2,
      "routing.kmeans_iters": 20,
      "routing.discriminative_at_outer_step": 1,
      "routing.router_max_docs": 40,
      "routing.prefix_len": 4,
    }
  )
  wd = str(tmp_path / "wd")
  grid = grid_lib.Grid(cfg)
  exp, plan, _ = driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  for s in grid.groups:  # Version 1 (the re-shard's): version 0 (θ̄ everywhere) + noise.
    for e in range(s.num_modules):
      m = storage.load_tree(storage.module_file(wd, s.name, e, 0), grid.module_template(s.name))
      m = jax.tree.map(lambda x: x + 0.05 * rng.normal(size=x.shape).astype(x.dtype), m)
      storage.save_tree(storage.module_file(wd, s.name, e, 1), m)
  w = worker_lib.PathWorker(cfg, wd, 0)
  P = grid.topo.num_paths
  assert [w.score(1, p)["docs"] for p in range(P)] == [40] * P
  cols = np.stack([storage.load_array(storage.scores_file(wd, 1, p)) for p in range(P)], 1)
  # The spmd loop's scoring: every path at once, on the driver's mesh.
  scorer = routing.PathScorer(
    exp,
    driver._paths_at(exp, grid, wd, 1),
    seq_len=routing.score_len(cfg),  # pylint: disable=protected-access
  )
  L = cfg.routing.prefix_len
  ref = np.concatenate(
    [phases.score_documents(scorer, docs, L) for docs in routing.router_split_blocks(cfg, L)]
  )
  assert ref.shape == (40, P) and len(set(ref.argmax(1).tolist())) > 1
  np.testing.assert_allclose(cols, ref, rtol=1e-5)  # One device's program against the mesh's.
  # A fit on given scores is the fit that scores: the same scores, the same router.
  a = routing.fit_discriminative_router(cfg, scorer, plan.extractor)
  b = routing.fit_discriminative_router(cfg, None, plan.extractor, scores_NxP=ref, topo=exp.topo)
  assert a.arrays.keys() == b.arrays.keys()
  for k in a.arrays:
    np.testing.assert_array_equal(a.arrays[k], b.arrays[k])
  with pytest.raises(ValueError, match="39 documents scored but the router split has 40"):
    routing.fit_discriminative_router(cfg, None, plan.extractor, scores_NxP=ref[:39], topo=exp.topo)


def test_coordinator_process_imports_no_jax():
  """The queue actor starts in a fraction of a second: its module and its plan need no JAX."""
  code = (
    "import pickle, sys\n"
    "from dipaco_jax.runtime.elastic import coordinator\n"
    "pickle.loads(sys.stdin.buffer.read())\n"
    "print(sorted(m for m in ('jax', 'flax', 'tensorboard') if m in sys.modules))"
  )
  plan = pickle.dumps(grid_lib.Grid(_config()).queue_plan())  # What Ray sends the actor.
  out = subprocess.run([sys.executable, "-c", code], input=plan, capture_output=True, check=True)
  assert out.stdout.decode().strip() == "[]"


def test_queue_timeout_requeues(tmp_path):
  q = _queue(_config(**{"elastic.task_timeout_s": 1e-9}), str(tmp_path))
  task = q.lease(0)
  assert q.expired() == [(task, 0)] and q.pending[0] == task


def _progress(steps, elapsed_s, since_step_s, of=40):
  """A worker's answer to PathWorker.progress for task (0, 1)."""
  return {
    "phase": 0,
    "worker": 1,
    "steps": steps,
    "of": of,
    "elapsed_s": elapsed_s,
    "since_step_s": since_step_s,
  }


def test_a_task_timeout_shorter_than_the_tasks_stops_the_run_in_one_line():
  Timeouts = elastic_driver._Timeouts  # pylint: disable=protected-access
  t = Timeouts(4.0, 40)
  stepping = _progress(3, 4.2, 0.5)  # 3 of 40 steps in 4.2 s: the task takes ~56 s.
  line = t.expired((0, 1), 0, stepping)
  assert line.startswith("elastic: task (phase 0, worker 1) passed config.elastic.task_timeout_s=4")
  assert "3 of 40 inner steps done in 4.2 s, about 56 s for the task's 40" in line
  # Not counted towards the stop: another task's timeout, an attempt whose worker did not answer
  # (not placed yet), one that made no step lately (a hang: what the timeout is for).
  t.expired((0, 2), 1, stepping)
  assert "did not answer" in t.expired((0, 1), 1, None)
  assert "none lately" in t.expired((0, 1), 1, _progress(20, 104.0, 100.0))
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    t.expired((0, 1), 1, _progress(4, 4.1, 0.2, of=40))
  assert str(e.value) == (
    "config.elastic.task_timeout_s=4 is shorter than a task: task (phase 0, worker 1) timed out "
    "2 times while its worker was stepping (the last attempt: 4 of 40 inner steps done in 4.1 s, "
    "about 41 s for the task's 40); set --config.elastic.task_timeout_s=130 (3x that) or more "
    "and rerun the same command (it resumes)."
  )
  # A task that never steps in time (hung, or a compile longer than the timeout): 3 answered
  # timeouts stop the run too.
  t = Timeouts(4.0, 40)
  for _ in range(2):
    t.expired((1, 0), 0, _progress(0, 4.0, None))
  with pytest.raises(elastic_errors.ElasticConfigError, match="timed out 3 times") as e:
    t.expired((1, 0), 0, _progress(0, 4.0, None))
  assert "--config.elastic.task_timeout_s=40 or more" in str(e.value)
  for n in range(2):  # A re-shard's scoring task: 3 timeouts.
    assert f"({n + 1} of 3 such timeouts" in t.expired_score(2, 0, 5.0)
  with pytest.raises(elastic_errors.ElasticConfigError, match="scoring task of path 2"):
    t.expired_score(2, 0, 5.0)
  # Stepping: a step done lately (within 30 s, or 3x the attempt's mean time per step so far).
  stepping = elastic_driver.stepping
  assert stepping(_progress(10, 100.0, 29.0)) and not stepping(_progress(10, 100.0, 31.0))
  assert stepping(_progress(2, 200.0, 100.0))  # Slow steps (100 s each): still stepping.
  assert not stepping(_progress(0, 10.0, None)) and not stepping(None)


def _node(alive=True, **resources):
  return {"Alive": alive, "Resources": {"memory": 1e9, "node:127.0.0.1": 1.0, **resources}}


def test_worker_resources_the_local_cluster_lacks_are_refused_a_joined_cluster_waits():
  check = elastic_driver.check_resources
  cfg = lambda res, n=2: _config(**{"elastic.worker_resources": res, "elastic.num_workers": n})
  local = [_node(CPU=3.0)]
  assert check(cfg(""), local, fixed=True) is None  # 1 CPU each: room for 3.
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    check(cfg('{"TPU": 4}'), local, fixed=True)
  assert str(e.value) == (
    """config.elastic.worker_resources='{"TPU": 4}' asks each worker actor for {"CPU": 1, """
    """"TPU": 4}, but the local Ray cluster (config.elastic.address='', this machine) has no """
    """TPU: it offers {"CPU": 3}; ask for resources this machine has (worker_resources='' = 1 """
    "CPU each), or join a cluster whose nodes advertise TPU with "
    "--config.elastic.address=HOST:PORT."
  )
  with pytest.raises(elastic_errors.ElasticConfigError, match="room for 1 of the config.elastic"):
    check(cfg('{"GPU": 1}'), [_node(CPU=3.0, GPU=1.0)], fixed=True)
  with pytest.raises(elastic_errors.ElasticConfigError, match="no node of the local Ray cluster"):
    check(cfg('{"GPU": 2}'), [_node(CPU=3.0, GPU=1.0)], fixed=True)
  # A joined cluster may grow (a pool still joining, spot VMs re-created): a warning, no stop.
  pool = [_node(CPU=8.0), _node(CPU=8.0, TPU=4.0), _node(False, CPU=8.0, TPU=4.0)]
  assert check(cfg('{"TPU": 1}', 4), pool, fixed=False) is None
  line = check(cfg('{"TPU": 1}', 8), pool, fixed=False)
  assert line.startswith("""elastic: config.elastic.worker_resources='{"TPU": 1}' asks""")
  assert """the cluster's 2 live nodes offer {"CPU": 16, "TPU": 4}: room for 4 of the""" in line
  assert "no node has" not in line
  assert "(no node has TPU)" in check(cfg('{"TPU": 1}', 1), pool[:1], fixed=False)


def test_worker_resources_the_machine_cannot_give_are_refused_before_anything_is_written(
  tmp_path,
):
  # More cores than exist: refused before Ray starts (the command's own cluster's CPUs).
  wd = tmp_path / "run"
  cfg = _config(**{"elastic.worker_resources": '{"CPU": 100000}'})
  with pytest.raises(elastic_errors.ElasticConfigError, match='worker_resources=\'{"CPU": 100000}'):
    train.train_and_evaluate(cfg, str(wd))
  assert not wd.exists()


def test_rays_token_file_is_written_and_kept_owner_only(tmp_path, monkeypatch):
  private = elastic_driver._private_token  # pylint: disable=protected-access
  monkeypatch.setenv("HOME", str(tmp_path))
  for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    monkeypatch.delenv(k, raising=False)
  token = tmp_path / ".ray" / "auth_token"
  assert elastic_driver.token_file() == token
  private()  # Missing: written owner-only, as Ray would (32 random bytes in hex).
  assert stat.S_IMODE(token.stat().st_mode) == 0o600
  assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
  text = token.read_text()
  assert re.fullmatch("[0-9a-f]{64}", text)
  token.chmod(0o644)  # As Ray 2.60 writes it under umask 022: every local user could read it.
  private()
  assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == text
  other = tmp_path / "elsewhere" / "token"
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
  private()
  assert stat.S_IMODE(other.stat().st_mode) == 0o600
  monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")  # No file: the token is in the environment.
  assert elastic_driver.token_file() is None
  monkeypatch.delenv("RAY_AUTH_TOKEN")
  monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
  assert elastic_driver.token_file() is None


def test_a_resource_no_node_has_stops_the_command_in_one_line_before_any_work(tmp_path):
  """`python -m dipaco_jax.main` asking TPUs of this CPU machine: exit 1, one line, no workdir."""
  pytest.importorskip("ray")
  wd = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "dipaco_jax.main", "--config=configs/tiny.py", f"--workdir={wd}"]
  flags = ["--config.dipaco.mode=elastic", '--config.elastic.worker_resources={"TPU": 4}']
  r = subprocess.run(
    cmd + flags, cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 1, r.stderr[-3000:]
  errors_ = [l for l in r.stderr.splitlines() if "Error" in l]
  assert errors_ == [
    "ElasticConfigError: config.elastic.worker_resources='{\"TPU\": 4}' asks each worker actor "
    'for {"CPU": 1, "TPU": 4}, but the local Ray cluster (config.elastic.address=\'\', this '
    'machine) has no TPU: it offers {"CPU": 3}; ask for resources this machine has '
    "(worker_resources='' = 1 CPU each), or join a cluster whose nodes advertise TPU with "
    "--config.elastic.address=HOST:PORT."
  ], r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  assert not wd.exists()


# ---- Bad input. ----


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("mesh.path", 2, "config.mesh.path=2"),
    ("elastic.num_workers", 0, "config.elastic.num_workers=0"),
    ("stop_at_step", 2, "config.stop_at_step=2"),
    ("elastic.late_deltas", "later", "config.elastic.late_deltas='later'"),
    ("elastic.worker_resources", "TPU=4", "worker_resources='TPU=4'"),
  ],
)
def test_bad_config_is_refused(tmp_path, field, value, match):
  # Refused by load's config check (elastic check_config is part of it), else by the trainer's.
  with pytest.raises(errors.ConfigError, match=match):
    train.train_and_evaluate(_config(**{field: value}), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_bad_mode_and_address_are_refused(tmp_path):
  with pytest.raises(errors.ConfigError, match="config.dipaco.mode='async'"):
    train.train_and_evaluate(_config(**{"dipaco.mode": "async"}), str(tmp_path))
  cfg = _config(**{"elastic.address": "127.0.0.1:1", "data.shard_dir": str(tmp_path / "s")})
  with pytest.raises(
    elastic_errors.ElasticConfigError, match="elastic.address='127.0.0.1:1' does not"
  ):
    train.train_and_evaluate(cfg, str(tmp_path / "run"))


def test_workdir_of_the_other_mode_is_refused(tmp_path):
  (tmp_path / "spmd" / "checkpoints").mkdir(parents=True)
  with pytest.raises(elastic_errors.ElasticConfigError, match="mode='spmd'"):
    train.train_and_evaluate(_config(), str(tmp_path / "spmd"))
  storage.save_json(storage.root(str(tmp_path / "el")) / "meta.json", {"mode": "elastic"})
  with pytest.raises(elastic_errors.ElasticConfigError, match="mode='elastic'"):
    train.train_and_evaluate(_config(**{"dipaco.mode": "spmd"}), str(tmp_path / "el"))


def test_actor_options_match_the_launch_scripts():
  # launch/ray_actions.sh starts TPU VM nodes with --resources='{"TPU": chips}' and the driver
  # with worker_resources='{"TPU": 1}': one worker actor per chip, 1 CPU each.
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  assert driver._worker_options('{"TPU": 1}') == {
    "max_restarts": -1,
    "max_concurrency": 2,
    "num_cpus": 1,
    "resources": {"TPU": 1},
  }
  assert driver._worker_options('{"CPU": 4, "GPU": 1}')["num_cpus"] == 4
  assert driver._worker_options("")["resources"] is None
  # The coordinator and executors stay on the driver's node (the head, not a spot TPU VM).
  pytest.importorskip("ray")
  context = type("Context", (), {"get_node_id": lambda self: "ab" * 28})()
  fake_ray = type("Ray", (), {"get_runtime_context": staticmethod(lambda: context)})
  strategy = driver._control_options(fake_ray)["scheduling_strategy"]
  assert (strategy.node_id, strategy.soft) == ("ab" * 28, False)


def test_cpu_sets_share_the_machines_cores_among_the_worker_actors():
  cpu_sets = elastic_driver.cpu_sets
  assert cpu_sets({0, 1}, 2) == [[0], [1]]
  assert cpu_sets({0, 1}, 1) == [[0, 1]]
  # 8 cores (one missing from the affinity), 3 actors: 2 each, the 7th core left over.
  assert cpu_sets({0, 1, 2, 3, 4, 6, 7}, 3) == [[0, 1], [2, 3], [4, 6]]
  assert cpu_sets({5, 9}, 3) == [[5], [9], [5]]  # More actors than cores: in turn.


def test_compile_cache_folder_of_each_setting(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("DIPACO_CACHE_DIR", str(tmp_path / "user"))
  assert jit_cache.directory("auto") == str(tmp_path / "user" / "jax_cache")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))  # The user's own wins.
  assert jit_cache.directory("auto") == str(tmp_path / "env")
  assert jit_cache.directory("gs://b/jit") == "gs://b/jit"
  assert jit_cache.directory("off") is None


# ---- End to end on a local Ray cluster. ----


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
  ray = pytest.importorskip("ray")
  # One persistent compilation cache for every actor (Ray's worker processes inherit the
  # environment ray.init starts the node with), as benchmarks/elastic.py: a worker actor
  # restarted after a kill, or the next run's, loads its executables instead of compiling.
  cache = {
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  with pytest.MonkeyPatch.context() as mp:
    for k, v in cache.items():
      mp.setenv(k, v)
    elastic_driver.start_local_ray(num_cpus=4)  # As the command's own cluster, 4 CPUs.
  yield ray
  ray.shutdown()


def _final(workdir):
  return checkpoint.restore_numpy(workdir)


# evaluate.py on micro runs: no re-router fits, a prefix shorter than the 16-token sequences.
_EVAL = {"eval.rerouters": (), "routing.prefix_len": 4}


@pytest.mark.slow
def test_elastic_matches_spmd_and_survives_kills(tmp_path, ray_cluster):
  shards = str(tmp_path / "shards")
  # Gradient accumulation and remat on: the recipe's inner step, in both runtimes.
  step = {"inner.microbatches": 2, "model.remat": "full"}
  cfg = lambda **kw: _config(
    **{"data.shard_dir": shards, "early_stopping.enabled": True, **_EVAL, **step, **kw}
  )
  spmd = cfg(**{"dipaco.mode": "spmd"})
  ref = train.train_and_evaluate(spmd, str(tmp_path / "spmd"))
  out = train.train_and_evaluate(cfg(), str(tmp_path / "clean"))
  assert out["status"]["done"] == 12 and out["status"]["requeued"] == 0  # 2 phases + eval.
  # elastic.pin_cpus: the command's local cluster gives each worker actor its own cores.
  done = [e for e in storage.read_task_log(str(tmp_path / "clean")) if e["event"] == "done"]
  cores = elastic_driver.cpu_sets(os.sched_getaffinity(0), 2)
  assert {e["actor"]: e["cpus"] for e in done} == dict(enumerate(cores))
  # Validation as tasks on the pool, at the steps train.py evaluates (after each outer step).
  np.testing.assert_allclose(out["val_loss"], ref["val_loss"], rtol=1e-5)
  np.testing.assert_allclose(out["train_loss_mean"], ref["train_loss_mean"], rtol=1e-5)
  a, b = _final(str(tmp_path / "spmd")), _final(str(tmp_path / "clean"))
  for name in ("store", "outer_opt", "params", "inner_opt"):
    for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True):
      # Not bit-identical: the SPMD program is the vmapped step partitioned over 4 devices,
      # the elastic worker's is the same step compiled for one device; XLA fuses the two
      # differently, so AdamW updates differ in the last float32 bits from the first step
      # with a nonzero LR (max |diff| measured: 4.8e-7 after 2 outer steps).
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  np.testing.assert_array_equal(a["step"], b["step"])
  # Early stopping (the driver feeds early_stopping.BestPaths the tasks' evaluations):
  # the same records and best set as spmd's; serving reads both sources of the checkpoint.
  rec_a, rec_b = (checkpoint.read_best_records(str(tmp_path / d)) for d in ("spmd", "clean"))
  assert rec_a["step"] == rec_b["step"] and rec_b["checkpoint_step"] == 4
  np.testing.assert_allclose(rec_a["loss"], rec_b["loss"], rtol=1e-5)
  for path in range(4):
    for source in ("store", "best"):
      x, _ = serve.load_path_params(str(tmp_path / "spmd"), spmd, path, source=source)
      y, info = serve.load_path_params(str(tmp_path / "clean"), cfg(), path, source=source)
      assert info["step"] == 4
      for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=1e-6)
  # Routed evaluation (evaluate.py) of the elastic checkpoint, store and best set.
  reports = []
  for d, c in (("spmd", spmd), ("clean", cfg())):
    evaluate.evaluate_and_write(c, str(tmp_path / d))
    reports.append(json.loads((tmp_path / d / "eval" / "step_4.json").read_text()))
  assert set(reports[1]) == {"store", "best"}
  for k in ("store", "best"):
    np.testing.assert_allclose(
      reports[0][k]["own_shard"]["loss"], reports[1][k]["own_shard"]["loss"], rtol=1e-5
    )

  # Faults: worker and executor SIGKILLs at random moments of their calls (tasks slowed
  # to ~1 s so kills land mid-task), and the driver stopping after 4 accepted tasks,
  # then the same command again: the clean run's bytes. Workers dispatch ahead here (the
  # TPU/GPU default; the clean run reads every step): the same steps, the same bytes.
  faulty = str(tmp_path / "faulty")
  slow, delay = {"dispatch_ahead": "on"}, {"step_delay_s": (0.5, 0.5)}
  first = train.train_and_evaluate(
    cfg(**slow), faulty, faults_lib.Faults(worker_kills=1, stop_after_tasks=4, **delay)
  )
  assert first["stopped"] and first["status"]["done"] >= 4
  out = train.train_and_evaluate(
    cfg(**slow), faulty, faults_lib.Faults(worker_kills=3, executor_kills=2, **delay)
  )
  assert out["step"] == 4 and out["status"]["done"] == 12
  kills = first["status"]["worker_kills"] + out["status"]["worker_kills"]
  assert kills >= 2 and out["status"]["requeued"] >= 2, (first, out)
  c = _final(faulty)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The best set too (the rerun driver replays early stopping from the accepted results).
  assert checkpoint.read_best_records(faulty) == rec_b | {"checkpoint_step": 4}
  for path in range(4):
    x, _ = serve.load_path_params(str(tmp_path / "clean"), cfg(), path, source="best")
    y, _ = serve.load_path_params(faulty, cfg(), path, source="best")
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  assert (tmp_path / "faulty" / "metrics.jsonl").read_text().count('"step"') == 2  # One per phase.
  events = storage.read_task_log(faulty)
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))  # Each accepted once.
  # The kills landed (the log, not the schedule): a worker mid-task, a worker with its
  # outputs half written (seed 0 draws the rerun's 4th dispatch, a training task), an executor.
  kills = [(e["target"], e["how"]) for e in events if e["event"] == "kill"]
  assert ("worker", "timed") in kills and ("worker", "write") in kills, kills
  assert ("executor", "timed") in kills, kills
  assert sum(e["event"] == "failed" for e in events) >= sum(t == "worker" for t, _ in kills)

  # A guard that trips: a worker's task stops as the spmd loop does (the same rule at the same
  # step), and the driver stops the run with that error.
  trip = {"guard.max_param_norm_ratio": 1.001, "inner.lr": 0.05}
  with pytest.raises(guard_lib.DivergenceError) as want:
    train.train_and_evaluate(cfg(**{"dipaco.mode": "spmd", **trip}), str(tmp_path / "trip_spmd"))
  with pytest.raises(guard_lib.DivergenceError) as got:
    train.train_and_evaluate(cfg(**trip), str(tmp_path / "trip_elastic"))
  rule = re.compile(r"parameter norm of \w+ grew [\d.]+x since step 0 .* at step (\d+),")
  assert rule.search(str(want.value)) and rule.search(str(got.value)), (want.value, got.value)
  assert rule.search(str(want.value))[1] == rule.search(str(got.value))[1]


@pytest.mark.slow
def test_quorum_end_to_end_with_a_slow_worker(tmp_path, ray_cluster):
  # Actor 1 sleeps 3 s per inner step, so task (0, 1) (leased to it first) ends long after
  # actor 0 ran (0, 0), (0, 2), (0, 3): with quorum 0.5 every module steps phase 0 without
  # worker 1; its late delta joins phase 1's step (the last, which waits for all).
  wd = str(tmp_path / "run")
  cfg = _config(
    **{
      "data.shard_dir": str(tmp_path / "shards"),
      "elastic.quorum": 0.5,
    }
  )
  out = train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=(0.0, 3.0)))
  assert out["step"] == 4 and out["status"]["done"] == 12
  assert np.isfinite(out["train_loss_mean"])
  grid = grid_lib.Grid(cfg)
  snap = storage.load_json(exec_lib.snapshot_file(wd, 0))
  # Phase 0 is settled (phase 1 complete too): its record left the snapshot for its own file.
  assert snap["settled"] == 1 and "0" not in snap["received"]
  used0 = storage.load_json(exec_lib.settled_file(wd, 0, 0))["used"]
  assert used0, snap  # Some module stepped phase 0 without every worker.
  assert exec_lib.quorum_steps(wd, 0) == {0: used0}
  for key, used in used0.items():
    g, e = key.split("/")
    through = grid.workers_through(g, int(e))
    assert 1 not in used and set(used) < set(through)
    # Each late delta joined the next step exactly once.
    assert sorted(used + snap["carried"]["1"][key]) == through
  assert "1" not in snap["used"]  # The last step waited for every report ("next").
  events = storage.read_task_log(wd)
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))


def _sockets(root) -> list:
  """(process name, socket) of every inet socket of `root` ("driver") and its descendants, now."""
  psutil = pytest.importorskip("psutil")
  out = []
  try:
    procs = [root, *root.children(recursive=True)]
  except psutil.Error:
    return out
  for p in procs:
    try:
      name = "driver" if p.pid == root.pid else p.name()
      out += [(name, c) for c in p.net_connections(kind="inet")]
    except psutil.Error:  # Ended meanwhile.
      pass
  return out


@pytest.mark.slow
def test_the_commands_own_cluster_listens_on_loopback_only_and_keeps_its_token_private(tmp_path):
  """Every socket of the command's own Ray cluster is on 127.0.0.1; its token file is 0600.

  The run starts in a child process (as the command does: Ray not started yet, so `_connect`
  starts the cluster), stopped after its first accepted task; this process lists the child's
  and its descendants' sockets (GCS, raylet, agents, driver, actors) every 0.2 s meanwhile.
  """
  psutil = pytest.importorskip("psutil")
  pytest.importorskip("ray")
  over = {
    "model.vocab_size": 8192,
    "early_stopping.enabled": False,
    "dipaco.mode": "elastic",
    "elastic.num_workers": 1,
    "data.shard_dir": str(tmp_path / "shards"),
  }
  code = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "import helpers\n"
    "from dipaco_jax import train\n"
    "from dipaco_jax.runtime import faults\n"
    "import json\n"
    "cfg = helpers.micro_config(**json.loads(sys.argv[2]))\n"
    "out = train.train_and_evaluate(cfg, sys.argv[3], faults.Faults(stop_after_tasks=1))\n"
    "assert out['stopped'], out\n"
  )
  test_dir = os.path.dirname(os.path.abspath(__file__))
  # A home of its own: Ray's token file is ~/.ray/auth_token, written by the command (0600).
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  env["HOME"] = str(tmp_path / "home")
  for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    env.pop(k, None)
  args = [sys.executable, "-c", code, test_dir, json.dumps(over), str(tmp_path / "run")]
  child = subprocess.Popen(args, cwd=helpers.ROOT, env=env, stderr=subprocess.PIPE, text=True)
  seen = {}  # (process, kind, status, local ip, remote ip) -> times seen
  root = psutil.Process(child.pid)
  try:
    while child.poll() is None:
      for name, c in _sockets(root):
        local, remote = (a.ip if a else "" for a in (c.laddr, c.raddr))  # "": none (unbound).
        key = (name.split(".")[0], c.type.name, c.status, local, remote)
        seen[key] = seen.get(key, 0) + 1
      time.sleep(0.2)
    stderr = child.stderr.read()
  finally:
    if child.poll() is None:
      child.kill()
  assert child.returncode == 0, stderr[-3000:]
  listening = {k for k in seen if k[2] == psutil.CONN_LISTEN}
  # GCS, raylet, the driver and the actors' processes (coordinator, executor, worker) listen.
  names = {k[0] for k in listening}
  assert {"gcs_server", "raylet", "driver", "ray::PathWorker", "ray::Coordinator"} <= names, seen
  exposed = [k for k in seen if any(ip and not elastic_driver.is_loopback(ip) for ip in k[3:])]
  assert not exposed, exposed  # Listening, bound (UDP) and connected: loopback only.
  token = tmp_path / "home" / ".ray" / "auth_token"
  if env.get("RAY_AUTH_MODE", "token").lower() == "token":  # Ray's default: tokens on.
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert re.fullmatch("[0-9a-f]{64}", token.read_text())
  else:  # The user turned Ray's tokens off: the command writes none.
    assert not token.exists()
  assert elastic_driver.is_loopback("::ffff:127.0.0.1") and elastic_driver.is_loopback("::1")
  assert not elastic_driver.is_loopback("0.0.0.0") and not elastic_driver.is_loopback("::")


@pytest.mark.slow
def test_a_task_timeout_shorter_than_the_task_stops_the_run(tmp_path, ray_cluster):
  """task_timeout_s=6 s for tasks of 20 s (1 s per inner step): stopped at the second cut."""
  cfg = _config(
    **{
      "data.shard_dir": str(tmp_path / "shards"),
      "dipaco.inner_steps": 20,
      "eval.every_steps": 20,
      "ckpt.every_steps": 20,
      "elastic.num_workers": 1,
      "elastic.task_timeout_s": 6.0,
    }
  )
  wd = str(tmp_path / "run")
  t0 = time.time()
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=(1.0,)))
  wall = time.time() - t0
  msg = str(e.value)
  assert msg.startswith("config.elastic.task_timeout_s=6"), msg
  cuts = [x for x in storage.read_task_log(wd) if x["event"] == "timeout"]
  assert {(x["phase"], x["worker"]) for x in cuts} == {(0, 0)}, cuts  # The one actor's task.
  answered = [x["progress"] for x in cuts if x["progress"]]
  stepped = [p for p in answered if elastic_driver.stepping(p)]
  if len(stepped) == 2:  # The rule that fired (or, on a loaded machine, 3 answered attempts).
    m = re.search(
      r"task \(phase 0, worker 0\) timed out 2 times while its worker was stepping \(the last "
      r"attempt: (\d+) of 20 inner steps done in ([\d.]+) s, about (\d+) s for the task's 20\); "
      r"set --config.elastic.task_timeout_s=(\d+) \(3x that\)",
      msg,
    )
    assert m, msg
    steps, elapsed, est, value = int(m[1]), float(m[2]), int(m[3]), int(m[4])
    assert steps == stepped[-1]["steps"] and abs(elapsed - stepped[-1]["elapsed_s"]) < 0.06
    assert abs(est - elapsed * 20 / steps) <= 0.5 and value >= 3 * est
    assert est >= 20  # 20 steps of >= 1 s each: the task's real time, not the timeout's.
  else:  # The first steps' compile took longer than the timeout (a loaded machine).
    assert len(answered) == 3 and "timed out 3 times" in msg, (msg, cuts)
    assert "set --config.elastic.task_timeout_s=" in msg, msg
  assert len(cuts) <= 4 and wall < 180, (len(cuts), wall)  # Stopped, not thrashing.
  assert not [x for x in storage.read_task_log(wd) if x["event"] == "done"]


def _tree_files(root) -> dict:
  return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_elastic_reshard_matches_spmd_and_survives_kills(tmp_path, ray_cluster, monkeypatch):
  with contextlib.ExitStack() as stack:
    _reshard_matches_spmd_and_survives_kills(tmp_path, monkeypatch, stack)


def _reshard_matches_spmd_and_survives_kills(tmp_path, monkeypatch, stack):
  # k-means phase 0, a discriminative re-shard after outer step 1 of 2; scoring tasks on the
  # pool score the router split with the paths at version 1, the driver fits the router.
  # The driver and the spmd loop see the corpus's first 200 documents per split; the
  # worker actors (other processes) the whole corpus: they read only the router split,
  # whose first routing.router_max_docs = 200 labelled documents are those 200.
  routing_testlib.small_corpus(monkeypatch, 200)
  stack.enter_context(helpers.compile_cache(tmp_path / "jax_cache"))  # The driver's and spmd's.
  cfg = lambda **kw: _config(
    **{
      "early_stopping.enabled": True,
      "routing.router": "kmeans",
      "routing.kmeans_restarts": 2,
      "routing.kmeans_iters": 20,
      "routing.discriminative_at_outer_step": 1,
      "routing.router_max_docs": 200,
      **_EVAL,
      **kw,
    }
  )
  spmd, clean, faulty = (str(tmp_path / d) for d in ("spmd", "clean", "faulty"))
  ref = train.train_and_evaluate(cfg(**{"dipaco.mode": "spmd"}), spmd)
  out = train.train_and_evaluate(cfg(), clean)
  assert out["status"]["done"] == 12 and out["status"]["reshards"] == [1]
  np.testing.assert_allclose(out["val_loss"], ref["val_loss"], rtol=1e-5)
  # The phase's router: fitted on paths within 1e-6 of spmd's, so the same up to float
  # rounding; its shards (and so α and every batch) the same.
  for phase in (0, 1):
    r = [router_lib.Router.load(routing.router_dir(d, phase), grid=(2, 2)) for d in (spmd, clean)]
    assert r[0].kind == r[1].kind == ("kmeans", "linear")[phase]
    for k in r[0].arrays:
      np.testing.assert_allclose(r[0].arrays[k], r[1].arrays[k], rtol=1e-4, atol=1e-5)
  shard_meta = [
    json.loads((tmp_path / d / "shards_phase_1" / "train" / "meta.json").read_text())
    for d in ("spmd", "clean")
  ]
  assert shard_meta[0] == shard_meta[1]
  # The new phase's α differs from phase 0's, so the final state below checks the executors
  # took it (the store matches spmd's only with each phase's α).
  alpha = [
    storage.load_json(storage.root(clean) / "meta.json")["alpha_W"],
    storage.load_json(storage.alpha_file(clean, 1)),
  ]
  assert alpha[0] != alpha[1], alpha
  a, b = _final(spmd), _final(clean)
  for name in ("store", "outer_opt", "params", "inner_opt"):
    for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True):
      # Not bit-identical, as in test_elastic_matches_spmd_and_survives_kills: one device's
      # program against the 4-device SPMD one (last float32 bits of AdamW's updates).
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  # The data state names the phase; the positions after it are spmd's new feed's.
  exp = experiment.Experiment(cfg(**{"dipaco.mode": "spmd"}))
  states = [checkpoint.Checkpointer(d).restore(exp.abstract_state)[1] for d in (spmd, clean)]
  assert states[0] == states[1] and states[1]["routing"]["phase"] == 1
  # Early stopping's records restarted with the phase: the same per-path records as spmd.
  rec_a, rec_b = (checkpoint.read_best_records(d) for d in (spmd, clean))
  assert rec_a["phase"] == rec_b["phase"] == 1 and rec_a["step"] == rec_b["step"]
  np.testing.assert_allclose(rec_a["loss"], rec_b["loss"], rtol=1e-5)
  shards_rec = [
    [r for r in metrics_lib.read_records(d) if r.get("step") == 2][-1] for d in (spmd, clean)
  ]
  assert shards_rec[1]["shards/phase"] == 1
  assert {k: v for k, v in shards_rec[0].items() if k.startswith("shards/")} == {
    k: v for k, v in shards_rec[1].items() if k.startswith("shards/")
  }

  # Faults around the re-shard: the driver stops after phase 0's 4 tasks (the re-shard
  # due or not yet), then after 2 more (the router fitted and its tasks running), then
  # runs to the end; worker and executor SIGKILLs on the way. The clean run's bytes.
  # Seed 2 draws, of 2 kills each: the 1st invocation's dispatches 0 (killed mid-write) and 1
  # (at a random moment), the 2nd's dispatch 0 (task (1, ·): the new phase's first, mid-write),
  # the 3rd's dispatch 0 (mid-write) and 5.
  slow = cfg(dispatch_ahead="on")
  kw = {"worker_kills": 2, "seed": 2, "step_delay_s": (0.3, 0.3)}
  first = train.train_and_evaluate(slow, faulty, faults_lib.Faults(stop_after_tasks=4, **kw))
  second = train.train_and_evaluate(slow, faulty, faults_lib.Faults(stop_after_tasks=2, **kw))
  assert first["stopped"] and second["stopped"] and second["status"]["reshards"] == [1]
  last = train.train_and_evaluate(slow, faulty, faults_lib.Faults(executor_kills=1, **kw))
  assert last["step"] == 4 and last["status"]["done"] == 12
  kills = [r["status"]["worker_kills"] for r in (first, second, last)]
  assert sum(kills) >= 3, kills
  c = _final(faulty)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert checkpoint.read_best_records(faulty) == rec_b
  for sub in ("router", "shards_phase_1"):
    assert _tree_files(tmp_path / "faulty" / sub) == _tree_files(tmp_path / "clean" / sub)
  events = storage.read_task_log(faulty)
  assert [e["fitted"] for e in events if e["event"] == "reshard"] == [True]  # Fitted once.
  # Scored on the pool, one task per path; the one killed before its write was scored again.
  scored = [e["path"] for e in events if e["event"] == "scored"]
  assert sorted(scored) == [0, 1, 2, 3] and all(e["docs"] == 200 for e in events if "docs" in e)
  assert sum(e["event"] == "failed_score" for e in events) >= 1
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))  # Each accepted once.
  kills = [(e["target"], e["how"]) for e in events if e["event"] == "kill"]
  assert ("worker", "timed") in kills and ("worker", "write") in kills, kills
  assert ("executor", "timed") in kills, kills
