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
newer than s. This is the one module that knows orbax's on-disk layout: the
trainer, evaluation and serving read checkpoints through it (serving reads one
path's rows of an item straight from orbax's OCDBT files with TensorStore).

Reading. A file that cannot be read (truncated, missing, a compressed chunk
that does not decode, bad or missing zarr metadata, a missing chunk) or an
array whose bytes do not match its checksum gives one DamagedCheckpointError
naming the step, the file or the item's array (and row) and the older
checkpoint to resume from; nothing falls back silently.

Checksums. orbax writes every array zstd-compressed, and a flipped byte in a
compressed chunk often still decodes, to other numbers: only a checksum sees
it. They are crc32s (zlib's, several GB/s) of each leading-axis row of each
array (module, worker; one for a 0-d array) in the bytes of the dtype saved,
plus one of the data item's canonical JSON, saved as the `checksums` item of
the same atomic save. Per row because every reader reads rows: serving reads
one module's row of each store array (one row per chunk, `module_chunks`) and
checks exactly the rows it read, at no extra I/O; restores check every row of
every array they return. They are summed at save time from each device
buffer's host view, one shard at a time, in threads (the tiny config's 132 MiB
of state and best set: ~25-40 ms here; on an accelerator this reads the state
to the host once more than orbax's own copy), and at read time from the arrays
as read, so nothing trained on is touched. With several processes each sums
the rows it holds and one all-gather gives every process every row's sum (a
row no single device holds whole, tensor parallel in a multi-process run, is
left unsummed and unchecked). A step saved before checksums existed still
loads, unverified (an INFO line says so, once).

