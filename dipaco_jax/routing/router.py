"""The saved document router: features [N, D] -> path ids [N, top_k] (paper §2.4).

Three kinds share one object, one `route` and one on-disk format:
  kmeans          centroids [P, D]; path id = cluster id (P = prod(grid)); a balanced
                  router (fit_kmeans_router's min_share) also holds bias [P], subtracted
                  from each cluster's squared distance.
  product_kmeans  centroids_l [K_l, D_l] on contiguous feature slices; path id
                  is (i_1..i_L) flattened row-major, i.e. i_1*K_2 + i_2 for 2 levels.
  linear          logistic regression w [D, P], calibrated bias b [P], and the
                  feature standardisation mean [D], std [D].
On disk: `router.npz` (the arrays) + `router.json` (kind, grid, dims, fit info).
"""

import dataclasses
import math
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from dipaco_jax import errors
from dipaco_jax.io import files
from dipaco_jax.routing import discriminative
from dipaco_jax.routing import kmeans

KINDS = ("kmeans", "product_kmeans", "linear")
ARRAYS_FILE = "router.npz"
META_FILE = "router.json"
_FORMAT_VERSION = 1


def _grid_str(grid: Sequence[int]) -> str:
  return "x".join(str(k) for k in grid)


def _expected_shapes(
  kind: str, grid: tuple[int, ...], dim: int, biased: bool = False
) -> dict[str, tuple[int, ...]]:
  """Array names and shapes a router of this kind, grid and feature dim must hold."""
  p = math.prod(grid)
  if kind == "kmeans":
    return {"centroids": (p, dim), **({"bias": (p,)} if biased else {})}
  if kind == "product_kmeans":
    return {
      f"centroids_{l}": (k, hi - lo)
      for l, (k, (lo, hi)) in enumerate(zip(grid, kmeans.split_dims(dim, len(grid))))
    }
  return {"w": (dim, p), "b": (p,), "mean": (dim,), "std": (dim,)}


def _feature_dim(kind: str, arrays: dict[str, np.ndarray]) -> int:
  """D read off the arrays (0 when they are malformed; the shape check then names them)."""
  if kind == "linear":
    w = arrays.get("w")
    return w.shape[0] if w is not None and w.ndim == 2 else 0
  return sum(v.shape[1] for v in arrays.values() if v.ndim == 2)


