"""Checksums: a crc32 of every row of every saved array, taken at save, checked by every reader.

orbax writes every array zstd-compressed, and a flipped byte in a compressed
chunk often still decodes, to other numbers: only a checksum sees it. They are
crc32s (zlib's, several GB/s) of each leading-axis row of each array (module,
worker; one for a 0-d array) in the bytes of the dtype saved, plus one of the
data item's canonical JSON, saved as the `checksums` item of the same atomic
save. Per row because every reader reads rows: serving reads one module's row
of each store array (one row per chunk, `module_chunks`) and checks exactly the
rows it read, at no extra I/O; restores check every row of every array they
return. They are summed at save time from each device buffer's host view, one
shard at a time, in threads (the tiny config's 132 MiB of state and best set:
~25-40 ms here; on an accelerator this reads the state to the host once more
than orbax's own copy), and at read time from the arrays as read, so nothing
trained on is touched. With several processes each sums the rows it holds and
one all-gather gives every process every row's sum (a row no single device
holds whole, a module split over 'path' on an inner dim across hosts, is summed
and checked part by part, one crc32 per device's part). The step's data item lists
the items saved with it (layout.SAVED_ITEMS), so a step whose checksums item is
gone is damaged, not unverified; only a step saved before checksums existed (its
data item lists no items) loads unverified, said once at WARNING. A mismatch is a
DamagedCheckpointError (damage.py).
"""

import concurrent.futures
import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath

from dipaco_jax.io import damage
from dipaco_jax.io import layout
from dipaco_jax.types import PyTree

_CHECKSUM = "crc32"  # zlib's: several GB/s, in the standard library.

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


def _checksums_of(
  arrays: dict, dtypes: dict | None = None, row_sums=row_checksums
) -> dict[str, list[int | None]]:
  """row_sums of each array (as dtypes[name]), in threads (zlib frees the GIL)."""
  dtypes = dtypes or {}
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    sums = pool.map(lambda n: row_sums(arrays[n], dtypes.get(n)), arrays)
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


def _tree_checksums(tree: PyTree, row_sums) -> tuple[dict, dict]:
  """({array: [crc32 per row]}, {array: {row: {box: crc32}}} of rows held in parts)."""
  flat = _flat(tree)
  rows = _checksums_of(flat, row_sums=row_sums)
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


def for_save(trees: dict[str, PyTree], data_state: dict, row_sums=row_checksums) -> dict:
  """The checksums item of a save of `trees` ({item: tree}) and the data item `data_state`.

  `row_sums` sums one array's rows (row_checksums; tests stand in for one that
  sees a multi-host layout).
  """
  sums = {"algorithm": _CHECKSUM, "data": _json_checksum(data_state), "pieces": {}}
  for item, tree in trees.items():
    rows, pieces = _across_processes(*_tree_checksums(tree, row_sums))
    sums[item] = rows
    if pieces:
      sums["pieces"][item] = _pieces_json(pieces)
  sums["dtypes"] = {item: _dtypes(tree) for item, tree in trees.items()}  # As saved.
  return sums


_UNVERIFIED: set[str] = set()  # Checkpoint directories already said to have no checksums.


def read(root: epath.Path, step: int) -> dict | None:
  """The checksums item of a step, or None for a step saved before checksums (said once)."""
  path = root / str(step) / layout.CHECKSUMS / "metadata"
  if path.exists():
    return json.loads(path.read_text())  # Its JSON was checked by damage.reading.
  if damage.saved_items(root / str(step)) is not None:  # Saved with them: they were removed.
    raise damage.damaged(
      root, step, f"{layout.CHECKSUMS}/: missing, though its data item lists it as saved"
    )
  if str(root) not in _UNVERIFIED:
    _UNVERIFIED.add(str(root))
    absl_logging.warning(
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


def verify_tree(root: epath.Path, step: int, item: str, tree: PyTree, sums: dict | None):
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
        raise damage.damaged(
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
          raise damage.damaged(root, step, _mismatch(item, name, row, crc(part), want, box))


def verify_row(root, step, item: str, name: str, row: int, value, sums: dict | None):
  """Checks one row read on its own (serving) against its checksum, or its pieces'."""
  if not sums:
    return
  saved = (sums.get(item) or {}).get(name) or []
  want = saved[row] if row < len(saved) else None
  if want is not None and _crc(value) != want:
    raise damage.damaged(root, step, _mismatch(item, name, row, _crc(value), want))
  pieces = (sums.get("pieces") or {}).get(item, {}).get(name, {})
  for box, want in _pieces_from_json({name: pieces})[name].get(row, []):
    got = _crc(value[_cut(box)])
    if got != want:
      raise damage.damaged(root, step, _mismatch(item, name, row, got, want, box))


def verify_data(root: epath.Path, step: int, data: dict, sums: dict | None):
  """Raises DamagedCheckpointError if the data item read does not match its checksum."""
  if sums is not None and "data" in sums and _json_checksum(data) != sums["data"]:
    got = _json_checksum(data)
    raise damage.damaged(
      root, step, f"data/metadata: {_CHECKSUM} {got:08x} read, {sums['data']:08x} saved"
    )
