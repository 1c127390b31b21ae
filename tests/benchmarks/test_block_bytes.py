"""benchmarks/block_bytes.py: one block compiled for a TPU chip; RoPE and splash as they lower."""

import os
import sys

import pytest

import helpers

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[aot]').")
sys.path.insert(0, os.path.join(helpers.ROOT, "benchmarks"))
import block_bytes  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.slow, pytest.mark.aot]


def test_one_tiny_block_on_a_v6e_chip_writes_no_rope_halves_and_runs_the_fused_backward():
  sets = ["model.dtype=bfloat16", "model.remat=none"]
  cfg, seq_len = block_bytes.model_config(os.path.join(helpers.ROOT, "configs/tiny.py"), sets)
  text = block_bytes.compile_block(cfg, seq_len, 2, "v6e:2x2").as_text()
  # Splash runs (128 positions: one 128 block) with its fused backward: no separate dq kernel.
  assert "splash_mha_fwd" in text and "splash_mha_dkv" in text
  assert "splash_mha_dq" not in text
  # RoPE's halves [B, T, H, K/2] = [2, 128, 4, 16]: the old slicing form wrote them (4x padded
  # on the TPU's 128 lanes); the permutation matmul keeps the rotation whole.
  assert f"[2,{seq_len},{cfg.num_heads},{cfg.head_dim // 2}]" not in text
