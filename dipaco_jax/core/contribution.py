"""How much a worker's delta counts in its module's outer step: α, tokens trained, staleness.

The outer step averages Δ_n with weights w_n / Σ w (core/outer.py's `weights`),
so the factors below multiply (product weights, normalised there once):

  w_n = α_n · (s_n / H) · γ^(late_n)

α_n: the worker's shard-size weight (the paper, §2.7); s_n / H: the share of the
phase's H inner steps its task trained (elastic.token_weights; every step reads
the same batch shape, so steps count tokens); γ^late_n: a delta that missed its
module's step by late_n phases (elastic.late_deltas="discount"). A factor of
exactly 1 leaves α's float32 bits alone, so equal speeds and on-time deltas give
the same step as without these switches.
"""
# pylint: disable=invalid-name

import numpy as np


def weights(alpha_N, steps_N=None, H: int = 1, late_N=None, discount: float = 1.0) -> np.ndarray:
  """w_n = α_n · (s_n / H) · discount^late_n, float32 (steps_N/late_N None: that factor off)."""
  w = np.asarray(alpha_N, np.float32).copy()
  if steps_N is not None:
    w = w * (np.asarray(steps_N, np.float32) / np.float32(H))
  if late_N is not None:
    w = w * np.power(np.float32(discount), np.asarray(late_N, np.float32))
  return w.astype(np.float32)
