r"""Where a compiled TPU step's HBM bytes sit: its top-level ops' bytes, by source and by kind.

  python -m dipaco_jax.aot --config=configs/dense_150m.py --topology=v6e:2x2 --steps=inner \
    --hlo_dir=/tmp/hlo  # writes /tmp/hlo/inner.hlo.txt
  python benchmarks/hlo_bytes.py /tmp/hlo/inner.hlo.txt [--top=30] [--out=FILE.json]

An approximation of XLA's own count (`bytes accessed`, which dipaco_jax.aot reports whole):
each op outside a fusion counts its operands and its result, a fusion as one op, times the
runs of the computation holding it (hlo.trip_counts: a loop body its trip count). Async
slices and copies count what they move (twice their slice: read and written), their `-done`
halves nothing. Sizes are of the TPU's tiles: a layout `T(8,128)` rounds its two minor dims up
to 8 and 128, so a [..., 64] array (head_dim 64 minor) takes 2x its elements in HBM. Both the
tiled and the element count are printed; the tiled one is the one near XLA's (the dense_150m
2-block v6e step: 1.87e11 tiled, 1.39e11 elements, XLA 1.85e11; docs/results/tpu.md).
"""
# pylint: disable=invalid-name

import argparse
import collections
import json
import math
import re
import sys

from dipaco_jax import hlo

_INST = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z\-]+)\((.*?)\)(, .*)?$")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([\d,]*)\](?:\{([\d,]*)(?::T\((\d+),(\d+)\))?)?")
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "while", "call"}
_FREE |= {"conditional", "after-all", "partition-id", "replica-id", "opt-barrier"}


def array_bytes(shape: str, tiled: bool = True) -> int:
  """Bytes of an HLO shape (a tuple sums its arrays); tiled: minor dims rounded to T(a,b)."""
  total = 0
  for dtype, dims, layout, t0, t1 in _ARRAY.findall(shape):
    bits = hlo.element_bits(dtype)
    if bits is None:
      continue
    d = [int(x) for x in dims.split(",") if x]
    minor = [int(x) for x in layout.split(",") if x]
    if tiled and t0 and len(minor) == len(d):
      for dim, tile in zip(minor, (int(t1), int(t0))):
        d[dim] = -(-d[dim] // tile) * tile
    total += -(-bits * math.prod(d) // 8)
  return total


def op_rows(hlo_text: str) -> list[dict]:
  """One row per top-level op that moves bytes: name, op, source, runs, tiled and element bytes."""
  runs = hlo.trip_counts(hlo_text)
  inside = set(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", hlo_text))
  rows, current, shapes = [], None, {}
  for line in hlo_text.splitlines():
    name = hlo.computation_name(line)
    if name is not None:
      current, shapes = name, {}
      continue
    m = _INST.match(line)
    if current is None or current in inside or not m:
      continue
    op_name, shape, op, args = m.group(1), m.group(2), m.group(3), m.group(4)
    shapes[op_name] = shape
    if op in _FREE or op.endswith("-done"):
      continue
    if op in ("slice-start", "copy-start"):  # ((operand), result, context): what it moves.
      moved = hlo.split_top(shape.strip()[1:-1])[1]
      sizes = [2 * array_bytes(moved, t) for t in (True, False)]
    else:
      operands = [shapes.get(a.strip().lstrip("%"), "") for a in hlo.split_top(args)]
      sizes = [
        array_bytes(shape, t) + sum(array_bytes(o, t) for o in operands) for t in (True, False)
      ]
    source = re.search(r'op_name="([^"]*)"', line)
    n = runs.get(current, 1)
    rows.append(
      dict(
        name=op_name,
        op=op,
        source=source.group(1) if source else "",
        runs=n,
        bytes=n * sizes[0],
        element_bytes=n * sizes[1],
      )
    )
  return rows


def summary(rows: list[dict], top: int) -> dict:
  """Totals, and the largest shares by source (op_name metadata, blocks merged) and by op."""
  by_source, by_op = collections.Counter(), collections.Counter()
  for r in rows:
    # An op without source metadata (the compiler's copies, the Pallas kernels) by its name.
    source = re.sub(r"block_\d+", "block_N", r["source"]) or "(no source) " + re.sub(
      r"\.\d+$", "", r["name"]
    )
    by_source[source] += r["bytes"]
    by_op[r["op"]] += r["bytes"]
  return dict(
    bytes=sum(r["bytes"] for r in rows),
    element_bytes=sum(r["element_bytes"] for r in rows),
    by_source=dict(by_source.most_common(top)),
    by_op=dict(by_op.most_common(top)),
  )


def main(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("hlo", help="a compiled step's HLO text (dipaco_jax.aot --hlo_dir)")
  p.add_argument("--top", type=int, default=30, help="sources and ops listed")
  p.add_argument("--out", default="", help="JSON file to write")
  a = p.parse_args(argv)
  with open(a.hlo) as f:
    s = summary(op_rows(f.read()), a.top)
  print(f"{s['bytes']:.4e} bytes in tiles, {s['element_bytes']:.4e} in elements")
  for key in ("by_op", "by_source"):
    print(f"{key}:")
    for k, v in s[key].items():
      print(f"  {v:.3e} {v / s['bytes']:6.1%}  {k}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(s, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
