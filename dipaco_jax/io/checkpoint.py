"""Checkpoints: one orbax CheckpointManager per run, everything in one atomic save.

`<workdir>/checkpoints/<step>/` holds three items, written in one save:
  state  store, outer optimizer state, every worker's params and AdamW state,
         step, RNG (arrays, restored with their shardings);
  data   JSON: the batch iterators' positions, the routing phase and early
         stopping's records (best loss, step, phase per worker);
  best   early stopping's set: each worker's best params [W, ...] (absent
         before the first evaluation and when early stopping is off).
So a resume from step s, mid-phase included, is bit-identical and sees nothing
newer than s. This is the one module that knows orbax's on-disk layout: the
trainer, evaluation and serving read checkpoints through it (serving reads one
path's rows of an item straight from orbax's OCDBT files with TensorStore).
A file that cannot be read gives one DamagedCheckpointError naming the step,
the file and the older checkpoint to resume from; nothing falls back silently.
"""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from dipaco_jax import errors
from dipaco_jax.types import PyTree

DIRNAME = "checkpoints"
ITEMS = ("state", "data", "best")
_BEST_RECORDS = "early_stopping"  # Key of early stopping's records in the data item.
# orbax's JSON files in a step directory (the OCDBT files are checked by TensorStore).
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")
# TensorStore status codes of unreadable bytes (not of a missing array or a shape mismatch).
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE")


class _SmallChunkFilter(logging.Filter):
  """Drops orbax's warning about chunks under 1 MiB: one-module chunks are the point."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "target_byte_size too small" not in record.getMessage()


logging.getLogger("absl").addFilter(_SmallChunkFilter())


class DamagedCheckpointError(errors.DamagedFileError):
  """A file of a checkpoint step cannot be read."""


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
  return epath.Path(workdir) / DIRNAME


def steps(workdir: str) -> list[int]:
  """The finished checkpoint steps of a run, oldest first."""
  root = directory(workdir)
  # orbax writes into a temporary name and renames to the bare step when finished.
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def latest_step(workdir: str) -> int:
  """The newest finished step (NoCheckpointError when there is none)."""
  found = steps(workdir)
  if not found:
    raise NoCheckpointError(
      f"no finished checkpoint under {directory(workdir)}: train the run "
      "first (python -m dipaco_jax.main --config=... --workdir=...)."
    )
  return found[-1]


def _json_files(step_dir: epath.Path) -> list[epath.Path]:
  """orbax's JSON files of a step: its own, and each item's (array metadata included)."""
  out = []
  for p in step_dir.iterdir():
    for q in p.iterdir() if p.is_dir() else [p]:
      if q.name in _JSON_FILES:
        out.append(q)
      elif q.name == "array_metadatas" and q.is_dir():
        out.extend(q.iterdir())
  return sorted(out, key=str)


def _bad_json(step_dir: epath.Path) -> str | None:
  """'<file>: <reason>' for the first of a step's JSON files that does not parse."""
  for p in _json_files(step_dir):
    try:
      json.loads(p.read_text())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
      return f"{p.relative_to(step_dir)}: {errors.json_problem(e)}"
  return None


def _bad_bytes(err: BaseException | None, step_dir: epath.Path) -> str | None:
  """'<file>: <reason>' when an orbax/TensorStore error (or its cause) reports unreadable bytes."""
  while err is not None:
    msg = str(err).split(" [tensorstore_spec")[0]
    if any(msg.startswith(code + ":") for code in _DAMAGE_CODES):
      files = re.findall(r'local file "([^"]+)"', msg)
      what = os.path.relpath(files[-1], os.path.abspath(step_dir)) if files else "an OCDBT file"
      array = re.search(r'Error reading "([^"]+)/', msg)
      if files and files[-1].endswith("/") and array:  # TensorStore names the item, not the file.
        what = f"{what} data of array {array.group(1)}"
      return f"{what}: {msg.rsplit(': ', 1)[-1]}"
    err = err.__cause__ or err.__context__
  return None


def _quick_check(step_dir: epath.Path) -> bool:
  """Whether a step's JSON files parse and its OCDBT indexes list (data files unread)."""
  if _bad_json(step_dir) is not None:
    return False
  for manifest in step_dir.glob("*/manifest.ocdbt"):
    try:
      kv = ts.KvStore.open({"driver": "ocdbt", "base": _kv_url(manifest.parent)}).result()
      kv.list().result()
    except Exception:  # pylint: disable=broad-except
      return False
  return True


def _damaged(root: epath.Path, step: int, what: str) -> DamagedCheckpointError:
  older = [s for s in steps(root.parent) if s < step]
  intact = next((s for s in reversed(older) if _quick_check(root / str(s))), None)
  aside = f"mv {root / str(step)} {root.parent / f'damaged_checkpoint_{step}'}"
  then = (
    f"to resume from step {intact}, the newest intact checkpoint"
    if intact is not None
    else "to start the run over from step 0 (no older checkpoint is intact)"
  )
  return DamagedCheckpointError(
    f"checkpoint step {step} in {root} is damaged ({what}); move it aside ({aside}) {then}."
  )


