"""What the driver derives as phases complete: metrics records and early stopping's best paths.

Streamed (fragments.py), a phase's results are its units' tasks: its first unit's task
evaluated (as task t does otherwise) and its last unit's ended it.
"""
# pylint: disable=invalid-name

import numpy as np

from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import streamed
from dipaco_jax.runtime.elastic import versions


def units(grid, t: int) -> range:
  """The tasks (units) of phase t; phase T: its evaluation-only task."""
  s = grid.sched
  return range(s.first_unit(t), s.first_unit(t + 1) if t < grid.T else s.U + 1)


def _update_best(best, exp, grid: grid_lib.Grid, workdir: str, results: dict, t: int) -> None:
  """Early stopping after evaluation phase t: the tasks' own-shard losses and version t's paths.

  Task (t, w) evaluated path w's params at version t (the spmd loop's evaluation
  after outer step t), so `early_stopping.BestPaths` takes the same inputs as
  in the synchronous loop.
  """
  # Held-out training documents' loss where early stopping reads it, else validation's.
  u = grid.sched.first_unit(t)
  val_W = [
    results[f"{u}/{w}"].get("stop_loss", results[f"{u}/{w}"].get("val_loss")) for w in range(grid.W)
  ]
  if any(v is None for v in val_W):  # No evaluation at this step.
    return
  if grid.sched.streamed and t < grid.T:  # The workers' own params, as the spmd loop's.
    params = streamed.phase_params(exp, grid, workdir, t)
  else:
    params = versions.paths_at(exp, grid, workdir, grid.sched.first_unit(t))
  # Records restart with a routing phase (task t evaluated on its phase's shards).
  best.update(t * grid.H, np.asarray(val_W, np.float64), params, phase=grid.routing_phase(t))


def _step_records(workdir: str, grid, t: int, every: int) -> list[tuple[int, dict]]:
  """Records of phase t's logged steps before its last (config.log_every_steps).

  From the losses each task kept in its done.json: the steps the spmd loop logs.
  """
  steps = [s for s in range(t * grid.H + 1, (t + 1) * grid.H) if s % every == 0]
  if not steps:
    return []
  losses = [
    [
      x
      for u in units(grid, t)
      for x in storage.load_json(storage.worker_out_dir(workdir, w, u + 1) / "done.json")["loss"]
    ]
    for w in range(grid.W)
  ]
  out = []
  for s in steps:
    i = s - t * grid.H - 1  # NaN where a paced task (elastic.pace_steps) ran fewer steps.
    train_W = [float(loss[i]) if i < len(loss) else float("nan") for loss in losses]
    mean = metrics_lib.nan_mean(train_W)
    out.append((s, {"phase": t, "train_loss": train_W, "train_loss_mean": mean}))
  return out


def record(grid, results, t: int) -> dict:
  """metrics.jsonl record of step (t+1)*H: phase t's train losses, tasks t+1's validation."""
  last, nxt = units(grid, t)[-1], units(grid, t + 1)[0]
  train_W = [results[f"{last}/{w}"]["last_loss"] for w in range(grid.W)]
  rec = {
    "phase": t,
    "train_loss": train_W,
    "train_loss_mean": float(np.mean(train_W)),
    "grad_norm": [results[f"{last}/{w}"]["grad_norm"] for w in range(grid.W)],
  }
  val = [results[f"{nxt}/{w}"].get("val_loss") for w in range(grid.W)]
  if all(v is not None for v in val):
    rec.update(val_loss=val, val_loss_mean=metrics_lib.nan_mean(val))
  return rec


class PhaseRecords:
  """Metrics and early stopping of each phase the accepted results complete, in phase order.

  `results` is the loop's own dict of accepted tasks ({"t/w": summary}), read as
  it grows; a rerun writes what the run before it had not.
  """

  def __init__(self, config, workdir: str, exp, grid: grid_lib.Grid, results: dict):
    self.config, self.workdir, self.exp, self.grid = config, workdir, exp, grid
    self.results = results
    # Step (t+1)*H's record: phase t's training losses and tasks t+1's validation (as spmd).
    self.logged = sum(self._complete(t) and self._complete(t + 1) for t in range(grid.T))
    self.mlog = metrics_lib.MetricsLogger(
      workdir,
      resume_step=self.logged * grid.H,
      worker_labels=grid.topo.worker_labels(),
      module_labels=grid.topo.module_labels(),
    )
    if self.logged == 0 and not results:
      self.mlog.write_hparams(config.to_dict())
    # Per-path early stopping on the tasks' evaluations, in phase order (replayed on a rerun).
    self.best = None
    if config.early_stopping.enabled:
      self.best = early_stopping.BestPaths(exp.state_sharding.params, grid.W)
    self.best_next = 1  # The next phase whose evaluation early stopping takes.

  def _complete(self, t: int) -> bool:
    return all(f"{u}/{w}" in self.results for u in units(self.grid, t) for w in range(self.grid.W))

  def early_stop(self) -> None:
    """Early stopping takes every evaluation phase whose tasks are all in, once each."""
    grid = self.grid
    while self.best is not None and self.best_next <= grid.T and self._complete(self.best_next):
      _update_best(self.best, self.exp, grid, self.workdir, self.results, self.best_next)
      self.best_next += 1

  def write(self, shard_records: dict) -> None:
    """The metrics of each phase complete with its successor (`shard_records`: the re-shards')."""
    grid = self.grid
    while self.logged < grid.T and self._complete(self.logged) and self._complete(self.logged + 1):
      t = self.logged
      for step, rec in _step_records(self.workdir, grid, t, self.config.log_every_steps):
        self.mlog.write(step, rec)
      rec = record(grid, self.results, t)
      self.mlog.write((t + 1) * grid.H, {**rec, **shard_records.get((t + 1) * grid.H, {})})
      self.logged += 1

  def close(self) -> None:
    self.mlog.close()
