"""One path's params read straight from a run's checkpoint: its module row of every store group.

For each store group, row `module_of(p)` of every leaf (checkpoint.read_rows): nothing else is
materialised, whatever the grid size. Serving and export read paths through it.
"""

import functools

import jax
import numpy as np

from dipaco_jax import errors
from dipaco_jax.config import sections
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.types import PyTree


def load(
  workdir: str, config, path: int, *, source: str = "store", step: int | None = None
) -> tuple[PyTree, dict]:
  """Path `path`'s params (no leading axis) and what was read: from the store or best set.

  Both come from one checkpoint step (the latest by default): the best set
  saved with it holds each worker's best params as of that step.
  """
  topo = topo_lib.from_config(config)
  if not 0 <= path < topo.num_paths:
    raise errors.ArgumentError(
      f"path {path} is not in this grid (paths 0-{topo.num_paths - 1}): give --path in that "
      "range, or leave it out for the routed path."
    )
  if source not in ("store", "best"):
    raise errors.ArgumentError(
      f"source={source!r}: use 'store' (trained modules) or 'best' (per-path early stopping)."
    )
  theta = jax.eval_shape(
    functools.partial(model_lib.init_params, sections.ModelConfig.of(config)), jax.random.key(0)
  )
  step = checkpoint.latest_step(workdir) if step is None else step
  worker = int(np.flatnonzero(topo.path_of_worker == path)[0])
  if source == "store":
    row = {
      s.name: checkpoint.Row(int(s.module_of_worker[worker]), s.num_modules)
      for s in topo.store_groups()
    }
    rows = {"store": {g: jax.tree.map(lambda _, g=g: row[g], sub) for g, sub in theta.items()}}
  else:
    if checkpoint.read_best_records(workdir, step) is None:
      raise checkpoint.NoCheckpointError(
        f"checkpoint step {step} of {workdir} holds no early-stopping set: train with "
        "config.early_stopping.enabled=True (the set is saved with every checkpoint after "
        "the first evaluation)."
      )
    rows = jax.tree.map(lambda _: checkpoint.Row(worker, topo.num_workers), theta)
  before = checkpoint.bytes_read()
  arrays = checkpoint.read_rows(workdir, step, "state" if source == "store" else "best", rows)
  params = arrays["store"] if source == "store" else arrays
  flat = jax.tree.leaves(params)
  info = {
    "step": step,
    "source": source,
    "arrays": len(flat),
    "bytes": int(sum(a.nbytes for a in flat)),
    "bytes_read": checkpoint.bytes_read() - before,
  }
  return params, info