# A restore that fails on a damaged file leaves echoes: orbax stops at the first unreadable
# array while its other reads go on; they fail too (asyncio logs "Task exception was never
# retrieved"), are closed unawaited, or their TensorStore callbacks find orbax's event loop
# closed, during and after the failed call. The damage is reported once, in one line; these
# would print a traceback each, so they are dropped.
_ORBAX_READ_ERROR = "Encountered error while reading array index"


def _is_echo(exc: BaseException | None, loop_closed: bool) -> bool:
  while exc is not None:
    msg = str(exc)
    if (
      msg.startswith(_ORBAX_READ_ERROR)
      or any(msg.startswith(c + ":") for c in _DAMAGE_CODES)
      or (loop_closed and isinstance(exc, RuntimeError) and msg == "Event loop is closed")
    ):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def _quiet_echoes(previous, unraisable) -> None:
  """sys.unraisablehook while (and after) a checkpoint is read: drops the echoes."""
  if not _is_echo(unraisable.exc_value, loop_closed=True):
    previous(unraisable)


class _EchoFilter(logging.Filter):
  """Drops asyncio's "exception was never retrieved" records of a failed orbax read."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not ("never retrieved" in record.getMessage() and _is_echo(exc, loop_closed=False))


logging.getLogger("asyncio").addFilter(_EchoFilter())


@contextlib.contextmanager
def _reading(root: epath.Path, step: int):
  """Turns an unreadable file of checkpoint `step` into one DamagedCheckpointError."""
  step_dir = root / str(step)
  bad = _bad_json(step_dir) if step_dir.exists() else None
  if bad is not None:
    raise _damaged(root, step, bad)
  previous = sys.unraisablehook
  sys.unraisablehook = functools.partial(_quiet_echoes, previous)
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    bad = _bad_bytes(e, step_dir)
    if bad is None:
      sys.unraisablehook = previous
      raise
    raise _damaged(root, step, bad) from e  # The hook stays: echoes come later too.
  sys.unraisablehook = previous


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

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
    self, step: int, state: PyTree, data_state: dict, best: tuple[PyTree, dict] | None = None
  ) -> None:
    """Writes the items atomically (in the background when async); best = (params_W, records)."""
    items = {"state": ocp.args.StandardSave(state, save_args=save_args(state))}
    if best is not None:
      params_W, records = best
      data_state = {**data_state, _BEST_RECORDS: records}
      items["best"] = ocp.args.StandardSave(params_W, save_args=module_chunks(params_W))
    items["data"] = ocp.args.JsonSave(data_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, abstract_state: PyTree, step: int | None = None):
    """Latest (or given) step as (state with target shardings, data state), or None."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    with _reading(self.directory, step):
      out = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        ),
      )
    data_state = dict(out["data"])
    data_state.pop(_BEST_RECORDS, None)
    return out["state"], data_state

  def restore_best(self, abstract_params: PyTree, step: int | None = None):
    """Early stopping's set saved with the latest (or given) step: (params_W, records), or None."""
    step = self.latest_step() if step is None else step
    records = None if step is None else _best_records(self.directory.parent, step)
    if records is None:
      return None
    with _reading(self.directory, step):
      out = self._manager.restore(
        step, args=ocp.args.Composite(best=ocp.args.StandardRestore(abstract_params))
      )
    return out["best"], records

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def read_data_state(workdir: str, step: int) -> dict:
  """The data item of a step (iterator positions, routing phase, early stopping's records)."""
  root = directory(workdir)
  path = root / str(step) / "data" / "metadata"  # Where orbax's JsonSave writes.
  if not path.exists():
    raise NoCheckpointError(
      f"no checkpoint step {step} (or no data item) in {root}; its steps: {steps(workdir)}."
    )
  with _reading(root, step):
    return json.loads(path.read_text())


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
    item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
  )
  try:
    with _reading(root, step):
      meta = manager.item_metadata(step)["state"]
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
      return manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=restore_args))
      )["state"]
  finally:
    manager.close()


def restore_worker_params(workdir: str, worker: int = 0) -> PyTree:
  """Params of one worker of another run (e.g. a dense pretraining run)."""
  return jax.tree.map(lambda x: x[worker], restore_numpy(workdir)["params"])


@dataclasses.dataclass(frozen=True)
class Row:
  """Row `index` of a saved array of `count` rows (a module of K, a worker of W)."""

  index: int
  count: int


def _kv_url(path) -> str:
  return str(path) if "://" in str(path) else "file://" + os.path.abspath(str(path))


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
  (`module_chunks`) only that row's bytes are read.
  """
  root = directory(workdir)
  item_dir = root / str(step) / item
  if not item_dir.exists():
    raise NoCheckpointError(f"checkpoint step {step} in {root} has no {item!r} item.")
  flat, treedef = jax.tree_util.tree_flatten_with_path(rows)
  base = _kv_url(item_dir)
  out = []
  with _reading(root, step):
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
        "kvstore": {"driver": "ocdbt", "base": base, "path": f"{name}/"},
      }
      arr = ts.open(spec, open=True, read=True, context=ctx).result()
      if arr.shape[0] != row.count:
        raise ValueError(
          f"{item_dir}: {name} has {arr.shape[0]} rows but this grid has "
          f"{row.count}: the checkpoint was written by another grid. Pass the "
          "config the run was trained with."
        )
      out.append(arr[row.index].read().result())
  return jax.tree.unflatten(treedef, out)
