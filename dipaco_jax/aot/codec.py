"""The outer codec's cost on a chip: its compiled encode and decode against the link time saved.

`codec_row` is the outer step's "codec" entry in the AOT report: XLA's bytes of encoding the
workers' Δ as a device holds them (each params leaf's shard: the outer step codes its whole copy)
and of decoding them, compiled alone for one device of the report's topology, as HBM time (twice:
the Δ up, the update down), beside the link time the wire form saves against float32 both ways,
by arithmetic (compression.wire_bytes) on the part a device sends (its shard over the devices
that hold the same one).

    python -m dipaco_jax.aot.codec [TOPOLOGY]    # default v5e:2x2

prints the bytes a value of each kind on one [896, 3584] leaf (compression.CODEC_BYTES, what
outer.compression="auto" weighs) and each kind's break-even link bandwidth on that chip.
"""
# pylint: disable=invalid-name

import math
import sys
from typing import Any

import jax
import numpy as np

from dipaco_jax import errors
from dipaco_jax.aot import compile as compile_lib
from dipaco_jax.core import compression as comp

LEAF = (896, 3584)  # dipaco_2x4's MLP kernel (d_model x 4 d_model), the table's leaf.


def codec_bytes(shapes, kind: str, block: int, keep: int, device) -> tuple[float, float]:
  """XLA's bytes of encoding float32 arrays of `shapes` on `device`, and of decoding them."""
  if kind == "none":
    return 0.0, 0.0
  one = jax.sharding.SingleDeviceSharding(device)
  xs = [jax.ShapeDtypeStruct(s, np.float32, sharding=one) for s in shapes]
  enc = jax.jit(lambda xs: [comp.encode(x, kind, block, keep) for x in xs])
  wire = jax.tree.map(
    lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=one), jax.eval_shape(enc, xs)
  )
  dec = jax.jit(lambda ws: [comp.decode(w, kind, block, s[-1], keep) for w, s in zip(ws, shapes)])
  _, encoded = compile_lib.cost(compile_lib.compile_step(enc, xs))
  _, decoded = compile_lib.cost(compile_lib.compile_step(dec, wire))
  return encoded, decoded


def _replicas(x) -> int:
  """How many devices hold each distinct shard of the sharded array `x`."""
  where = x.sharding.devices_indices_map(x.shape)
  distinct = {tuple((i.start, i.stop) for i in ix) for ix in where.values()}
  return len(where) // len(distinct)


def codec_row(report) -> dict[str, Any] | None:
  """The codec's HBM time against the link time it saves, per device per outer step."""
  cfg = report.exp.recipe.outer_cfg
  if not cfg.enabled or cfg.compression == "none":
    return None
  kind, block, keep = cfg.compression, cfg.compression_block, cfg.compression_keep
  shapes, sent, wire = [], 0.0, 0.0
  for x in jax.tree.leaves(report.exp.abstract_state.params):
    s = tuple(x.sharding.shard_shape(x.shape))
    s = s if len(s) > 1 else s + (1,)  # comp.as_rows: a scalar module's [W] as rows.
    shapes.append(s)
    # The devices that hold the same shard (a path's 'data' copies) each send their part.
    n = _replicas(x)
    sent += math.prod(s) / n
    wire += comp.wire_bytes(s, kind, block, keep) / n
  values = sum(math.prod(s) for s in shapes)
  encoded, decoded = codec_bytes(shapes, kind, block, keep, report.mesh.devices.flat[0])
  per_value = (encoded + decoded) / values
  link = report.dcn_bytes_per_s / report.devices_per_chip  # A chip's devices share its link.
  hbm_gbs = report.chip.hbm_bw / 1e9
  return dict(
    kind=kind,
    values=values,
    encode_bytes=encoded,
    decode_bytes=decoded,
    bytes_per_value=per_value,
    # Twice: each worker's Δ coded up, the owner's update coded down.
    hbm_s=2 * (encoded + decoded) / report.hbm_bw,
    sent_values=sent,
    wire_bytes=wire,
    saved_s=2 * (4 * sent - wire) / link,
    # Where the link time saved equals the HBM time (both per device, as above).
    break_even_gbps=(4 * sent - wire) * 8 * hbm_gbs / (encoded + decoded),
    auto=comp.choose(block, report.dcn_gbps, hbm_gbs),
  )


def table(topology: str = "v5e:2x2", block: int = 64) -> list[dict[str, Any]]:
  """Per kind, XLA's bytes a value of encoding and decoding one LEAF on one device of `topology`."""
  device = compile_lib.topology_devices(topology, 1)[0]
  _, chip = compile_lib.chip_of(topology)
  rows = []
  for kind in comp.AUTO_KINDS[1:]:
    encoded, decoded = codec_bytes([LEAF], kind, block, 1, device)
    n = math.prod(LEAF)
    per_value = (encoded + decoded) / n
    saved = 4 - comp.wire_bytes(LEAF, kind, block) / n
    rows.append(
      dict(
        kind=kind,
        encode=encoded / n,
        decode=decoded / n,
        bytes_per_value=per_value,
        break_even_gbps=saved * 8 * chip.hbm_bw / 1e9 / per_value,
      )
    )
  return rows


def main(argv: list[str]) -> None:
  topology = argv[1] if len(argv) > 1 else "v5e:2x2"
  try:
    rows = table(topology)
  except (ValueError, errors.UserError) as e:
    print(errors.one_line(e), file=sys.stderr)
    sys.exit(1)
  print(f"{topology}, one [{LEAF[0]}, {LEAF[1]}] float32 leaf, blocks of 64 (XLA's bytes):")
  for r in rows:
    print(
      f"  {r['kind']:<5} encode {r['encode']:6.2f} + decode {r['decode']:6.2f} = "
      f"{r['bytes_per_value']:6.2f} B a value; cheaper than float32 below "
      f"{r['break_even_gbps']:,.0f} Gb/s per chip"
    )


if __name__ == "__main__":
  main(sys.argv)
