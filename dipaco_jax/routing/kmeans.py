"""k-means and product k-means on router features (paper §2.4.1 and §7.3).

Fitting runs on the router split (in memory, one jitted program per restart);
assignment streams any number of rows through one jitted batch function.

Empty clusters: after each Lloyd update, a cluster that received no point is
re-seeded at the point farthest from its current centroid (the j-th empty
cluster takes the j-th farthest point), so k clusters stay in use.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.io import progress

DEFAULT_BATCH_SIZE = 8192  # Rows per assignment batch: bounds memory to batch x K floats.


def check_features(x_NxD, dim: int | None = None, name: str = "features") -> None:
  """Raises ValueError unless x is a non-empty [N, D] array (with D == dim when given)."""
  shape = getattr(x_NxD, "shape", None)
  if shape is None or len(shape) != 2:
    raise ValueError(
      f"{name} must be a 2-D array [N, D]; got shape {shape}. "
      "Stack one feature vector per document."
    )
  if shape[0] == 0:
    raise ValueError(f"{name} is empty (shape {tuple(shape)}); pass at least one document.")
  if dim is not None and shape[1] != dim:
    raise ValueError(
      f"{name} have dimension {shape[1]} but {dim} is expected; extract "
      "features with the same base model the router was fitted on."
    )


def check_finite(x, name: str = "features", offset: int = 0) -> None:
  """Raises ValueError naming the first row holding a NaN or inf."""
  bad = ~np.isfinite(np.asarray(x))
  if bad.any():
    rows = np.nonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0]
    raise ValueError(
      f"{name} hold NaN/inf in {rows.size} row(s), first at row "
      f"{int(rows[0]) + offset}; fix or drop those documents before routing."
    )


def check_top_k(top_k: int, num_choices: int) -> None:
  """Raises ValueError unless 1 <= top_k <= num_choices."""
  if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= num_choices:
    raise ValueError(f"top_k must be an integer in [1, {num_choices}]; got {top_k!r}.")


def sq_dists(x_NxD: jax.Array, c_KxD: jax.Array) -> jax.Array:
  """Squared Euclidean distances [N, K], clamped at 0 against rounding."""
  d_NxK = (
    jnp.sum(x_NxD**2, axis=1, keepdims=True)
    - 2.0 * x_NxD @ c_KxD.T
    + jnp.sum(c_KxD**2, axis=1)[None, :]
  )
  return jnp.maximum(d_NxK, 0.0)


def stream_batches(
  fn: Callable[[jax.Array], jax.Array], x_NxD, batch_size: int, name: str = "features"
) -> np.ndarray:
  """Applies a row-wise jitted fn batch by batch (last batch padded: one compile)."""
  n = x_NxD.shape[0]
  bs = max(1, min(batch_size, n))
  outs = []
  for start in range(0, n, bs):
    xb = np.asarray(x_NxD[start : start + bs], dtype=np.float32)
    check_finite(xb, name, offset=start)
    m = xb.shape[0]
    if m < bs:
      xb = np.concatenate([xb, np.zeros((bs - m, xb.shape[1]), np.float32)])
    # np.asarray blocks on the result, so dispatch never runs far ahead.
    outs.append(np.asarray(fn(jnp.asarray(xb)))[:m])
  return np.concatenate(outs)


def _kmeanspp(key: jax.Array, x_NxD: jax.Array, k: int) -> jax.Array:
  """k-means++ seeding: each next centroid drawn with prob. ∝ squared distance."""
  key, sub = jax.random.split(key)
  first = jax.random.randint(sub, (), 0, x_NxD.shape[0])
  c_KxD = jnp.zeros((k, x_NxD.shape[1]), x_NxD.dtype).at[0].set(x_NxD[first])
  mind_N = jnp.sum((x_NxD - x_NxD[first]) ** 2, axis=1)

  def body(j, carry):
    c_KxD, mind_N, key = carry
    key, sub = jax.random.split(key)
    # All points already on a centroid (fewer distinct points than k): draw uniformly.
    logits_N = jnp.where(mind_N.sum() > 0, jnp.log(mind_N), 0.0)
    idx = jax.random.categorical(sub, logits_N)
    c_KxD = c_KxD.at[j].set(x_NxD[idx])
    mind_N = jnp.minimum(mind_N, jnp.sum((x_NxD - x_NxD[idx]) ** 2, axis=1))
    return c_KxD, mind_N, key

  c_KxD, _, _ = jax.lax.fori_loop(1, k, body, (c_KxD, mind_N, key))
  return c_KxD


def _lloyd_step(x_NxD: jax.Array, c_KxD: jax.Array) -> jax.Array:
  """One Lloyd update; empty clusters move to the farthest points (see module doc)."""
  k = c_KxD.shape[0]
  d_NxK = sq_dists(x_NxD, c_KxD)
  label_N = jnp.argmin(d_NxK, axis=1)
  mind_N = jnp.min(d_NxK, axis=1)
  sums_KxD = jax.ops.segment_sum(x_NxD, label_N, num_segments=k)
  count_K = jax.ops.segment_sum(jnp.ones_like(mind_N), label_N, num_segments=k)
  mean_KxD = sums_KxD / jnp.maximum(count_K, 1.0)[:, None]
  empty_K = count_K == 0
  rank_K = jnp.cumsum(empty_K) - 1  # j-th empty cluster -> j-th farthest point.
  _, far_K = jax.lax.top_k(mind_N, k)
  reseed_KxD = x_NxD[far_K[jnp.maximum(rank_K, 0)]]
  return jnp.where(empty_K[:, None], reseed_KxD, mean_KxD)


def _inertia(x_NxD: jax.Array, c_KxD: jax.Array) -> jax.Array:
  return jnp.sum(jnp.min(sq_dists(x_NxD, c_KxD), axis=1))


@functools.partial(jax.jit, static_argnames=("k", "iters"))
def _one_run(key, x_NxD, tol, *, k: int, iters: int):
  """One k-means++ + Lloyd run; returns (centroids, inertia)."""
  # Stop when the summed squared centroid shift falls under tol x mean feature variance.
  tol_abs = tol * jnp.mean(jnp.var(x_NxD, axis=0))
  c_KxD = _kmeanspp(key, x_NxD, k)

  def cond(state):
    i, _, shift = state
    return (i < iters) & (shift > tol_abs)

  def body(state):
    i, c_KxD, _ = state
    new_KxD = _lloyd_step(x_NxD, c_KxD)
    return i + 1, new_KxD, jnp.sum((new_KxD - c_KxD) ** 2)

  _, c_KxD, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), c_KxD, jnp.float32(jnp.inf)))
  return c_KxD, _inertia(x_NxD, c_KxD)


def _fit(key, x_NxD, tol, *, k: int, restarts: int, iters: int, bar=None):
  """Best of `restarts` runs (the first on ties); returns (centroids, inertia).

  Restarts run one after another (memory stays at one N x K matrix), one
  jitted program each, so `bar` (a progress bar) advances once per restart.
  """
  best = None
  for key_r in jax.random.split(key, restarts):
    c_KxD, inertia_r = _one_run(key_r, x_NxD, tol, k=k, iters=iters)
    inertia_r = float(inertia_r)  # Blocks: one restart in flight at a time.
    if best is None or inertia_r < best[1]:
      best = (c_KxD, inertia_r)
    if bar is not None:
      bar.update(1)
  return best


def _fit_key(
  key: jax.Array, x_NxD, k: int, restarts: int, iters: int, tol: float, bar=None
) -> tuple[np.ndarray, float]:
  check_features(x_NxD)
  check_finite(x_NxD)
  if not 1 <= k <= x_NxD.shape[0]:
    raise ValueError(
      f"k-means needs 1 <= k <= N; got k={k} for N={x_NxD.shape[0]} documents. "
      "Use fewer clusters or more router data."
    )
  if restarts < 1 or iters < 0:
    raise ValueError(f"need restarts >= 1 and iters >= 0; got {restarts}, {iters}.")
  x_NxD = np.asarray(x_NxD, np.float32)
  # Centering first keeps ||x||^2 - 2x.c + ||c||^2 accurate in float32.
  mean_D = x_NxD.mean(axis=0)
  c_KxD, inertia = _fit(
    key,
    jnp.asarray(x_NxD - mean_D),
    jnp.float32(tol),
    k=k,
    restarts=restarts,
    iters=iters,
    bar=bar,
  )
  return np.asarray(c_KxD) + mean_D, float(inertia)


def fit_kmeans(
  x_NxD, k: int, *, restarts: int = 4, iters: int = 100, tol: float = 1e-4, seed: int = 0
) -> np.ndarray:
  """k-means++ + Lloyd, best inertia over restarts; deterministic in seed -> [K, D]."""
  with progress.bar(total=restarts, desc=f"k-means ({k} clusters)", unit="restart") as bar:
    return _fit_key(jax.random.PRNGKey(seed), x_NxD, k, restarts, iters, tol, bar)[0]


def inertia(x_NxD, c_KxD) -> float:
  """Sum over documents of the squared distance to the nearest centroid."""
  return float(_inertia(jnp.asarray(x_NxD, jnp.float32), jnp.asarray(c_KxD, jnp.float32)))


@functools.partial(jax.jit, static_argnames=("top_k",))
def _nearest(x_NxD, c_KxD, bias_K, *, top_k: int):
  return jax.lax.top_k(bias_K - sq_dists(x_NxD, c_KxD), top_k)[1]


def assign(
  x_NxD,
  centroids_KxD,
  top_k: int = 1,
  *,
  bias_K=None,
  batch_size: int = DEFAULT_BATCH_SIZE,
) -> np.ndarray:
  """Ids of the top_k nearest centroids, nearest first -> int32 [N, top_k].

  bias_K (squared-distance units) is subtracted from each cluster's distance: a
  balanced router's calibrated shift (router.fit_kmeans_router's min_share).
  """
  check_features(x_NxD, centroids_KxD.shape[1])
  check_top_k(top_k, centroids_KxD.shape[0])
  c_KxD = jnp.asarray(centroids_KxD, jnp.float32)
  b_K = jnp.zeros(c_KxD.shape[0]) if bias_K is None else jnp.asarray(bias_K, jnp.float32)
  fn = lambda xb: _nearest(xb, c_KxD, b_K, top_k=top_k)
  return stream_batches(fn, x_NxD, batch_size).astype(np.int32)


# --- Product k-means: one k-means per contiguous slice of the features. ---


def split_dims(dim: int, levels: int) -> list[tuple[int, int]]:
  """Contiguous [lo, hi) slices, one per level; earlier slices get the remainder."""
  if not 1 <= levels <= dim:
    raise ValueError(f"cannot split {dim} feature dims into {levels} levels.")
  sizes = [dim // levels + (l < dim % levels) for l in range(levels)]
  bounds = np.cumsum([0] + sizes)
  return [(int(bounds[l]), int(bounds[l + 1])) for l in range(levels)]


def fit_product_kmeans(
  x_NxD,
  grid: Sequence[int],
  *,
  restarts: int = 4,
  iters: int = 100,
  tol: float = 1e-4,
  seed: int = 0,
) -> list[np.ndarray]:
  """k-means with K_l clusters on feature slice l -> list of [K_l, D_l] centroids."""
  check_features(x_NxD)
  key = jax.random.PRNGKey(seed)
  out = []
  desc = f"product k-means ({'x'.join(str(k) for k in grid)} clusters)"
  with progress.bar(total=restarts * len(grid), desc=desc, unit="restart") as bar:
    for l, ((lo, hi), k) in enumerate(zip(split_dims(x_NxD.shape[1], len(grid)), grid)):
      sub = jax.random.fold_in(key, l)  # Independent, reproducible stream per level.
      x_l = np.asarray(x_NxD)[:, lo:hi]
      out.append(_fit_key(sub, x_l, int(k), restarts, iters, tol, bar)[0])
  return out


@functools.partial(jax.jit, static_argnames=("top_k",))
def _product_nearest(x_NxD, cents: tuple[jax.Array, ...], *, top_k: int):
  """Exact top_k paths by summed squared distance, path ids in row-major order.

  A prefix (i_1..i_l) of a top-k path is among the top-k prefixes by partial
  distance (otherwise k better prefixes with the same suffix would beat it), so
  pruning to k candidates after each level, and to the k nearest centroids
  within each level, loses nothing: cost N x k x k per level, not N x prod K.
  """
  n = x_NxD.shape[0]
  dist_NxM = jnp.zeros((n, 1), x_NxD.dtype)
  path_NxM = jnp.zeros((n, 1), jnp.int32)
  lo = 0
  for c_KxE in cents:
    k_l, e = c_KxE.shape
    neg_NxJ, idx_NxJ = jax.lax.top_k(-sq_dists(x_NxD[:, lo : lo + e], c_KxE), min(top_k, k_l))
    lo += e
    dist_NxMJ = (dist_NxM[:, :, None] - neg_NxJ[:, None, :]).reshape(n, -1)
    path_NxMJ = (path_NxM[:, :, None] * k_l + idx_NxJ[:, None, :]).reshape(n, -1)
    neg_NxM, sel_NxM = jax.lax.top_k(-dist_NxMJ, min(top_k, dist_NxMJ.shape[1]))
    dist_NxM = -neg_NxM
    path_NxM = jnp.take_along_axis(path_NxMJ, sel_NxM, axis=1)
  return path_NxM


def product_assign(
  x_NxD, centroids: Sequence[np.ndarray], top_k: int = 1, *, batch_size: int = DEFAULT_BATCH_SIZE
) -> np.ndarray:
  """Top_k paths (i_1..i_L flattened row-major), nearest first -> int32 [N, top_k]."""
  dim = sum(c.shape[1] for c in centroids)
  check_features(x_NxD, dim)
  check_top_k(top_k, int(np.prod([c.shape[0] for c in centroids])))
  cents = tuple(jnp.asarray(c, jnp.float32) for c in centroids)
  fn = lambda xb: _product_nearest(xb, cents, top_k=top_k)
  return stream_batches(fn, x_NxD, batch_size).astype(np.int32)
