"""Checkpoints: one orbax CheckpointManager per run, everything in one atomic save.

`<workdir>/checkpoints/<step>/` holds four items, written in one save:
  state      store, outer optimizer state, every worker's params and AdamW
             state, step, RNG (arrays, restored with their shardings);
  data       JSON: the batch iterators' positions, the routing phase and early
             stopping's records (best loss, step, phase per worker);
  best       early stopping's set: each worker's best params [W, ...] (absent
             before the first evaluation and when early stopping is off);
  checksums  JSON: a crc32 of every saved array, one per leading-axis row
             (module, worker; one for a 0-d array), and one of the data item.
So a resume from step s, mid-phase included, is bit-identical and sees nothing
newer than s. The trainer, evaluation and serving read checkpoints through this
module (serving reads one path's rows of an item straight from orbax's OCDBT
files with TensorStore). Only it and the modules it imports (layout.py,
checksums.py, damage.py, save_failures.py) know orbax's on-disk layout.

Every reader checks the rows it returns against their checksums (checksums.py)
and reports an unreadable file or a mismatch as one DamagedCheckpointError
(damage.py). A save that fails stops the run with one CheckpointSaveError
(save_failures.py); a background save's outcome is checked at every step
(`check`), before the next save and at `close`.
"""

import dataclasses
import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import checksums
from dipaco_jax.io import damage
from dipaco_jax.io import layout
from dipaco_jax.io import save_failures

# Imported `as` themselves: defined below this module, callers name them checkpoint.X.
from dipaco_jax.io.checksums import row_checksums as row_checksums
from dipaco_jax.io.damage import DamagedCheckpointError as DamagedCheckpointError
from dipaco_jax.io.layout import CHECKSUMS as CHECKSUMS
from dipaco_jax.io.layout import ITEMS as ITEMS
from dipaco_jax.io.save_failures import CheckpointSaveError as CheckpointSaveError
from dipaco_jax.types import PyTree

DIRNAME = "checkpoints"
_BEST_RECORDS = "early_stopping"  # Key of early stopping's records in the data item.


