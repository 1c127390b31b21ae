"""Rotary position embedding (RoPE) on pairs of halves of the head dim, with a fused backward."""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np


def swap_halves(x_BxTxHxK):
  """(-x2, x1) for x = (x1, x2) on the last axis, in float32: one matmul by a signed permutation.

  Exact (each output is one input times +-1, accumulated in float32). Slicing into halves and
  concatenating them instead made XLA:TPU write 32-wide halves, each padded to the 128 lanes
  (4x its bytes), between separate ops; the matmul keeps the rotation one fused op on 64 lanes.
  """
  K = x_BxTxHxK.shape[-1]
  half = K // 2
  perm_KxK = np.zeros((K, K), np.float32)
  perm_KxK[np.arange(half) + half, np.arange(half)] = -1.0  # out[j] = -x[j + half]
  perm_KxK[np.arange(half), np.arange(half) + half] = 1.0  # out[j + half] = x[j]
  dims = (((x_BxTxHxK.ndim - 1,), (0,)), ((), ()))
  perm = jnp.asarray(perm_KxK, x_BxTxHxK.dtype)
  # HIGHEST: a float32 x stays exact on TPU (default: one bfloat16 pass) and GPU (TF32).
  return jax.lax.dot_general(
    x_BxTxHxK, perm, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )


def tables(positions_BxT, K: int):
  """sin and cos [B, T, 1, K] of each position's angles, each frequency for both halves."""
  half = K // 2
  freq_K2 = 1.0 / (10_000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle_BxTxK = positions_BxT[..., None].astype(jnp.float32) * jnp.tile(freq_K2, 2)
  return jnp.sin(angle_BxTxK)[:, :, None, :], jnp.cos(angle_BxTxK)[:, :, None, :]


def _rotate(x_BxTxHxK, positions_BxT, sign: float):
  """x's halves rotated by the positions' angles (sign -1: back), in float32, in x's dtype."""
  sin, cos = tables(positions_BxT, x_BxTxHxK.shape[-1])
  x = x_BxTxHxK.astype(jnp.float32)
  return (x * cos + sign * swap_halves(x_BxTxHxK) * sin).astype(x_BxTxHxK.dtype)


@jax.custom_vjp
def rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  """Rotary position embedding on the last axis (pairs of halves)."""
  return _rotate(x_BxTxHxK, positions_BxT, 1.0)


def _rope_fwd(x_BxTxHxK, positions_BxT):
  return _rotate(x_BxTxHxK, positions_BxT, 1.0), positions_BxT


def _rope_bwd(positions_BxT, g_BxTxHxK):
  # A rotation's transpose rotates back: the gradient leaves in the compute dtype, as autodiff's
  # would, but from one fused op (no float32 gradient written to HBM). Only the positions are
  # kept: the tables are recomputed (sin and cos are cheaper than reading them back).
  return _rotate(g_BxTxHxK, positions_BxT, -1.0), None


rope.defvjp(_rope_fwd, _rope_bwd)
