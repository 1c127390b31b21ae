"""core/rope.py: RoPE's rotation by hand, its relative-position property, the old halves formula."""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax.core import rope as rope_lib


def test_rope_rotates_pairs_of_halves_by_position_times_frequency():
  # head_dim 2: one frequency, 10000**0 = 1, so position p rotates (x1, x2) by p radians.
  x_1x3x1x2 = jnp.asarray([[[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]]])
  positions_1x3 = jnp.asarray([[0, 1, 3]])
  out = np.asarray(rope_lib.rope(x_1x3x1x2, positions_1x3))
  expected = [[1.0, 0.0], [np.cos(1.0), np.sin(1.0)], [-2 * np.sin(3.0), 2 * np.cos(3.0)]]
  np.testing.assert_allclose(out[0, :, 0], expected, rtol=1e-6, atol=1e-6)


def test_rope_scores_depend_on_relative_position_only():
  # q(p) . k(s) after RoPE is a function of p - s: shifting both by 37 keeps every score.
  rng = np.random.default_rng(2)
  q_1x1x1xK = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k_1x1x1xK = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  rope = rope_lib.rope
  score = lambda p, s: float(
    jnp.sum(rope(q_1x1x1xK, jnp.asarray([[p]])) * rope(k_1x1x1xK, jnp.asarray([[s]])))
  )
  for p, s in [(5, 2), (9, 9), (3, 0)]:
    # float32 angles p * freq round to a relative 6e-8 (< 3e-6 rad at p < 50); times |q||k| ~ 8
    # that moves a score by < 3e-5, under the 1e-4 allowed.
    np.testing.assert_allclose(score(p + 37, s + 37), score(p, s), rtol=1e-4, atol=1e-4)
  assert abs(score(5, 2) - score(5, 0)) > 1e-3  # the relative offset itself does matter


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [6, 64])  # 64: the 150M path's head_dim.
def test_rope_equals_the_halves_formula_and_its_gradient_autodiffs(dtype, K):
  """rope (a signed-permutation matmul, a custom backward) against the halves formula.

  The formula is the one rope replaced: x1 cos - x2 sin, x2 cos + x1 sin on the halves, in
  float32. The permutation moves each element exactly, times +-1, so the values are equal
  bit for bit, and the backward (rotate back, in the compute dtype) is autodiff's.
  """
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 8, 3, K)), dtype)
  w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  pos = jnp.asarray(rng.integers(0, 1024, size=(2, 8)), jnp.int32)
  h = K // 2

  def plain(x):
    freq = 1.0 / (10_000.0 ** (jnp.arange(h, dtype=jnp.float32) / h))
    angle = pos[..., None].astype(jnp.float32) * freq
    s, c = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
    x1, x2 = x[..., :h].astype(jnp.float32), x[..., h:].astype(jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)

  loss = lambda f: jax.grad(lambda x: (f(x).astype(jnp.float32) * w).sum())(x)
  np.testing.assert_array_equal(rope_lib.rope(x, pos), plain(x))
  got, want = loss(lambda x: rope_lib.rope(x, pos)), loss(plain)
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6
  )


def test_rope_swap_moves_each_element_exactly():
  # (x1, x2) -> (-x2, x1): values with more mantissa than bfloat16 survive the matmul unchanged.
  x = jnp.asarray([[1.0 + 2**-20, 2.0, -3.0 - 2**-18, 4.0]], jnp.float32)
  want = [[3.0 + 2**-18, -4.0, 1.0 + 2**-20, 2.0]]
  np.testing.assert_array_equal(rope_lib.swap_halves(x), want)
