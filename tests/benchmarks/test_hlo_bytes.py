"""benchmarks/hlo_bytes.py: a compiled step's bytes per top-level op, in the TPU's tiles."""

import os
import sys

import helpers

sys.path.insert(0, os.path.join(helpers.ROOT, "benchmarks"))
import hlo_bytes  # pylint: disable=g-import-not-at-top,wrong-import-position

# A loop of 3 trips whose body runs one fusion and one async slice, and an entry that adds the
# loop's result to a parameter: the shapes as libtpu prints them (layouts with tiles).
HLO = """HloModule m

%fused (p: bf16[16,64]) -> bf16[16,64] {
  %p = bf16[16,64]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %n = bf16[16,64]{1,0:T(8,128)(2,1)} negate(%p)
}

%body (t: (s32[], bf16[16,64])) -> (s32[], bf16[16,64]) {
  %t = (s32[], bf16[16,64]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[16,64]{1,0:T(8,128)(2,1)} get-tuple-element(%t), index=1
  %f = bf16[16,64]{1,0:T(8,128)(2,1)} fusion(%x), calls=%fused, metadata={op_name="f/block_3/neg"}
  %b = s8[2048]{0:T(1024)} bitcast(%f)
  %ss = ((s8[2048]{0:T(1024)}), s8[1024]{0:T(1024)S(1)}, s32[]) slice-start(%b), slice={[0:1024]}
  %sd = s8[1024]{0:T(1024)S(1)} slice-done(%ss)
  ROOT %r = (s32[], bf16[16,64]{1,0:T(8,128)(2,1)}) tuple(%i, %f)
}

%cond (t: (s32[], bf16[16,64])) -> pred[] {
  %t = (s32[], bf16[16,64]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: bf16[16,64]) -> bf16[16,64] {
  %a = bf16[16,64]{1,0:T(8,128)(2,1)} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], bf16[16,64]{1,0:T(8,128)(2,1)}) tuple(%z, %a)
  %w = (s32[], bf16[16,64]{1,0:T(8,128)(2,1)}) while(%t), condition=%cond, body=%body
  %y = bf16[16,64]{1,0:T(8,128)(2,1)} get-tuple-element(%w), index=1
  ROOT %s = bf16[16,64]{1,0:T(8,128)(2,1)} add(%a, %y), metadata={op_name="f/add"}
}
"""


def test_tiles_and_trips_by_hand():
  # bf16[16,64] in T(8,128) tiles: the minor dim 64 padded to 128, 16 x 128 x 2 = 4096 bytes
  # (2048 as elements); f32[3,5] in T(8,128): 8 x 128 x 4 = 4096; no layout: 3 x 5 x 4 = 60.
  assert hlo_bytes.array_bytes("bf16[16,64]{1,0:T(8,128)(2,1)}") == 4096
  assert hlo_bytes.array_bytes("bf16[16,64]{1,0:T(8,128)(2,1)}", tiled=False) == 2048
  assert hlo_bytes.array_bytes("f32[3,5]{1,0:T(8,128)}") == 4096
  assert hlo_bytes.array_bytes("f32[3,5]") == 60
  rows = {r["name"]: r for r in hlo_bytes.op_rows(HLO)}
  # Only the ops that move bytes, each once per run of its computation: the fusion and the
  # slice 3 times (the loop's trips), the add and the loop's compare once (hlo.trip_counts
  # counts a condition once); the fusion's inside, tuples, bitcasts, the loop and the slice's
  # -done half count nothing.
  assert sorted(rows) == ["f", "lt", "s", "ss"], sorted(rows)
  assert rows["lt"]["bytes"] == 4 + 4 + 1  # Two s32 scalars in, a pred out.
  assert rows["f"]["runs"] == 3 and rows["s"]["runs"] == 1
  assert rows["f"]["bytes"] == 3 * (4096 + 4096)  # Operand and result, 3 trips.
  assert rows["f"]["element_bytes"] == 3 * (2048 + 2048)
  assert rows["ss"]["bytes"] == 3 * 2 * 1024  # The 1,024-byte slice read and written.
  assert rows["s"]["bytes"] == 3 * 4096  # Two operands and the result.
  s = hlo_bytes.summary(list(rows.values()), top=5)
  assert s["bytes"] == 24576 + 6144 + 12288 + 9
  # Sources with the block's number merged; an op without metadata by its name.
  assert s["by_source"] == {
    "f/block_N/neg": 24576,
    "f/add": 12288,
    "(no source) ss": 6144,
    "(no source) lt": 9,
  }
