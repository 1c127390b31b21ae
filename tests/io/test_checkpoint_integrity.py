"""Checksums: a damaged array, chunk or metadata is named in one line by every reader.

Every array orbax writes is zstd-compressed (zarr `compressor: zstd`); values of
1 KiB and more sit in the item's per-process data files, smaller ones (step,
rng, counts, all-zero moments) inline in its OCDBT b-tree node. Bytes flipped
inside a compressed value either fail to decode (TensorStore's error, mapped)
or decode to other numbers (caught by the checksums); values rewritten through
TensorStore decode fine and only the checksums can tell.
"""

import json
import logging
import os
import re
import shutil
import zlib

import jax
import numpy as np
import pytest
import tensorstore as ts
import tensorstore.ocdbt

from dipaco_jax import serve
from dipaco_jax.core import experiment
from dipaco_jax.io import checkpoint

import helpers

PATH = 1  # The path serving reads (worker 1).


def _expected(exp, want):
  return {
    "resume": {k: want[k] for k in ("state", "data", "best", "records")},
    "serve_store": helpers.path_params(want["state"].store, exp.topo, PATH),
    "serve_best": jax.tree.map(lambda x: x[PATH], want["best"]),
    "serve_phase": {**want["data"], "early_stopping": want["records"]},
    "init_from": jax.tree.map(lambda x: x[PATH], want["state"].params),
  }


def _same(a, b) -> bool:
  if isinstance(a, dict) and isinstance(b, dict) and a.keys() != b.keys():
    return False
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


def _module_of_path(exp, group: str) -> int:
  (g,) = [g for g in exp.topo.store_groups() if g.name == group]
  return int(g.module_of_worker[PATH])  # Worker PATH serves path PATH (one replica each).


# Damage, applied to the copy's step 4 -------------------------------------------------------


def _url(item_dir: str) -> str:
  return "file://" + os.path.abspath(item_dir) + "/"


def _kv(item_dir: str):
  return ts.KvStore.open({"driver": "ocdbt", "base": _url(item_dir)}).result()


def _value_location(item_dir: str, key: str) -> tuple[str, int, int]:
  """(data file, offset, length) of an OCDBT value stored outside the b-tree."""
  base = ts.KvStore.open(_url(item_dir)).result()
  manifest = tensorstore.ocdbt.dump(base).result()
  node = tensorstore.ocdbt.dump(base, manifest["versions"][-1]["root"]["location"]).result()
  assert node["height"] == 0, "one b-tree leaf node in a micro checkpoint"
  (entry,) = [e for e in node["entries"] if e["key"] == key.encode()]
  _, subdir, name, offset, length = entry["indirect_value"].split(":")
  return os.path.join(item_dir, subdir, name), int(offset), int(length)