class _SmallChunkFilter(logging.Filter):
  """Drops orbax's warning about chunks under 1 MiB: one-module chunks are the point."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "target_byte_size too small" not in record.getMessage()


logging.getLogger("absl").addFilter(_SmallChunkFilter())


class NoCheckpointError(errors.UserError, FileNotFoundError):
  """The workdir holds no finished checkpoint (or not the item asked for)."""


def module_chunks(tree: PyTree) -> PyTree:
  """SaveArgs storing each leading-axis row (module, path) in its own chunks."""
  return jax.tree.map(
    lambda x: ocp.SaveArgs(
      chunk_byte_size=max(int(np.prod(x.shape[1:])) * x.dtype.itemsize, 1), shard_axes=(0,)
    ),
    tree,
  )


def save_args(state: PyTree) -> PyTree:
  """Store modules in their own chunks, so serving one path reads its bytes only."""
  default = jax.tree.map(lambda _: ocp.SaveArgs(), state)
  return default.replace(store=module_chunks(state.store))


def directory(workdir: str) -> epath.Path:
  """<workdir>/checkpoints; a relative local workdir made absolute (orbax wants absolute paths)."""
  local = "://" not in os.fspath(workdir)
  return epath.Path(os.path.abspath(workdir) if local else workdir) / DIRNAME


def steps(workdir: str) -> list[int]:
  """The finished checkpoint steps of a run, oldest first."""
  return layout.finished_steps(directory(workdir))


def latest_step(workdir: str) -> int:
  """The newest finished step (NoCheckpointError when there is none)."""
  found = steps(workdir)
  if not found:
    raise NoCheckpointError(
      f"no finished checkpoint under {directory(workdir)}: train the run "
      "first (python -m dipaco_jax.main --config=... --workdir=...)."
    )
  return found[-1]


class Checkpointer:
  """Saves and restores (train state, data state, best set) under `<workdir>/checkpoints`."""

  def __init__(self, workdir: str, *, max_to_keep: int = 2, async_save: bool = True):
    self.directory = directory(workdir)
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
      ),
      item_names=ITEMS,
    )
    self._async = async_save
    self._pending: int | None = None  # The step whose save runs in the background.
    self._failed = False
    save_failures.install_save_echo_hook()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
    self, step: int, state: PyTree, data_state: dict, best: tuple[PyTree, dict] | None = None
  ) -> None:
    """Writes the items atomically (in the background when async); best = (params_W, records).

    Raises CheckpointSaveError if this save, or the previous one in the background, failed.
    """
    self._finish_pending()
    items = {"state": ocp.args.StandardSave(state, save_args=save_args(state))}
    trees = {"state": state}
    if best is not None:
      params_W, records = best
      data_state = {**data_state, _BEST_RECORDS: records}
      items["best"] = ocp.args.StandardSave(params_W, save_args=module_chunks(params_W))
      trees["best"] = params_W
    # The items of this step, in the data item: none can then go missing unnoticed (checksums).
    data_state = {**data_state, layout.SAVED_ITEMS: sorted(trees) + ["data", CHECKSUMS]}
    items["data"] = ocp.args.JsonSave(data_state)
    # This module's row_checksums, looked up at each save: a test replaces it to sum as on hosts.
    items[CHECKSUMS] = ocp.args.JsonSave(checksums.for_save(trees, data_state, row_checksums))
    try:
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._raise_failed(step, e)
    if self._async:  # Its outcome is checked by `check`, the next save or `close`.
      self._pending = step

  def check(self) -> None:
    """Raises CheckpointSaveError if the save running in the background failed; never waits.

    The trainer calls it at every step, so a failed write stops the run at the
    next step boundary rather than at the next save.
    """
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self._finish_pending()

  def _finish_pending(self) -> None:
    """Waits for the background save, if any; CheckpointSaveError if it failed."""
    step, self._pending = self._pending, None
    if step is None:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._raise_failed(step, e)

  def _raise_failed(self, step: int, e: Exception):
    """Stops orbax's threads, then raises one CheckpointSaveError (or `e` if it is no I/O)."""
    self._failed = True
    save_failures.release_commit_threads()
    failure = save_failures.write_failure(e)
    if failure is None:
      raise e  # A bug rather than the storage: its traceback.
    raise save_failures.save_error(self.directory, step, failure) from e

  def restore(self, abstract_state: PyTree, step: int | None = None):
    """Latest (or given) step as (state with target shardings, data state), or None."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    with damage.reading(self.directory, step):
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        ),
      )
      sums = checksums.read(self.directory, step)
    checksums.verify_tree(self.directory, step, "state", out["state"], sums)
    checksums.verify_data(self.directory, step, out["data"], sums)
    data_state = dict(out["data"])
    data_state.pop(_BEST_RECORDS, None)
    data_state.pop(layout.SAVED_ITEMS, None)
    return out["state"], data_state

  def restore_best(self, abstract_params: PyTree, step: int | None = None):
    """Early stopping's set saved with the latest (or given) step: (params_W, records), or None."""
    step = self.latest_step() if step is None else step
    records = None if step is None else _best_records(self.directory.parent, step)
    if records is None:
      return None
    with damage.reading(self.directory, step):
      out = self._manager.restore(
        step, args=ocp.args.Composite(best=ocp.args.StandardRestore(abstract_params))
      )
      sums = checksums.read(self.directory, step)
    checksums.verify_tree(self.directory, step, "best", out["best"], sums)
    return out["best"], records

  def close(self) -> None:
    """Waits for the background save (CheckpointSaveError if it failed) and closes orbax.

    After a failed save it waits for nothing more and raises nothing more.
    """
    try:
      if not self._failed:
        self._finish_pending()
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        if not self._failed:
          raise  # After a failure: the same error again, already reported.


def read_data_state(workdir: str, step: int) -> dict:
  """The data item of a step (iterator positions, routing phase, early stopping's records)."""
  root = directory(workdir)
  path = root / str(step) / "data" / "metadata"  # Where orbax's JsonSave writes.
  if not (root / str(step)).exists():
    raise NoCheckpointError(
      f"no checkpoint step {step} (or no data item) in {root}; its steps: {steps(workdir)}."
    )
  with damage.reading(root, step):
    data = json.loads(path.read_text())
    sums = checksums.read(root, step)
  checksums.verify_data(root, step, data, sums)
  return {k: v for k, v in data.items() if k != layout.SAVED_ITEMS}


def read_checksums(workdir: str, step: int) -> dict | None:
  """The checksums saved with a step ({item: {array: [crc32 per row]}, "data": crc32}), or None."""
  root = directory(workdir)
  with damage.reading(root, step):
    return checksums.read(root, step)


