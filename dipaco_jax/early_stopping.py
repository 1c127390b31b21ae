"""Per-path early stopping (paper §2.7): each worker's best params by its own shard's val loss.

At every evaluation, a worker whose validation loss (on its own shard's
validation split) beats its best so far has its params copied into the best
set. The set lives in `<workdir>/best_paths/` as its own orbax checkpoint
(items `params` [W, ...] and `meta` JSON: best loss, step and shard phase per
worker), so it exports and serves like any checkpoint. A discriminative
re-shard changes every shard, so losses from an earlier phase do not compare:
the records restart with the new phase.
"""
# pylint: disable=invalid-name

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dipaco_jax import checkpoint
from dipaco_jax.types import PyTree

DIRNAME = "best_paths"


class BestPaths:
  """The best params of every worker so far, and their records."""

  def __init__(self, workdir: str, params_sharding: PyTree, abstract_params: PyTree,
               num_workers: int):
    self.directory = epath.Path(workdir) / DIRNAME
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=("params", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
    self._abstract = abstract_params
    self.params: PyTree | None = None
    self.meta = self._empty(num_workers, phase=0)
    # Keeps the old best row unless the new loss is lower; old best buffers are donated.
    self._select = jax.jit(
        lambda old, new, better_W: jax.tree.map(
            lambda o, n: jnp.where(better_W.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
            old, new),
        in_shardings=(params_sharding, params_sharding, None), out_shardings=params_sharding,
        donate_argnums=(0,))
    self._copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), in_shardings=(params_sharding,),
                         out_shardings=params_sharding)

  @staticmethod
  def _empty(num_workers: int, phase: int) -> dict:
    return {"phase": phase, "loss": [float("inf")] * num_workers, "step": [-1] * num_workers}

  def restore(self) -> None:
    """Loads the saved set, if any (the trainer calls this once at start)."""
    step = self._manager.latest_step()
    if step is None:
      return
    out = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(self._abstract), meta=ocp.args.JsonRestore()))
    self.params, self.meta = out["params"], out["meta"]

  def update(self, step: int, val_W: np.ndarray, params_W: PyTree, phase: int) -> list[int]:
    """Copies in every worker whose loss improved; saves; returns those workers."""
    val_W = np.asarray(val_W, np.float64)
    if phase != self.meta["phase"] or self.params is None:
      self.meta = self._empty(len(val_W), phase)
    # A worker without validation tokens (NaN) has nothing to stop on: it keeps its latest.
    better_W = (val_W < np.asarray(self.meta["loss"])) | np.isnan(val_W)
    if not better_W.any():
      return []
    if self.params is None:
      self.params = self._copy(params_W)
    else:
      self.params = self._select(self.params, params_W, jnp.asarray(better_W))
    for w in np.flatnonzero(better_W):
      if not np.isnan(val_W[w]):
        self.meta["loss"][w] = float(val_W[w])
      self.meta["step"][w] = int(step)
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(self.params, save_args=checkpoint.module_chunks(self.params)),
        meta=ocp.args.JsonSave(self.meta)), force=True)
    self._manager.wait_until_finished()
    return np.flatnonzero(better_W).tolist()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def read_meta(workdir: str) -> dict | None:
  """The saved records (loss, step, phase per worker), or None when there is no best set."""
  directory = epath.Path(workdir) / DIRNAME
  if not directory.exists():
    return None
  steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
  for step in reversed(steps):
    path = directory / str(step) / "meta" / "metadata"
    if path.exists():
      return {"checkpoint_step": step, **json.loads(path.read_text())}
  return None
