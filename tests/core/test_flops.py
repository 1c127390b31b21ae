"""core/flops.py: the peak and bandwidth tables, their one-line refusal, the roofline's bounds."""

import pytest

from dipaco_jax import errors
from dipaco_jax.core import flops


def test_hopper_gpus_have_their_data_sheet_peaks_and_bandwidths():
  # NVIDIA's data sheets: H100 SXM and H200 989 TFLOP/s dense bf16 (1,979 with sparsity);
  # HBM 3.35 and 4.8 TB/s.
  assert flops.require_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
  assert flops.require_peak_tflops("NVIDIA H200", "bfloat16") == 989.0
  assert flops.hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
  assert flops.hbm_bytes_per_s("NVIDIA H200") == 4.8e12
  assert flops.hbm_bytes_per_s("TPU v5 lite") == 819e9


def test_a_device_missing_from_the_peak_table_is_one_line_naming_it():
  with pytest.raises(errors.UserError) as e:
    flops.require_peak_tflops("NVIDIA A10G", "bfloat16")
  line = errors.one_line(e.value)
  assert "\n" not in str(e.value)
  assert "'NVIDIA A10G'" in line and "PEAK_TFLOPS" in line and "--peak_tflops" in line
  assert "NVIDIA H200" in line  # The kinds it has, to compare the name with.


def test_roofline_ceiling_overlaps_and_floor_adds():
  # 2e12 flops at 1e12 FLOP/s = 2 s; 3e9 bytes at 1e9 B/s = 3 s: memory-bound.
  # Ceiling: max = 3 s; floor: 2 + 3 = 5 s. Model FLOPs 1.5e12 -> MFU 1.5/3 = 0.5 and 1.5/5 = 0.3.
  r = flops.roofline(2e12, 3e9, 1e12, 1e9, 1.5e12)
  assert r["compute_s"] == 2.0 and r["memory_s"] == 3.0 and r["bound"] == "memory"
  assert r["step_s_overlap"] == 3.0 and r["step_s_serial"] == 5.0
  assert r["mfu_ceiling"] == pytest.approx(0.5) and r["mfu_floor"] == pytest.approx(0.3)
  # Compute-bound: 4 s of FLOPs, 1 s of bytes; ceiling 4 s, floor 5 s.
  r = flops.roofline(4e12, 1e9, 1e12, 1e9, 4e12)
  assert r["bound"] == "compute" and r["mfu_ceiling"] == 1.0 and r["mfu_floor"] == 0.8