@dataclasses.dataclass(frozen=True, eq=False)  # Arrays make == ambiguous; compare fields.
class Router:
  """A fitted router; `info` holds JSON-able fit diagnostics saved alongside."""

  kind: str
  grid: tuple[int, ...]
  arrays: dict[str, np.ndarray]
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"router kind must be one of {KINDS}; got {self.kind!r}.")
    grid = tuple(int(k) for k in self.grid)
    if not grid or min(grid) < 1:
      raise ValueError(f"grid must be a non-empty tuple of module counts >= 1; got {self.grid}.")
    object.__setattr__(self, "grid", grid)
    arrays = {k: np.asarray(v, np.float32) for k, v in self.arrays.items()}
    object.__setattr__(self, "arrays", arrays)
    dim = _feature_dim(self.kind, arrays)
    biased = self.kind == "kmeans" and "bias" in arrays
    want = _expected_shapes(self.kind, grid, dim, biased) if dim else "a feature dim >= 1"
    got = {k: v.shape for k, v in arrays.items()}
    if got != want:
      raise ValueError(
        f"a {self.kind} router for grid {_grid_str(grid)} needs arrays {want}; "
        f"got {got}. Build it with the fit_*_router functions."
      )
    for k, v in arrays.items():
      kmeans.check_finite(v.reshape(v.shape[0], -1), name=f"router array {k!r}")

  @property
  def num_paths(self) -> int:
    return math.prod(self.grid)

  @property
  def feature_dim(self) -> int:
    return _feature_dim(self.kind, self.arrays)

  def describe(self) -> str:
    return (
      f"{self.kind} router for grid {_grid_str(self.grid)} ({self.num_paths} paths, "
      f"feature dim {self.feature_dim})"
    )

  def route(
    self, x_NxD, top_k: int = 1, *, batch_size: int = kmeans.DEFAULT_BATCH_SIZE
  ) -> np.ndarray:
    """Top_k path ids per document, best first -> int32 [N, top_k]."""
    kmeans.check_features(x_NxD, self.feature_dim)
    kmeans.check_top_k(top_k, self.num_paths)
    if self.kind == "kmeans":
      c_PxD, b_P = self.arrays["centroids"], self.arrays.get("bias")
      return kmeans.assign(x_NxD, c_PxD, top_k, bias_K=b_P, batch_size=batch_size)
    if self.kind == "product_kmeans":
      cents = [self.arrays[f"centroids_{l}"] for l in range(len(self.grid))]
      return kmeans.product_assign(x_NxD, cents, top_k, batch_size=batch_size)
    return discriminative.predict_top_k(x_NxD, self.arrays, top_k, batch_size=batch_size)

  def check_matches(
    self,
    *,
    grid: Sequence[int] | None = None,
    num_paths: int | None = None,
    feature_dim: int | None = None,
    source: str = "this router",
  ) -> None:
    """Raises ValueError ('router from another grid') unless grid / P / D match."""
    bad = (
      (grid is not None and tuple(grid) != self.grid)
      or (num_paths is not None and num_paths != self.num_paths)
      or (feature_dim is not None and feature_dim != self.feature_dim)
    )
    if bad:
      want = ", ".join(
        s
        for s in (
          grid is not None and f"grid {_grid_str(grid)}",
          num_paths is not None and f"{num_paths} paths",
          feature_dim is not None and f"feature dim {feature_dim}",
        )
        if s
      )
      raise ValueError(
        f"router from another grid: {source} is a {self.describe()}, but this run "
        f"expects {want}. Point the run at the router fitted for this grid and "
        "base model, or refit one (fit_*_router) on this run's router features."
      )

  def save(self, directory: str, *, overwrite: bool = False) -> None:
    """Writes router.npz + router.json into directory (refuses to replace unless overwrite)."""
    paths = [files.path(directory) / f for f in (ARRAYS_FILE, META_FILE)]
    if not overwrite and any(p.exists() for p in paths):
      raise FileExistsError(
        f"a router is already saved in {directory}; pick a new directory or pass overwrite=True."
      )
    meta = {
      "format_version": _FORMAT_VERSION,
      "kind": self.kind,
      "grid": list(self.grid),
      "num_paths": self.num_paths,
      "feature_dim": self.feature_dim,
      "arrays": {k: list(v.shape) for k, v in self.arrays.items()},
      "info": self.info,
    }
    # Each file is written whole, the metadata last (and an old one removed first): a reader
    # (`exists`, `load`) sees a whole router or none, never new arrays under old metadata.
    paths[1].unlink(missing_ok=True)
    files.write_npz(paths[0], self.arrays)
    files.write_json(paths[1], meta)

  @staticmethod
  def exists(directory: str) -> bool:
    """Whether `directory` holds a saved router (its metadata is written last)."""
    return (files.path(directory) / META_FILE).exists()

  @classmethod
  def load(
    cls,
    directory: str,
    *,
    grid: Sequence[int] | None = None,
    num_paths: int | None = None,
    feature_dim: int | None = None,
  ) -> "Router":
    """Reads a saved router; checks it against the expected grid / P / D when given."""
    paths = [files.path(directory) / f for f in (ARRAYS_FILE, META_FILE)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
      raise FileNotFoundError(
        f"no saved router in {directory} (missing {missing}); fit one "
        "with a fit_*_router function and Router.save it there."
      )
    try:
      meta = files.read_json(paths[1])
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
      raise _damaged(paths[1], errors.json_problem(e)) from e
    if not isinstance(meta, dict) or meta.get("format_version") != _FORMAT_VERSION:
      found = meta.get("format_version") if isinstance(meta, dict) else None
      raise _damaged(paths[1], f"router format {found}, this code reads {_FORMAT_VERSION}")
    try:
      arrays = files.read_npz(paths[0])
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:  # What a cut zip raises.
      raise _damaged(paths[0], str(e) or type(e).__name__) from e
    try:
      router = cls(meta["kind"], tuple(meta["grid"]), arrays, meta.get("info", {}))
      shape = (router.feature_dim, router.num_paths)
      said = (meta["feature_dim"], meta["num_paths"])
    except (KeyError, TypeError, ValueError, IndexError) as e:  # A field or array gone or wrong.
      raise _damaged(paths[1], f"{META_FILE} and {ARRAYS_FILE} do not fit: {e!r}") from e
    if shape != said:
      raise _damaged(
        paths[1],
        f"it says {said[0]} features and {said[1]} paths, {ARRAYS_FILE} holds "
        f"{shape[0]} and {shape[1]}",
      )
    router.check_matches(
      grid=grid, num_paths=num_paths, feature_dim=feature_dim, source=f"the router in {directory}"
    )
    return router


def _damaged(path, reason: str) -> errors.DamagedFileError:
  directory = files.path(path).parent
  return errors.DamagedFileError(
    f"router file {path} is damaged ({reason}); move {directory} aside (mv {directory} "
    f"{directory}.damaged) and rerun to fit it again (a discriminative phase's router is "
    "refitted only when the run resumes from before its re-shard)."
  )


def _json_info(**info) -> dict[str, Any]:
  return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in info.items()}


