"""Checkpoints: one orbax CheckpointManager per run, everything in one save.

Each step directory holds `state` (store, outer optimizer state, every
worker's params and AdamW state, step, RNG: arrays, restored with their
shardings) and `data` (the batch iterators' positions, JSON). The two are
written in one atomic save, so resuming anywhere, mid-phase included, gives
bit-identical results.
"""

import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dipaco_jax.types import PyTree



class _SmallChunkFilter(logging.Filter):
  """Drops orbax's warning about chunks under 1 MiB: one-module chunks are the point."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "target_byte_size too small" not in record.getMessage()


logging.getLogger("absl").addFilter(_SmallChunkFilter())


def module_chunks(tree: PyTree) -> PyTree:
  """SaveArgs storing each leading-axis row (module, path) in its own chunks."""
  return jax.tree.map(lambda x: ocp.SaveArgs(
      chunk_byte_size=max(int(np.prod(x.shape[1:])) * x.dtype.itemsize, 1),
      shard_axes=(0,)), tree)


def save_args(state: PyTree) -> PyTree:
  """Store modules in their own chunks, so serving one path reads its bytes only."""
  default = jax.tree.map(lambda _: ocp.SaveArgs(), state)
  return default.replace(store=module_chunks(state.store))


class Checkpointer:
  """Saves and restores (train state, data state) under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, *, max_to_keep: int = 2,
               async_save: bool = True):
    self.directory = epath.Path(workdir) / "checkpoints"
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=async_save),
        item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: PyTree, data_state: dict) -> None:
    """Writes both items atomically (in the background when async)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state, save_args=save_args(state)),
        data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, abstract_state: PyTree, step: int | None = None):
    """Latest (or given) step as (state with target shardings, data state)."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore()))
    return out["state"], out["data"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def restore_numpy(workdir: str, step: int | None = None) -> PyTree:
  """The train state of a run as host numpy, whatever mesh wrote it."""
  directory = epath.Path(workdir) / "checkpoints"
  if not directory.exists():
    raise FileNotFoundError(
        f"no checkpoints under {directory}: name the workdir of a dipaco_jax "
        "run that has saved at least once.")
  # Handlers named up front, so the metadata (shapes, dtypes) can be read.
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                     "data": ocp.JsonCheckpointHandler()})
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"{directory} holds no finished checkpoint.")
  meta = manager.item_metadata(step)["state"]
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                              meta)
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(restore_args=restore_args)))["state"]
  manager.close()
  return state


def restore_worker_params(workdir: str, worker: int = 0) -> PyTree:
  """Params of one worker of another run (e.g. a dense pretraining run)."""
  return jax.tree.map(lambda x: x[worker], restore_numpy(workdir)["params"])
