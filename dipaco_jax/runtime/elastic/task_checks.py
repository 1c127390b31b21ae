"""A worker task's checks of its path: the loss on its own shard, the divergence guard.

Mixed into worker.PathWorker (which sets config, grid, recipe, the eval and norms
programs, the caches `_val` and `_heldout`, and TaskStorage's `_shards`).
"""
# pylint: disable=invalid-name

import jax
import numpy as np

from dipaco_jax import data as data_lib
from dipaco_jax.runtime.elastic import storage


class TaskChecks:
  """PathWorker's evaluations and guard (a mixin: see the module)."""

  def _val_batches(self, worker: int, k: int, split: str = "validation") -> list:
    """The first eval.batches batches of the worker's validation shard, or of its held-out docs.

    Of routing phase k's shards. Split "validation": the spmd loop's eval_batches; "heldout":
    shard_plan's stop_batches.
    """
    key = (split, k, worker)
    if key not in self._val:
      d = self.config.data
      source = "train" if split == "heldout" else split
      n = self._shards(k).num_docs(source)[worker]
      if split == "heldout":
        n = self._heldout.count(int(n))
      # An empty validation shard (allow_validation), or a training shard too small to spare a
      # held-out document: the loss reads NaN, as the synchronous Feed's padding-only batches.
      if n == 0:
        self._val[key] = []
      else:
        it = data_lib.WorkerBatcher(
          self._shards(k),
          source,
          [worker],
          seq_len=d.seq_len,
          batch_size=d.batch_size,
          seed=d.seed,
          shuffle=False,
          holdout=self._heldout if split == "heldout" else None,
        )
        self._val[key] = [it.next_batch() for _ in range(self.config.eval.batches)]
    return self._val[key]

  def _evaluate(self, params, worker: int, k: int, split: str = "validation") -> float:
    """Token-weighted loss on the worker's own shard of routing phase k (Experiment.evaluate's)."""
    batches = self._val_batches(worker, k, split)
    if not batches:  # No document to score (see _val_batches).
      return float("nan")
    loss_sum = weight = 0.0
    for batch in batches:
      out = jax.device_get(self._eval(params, batch))
      loss_sum, weight = loss_sum + out["loss_sum"], weight + out["weight"]
    weight = np.asarray(weight)
    return float(np.where(weight > 0, np.asarray(loss_sum) / np.maximum(weight, 1.0), np.nan)[0])

  def _guard(self, phase: int, worker: int, norms, losses_so_far, unit: int | None = None):
    """The recipe's divergence guard for task (phase, worker), as the spmd loop's for it.

    `norms`: the phase's reference norms (of the path's modules at version `phase`,
    which the task started from; on the host). The loss window: this worker's earlier
    steps, read from its earlier tasks' results (the run's, as the spmd guard's in one
    process). Streamed: `unit` is the task's, `phase` its phase, `norms` the phase start's.
    """
    kept = f"every module up to outer step {phase} is kept"
    guard = self.recipe.guard([self.grid.topo.worker_labels()[worker]], kept=kept)
    guard.start_phase(phase, norms)
    n, earlier = self.recipe.guard_cfg.stuck_steps - len(losses_so_far), []
    t = phase if unit is None else unit
    while n > 0 and t > 0:
      done = storage.worker_out_dir(self.workdir, worker, t) / "done.json"
      if not done.exists():  # A shorter window: the rule fires later, never wrongly.
        break
      losses = list(storage.load_json(done)["loss"])  # H, or fewer (elastic.pace_steps).
      earlier = losses[-n:] + earlier
      n, t = n - len(losses), t - 1
    guard.seed_losses([[x] for x in earlier + list(losses_so_far)])
    return guard