def shard_sizes_info(counts_P, moved_off: float) -> dict[str, Any]:
  """Documents per path on the router split (min/median/max) and the share moved off argmin."""
  c_P = np.asarray(counts_P)
  return _json_info(
    docs_min=int(c_P.min()),
    docs_median=float(np.median(c_P)),
    docs_max=int(c_P.max()),
    moved_off_label=float(moved_off),
  )


def _argmin_sizes(labels_N, num_paths: int) -> dict[str, Any]:
  """Documents per path before any balancing (the argmin / best-path labels): min/median/max."""
  c_P = np.bincount(np.asarray(labels_N), minlength=num_paths)
  return _json_info(
    argmin_docs_min=int(c_P.min()),
    argmin_docs_median=float(np.median(c_P)),
    argmin_docs_max=int(c_P.max()),
  )


def balance_bias(x_NxD, c_PxD, min_share: float, *, tol: float = 0.1, weights_N=None) -> np.ndarray:
  """Bias [P] (squared-distance units) that floors every cluster's share at min_share / P.

  Shares count documents, or with `weights_N` (tokens per document) what the paths
  train on. The shares to match are the nearest-centroid ones with that floor
  (discriminative.target_distribution, water-filling), calibrated as the
  discriminative router's bias (discriminative.calibrate_bias) on the negative
  squared distances, divided by the median gap between each document's nearest
  and second-nearest centroid so that the calibration's steps are O(1).
  """
  x_NxD = np.asarray(x_NxD, np.float32)
  mean_D = x_NxD.mean(axis=0)  # Centred as in the fit: ||x||^2 - 2x.c + ||c||^2 stays accurate.
  d_NxP = np.asarray(kmeans.sq_dists(x_NxD - mean_D, np.asarray(c_PxD, np.float32) - mean_D))
  p = d_NxP.shape[1]
  if p == 1:
    return np.zeros(1, np.float32)
  two_NxK = np.sort(d_NxP, axis=1)[:, :2]
  gap = float(np.median(two_NxK[:, 1] - two_NxK[:, 0]))
  scale = gap if gap > 0 else 1.0
  t_P = discriminative.target_distribution(
    "labels", np.argmin(d_NxP, axis=1), p, min_share=min_share, weights_N=weights_N
  )
  b_P, _ = discriminative.calibrate_bias(-d_NxP / scale, t_P, tol=tol, weights_N=weights_N)
  return (b_P * scale).astype(np.float32)


