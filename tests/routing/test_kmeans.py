"""Tests for k-means and product k-means (dipaco_jax/routing/kmeans.py)."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax.routing import kmeans

# Four planted centres 20 apart; noise std 0.5, so each true cluster is far
# nearer its own centre than any other and the planted partition is the optimum.
_CENTRES = np.array(
  [[10, 0, 0, 0, 0, 0], [-10, 0, 0, 0, 0, 0], [0, 10, 0, 0, 0, 0], [0, -10, 0, 0, 0, 0]], np.float32
)


def _planted(n_per=50, seed=0):
  rng = np.random.default_rng(seed)
  labels = np.repeat(np.arange(4), n_per)
  x = _CENTRES[labels] + 0.5 * rng.normal(size=(4 * n_per, 6)).astype(np.float32)
  return x, labels


def _same_partition(a, b):
  """True if labelings a and b agree up to a permutation of ids."""
  pairs = set(zip(a.tolist(), b.tolist()))
  return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


@pytest.mark.parametrize("restarts", [1, 4])
def test_recovers_planted_clusters(restarts):
  x, labels = _planted()
  c = kmeans.fit_kmeans(x, 4, restarts=restarts, seed=3)
  ids = kmeans.assign(x, c)[:, 0]
  assert _same_partition(ids, labels)
  # Each fitted centroid is the mean of 50 points: within ~0.5*sqrt(6/50) ~ 0.17 of its centre.
  nearest = np.linalg.norm(c[:, None] - _CENTRES[None], axis=-1).min(axis=1)
  assert nearest.max() < 0.5
  # The planted partition is optimal, so the fit's inertia equals its within-cluster SS.
  within = sum(((x[labels == j] - x[labels == j].mean(0)) ** 2).sum() for j in range(4))
  assert kmeans.inertia(x, c) == pytest.approx(within, rel=1e-4)


def test_deterministic_under_seed():
  x, _ = _planted(seed=1)
  a = kmeans.fit_kmeans(x, 4, restarts=2, seed=7)
  b = kmeans.fit_kmeans(x, 4, restarts=2, seed=7)
  np.testing.assert_array_equal(a, b)


def test_empty_cluster_reseeded_at_farthest_point():
  # Every point is nearer (0, 0) than (100, 100), so cluster 1 gets none. Cluster 0
  # becomes the mean (0, 11/3); cluster 1 moves to the point farthest from its
  # centroid (0, 0), which is (0, 10).
  x = jnp.array([[0.0, 0.0], [0.0, 1.0], [0.0, 10.0]])
  c = kmeans._lloyd_step(x, jnp.array([[0.0, 0.0], [100.0, 100.0]]))
  np.testing.assert_allclose(c, [[0.0, 11.0 / 3.0], [0.0, 10.0]], rtol=1e-6)


def test_fewer_distinct_points_than_k():
  # Three distinct points, k = 4: k-means++ falls back to uniform draws; the fit
  # must still end with every point on a centroid (inertia 0) and finite values.
  x = np.repeat(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], np.float32), 3, axis=0)
  c = kmeans.fit_kmeans(x, 4, restarts=1, seed=0)
  assert np.isfinite(c).all()
  assert kmeans.inertia(x, c) == pytest.approx(0.0, abs=1e-6)


def test_assign_top_k_matches_brute_force_and_streams():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(50, 5)).astype(np.float32)
  c = rng.normal(size=(6, 5)).astype(np.float32)
  # batch_size=7 forces 8 batches, the last one padded.
  got = kmeans.assign(x, c, top_k=3, batch_size=7)
  d = ((x[:, None] - c[None]) ** 2).sum(-1)
  np.testing.assert_array_equal(got, np.argsort(d, axis=1)[:, :3])
  assert got.dtype == np.int32 and got.shape == (50, 3)


def test_split_dims():
  assert kmeans.split_dims(8, 2) == [(0, 4), (4, 8)]  # The paper's halves.
  assert kmeans.split_dims(7, 2) == [(0, 4), (4, 7)]  # Remainder to earlier levels.
  assert kmeans.split_dims(7, 3) == [(0, 3), (3, 5), (5, 7)]


def test_product_assign_is_per_half_nearest_flattened_row_major():
  a = np.array([[0, 0], [10, 0], [0, 10]], np.float32)  # Level 1, K_1 = 3.
  b = np.array([[0, 0], [10, 10]], np.float32)  # Level 2, K_2 = 2.
  rng = np.random.default_rng(0)
  ij = np.array(list(itertools.product(range(3), range(2))) * 5)
  x = np.concatenate([a[ij[:, 0]], b[ij[:, 1]]], axis=1) + 0.1 * rng.normal(size=(30, 4))
  got = kmeans.product_assign(x, [a, b])[:, 0]
  per_half = kmeans.assign(x[:, :2], a)[:, 0] * 2 + kmeans.assign(x[:, 2:], b)[:, 0]
  np.testing.assert_array_equal(got, per_half)
  np.testing.assert_array_equal(got, ij[:, 0] * 2 + ij[:, 1])  # path = i * K_2 + j.
  np.testing.assert_array_equal(got, np.ravel_multi_index(ij.T, (3, 2)))


def test_fit_product_kmeans_recovers_planted_grid():
  a = np.array([[0, 0], [10, 0], [0, 10]], np.float32)
  b = np.array([[0, 0], [10, 10]], np.float32)
  rng = np.random.default_rng(1)
  ij = np.array(list(itertools.product(range(3), range(2))) * 20)
  x = np.concatenate([a[ij[:, 0]], b[ij[:, 1]]], axis=1) + 0.3 * rng.normal(size=(120, 4))
  cents = kmeans.fit_product_kmeans(x, (3, 2), restarts=2, seed=0)
  assert [c.shape for c in cents] == [(3, 2), (2, 2)]
  path = kmeans.product_assign(x, cents)[:, 0]
  # Same grouping as the planted (i, j) pairs, and each level alone matches its labels.
  assert _same_partition(path, ij[:, 0] * 2 + ij[:, 1])
  assert _same_partition(path // 2, ij[:, 0]) and _same_partition(path % 2, ij[:, 1])


@pytest.mark.parametrize("top_k", [1, 4, 60])
def test_product_top_k_exact_by_brute_force(top_k):
  rng = np.random.default_rng(2)
  grid = (4, 5, 3)
  cents = [rng.normal(size=(k, 2)).astype(np.float32) for k in grid]
  x = rng.normal(size=(40, 6)).astype(np.float32)
  # All 60 full centroids, enumerated in itertools.product order = row-major path ids.
  full = np.array(
    [
      np.concatenate([cents[l][i] for l, i in enumerate(t)])
      for t in itertools.product(*map(range, grid))
    ]
  )
  d = ((x[:, None] - full[None]) ** 2).sum(-1)
  want = np.argsort(d, axis=1)[:, :top_k]
  np.testing.assert_array_equal(kmeans.product_assign(x, cents, top_k, batch_size=16), want)


def test_bad_inputs():
  x, _ = _planted(n_per=2)
  with pytest.raises(ValueError, match="1 <= k <= N"):
    kmeans.fit_kmeans(x, 9)
  x_nan = x.copy()
  x_nan[5, 2] = np.nan
  with pytest.raises(ValueError, match="first at row 5"):
    kmeans.fit_kmeans(x_nan, 2)
  with pytest.raises(ValueError, match="first at row 5"):
    kmeans.assign(x_nan, _CENTRES, batch_size=4)
  with pytest.raises(ValueError, match="top_k"):
    kmeans.assign(x, _CENTRES, top_k=0)
  with pytest.raises(ValueError, match="top_k"):
    kmeans.assign(x, _CENTRES, top_k=5)
  with pytest.raises(ValueError, match="dimension 5 but 6"):
    kmeans.assign(x[:, :5], _CENTRES)
  with pytest.raises(ValueError, match="empty"):
    kmeans.assign(x[:0], _CENTRES)
