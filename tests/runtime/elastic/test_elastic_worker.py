"""Elastic worker tasks: mid-task progress saves, the scoring tasks of a re-shard."""
# pylint: disable=invalid-name

import itertools
import os

import jax
import numpy as np
import pytest

from dipaco_jax import data as data_lib
from dipaco_jax import routing
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage

import helpers
import routing_testlib

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


def _six_step_workdir(tmp_path, **over):
  """An elastic micro config of 6 inner steps (eval, ckpt at 6) and its prepared workdir."""
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  six = {"dipaco.inner_steps": 6, "eval.every_steps": 6, "ckpt.every_steps": 6}
  cfg = helpers.elastic_config(**{"data.shard_dir": str(tmp_path / "s"), **six, **over})
  wd = str(tmp_path / "wd")
  grid = grid_lib.Grid(cfg)
  driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
  return cfg, wd, grid


def test_worker_resumes_from_its_progress_save_with_the_same_bytes(tmp_path, monkeypatch):
  """A task killed after a save resumes there; a save cut short is skipped; the same bytes."""
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  cfg, wd, grid = _six_step_workdir(tmp_path, **{"elastic.progress_every_steps": 2})
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
  cfg = helpers.elastic_config(
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


def test_a_paced_task_runs_its_steps_and_a_retry_past_them_keeps_the_save(tmp_path, monkeypatch):
  """run(steps=n) trains the first n of H steps (timed); a retry with a save past n ends there."""
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  cfg, wd, grid = _six_step_workdir(tmp_path, **{"elastic.progress_every_steps": 4})
  w = worker_lib.PathWorker(cfg, wd, 0)
  full = w.run(0, 1)
  short = w.run(0, 1, steps=2)
  assert short["loss"] == full["loss"][:2] and short["step_s"] > 0
  done = storage.load_json(storage.worker_out_dir(wd, 1, 1) / "done.json")
  assert len(done["loss"]) == 2  # What token_weights reads.

  def kill(pid, sig):
    assert pid == os.getpid() and sig == faults_lib.signal.SIGKILL
    raise _Killed

  monkeypatch.setattr(faults_lib.os, "kill", kill)
  files = len(grid.modules_of_worker(1)) + 3  # Its groups, AdamW state, data, at.json.
  with pytest.raises(_Killed):  # Killed right after its save of step 4 is complete.
    w.run(0, 1, faults={"die_in_progress": files})
  out = w.run(0, 1, steps=2)  # Leased again, now paced to 2: the save's 4 steps stand.
  assert out["resumed_at_step"] == 4 and out["loss"] == full["loss"][:4]
  assert "step_s" not in out and out["grad_norm"] > 0


def test_a_task_stops_at_its_deadline_after_the_floor_and_says_so(tmp_path, monkeypatch):
  """stop_after (the driver's call while a task runs, or with its lease) ends it early."""
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  paced = {"elastic.pace_steps": True, "elastic.min_inner_steps": 2}
  cfg, wd, _ = _six_step_workdir(tmp_path, **paced)
  w = worker_lib.PathWorker(cfg, wd, 0)
  full = w.run(0, 1)
  assert len(full["loss"]) == 6 and "deadline_s" not in full
  # The driver's call arrives during step 3 (a deadline of 0 s: already past): the check
  # before step 4 stops it, with 3 steps trained, the same 3 as the full task's first.
  seen, step = [], w._step  # pylint: disable=protected-access

  def third_step_tells(*args):
    seen.append(1)
    if len(seen) == 3:
      w.stop_after(0, 1, 0.0)
    return step(*args)

  monkeypatch.setattr(w, "_step", third_step_tells)
  out = w.run(0, 1)
  assert out["loss"] == full["loss"][:3] and out["deadline_s"] == 0.0
  done = storage.load_json(storage.worker_out_dir(wd, 1, 1) / "done.json")
  assert len(done["loss"]) == 3  # What token_weights and the next task's guard read.
  # With the lease, already past: elastic.min_inner_steps (2) still run.
  seen.clear()
  assert w.run(0, 1, stop_after_s=0.0)["loss"] == full["loss"][:2]
  # A deadline for a task that already ended is dropped with it: the next runs all H.
  w.stop_after(0, 1, 0.0)
  w.run(0, 2)  # Another task ends: the deadlines cleared.
  assert len(w.run(0, 1)["loss"]) == 6
