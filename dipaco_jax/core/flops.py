"""Model FLOPs of training: what MFU counts (the AOT report, benchmarks, perf/ in TensorBoard)."""

import math

import jax

from dipaco_jax.core import model as model_lib
from dipaco_jax.errors import UserError

# Model FLOPs conventions for MFU: attention's score and value matmuls counted over every
# (query, key) pair ("full": PaLM App. B, 12 L T H K per token) or over the causal half that a
# causal model needs ("causal": 6 L T H K, as MaxText counts). The AOT report's MFU is the causal
# one; both are printed.
CONVENTIONS = ("causal", "full")

# Dense peak bf16 TFLOP/s per TPU chip (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, read
# 2026-11): the AOT report's chips (aot.CHIPS) and the trainer's perf/mfu read these.
TPU_BF16_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}
# jax's device_kind of each TPU chip.
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e"}
# Dense peak TFLOP/s per device by (device_kind, compute dtype): the TPUs', and NVIDIA's data
# sheets (H100 SXM / H200: 989 bf16 dense, 67 float32 without TF32).
PEAK_TFLOPS = {
  **{(kind, "bfloat16"): TPU_BF16_TFLOPS[chip] for kind, chip in TPU_KINDS.items()},
  ("NVIDIA H100 80GB HBM3", "bfloat16"): 989.0,
  ("NVIDIA H100 80GB HBM3", "float32"): 67.0,
  ("NVIDIA H200", "bfloat16"): 989.0,
}
# HBM GB/s per TPU chip (the same pages) and HBM bytes/s per device by device_kind, with
# NVIDIA's data sheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s): the roofline beside a measured step
# (benchmarks/mfu.py). A v4 VM runs one device per chip (megacore): the chip's figure.
TPU_HBM_GBPS = {"v4": 1200.0, "v5e": 819.0, "v5p": 2765.0, "v6e": 1640.0}
HBM_BYTES_PER_S = {
  **{kind: TPU_HBM_GBPS[chip] * 1e9 for kind, chip in TPU_KINDS.items()},
  "NVIDIA H100 80GB HBM3": 3.35e12,
  "NVIDIA H200": 4.8e12,
}


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """A device's dense peak TFLOP/s in `dtype` (PEAK_TFLOPS), None where the table has none."""
  return PEAK_TFLOPS.get((device_kind, dtype))


def hbm_bytes_per_s(device_kind: str) -> float | None:
  """A device's HBM bandwidth in bytes/s (HBM_BYTES_PER_S), None where the table has none."""
  return HBM_BYTES_PER_S.get(device_kind)


def require_peak_tflops(device_kind: str, dtype: str) -> float:
  """peak_tflops, or a UserError naming the device kind and the table where it has none."""
  peak = peak_tflops(device_kind, dtype)
  if peak is None:
    kinds = sorted({k for k, d in PEAK_TFLOPS if d == dtype})
    raise UserError(
      f"no dense {dtype} peak for device kind {device_kind!r} in dipaco_jax/core/flops.py "
      f"PEAK_TFLOPS (it has {kinds}): add the device's data-sheet figure there, or pass "
      "--peak_tflops."
    )
  return peak


def roofline(
  flops: float, nbytes: float, peak: float, bandwidth: float, model_flops: float | None = None
):
  """A step's roofline estimates from its counts: FLOP/s `peak`, bytes/s `bandwidth`.

  Both bounds of a step that runs its FLOPs at peak and moves its bytes at full bandwidth:
  `step_s_overlap` = max(flops / peak, bytes / bandwidth) (compute and memory traffic
  perfectly overlapped: the MFU *ceiling*) and `step_s_serial` = their sum (no overlap: the
  MFU *floor*). Neither counts collectives, launch gaps or kernels below peak: estimates to
  hold a measured MFU against, not measurements.
  """
  compute_s, memory_s = flops / peak, nbytes / bandwidth
  overlap_s, serial_s = max(compute_s, memory_s), compute_s + memory_s
  out = {
    "compute_s": compute_s,
    "memory_s": memory_s,
    "bound": "compute" if compute_s >= memory_s else "memory",
    "step_s_overlap": overlap_s,
    "step_s_serial": serial_s,
  }
  if model_flops is not None:  # The MFU at each end.
    out.update(
      mfu_ceiling=model_flops / (overlap_s * peak), mfu_floor=model_flops / (serial_s * peak)
    )
  return out


def model_flops_per_token(
  cfg: model_lib.ModelConfig, seq_len: int, convention: str = "causal"
) -> float:
  """Training FLOPs per token: 6 x matmul params + attention (PaLM, App. B; see CONVENTIONS).

  The params are counted from the model's own tree, so every MLP kind (gelu, swiglu's third
  matrix) counts as built.
  """
  if convention not in CONVENTIONS:
    raise ValueError(f"convention={convention!r}: use one of {CONVENTIONS}")
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  # Lookup tables do no matmul; a tied table does one (the unembedding).
  n -= cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
  if cfg.positions == "learned":
    n -= cfg.max_len * cfg.d_model
  attention = 12.0 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  return 6.0 * n + (attention / 2 if convention == "causal" else attention)