Saving. A save that fails (no space left, no permission, any OSError or
TensorStore error of orbax's background write or its commit) stops the run
with one CheckpointSaveError naming the cause, the path and what to do; the
older checkpoints are untouched. A background save's outcome is checked at
every step (`check`), before the next save and at `close`; after a failure the
commit threads orbax left waiting are released, so the process exits.
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import logging
import os
import re
import sys
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging as absl_logging
from etils import epath

from dipaco_jax import errors
from dipaco_jax.types import PyTree

DIRNAME = "checkpoints"
CHECKSUMS = "checksums"
ITEMS = ("state", "data", "best", CHECKSUMS)
_BEST_RECORDS = "early_stopping"  # Key of early stopping's records in the data item.
# orbax's JSON files in a step directory (the OCDBT files are checked by TensorStore).
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")
# Files every finished step holds, by item: `state` and `data` are always saved; `best` and
# `checksums` when present (and an OCDBT item needs its manifest).
_REQUIRED = {
  "state": ("_METADATA", "manifest.ocdbt"),
  "data": ("metadata",),
  "best": ("_METADATA", "manifest.ocdbt"),
  CHECKSUMS: ("metadata",),
}
_ALWAYS_SAVED = ("state", "data")
# TensorStore status codes of unreadable bytes (not of a missing array or a shape mismatch).
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE")
# FAILED_PRECONDITION while reading a stored value: a chunk that does not decode (zstd
# "Data corruption detected", a truncated stream, a size that does not fit the zarr metadata)
# or metadata that does not parse. An array missing from an OCDBT database is NOT_FOUND.
_READ_FAILED = re.compile(r'^FAILED_PRECONDITION: .*?Error reading "([^"]+)"')
_MISSING = re.compile(
  r'^NOT_FOUND: .*?(?:Metadata at "(?P<meta>[^"]+)" .* does not exist'
  r'|chunk .* stored at "(?P<chunk>[^"]+)" .* is missing)'
)
_CHECKSUM = "crc32"  # zlib's: several GB/s, in the standard library.


class _SmallChunkFilter(logging.Filter):
  """Drops orbax's warning about chunks under 1 MiB: one-module chunks are the point."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "target_byte_size too small" not in record.getMessage()


logging.getLogger("absl").addFilter(_SmallChunkFilter())


class DamagedCheckpointError(errors.DamagedFileError):
  """A file of a checkpoint step cannot be read."""


class NoCheckpointError(errors.UserError, FileNotFoundError):
  """The workdir holds no finished checkpoint (or not the item asked for)."""


class CheckpointSaveError(errors.UserError):
  """A checkpoint could not be written (no space left, no permission, ...): the run stopped."""


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


# Checksums ------------------------------------------------------------------------------------

_Box = tuple[tuple[int, int], ...]  # [start, stop) on each dim after the leading one.


def _crc(a: np.ndarray) -> int:
  """crc32 of an array's bytes in C order (a row of a host copy: no copy when contiguous)."""
  return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _crc_as(dtype, own_dtype):
  """_crc, or _crc of the array cast to `dtype` (the dtype saved) when restored wider."""
  if dtype is None or dtype == own_dtype:
    return _crc
  return lambda a: _crc(np.asarray(a).astype(dtype))


def _bounds(index: tuple[slice, ...], shape) -> _Box:
  return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def _whole(box: _Box, shape) -> bool:
  return all(b == (0, n) for b, n in zip(box, shape))


def _cut(box: _Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box)


def row_checksums(x, dtype=None) -> list[int | None]:
  """crc32 of each leading-axis row of an array (one entry for a 0-d array), as `dtype`.

  Read from this process's shards, one device buffer at a time (nothing is
  assembled); a row no local device holds whole is None (see _piece_checksums).
  """
  crc = _crc_as(dtype, x.dtype)
  if not isinstance(x, jax.Array):
    a = np.asarray(x)
    return [crc(a)] if a.ndim == 0 else [crc(r) for r in a]
  if x.ndim == 0:
    return [crc(np.asarray(x.addressable_shards[0].data))]
  out: list[int | None] = [None] * x.shape[0]
  for shard in x.addressable_shards:
    if not _whole(_bounds(shard.index[1:], x.shape[1:]), x.shape[1:]):
      continue  # Split inside its rows: assembled below, or summed in pieces.
    start = shard.index[0].start or 0
    data = np.asarray(shard.data)
    for i in range(data.shape[0]):
      if out[start + i] is None:
        out[start + i] = crc(data[i])
  if None in out and x.is_fully_addressable:
    whole = np.asarray(x)
    out = [crc(whole[i]) if c is None else c for i, c in enumerate(out)]
  return out


def _piece_checksums(x, rows: list[int], dtype=None) -> dict[int, dict[_Box, int]]:
  """{row: {box: crc32}} of the parts of `rows` this process's devices hold.

  For rows no single device holds whole in a multi-process run (a module split
  over 'path' on an inner dim, its parts on several hosts).
  """
  crc = _crc_as(dtype, x.dtype)
  out: dict[int, dict[_Box, int]] = {}
  for shard in x.addressable_shards:
    start, stop = _bounds(shard.index[:1], x.shape[:1])[0]
    box = _bounds(shard.index[1:], x.shape[1:])
    data = None
    for r in rows:
      if start <= r < stop and box not in out.get(r, {}):
        data = np.asarray(shard.data) if data is None else data
        out.setdefault(r, {})[box] = crc(data[r - start])
  return out


def _part(x, row: int, box: _Box, whole: dict):
  """x[row][box] from this process's copy, or None when no local device holds all of it."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    if "array" not in whole:
      whole["array"] = np.asarray(x)
    return whole["array"][row][_cut(box)]
  for shard in x.addressable_shards:
    (start, stop), *inner = _bounds(shard.index, x.shape)
    if start <= row < stop and all(a <= b0 and b1 <= b for (a, b), (b0, b1) in zip(inner, box)):
      local = tuple((b0 - a, b1 - a) for (a, _), (b0, b1) in zip(inner, box))
      return np.asarray(shard.data)[row - start][_cut(local)]
  return None


def _flat(tree: PyTree) -> dict:
  """{orbax's array name ('params.embed.token'): leaf} of a saved or restored tree."""
  return {k: v for k, v in ocp.tree.to_flat_dict(tree, sep=".").items() if hasattr(v, "shape")}


def _checksums_of(arrays: dict, dtypes: dict | None = None) -> dict[str, list[int | None]]:
  """row_checksums of each array (as dtypes[name]), in threads (zlib frees the GIL)."""
  dtypes = dtypes or {}
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    sums = pool.map(lambda n: row_checksums(arrays[n], dtypes.get(n)), arrays)
    return dict(zip(arrays, sums))


def _dtypes(tree: PyTree) -> dict[str, str]:
  return {name: np.dtype(x.dtype).name for name, x in _flat(tree).items()}


def _sum_dtype(saved: str | None, restored):
  """The dtype to sum a restored array in: its own, the saved one, or None (not comparable)."""
  if saved is None or saved == np.dtype(restored).name:
    return restored
  try:
    saved = jnp.dtype(saved)
  except TypeError:
    return None
  # Restored wider (int32 saved, read as int64): cast back exactly. Narrower: nothing to compare.
  return saved if np.can_cast(saved, restored, "safe") else None


def _tree_checksums(tree: PyTree) -> tuple[dict, dict]:
  """({array: [crc32 per row]}, {array: {row: {box: crc32}}} of rows held in parts)."""
  flat = _flat(tree)
  rows = _checksums_of(flat)
  pieces = {
    name: _piece_checksums(flat[name], [i for i, c in enumerate(r) if c is None])
    for name, r in rows.items()
    if None in r
  }
  return rows, {name: p for name, p in pieces.items() if p}


def _json_checksum(obj) -> int:
  """crc32 of a JSON item's canonical text (the dict orbax writes and reads back)."""
  return zlib.crc32(json.dumps(obj, sort_keys=True).encode())


def _across_processes(rows: dict, pieces: dict) -> tuple[dict, dict]:
  """Each process summed what it holds; every process gets every sum (small all-gathers)."""
  if jax.process_count() == 1:
    return rows, pieces
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  names = sorted(rows)  # The same tree, so the same names, on every process.
  flat = [c for n in names for c in rows[n]]
  crcs = np.array([0 if c is None else c for c in flat], np.uint32)
  have = np.array([c is not None for c in flat], np.int32)
  all_crcs, all_have = multihost_utils.process_allgather((crcs, have))
  first = np.argmax(all_have, axis=0)
  merged = [int(all_crcs[p, i]) if all_have[p, i] else None for i, p in enumerate(first.tolist())]
  out, at = {}, 0
  for n in names:
    out[n] = merged[at : at + len(rows[n])]
    at += len(rows[n])
  # Pieces: one table row (array, row, crc, box dims, box starts, box stops) per piece, boxes
  # padded to the most dims and the table to the longest process's.
  dims = max([len(b) for p in pieces.values() for parts in p.values() for b in parts] + [0])
  dims = int(np.max(multihost_utils.process_allgather(np.array([dims], np.int32))))
  fill = lambda box: [0] * (dims - len(box))
  number = {n: i for i, n in enumerate(names)}
  table = [
    [number[n], r, c, len(b), *(a for a, _ in b), *fill(b), *(z for _, z in b), *fill(b)]
    for n, p in pieces.items()
    for r, parts in p.items()
    for b, c in parts.items()
  ]
  count = int(np.max(multihost_utils.process_allgather(np.array([len(table)], np.int32))))
  width = 4 + 2 * dims
  padded = np.full((max(count, 1), width), np.iinfo(np.uint32).max, np.uint32)
  if table:
    padded[: len(table)] = np.array(table, np.uint32)
  merged_pieces: dict[str, dict[int, dict[_Box, int]]] = {}
  for entry in multihost_utils.process_allgather(padded).reshape(-1, width).tolist():
    if entry[0] == np.iinfo(np.uint32).max:
      continue
    name, row, crc, n = names[entry[0]], entry[1], entry[2], entry[3]
    if out[name][row] is None:  # Else some process held the row whole.
      box = tuple(zip(entry[4 : 4 + n], entry[4 + dims : 4 + dims + n]))
      merged_pieces.setdefault(name, {}).setdefault(row, {})[box] = crc
  return out, merged_pieces


def _pieces_json(pieces: dict) -> dict:
  return {
    n: {str(r): [[[list(b) for b in box], c] for box, c in parts.items()] for r, parts in p.items()}
    for n, p in pieces.items()
  }


def _pieces_from_json(saved: dict) -> dict[str, dict[int, list[tuple[_Box, int]]]]:
  return {
    n: {int(r): [(tuple(tuple(b) for b in box), c) for box, c in parts] for r, parts in p.items()}
    for n, p in saved.items()
  }


_UNVERIFIED: set[str] = set()  # Checkpoint directories already said to have no checksums.


def _read_checksums(root: epath.Path, step: int) -> dict | None:
  """The checksums item of a step, or None for a step saved before checksums (said once)."""
  path = root / str(step) / CHECKSUMS / "metadata"
  if path.exists():
    return json.loads(path.read_text())  # Its JSON was checked by _reading.
  if str(root) not in _UNVERIFIED:
    _UNVERIFIED.add(str(root))
    absl_logging.info(
      "checkpoint step %d in %s has no checksums (saved before they were added): "
      "its arrays are read unverified.",
      step,
      root,
    )
  return None


def _mismatch(item: str, name: str, row: int | None, got: int, want: int, box=None) -> str:
  where = f"{item} array {name}" + ("" if row is None else f" row {row}")
  if box is not None:
    where += " [" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
  return f"{where}: {_CHECKSUM} {got:08x} read, {want:08x} saved"


def _verify_tree(root: epath.Path, step: int, item: str, tree: PyTree, sums: dict | None):
  """Raises DamagedCheckpointError for the first array of `tree` whose rows do not match."""
  saved = None if sums is None else sums.get(item)
  if saved is None:
    return
  saved_dtypes = (sums.get("dtypes") or {}).get(item, {})
  arrays, dtypes = {}, {}
  for name, x in _flat(tree).items():
    dtype = _sum_dtype(saved_dtypes.get(name), x.dtype)
    if name in saved and dtype is not None:
      arrays[name], dtypes[name] = x, dtype
  for name, got_rows in _checksums_of(arrays, dtypes).items():
    for i, (got, want) in enumerate(zip(got_rows, saved[name])):
      if got is not None and want is not None and got != want:
        raise _damaged(
          root, step, _mismatch(item, name, i if arrays[name].ndim else None, got, want)
        )
  for name, by_row in _pieces_from_json((sums.get("pieces") or {}).get(item, {})).items():
    if name not in arrays:
      continue
    x, crc, whole = arrays[name], _crc_as(dtypes[name], arrays[name].dtype), {}
    for row, parts in sorted(by_row.items()):
      for box, want in parts:
        part = _part(x, row, box, whole)
        if part is not None and crc(part) != want:
          raise _damaged(root, step, _mismatch(item, name, row, crc(part), want, box))


def _verify_row(root, step, item: str, name: str, row: int, value, sums: dict | None):
  """Checks one row read on its own (serving) against its checksum, or its pieces'."""
  if not sums:
    return
  saved = (sums.get(item) or {}).get(name) or []
  want = saved[row] if row < len(saved) else None
  if want is not None and _crc(value) != want:
    raise _damaged(root, step, _mismatch(item, name, row, _crc(value), want))
  pieces = (sums.get("pieces") or {}).get(item, {}).get(name, {})
  for box, want in _pieces_from_json({name: pieces})[name].get(row, []):
    got = _crc(value[_cut(box)])
    if got != want:
      raise _damaged(root, step, _mismatch(item, name, row, got, want, box))


def _verify_data(root: epath.Path, step: int, data: dict, sums: dict | None):
  if sums is not None and "data" in sums and _json_checksum(data) != sums["data"]:
    got = _json_checksum(data)
    raise _damaged(
      root, step, f"data/metadata: {_CHECKSUM} {got:08x} read, {sums['data']:08x} saved"
    )


# Damaged files --------------------------------------------------------------------------------


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


def _missing_file(step_dir: epath.Path) -> str | None:
  """'<file>: missing' for the first file a finished step must hold and does not."""
  for item, names in _REQUIRED.items():
    item_dir = step_dir / item
    if not item_dir.is_dir():
      if item in _ALWAYS_SAVED:
        return f"{item}/: missing"
      continue
    ocdbt = any(p.name == "d" or p.name.startswith("ocdbt.process_") for p in item_dir.iterdir())
    for name in names:
      if (name != "manifest.ocdbt" or ocdbt) and not (item_dir / name).exists():
        return f"{item}/{name}: missing"
  return None


def _saved_arrays(step_dir: epath.Path, item: str) -> set[str]:
  """The array names an item's _METADATA lists (what orbax saved in it)."""
  try:
    tree = json.loads((step_dir / item / "_METADATA").read_text())["tree_metadata"]
  except (OSError, ValueError, KeyError):
    return set()
  return {".".join(str(k["key"]) for k in v["key_metadata"]) for v in tree.values()}


def _status_message(err: BaseException) -> str:
  return str(err).split(" [tensorstore_spec")[0]


def _is_damage(msg: str) -> bool:
  """Whether a TensorStore status message reports stored bytes that cannot be read."""
  return any(msg.startswith(c + ":") for c in _DAMAGE_CODES) or bool(
    _READ_FAILED.match(msg) or _MISSING.match(msg)
  )


def _bad_bytes(err: BaseException | None, step_dir: epath.Path) -> str | None:
  """'<file>: <reason>' when an orbax/TensorStore error (or its cause) reports unreadable bytes."""
  while err is not None:
    msg = _status_message(err)
    files = re.findall(r'local file "([^"]+)"', msg)
    item = os.path.relpath(files[-1], os.path.abspath(step_dir)) if files else "an OCDBT file"
    if any(msg.startswith(code + ":") for code in _DAMAGE_CODES):
      what = item
      array = re.search(r'Error reading "([^"]+)/', msg)
      if files and files[-1].endswith("/") and array:  # TensorStore names the item, not the file.
        what = f"{what} data of array {array.group(1)}"
      return f"{what}: {msg.rsplit(': ', 1)[-1]}"
    if m := _READ_FAILED.match(msg):
      array, key = m.group(1).rsplit("/", 1) if "/" in m.group(1) else (m.group(1), "")
      part = "metadata" if key in (".zarray", "zarr.json") else "data"
      reason = re.split(r'(?:local file|database at) "[^"]*": ', msg)[-1].split("; at byte")[0]
      return f"{item} {part} of array {array}: {reason}"
    if m := _MISSING.match(msg):
      array, part = (m.group("meta") or m.group("chunk")).rsplit("/", 1)
      if array in _saved_arrays(step_dir, item):  # Else the caller asked for an unsaved array.
        return (
          f"{item} array {array}: {'zarr metadata' if m.group('meta') else f'chunk {part}'} missing"
        )
    err = err.__cause__ or err.__context__
  return None


def _quick_check(step_dir: epath.Path) -> bool:
  """Whether a step's files are there, its JSON parses and its OCDBT indexes list (data unread)."""
  if _missing_file(step_dir) is not None or _bad_json(step_dir) is not None:
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
    msg = _status_message(exc)
    if (
      msg.startswith(_ORBAX_READ_ERROR)
      or _is_damage(msg)
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
  """Drops asyncio's "exception was never retrieved" records of a failed orbax read or write."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    echo = _is_echo(exc, loop_closed=False) or _write_failure(exc) is not None
    return not ("never retrieved" in record.getMessage() and echo)


logging.getLogger("asyncio").addFilter(_EchoFilter())


@contextlib.contextmanager
def _reading(root: epath.Path, step: int):
  """Turns an unreadable file of checkpoint `step` into one DamagedCheckpointError."""
  step_dir = root / str(step)
  bad = (_missing_file(step_dir) or _bad_json(step_dir)) if step_dir.exists() else None
  if bad is not None:
    raise _damaged(root, step, bad)
  previous = sys.unraisablehook
  sys.unraisablehook = functools.partial(_quiet_echoes, previous)
  try:
    yield
  except DamagedCheckpointError:
    sys.unraisablehook = previous
    raise
  except Exception as e:  # pylint: disable=broad-except
    bad = _bad_bytes(e, step_dir)
    if bad is None:
      sys.unraisablehook = previous
      raise
    raise _damaged(root, step, bad) from e  # The hook stays: echoes come later too.
  sys.unraisablehook = previous


# Failed saves ---------------------------------------------------------------------------------

# Status codes TensorStore gives a failed write (its errors are ValueErrors named by the code).
_WRITE_CODES = (
  "RESOURCE_EXHAUSTED",
  "PERMISSION_DENIED",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
  "UNKNOWN",
  "INTERNAL",
  "ABORTED",
  "FAILED_PRECONDITION",
  "DATA_LOSS",
  "NOT_FOUND",
  "ALREADY_EXISTS",
  "OUT_OF_RANGE",
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclasses.dataclass(frozen=True)
class _WriteFailure:
  reason: str  # "No space left on device"
  path: str | None  # The file or directory the write failed on, when the error names it.
  errno: int | None


def _write_failure(err: BaseException | None) -> _WriteFailure | None:
  """The storage error in an exception's chain (OSError or TensorStore status), if any."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError):
      code = err.errno
      reason = err.strerror or (os.strerror(code) if code else str(err) or type(err).__name__)
      return _WriteFailure(reason, err.filename and str(err.filename), code)
    msg = _status_message(err)
    if any(msg.startswith(c + ":") for c in _WRITE_CODES):
      os_code = re.search(r"os_error_code='?(\d+)", msg)
      code = int(os_code.group(1)) if os_code else None
      reason = os.strerror(code) if code else msg.rsplit(": ", 1)[-1]
      path = re.search(r'(?:Failed writing|Error writing local file|local file): "([^"]+)"', msg)
      return _WriteFailure(reason, path.group(1) if path else None, code)
    err = err.__cause__ or err.__context__
  return None


def _save_error(root: epath.Path, step: int, failure: _WriteFailure) -> CheckpointSaveError:
  older = [s for s in steps(root.parent) if s < step]
  if failure.errno in _NO_SPACE:
    fix = f"free space on the disk of {root}"
  elif failure.errno in _NOT_WRITABLE:
    fix = f"make {root} writable (fix its permissions, or its mount if read-only)"
  else:
    fix = f"fix the storage of {root} (free space, fix permissions)"
  then = (
    f"resume from step {older[-1]}, the last saved checkpoint"
    if older
    else "start over from step 0 (no checkpoint was saved yet)"
  )
  where = f" ({failure.path})" if failure.path else ""
  return CheckpointSaveError(
    f"checkpoint step {step} could not be saved in {root}: {failure.reason}{where}; {fix}, "
    f"then rerun the same command to {then}."
  )


def _release_commit_threads(timeout_s: float = 10.0) -> None:
  """Stops orbax's commit threads that wait for a signal a failed save will never send.

  When orbax's background directory creation fails, each item's commit thread
  keeps waiting for the "directory created" signal for AsyncOptions.timeout_secs
  (20 minutes); they are not daemons, so the process could not exit. Each is
  cancelled (it returns instead of writing) and woken with its signals.
  """
  try:
    from orbax.checkpoint._src.futures import future as ocp_future  # pylint: disable=g-import-not-at-top

    waiting = [
      t
      for t in threading.enumerate()
      if isinstance(t, ocp_future._SignalingThread) and t.is_alive()  # pylint: disable=protected-access
    ]
    for t in waiting:
      t.cancel()
      ocp_future.set_signals(t._receive_signals, operation_id=t._operation_id)  # pylint: disable=protected-access
  except (ImportError, AttributeError) as e:  # Another orbax: its threads time out on their own.
    absl_logging.warning("could not stop orbax's commit threads after a failed save: %s", e)
    return
  for t in waiting:
    threading.Thread.join(t, timeout_s)
    if not t.is_alive():  # It returned before its work: close the coroutine it never ran.
      _close_unstarted(getattr(t, "_target", None))


def _close_unstarted(obj, depth: int = 4) -> None:
  """Closes the coroutines a function's closure (or a coroutine's arguments) holds unstarted.

  Else each warns "coroutine ... was never awaited" when collected.
  """
  if depth == 0 or obj is None:
    return
  if inspect.iscoroutine(obj):
    if inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:
      for arg in obj.cr_frame.f_locals.values():  # E.g. the coroutine `cancellable` wraps.
        _close_unstarted(arg, depth - 1)
      obj.close()
    return
  for cell in getattr(obj, "__closure__", None) or ():
    try:
      _close_unstarted(cell.cell_contents, depth - 1)
    except ValueError:  # An empty cell.
      pass


class _SaveFailureFilter(logging.Filter):
  """Drops orbax's error records of a failed save (a traceback each, thousands of lines).

  The Checkpointer reports the failure itself, in one line, on the training thread.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (
      record.levelno >= logging.ERROR
      and f"{os.sep}orbax{os.sep}" in record.pathname
      and _write_failure(exc) is not None
    )


logging.getLogger("absl").addFilter(_SaveFailureFilter())


def _is_save_echo(unraisable) -> bool:
  """An exception a failed background write leaves behind (callbacks, unfinished coroutines)."""
  exc = unraisable.exc_value
  if _is_echo(exc, loop_closed=True) or _write_failure(exc) is not None:
    return True
  code = getattr(unraisable.object, "cr_code", None)  # A coroutine dropped at interpreter exit.
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _quiet_save_echoes(previous, unraisable) -> None:
  if not _is_save_echo(unraisable):
    previous(unraisable)


_HOOK_LOCK = threading.Lock()


def _install_save_echo_hook() -> None:
  """Once per process: a failed background write's echoes come before it is reported."""
  with _HOOK_LOCK:
    if not getattr(sys.unraisablehook, "_dipaco_save_echoes", False):
      hook = functools.partial(_quiet_save_echoes, sys.unraisablehook)
      hook._dipaco_save_echoes = True  # pylint: disable=protected-access
      sys.unraisablehook = hook


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
    _install_save_echo_hook()

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
    items["data"] = ocp.args.JsonSave(data_state)
    sums = {"algorithm": _CHECKSUM, "data": _json_checksum(data_state), "pieces": {}}
    for item, tree in trees.items():
      rows, pieces = _across_processes(*_tree_checksums(tree))
      sums[item] = rows
      if pieces:
        sums["pieces"][item] = _pieces_json(pieces)
    sums["dtypes"] = {item: _dtypes(tree) for item, tree in trees.items()}  # As saved.
    items[CHECKSUMS] = ocp.args.JsonSave(sums)
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
    _release_commit_threads()
    failure = _write_failure(e)
    if failure is None:
      raise e  # A bug rather than the storage: its traceback.
    raise _save_error(self.directory, step, failure) from e

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
      sums = _read_checksums(self.directory, step)
    _verify_tree(self.directory, step, "state", out["state"], sums)
    _verify_data(self.directory, step, out["data"], sums)
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
      sums = _read_checksums(self.directory, step)
    _verify_tree(self.directory, step, "best", out["best"], sums)
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
  with _reading(root, step):
    data = json.loads(path.read_text())
    sums = _read_checksums(root, step)
  _verify_data(root, step, data, sums)
  return data


def read_checksums(workdir: str, step: int) -> dict | None:
  """The checksums saved with a step ({item: {array: [crc32 per row]}, "data": crc32}), or None."""
  root = directory(workdir)
  with _reading(root, step):
    return _read_checksums(root, step)


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
    with _reading(root, step):
      meta = manager.item_metadata(step)["state"]
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
      state = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(restore_args=restore_args))
      )["state"]
      sums = _read_checksums(root, step)
  finally:
    manager.close()
  _verify_tree(root, step, "state", state, sums)
  return state


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
  (`module_chunks`) only that row's bytes are read. Each row read is checked
  against its checksum.
  """
  root = directory(workdir)
  item_dir = root / str(step) / item
  if not item_dir.exists():
    raise NoCheckpointError(f"checkpoint step {step} in {root} has no {item!r} item.")
  flat, treedef = jax.tree_util.tree_flatten_with_path(rows)
  base = _kv_url(item_dir)
  out = []
  with _reading(root, step):
    sums = _read_checksums(root, step)
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
      _verify_row(root, step, item, name, row.index, value, sums)
      out.append(value)
  return jax.tree.unflatten(treedef, out)