def routing_phase(data_state: dict) -> int:
  """The routing phase a checkpoint trained in (shard_plan.ShardPlan.data_state)."""
  return int(data_state.get("routing", {}).get("phase", 0))


def _best_records(workdir: str, step: int) -> dict | None:
  if not (directory(workdir) / str(step) / "data").exists():
    return None
  return read_data_state(workdir, step).get(_BEST_RECORDS)


def read_best_records(workdir: str, step: int | None = None) -> dict | None:
  """Early stopping's records saved with the latest (or given) step, or None if it has none."""
  if step is None:
    found = steps(workdir)
    if not found:
      return None
    step = found[-1]
  records = _best_records(workdir, step)
  return None if records is None else {"checkpoint_step": step, **records}


def restore_numpy(workdir: str, step: int | None = None) -> PyTree:
  """The train state of a run as host numpy, whatever mesh wrote it."""
  root = directory(workdir)
  step = latest_step(workdir) if step is None else step
  # Handlers named up front, so the metadata (shapes, dtypes) can be read.
  manager = ocp.CheckpointManager(
    root,
    options=ocp.CheckpointManagerOptions(read_only=True),
    item_handlers={
      "state": ocp.PyTreeCheckpointHandler(),
      "data": ocp.JsonCheckpointHandler(),
      "best": ocp.PyTreeCheckpointHandler(),  # Named so that orbax warns of no unknown item.
      CHECKSUMS: ocp.JsonCheckpointHandler(),
    },
  )
  try:
    with damage.reading(root, step):
      meta = manager.item_metadata(step)["state"]
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
      state = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=restore_args))
      )["state"]
      sums = checksums.read(root, step)
  finally:
    manager.close()
  checksums.verify_tree(root, step, "state", state, sums)
  return state


def restore_worker_params(workdir: str, worker: int = 0) -> PyTree:
  """Params of one worker of another run (e.g. a dense pretraining run)."""
  return jax.tree.map(lambda x: x[worker], restore_numpy(workdir)["params"])


@dataclasses.dataclass(frozen=True)
class Row:
  """Row `index` of a saved array of `count` rows (a module of K, a worker of W)."""

  index: int
  count: int


def bytes_read() -> int:
  """Bytes TensorStore has read from any key-value store in this process so far."""
  total = 0
  for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
    if m["name"].endswith("/bytes_read"):
      total += sum(v.get("value", 0) for v in m["values"])
  return total


def read_rows(workdir: str, step: int, item: str, rows: PyTree) -> PyTree:
  """`array[row.index]` for every Row leaf of `rows` (a subtree of the item), nothing else.

  Reads orbax's OCDBT files through TensorStore: with one row per chunk
  (`module_chunks`) only that row's bytes are read. Each row read is checked
  against its checksum.
  """
  root = directory(workdir)
  item_dir = root / str(step) / item
  if not item_dir.exists():
    raise NoCheckpointError(f"checkpoint step {step} in {root} has no {item!r} item.")
  flat, treedef = jax.tree_util.tree_flatten_with_path(rows)
  base = layout.kv_url(item_dir)
  out = []
  with damage.reading(root, step):
    sums = checksums.read(root, step)
    # One context: the OCDBT manifest and b-tree nodes are read once, not once per array.
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 1 << 24}})
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=ctx).result()
    driver = None
    for key_path, row in flat:
      name = ".".join(str(getattr(k, "key", k)) for k in key_path)  # orbax's array names.
      if driver is None:  # orbax writes every array of an item in one zarr format.
        driver = "zarr" if kv.read(f"{name}/.zarray").result().state == "value" else "zarr3"
      spec = {
        "driver": driver,
        "recheck_cached_data": False,
        "fill_missing_data_reads": False,  # A missing chunk is damage, not zeros.
        "kvstore": {"driver": "ocdbt", "base": base, "path": f"{name}/"},
      }
      arr = ts.open(spec, open=True, read=True, context=ctx).result()
      if arr.shape[0] != row.count:
        raise ValueError(
          f"{item_dir}: {name} has {arr.shape[0]} rows but this grid has "
          f"{row.count}: the checkpoint was written by another grid. Pass the "
          "config the run was trained with."
        )
      value = arr[row.index].read().result()
      checksums.verify_row(root, step, item, name, row.index, value, sums)
      out.append(value)
  return jax.tree.unflatten(treedef, out)
