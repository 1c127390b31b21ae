"""Discriminative re-shards in the driver: scored on the pool, fitted here, then released."""
# pylint: disable=invalid-name

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import routing
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage


class Resharder:
  """Discriminative re-shards: the synchronous loop's `ShardPlan.reshard`, once per step.

  Re-shard step t_r (an outer step) is due once every module holds version t_r
  (the coordinator's `reshard_due`; it holds tasks (t_r, ·) until `resharded`).
  `begin` lists the paths whose scores of the router split are still missing:
  the driver leases them as scoring tasks to idle workers (`PathWorker.score`,
  path p at version t_r: the expensive half of the fit, on the pool). Once all
  are in, `finish` fits the router on them (or reloads it: a rerun finds it),
  writes the phase's shards (or reopens them) and its α for the executors, and
  only then is the coordinator told. Each step is idempotent, so a driver
  killed anywhere in it redoes it to the same bytes.
  """

  def __init__(self, exp, grid: grid_lib.Grid, workdir: str, plan, log):
    self.exp, self.grid, self.workdir, self.plan, self.log = exp, grid, workdir, plan, log
    # Step -> metrics record of the active shards (the spmd loop writes them at each re-shard).
    self.records = {grid.H: plan.shard_record()}
    self.due, self.todo = None, []  # The re-shard under way; its paths still to score.

  def reopen(self, step: int) -> None:
    """A re-shard done before a restart: its router and shards are reopened, not refitted."""
    self.plan.reshard(step * self.grid.H, None)  # The router exists: params are not read.
    self.records[step * self.grid.H] = self.plan.shard_record()
    alpha = storage.alpha_file(self.workdir, self._k(step))
    if not alpha.exists():  # Moved aside (a damage line): written again, the same bytes.
      self._write_alpha(self._k(step))

  def _write_alpha(self, k: int) -> None:
    alpha = np.asarray(jax.device_get(self.plan.alpha_W), np.float32)
    storage.save_json(storage.alpha_file(self.workdir, k), [float(a) for a in alpha])

  def _k(self, step: int) -> int:
    return self.grid.reshard_steps.index(step) + 1

  def begin(self, step: int) -> None:
    """Re-shard `step` is due: the paths to score (none where the router exists already)."""
    k, self.due = self._k(step), step
    self.todo = []
    if not routing.Router.exists(routing.router_dir(self.workdir, k)):
      P = self.grid.topo.num_paths
      self.todo = [p for p in range(P) if not storage.scores_file(self.workdir, k, p).exists()]
    self.log(event="reshard_due", step=step, phase=k, to_score=list(self.todo))

  def finish(self) -> int:
    """Fits (or reloads) the router on the paths' scores; shards, α. Returns the step."""
    step, k = self.due, self._k(self.due)
    directory = routing.router_dir(self.workdir, k)
    fitted = not routing.Router.exists(directory)
    scores = None
    if fitted:
      # A save cut short (arrays written, metadata not) would refuse the new save: drop it.
      part = epath.Path(directory) / router_lib.ARRAYS_FILE
      if part.exists():
        part.unlink()
      files = [storage.scores_file(self.workdir, k, p) for p in range(self.grid.topo.num_paths)]
      cols = [storage.load_array(f) for f in files]
      if len({c.shape for c in cols}) != 1:
        raise ValueError(
          f"the scoring tasks' files under {files[0].parent} hold different document counts "
          f"({[c.shape for c in cols]}): written by runs of different configs; delete that "
          "folder and rerun the same command to score again."
        )
      scores = np.stack(cols, 1)
    self.plan.reshard(step * self.grid.H, None, scores_NxP=scores)
    self._write_alpha(k)
    self.records[step * self.grid.H] = self.plan.shard_record()
    self.log(event="reshard", step=step, phase=k, fitted=fitted)
    logging.info("elastic: re-shard after outer step %d: routing phase %d", step, k)
    self.due = None
    return step
