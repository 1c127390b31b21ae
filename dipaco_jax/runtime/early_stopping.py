"""Per-path early stopping (paper §2.7): each worker's best params by its own shard's loss.

The loss it reads (early_stopping.source): "heldout" (the default) is each
worker's loss on a held-out slice of its own training shard, min(heldout_docs,
heldout_fraction x n) seeded documents that the worker never trains on, so the
validation split stays for the final numbers alone; "validation" reads the
worker's shard of the validation split (optimistic where it picks an earlier
checkpoint: the final perplexity is computed on the same documents). The slice
is a view on the shard (data.Holdout), so the shard files and the shard cache's
fingerprint are those of a run without it; dense and DiLoCo runs hold out from
each worker's shard the same way.

At every evaluation, a worker whose loss beats its best so far has its params
copied into the best set, in device memory. The trainer saves the set with every checkpoint, in the
same atomic save (checkpoint.py: item `best` [W, ...], records in the data
item: best loss, step and shard phase per worker), so a resume from step s
sees the set as of s, and the set serves like any checkpoint. A
discriminative re-shard changes every shard, so losses from an earlier phase
do not compare: the records restart with the new phase.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import data as data_lib
from dipaco_jax.config import sections
from dipaco_jax.io import checkpoint
from dipaco_jax.types import PyTree


def holdouts(config) -> tuple[data_lib.Holdout | None, data_lib.Holdout | None]:
  """(training part, held-out part) of each shard; (None, None) unless stopping on held-out."""
  es = config.early_stopping
  if es.source not in sections.STOP_SOURCES:
    raise ValueError(
      f"config.early_stopping.source={es.source!r}: choose one of {sections.STOP_SOURCES}."
    )
  if not es.enabled or es.source != "heldout":
    return None, None
  kw = dict(docs=es.heldout_docs, fraction=es.heldout_fraction)
  return data_lib.Holdout(part="rest", **kw), data_lib.Holdout(part="heldout", **kw)


class BestPaths:
  """The best params of every worker so far, and their records."""

  def __init__(self, params_sharding: PyTree, num_workers: int):
    self.params: PyTree | None = None
    self.meta = self._empty(num_workers, phase=0)
    # Keeps the old best row unless the new loss is lower; old best buffers are donated.
    self._select = jax.jit(
      lambda old, new, better_W: jax.tree.map(
        lambda o, n: jnp.where(better_W.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), old, new
      ),
      in_shardings=(params_sharding, params_sharding, None),
      out_shardings=params_sharding,
      donate_argnums=(0,),
    )
    self._copy = jax.jit(
      lambda t: jax.tree.map(jnp.copy, t),
      in_shardings=(params_sharding,),
      out_shardings=params_sharding,
    )

  @staticmethod
  def _empty(num_workers: int, phase: int) -> dict:
    return {"phase": phase, "loss": [float("inf")] * num_workers, "step": [-1] * num_workers}

  def load(self, saved: tuple[PyTree, dict] | None) -> None:
    """Takes the set a checkpoint saved (Checkpointer.restore_best), if any."""
    if saved is not None:
      self.params, self.meta = saved[0], dict(saved[1])

  def saved(self) -> tuple[PyTree, dict] | None:
    """What the next checkpoint saves: (params_W, records), or None before any evaluation."""
    return None if self.params is None else (self.params, self.meta)

  def update(self, step: int, val_W: np.ndarray, params_W: PyTree, phase: int) -> list[int]:
    """Copies in every worker whose loss improved; returns those workers."""
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
    self.meta = {**self.meta, "loss": list(self.meta["loss"]), "step": list(self.meta["step"])}
    for w in np.flatnonzero(better_W):
      if not np.isnan(val_W[w]):
        self.meta["loss"][w] = float(val_W[w])
      self.meta["step"][w] = int(step)
    return np.flatnonzero(better_W).tolist()


def read_meta(workdir: str, step: int | None = None) -> dict | None:
  """The records (loss, step, phase per worker) saved with a checkpoint (default: the latest).

  None when that checkpoint holds no best set (early stopping off, or saved
  before the first evaluation).
  """
  return checkpoint.read_best_records(workdir, step)