def _flip(item_dir: str, key: str, how: str) -> None:
  """XORs (or zeroes) 4 KiB, or half the value if smaller, in the middle of a stored value."""
  path, offset, length = _value_location(item_dir, key)
  n = min(4096, length // 2)
  with open(path, "r+b") as f:
    f.seek(offset + (length - n) // 2)
    old = f.read(n)
    f.seek(offset + (length - n) // 2)
    f.write(bytes(n) if how == "zero" else bytes(b ^ 0xFF for b in old))


def _rewrite(item_dir: str, name: str, index, fn) -> None:
  """array[index] = fn(array[index]) through TensorStore: valid chunks, other numbers."""
  spec = {
    "driver": "zarr",
    "kvstore": {"driver": "ocdbt", "base": _url(item_dir), "path": name + "/"},
  }
  arr = ts.open(spec, open=True, read=True, write=True).result()
  arr[index].write(fn(arr[index].read().result())).result()


def _first_chunk(item_dir: str, name: str) -> str:
  return sorted(
    k.decode() for k in _kv(item_dir).list().result() if k.startswith(f"{name}/0".encode())
  )[0]


def _edit_json(path: str, fn) -> None:
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(fn(text))


def _damage(kind: str, step_dir: str, exp) -> None:
  state, best = os.path.join(step_dir, "state"), os.path.join(step_dir, "best")
  plus_one = lambda x: x + 1
  if kind == "store_row_the_path_reads":
    _rewrite(state, "store.embed.token", 0, plus_one)
  elif kind == "store_row_the_path_does_not_read":
    _rewrite(state, "store.block_1.mlp_in.kernel", 1 - _module_of_path(exp, "block_1"), plus_one)
  elif kind == "inline_scalar":
    _rewrite(state, "step", (), lambda x: x + 96)
  elif kind == "best_row":
    _rewrite(best, "embed.token", PATH, plus_one)
  elif kind == "flipped_bytes":
    _flip(state, "params.embed.token/1.0.0", "xor")
  elif kind == "zeroed_bytes":
    _flip(state, "params.embed.token/1.0.0", "zero")
  elif kind == "flipped_bytes_in_a_served_row":
    _flip(state, f"store.block_1.mlp_in.kernel/{_module_of_path(exp, 'block_1')}.0.0", "xor")
  elif kind == "flipped_bytes_in_a_best_row":
    _flip(best, f"embed.token/{PATH}.0.0", "xor")
  elif kind == "garbage_chunk":
    _kv(state).write(_first_chunk(state, "store.embed.token"), b"not zstd" * 8).result()
  elif kind == "bad_zarr_metadata":
    _kv(state).write("store.embed.token/.zarray", b'{"chunks": [1, 25').result()
  elif kind == "wrong_zarr_dtype":
    meta = json.loads(_kv(state).read("store.embed.token/.zarray").result().value)
    _kv(state).write("store.embed.token/.zarray", json.dumps({**meta, "dtype": "<f2"})).result()
  elif kind == "missing_zarr_metadata":
    key = "store.embed.token/.zarray"
    _kv(state).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
  elif kind == "missing_chunk":
    key = _first_chunk(state, "store.embed.token")
    _kv(state).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
  elif kind == "missing_ocdbt_manifest":
    os.remove(os.path.join(state, "manifest.ocdbt"))
  elif kind == "missing_array_metadata":
    os.remove(os.path.join(state, "_METADATA"))
  elif kind == "missing_data_item":
    os.remove(os.path.join(step_dir, "data", "metadata"))
  elif kind == "data_value":  # Valid JSON, another iterator position.
    _edit_json(
      os.path.join(step_dir, "data", "metadata"),
      lambda t: t.replace('"position": 3', '"position": 7'),
    )
  else:
    raise ValueError(kind)


_CRC = r"crc32 [0-9a-f]{8} read, [0-9a-f]{8} saved"
_ALL = ("resume", "serve_store", "serve_best", "serve_phase", "init_from")
# kind: (readers that must fail, what the line names in its parentheses (a regex)). Every
# other reader must return the saved values exactly.
CASES = {
  "store_row_the_path_reads": (
    ("resume", "serve_store", "init_from"),
    rf"state array store\.embed\.token row 0: {_CRC}",
  ),
  # Serving verifies the rows it reads; a row it does not read cannot stop it.
  "store_row_the_path_does_not_read": (
    ("resume", "init_from"),
    rf"state array store\.block_1\.mlp_in\.kernel row \d: {_CRC}",
  ),
  "inline_scalar": (("resume", "init_from"), rf"state array step: {_CRC}"),
  "best_row": (("resume", "serve_best"), rf"best array embed\.token row {PATH}: {_CRC}"),
  # In a compressed value: decodes to other numbers (checksum) or not at all (zstd).
  "flipped_bytes": (
    ("resume", "init_from"),
    rf"state (array params\.embed\.token row 1: {_CRC}|data of array params\.embed\.token: .+)",
  ),
  "zeroed_bytes": (
    ("resume", "init_from"),
    rf"state (array params\.embed\.token row 1: {_CRC}|data of array params\.embed\.token: .+)",
  ),
  "flipped_bytes_in_a_served_row": (
    ("resume", "serve_store", "init_from"),
    rf"state (array store\.block_1\.mlp_in\.kernel row \d: {_CRC}"
    r"|data of array store\.block_1\.mlp_in\.kernel: .+)",
  ),
  "flipped_bytes_in_a_best_row": (
    ("resume", "serve_best"),
    rf"best (array embed\.token row {PATH}: {_CRC}|data of array embed\.token: .+)",
  ),
  "garbage_chunk": (
    ("resume", "serve_store", "init_from"),
    r"state data of array store\.embed\.token: ZSTD_decompressStream\(\) failed: Unknown frame "
    r"descriptor",
  ),
  "bad_zarr_metadata": (
    ("resume", "serve_store", "init_from"),
    r"state metadata of array store\.embed\.token: Invalid JSON",
  ),
  "wrong_zarr_dtype": (
    ("resume", "serve_store", "init_from"),
    r"state data of array store\.embed\.token: End of data expected; remaining length: 4096",
  ),
  "missing_zarr_metadata": (
    ("resume", "serve_store", "init_from"),
    r"state array store\.embed\.token: zarr metadata missing",
  ),
  "missing_chunk": (
    ("resume", "serve_store", "init_from"),
    r"state array store\.embed\.token: chunk 0\.\d\.0 missing",
  ),
  # A file every finished step holds: every read of the step stops.
  "missing_ocdbt_manifest": (_ALL, r"state/manifest\.ocdbt: missing"),
  "missing_array_metadata": (_ALL, r"state/_METADATA: missing"),
  "missing_data_item": (_ALL, r"data/metadata: missing"),
  "data_value": (("resume", "serve_best", "serve_phase"), rf"data/metadata: {_CRC}"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_reader_names_the_damaged_array_and_step(saved, tmp_path, kind):
  cfg, exp, src, want = saved
  workdir = str(tmp_path / "run")
  shutil.copytree(src, workdir)
  root = os.path.join(workdir, "checkpoints")
  _damage(kind, os.path.join(root, "4"), exp)
  before = helpers.tree_bytes(workdir)
  must_fail, what = CASES[kind]
  expected = _expected(exp, want)
  failed = []
  for op, read in helpers.checkpoint_reads(cfg, exp, workdir, PATH).items():
    try:
      got = read()
    except checkpoint.DamagedCheckpointError as e:
      msg = str(e)
      assert "\n" not in msg, msg
      assert re.fullmatch(
        rf"checkpoint step 4 in {re.escape(root)} is damaged \({what}\); move it aside "
        rf"\(mv {re.escape(root)}/4 {re.escape(workdir)}/damaged_checkpoint_4\) to resume "
        r"from step 2, the newest intact checkpoint\.",
        msg,
      ), (op, msg)
      failed.append(op)
    else:
      assert _same(got, expected[op]), (kind, op)
  assert tuple(failed) == must_fail, (kind, failed)
  assert helpers.tree_bytes(workdir) == before  # Nothing deleted or rewritten by a reader.


def test_a_step_saved_without_checksums_loads_unverified_and_says_so_once(saved, tmp_path, caplog):
  cfg, exp, src, want = saved
  workdir = str(tmp_path / "run")
  shutil.copytree(src, workdir)
  for step in (2, 4):  # As checkpoints saved before checksums existed: no list of items either.
    shutil.rmtree(os.path.join(workdir, "checkpoints", str(step), checkpoint.CHECKSUMS))
    meta = os.path.join(workdir, "checkpoints", str(step), "data", "metadata")
    with open(meta) as f:
      data = json.load(f)
    del data["saved_items"]
    with open(meta, "w") as f:
      json.dump(data, f)
  expected = _expected(exp, want)
  # absl's own logger at INFO too: a CLI run earlier in this process may have raised its level.
  with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="absl"):
    for op, read in helpers.checkpoint_reads(cfg, exp, workdir, PATH).items():
      assert _same(read(), expected[op]), op
  said = [r.getMessage() for r in caplog.records if "has no checksums" in r.getMessage()]
  assert said == [
    f"checkpoint step 4 in {workdir}/checkpoints has no checksums (saved before they were "
    "added): its arrays are read unverified."
  ]


def test_checksums_cover_every_array_row_of_every_item(saved):
  _, exp, workdir, want = saved
  with open(os.path.join(workdir, "checkpoints", "4", checkpoint.CHECKSUMS, "metadata")) as f:
    sums = json.load(f)
  assert set(sums) == {"algorithm", "state", "best", "data", "dtypes", "pieces"}
  assert sums["pieces"] == {}  # One process holds every row whole.
  assert sums["algorithm"] == "crc32" and sums["dtypes"]["state"]["step"] == "int32"
  assert len(sums["state"]) == len(jax.tree.leaves(want["state"]))
  assert len(sums["best"]) == len(jax.tree.leaves(want["best"]))
  # One crc32 per row of the bytes as saved (one for a 0-d array); the data item's JSON text.
  token = want["state"].params["embed"]["token"]
  assert sums["state"]["params.embed.token"] == [zlib.crc32(row.tobytes()) for row in token]
  assert sums["state"]["step"] == [zlib.crc32(np.asarray(want["state"].step).tobytes())]
  assert sums["best"]["embed.token"] == [
    zlib.crc32(row.tobytes()) for row in want["best"]["embed"]["token"]
  ]
  items = ["best", "state", "data", checkpoint.CHECKSUMS]  # The step's items, listed in it.
  data = {**want["data"], "early_stopping": want["records"], "saved_items": items}
  assert sums["data"] == zlib.crc32(json.dumps(data, sort_keys=True).encode())


def test_a_restore_into_another_dtype_is_checked_as_saved(tmp_path):
  """Widened (bf16 saved, read as f32): summed cast back, exactly; narrowed: nothing to check."""
  cfg = helpers.micro_config()
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  bf16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), state.params)
  workdir = str(tmp_path / "run")
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  ck.save(2, state, {"train": {}}, best=(bf16, {"phase": 0, "loss": [1.0] * 4, "step": [2] * 4}))
  ck.close()
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  params, _ = ck.restore_best(exp.abstract_state.params)  # float32, as the trainer asks.
  assert _same(params, jax.tree.map(lambda x: np.asarray(x, np.float32), bf16))
  narrow = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(
      s.shape, jax.numpy.bfloat16 if s.dtype == np.float32 else s.dtype, sharding=s.sharding
    ),
    exp.abstract_state,
  )
  restored, _ = ck.restore(narrow)  # No false alarm: a narrowed array cannot be summed as saved.
  assert _same(restored.params, bf16)
  _rewrite(os.path.join(workdir, "checkpoints", "2", "best"), "embed.token", PATH, lambda x: x + 1)
  with pytest.raises(
    checkpoint.DamagedCheckpointError, match=rf"best array embed\.token row {PATH}: crc32"
  ):
    ck.restore_best(exp.abstract_state.params)
  ck.close()


def test_rows_held_in_parts_are_checked_part_by_part(tmp_path, monkeypatch):
  """Across hosts a store module split over 'path' has no one device holding it whole.

  Here the 4 devices are one process's, so that layout is simulated: rows split
  inside are summed per device part, and each reader checks the parts it reads.
  """
  cfg = helpers.micro_config()
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  split = state.store["block_1"]["mlp_in"]["kernel"]
  boxes = {tuple(map(str, sh.index[1:])) for sh in split.addressable_shards}
  assert len(boxes) == 4  # K=2 on 4 'path' devices: each module split in 4 on an inner dim.
  real = checkpoint.row_checksums

  def as_on_hosts(x, dtype=None):
    rows = real(x, dtype)
    whole = all(
      s.index[1:] == (slice(None),) * (x.ndim - 1) for s in getattr(x, "addressable_shards", [])
    )
    return rows if whole or not isinstance(x, jax.Array) else [None] * len(rows)

  monkeypatch.setattr(checkpoint, "row_checksums", as_on_hosts)
  workdir = str(tmp_path / "run")
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  for step in (2, 4):
    ck.save(step, state, {"train": {}})
  ck.close()
  with open(os.path.join(workdir, "checkpoints", "4", checkpoint.CHECKSUMS, "metadata")) as f:
    sums = json.load(f)
  name = "store.block_1.mlp_in.kernel"
  assert sums["state"][name] == [None, None]
  parts = sums["pieces"]["state"][name]["1"]
  assert len(parts) == 4 and all(isinstance(c, int) for _, c in parts)
  _rewrite(os.path.join(workdir, "checkpoints", "4", "state"), name, 1, lambda x: x + 1)
  part = r"\[\d+:\d+, \d+:\d+\]"
  for read in (
    lambda: checkpoint.Checkpointer(workdir, async_save=False).restore(exp.abstract_state),
    lambda: checkpoint.restore_numpy(workdir),
    lambda: serve.load_path_params(workdir, cfg, _path_of_module(exp, "block_1", 1))[0],
  ):
    with pytest.raises(
      checkpoint.DamagedCheckpointError, match=rf"state array {name} row 1 {part}: crc32"
    ):
      read()
  # The other module's parts are intact: serving the path through it reads true values.
  path = _path_of_module(exp, "block_1", 0)
  got = serve.load_path_params(workdir, cfg, path)[0]
  assert _same(got, helpers.path_params(jax.tree.map(np.asarray, state.store), exp.topo, path))


def _path_of_module(exp, group: str, module: int) -> int:
  (g,) = [g for g in exp.topo.store_groups() if g.name == group]
  worker = int(np.flatnonzero(g.module_of_worker == module)[0])
  return int(exp.topo.path_of_worker[worker])
