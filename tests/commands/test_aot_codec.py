"""The outer codec's cost compiled for a TPU (libtpu, no TPU): the table "auto" reads, the row."""

import os

import pytest

pytest.importorskip(
  "libtpu",
  reason="libtpu is not installed (pip install -e '.[aot]'): "
  "the TPU compiler is needed to compile for a TPU topology.",
)

from dipaco_jax import aot  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax.aot import codec  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax.core import compression as comp  # pylint: disable=g-import-not-at-top

import helpers  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.slow, pytest.mark.aot]


def test_the_table_auto_reads_is_what_the_tpu_compiler_counts():
  """compression.CODEC_BYTES: encode + decode of a [896, 3584] leaf on v5e, to 0.1 B a value."""
  got = {r["kind"]: r["bytes_per_value"] for r in codec.table("v5e:2x2")}
  for kind, want in comp.CODEC_BYTES.items():
    if kind != "none":
      assert got[kind] == pytest.approx(want, abs=0.1), (kind, got)
  # bf16 reads 4 and writes 2 bytes a value each way: no pass beyond the cast.
  assert got["bf16"] == pytest.approx(12.0, abs=0.01)


def test_the_outer_row_carries_the_codec_against_the_dcn_time():
  """tiny (vocab 512, d 128: 2 x 4 paths) with fp4 on 2 x v5e:2x2: mesh path 4 x data 2."""
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  cfg = config_check.load(tiny, **{"outer.compression": "fp4"})
  rep = aot.Report(cfg, "v5e:2x2", slices=2)
  row = codec.codec_row(rep)
  assert row["kind"] == "fp4" and row["values"] > 0
  # Each 'data' copy of a path sends half of it (params replicated over data = 2).
  assert row["sent_values"] == pytest.approx(row["values"] / rep.mesh.shape["data"])
  assert row["hbm_s"] == pytest.approx(2 * (row["encode_bytes"] + row["decode_bytes"]) / rep.hbm_bw)
  # fp4 saves 4 - 0.5625 bytes a value both ways at 25 Gb/s (3.125 GB/s), b = 64 rows.
  assert row["saved_s"] == pytest.approx(
    2 * (4 * row["sent_values"] - row["wire_bytes"]) / 3.125e9, rel=1e-9
  )
  assert row["break_even_gbps"] > 25 and row["auto"] == "fp4"
  line = aot.command.codec_line(row, rep.result)
  assert "codec fp4" in line and "auto picks fp4" in line and "\n" not in line
  # auto resolved before the report: the report names the kind it compiled.
  auto = config_check.load(tiny, **{"outer.compression": "auto", "outer.link_gbps": 1e6})
  assert aot.Report(auto, "v5e:2x2", slices=2).result["config"]["outer_compression"] == "none"