def fit_kmeans_router(
  x_NxD,
  grid: Sequence[int],
  *,
  restarts: int = 4,
  iters: int = 100,
  tol: float = 1e-4,
  seed: int = 0,
  min_share: float = 0.0,
  calibration: tuple[np.ndarray, np.ndarray | None] | None = None,
) -> Router:
  """k-means with prod(grid) clusters; cluster id = path id (§2.4.1).

  min_share > 0: a balanced router whose calibrated bias floors every path's share
  at min_share / P (see balance_bias); 0 = plain nearest centroid. The share is
  measured on `calibration` = (features [M, D], weights [M] or None), e.g. a
  sample of the training split weighted by tokens; None: x_NxD's documents.
  The info reports the shard sizes on x_NxD's documents, the share moved off the
  nearest centroid, and (calib_*) the sizes on the calibration documents.
  """
  c_PxD = kmeans.fit_kmeans(
    x_NxD, math.prod(grid), restarts=restarts, iters=iters, tol=tol, seed=seed
  )
  arrays = {"centroids": c_PxD}
  cx_MxD, cw_M = (x_NxD, None) if calibration is None else calibration
  kmeans.check_features(cx_MxD, c_PxD.shape[1], name="calibration features")
  if min_share > 0:
    b_P = balance_bias(cx_MxD, c_PxD, min_share, weights_N=cw_M)
    if b_P.any():  # No cluster under the floor: the plain router (and its shards) as is.
      arrays["bias"] = b_P
  nearest_N = kmeans.assign(x_NxD, c_PxD)[:, 0]
  router = Router("kmeans", tuple(grid), arrays)
  routed_N = router.route(x_NxD)[:, 0]  # What the saved router does (float32, batched).
  counts_P = np.bincount(routed_N, minlength=router.num_paths)
  router.info.update(
    _json_info(
      inertia=kmeans.inertia(x_NxD, c_PxD), num_docs=len(x_NxD), seed=seed, min_share=min_share
    ),
    **shard_sizes_info(counts_P, np.mean(routed_N != nearest_N)),
    **_argmin_sizes(nearest_N, router.num_paths),
  )
  if calibration is not None:
    w_M = discriminative.check_weights(cw_M, cx_MxD.shape[0])
    calib_P = np.bincount(router.route(cx_MxD)[:, 0], weights=w_M, minlength=router.num_paths)
    router.info.update(
      _json_info(calib_docs=len(cx_MxD), **discriminative.calibration_sizes(calib_P))
    )
  return router


def fit_product_kmeans_router(
  x_NxD,
  grid: Sequence[int],
  *,
  restarts: int = 4,
  iters: int = 100,
  tol: float = 1e-4,
  seed: int = 0,
) -> Router:
  """One k-means of K_l clusters per contiguous feature slice l (§7.3)."""
  cents = kmeans.fit_product_kmeans(x_NxD, grid, restarts=restarts, iters=iters, tol=tol, seed=seed)
  info = _json_info(num_docs=len(x_NxD), seed=seed)
  return Router(
    "product_kmeans", tuple(grid), {f"centroids_{l}": c for l, c in enumerate(cents)}, info
  )


def fit_linear_router(
  x_NxD,
  scores_NxP,
  grid: Sequence[int],
  *,
  target: str | Sequence[float] = "labels",
  tol: float = 0.02,
  **fit_kwargs,
) -> Router:
  """Discriminative router from per-path scores (§2.4.2); see discriminative.fit_discriminative."""
  if scores_NxP.shape[-1] != math.prod(grid):
    raise ValueError(
      f"scores have {scores_NxP.shape[-1]} paths but grid {_grid_str(grid)} has "
      f"{math.prod(grid)}; score every path of this grid."
    )
  params, info = discriminative.fit_discriminative(
    x_NxD, scores_NxP, target=target, tol=tol, **fit_kwargs
  )
  target_name = target if isinstance(target, str) else "given"
  return Router(
    "linear", tuple(grid), params, _json_info(num_docs=len(x_NxD), target=target_name, **info)
  )
