"""Tests for the saved Router (dipaco_jax/routing/router.py)."""

import json
import os

import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax.routing import discriminative
from dipaco_jax.routing import kmeans
from dipaco_jax.routing import router as router_lib

import helpers

_GRID = (2, 3)  # P = 6 paths.


def _data(n=120, d=6, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  scores = x @ rng.normal(size=(d, 6)) + 0.1 * rng.normal(size=(n, 6))
  return x, scores


@pytest.fixture(scope="module")
def routers():
  x, scores = _data()
  return x, {
    "kmeans": router_lib.fit_kmeans_router(x, _GRID, restarts=2, seed=0),
    "product_kmeans": router_lib.fit_product_kmeans_router(x, _GRID, restarts=2, seed=0),
    "linear": router_lib.fit_linear_router(x, scores, _GRID, steps=200),
  }


def test_each_kind_routes_like_its_underlying_function(routers):
  x, rs = routers
  r = rs["kmeans"]
  np.testing.assert_array_equal(r.route(x, 2), kmeans.assign(x, r.arrays["centroids"], 2))
  r = rs["product_kmeans"]
  cents = [r.arrays["centroids_0"], r.arrays["centroids_1"]]
  # Level 0 clusters the first 3 dims into 2, level 1 the last 3 into 3.
  assert [c.shape for c in cents] == [(2, 3), (3, 3)]
  np.testing.assert_array_equal(r.route(x, 3), kmeans.product_assign(x, cents, 3))
  r = rs["linear"]
  np.testing.assert_array_equal(
    r.route(x)[:, 0], discriminative.linear_logits(x, r.arrays).argmax(1)
  )
  for r in rs.values():
    assert r.num_paths == 6 and r.feature_dim == 6
    ids = r.route(x, 6)
    assert ids.shape == (120, 6) and ids.dtype == np.int32
    # Top-P is a permutation of all paths for every document.
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.tile(np.arange(6), (120, 1)))


def test_linear_router_leaves_no_path_empty(routers):
  x, rs = routers
  assert (np.bincount(rs["linear"].route(x)[:, 0], minlength=6) > 0).all()
  assert rs["linear"].info["empty"] == 0 and rs["linear"].info["target"] == "labels"


@pytest.mark.parametrize("kind", router_lib.KINDS)
def test_save_load_round_trip(routers, tmp_path, kind):
  x, rs = routers
  r = rs[kind]
  r.save(str(tmp_path))
  back = router_lib.Router.load(str(tmp_path), grid=_GRID, num_paths=6, feature_dim=6)
  assert (back.kind, back.grid, back.info) == (r.kind, r.grid, r.info)
  assert back.arrays.keys() == r.arrays.keys()
  for k in r.arrays:
    np.testing.assert_array_equal(back.arrays[k], r.arrays[k])
  np.testing.assert_array_equal(back.route(x, 2), r.route(x, 2))
  meta = json.loads((tmp_path / router_lib.META_FILE).read_text())
  assert meta["grid"] == [2, 3] and meta["num_paths"] == 6 and meta["feature_dim"] == 6


def test_save_refuses_to_overwrite(routers, tmp_path):
  _, rs = routers
  rs["kmeans"].save(str(tmp_path))
  with pytest.raises(FileExistsError, match="already saved"):
    rs["linear"].save(str(tmp_path))
  assert router_lib.Router.load(str(tmp_path)).kind == "kmeans"  # Untouched.
  rs["linear"].save(str(tmp_path), overwrite=True)
  assert router_lib.Router.load(str(tmp_path)).kind == "linear"
  assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.95])
@pytest.mark.parametrize("name", [router_lib.ARRAYS_FILE, router_lib.META_FILE])
@pytest.mark.parametrize("kind", ["kmeans", "linear"])
def test_a_truncated_router_file_gives_one_line_naming_it(routers, tmp_path, kind, name, keep):
  d = str(tmp_path / "phase_1")
  routers[1][kind].save(d)
  helpers.truncate(os.path.join(d, name), keep)
  before = helpers.tree_bytes(tmp_path)
  with pytest.raises(errors.DamagedFileError) as e:
    router_lib.Router.load(d)
  msg = str(e.value)
  assert "\n" not in msg, msg
  assert msg.startswith(f"router file {os.path.join(d, name)} is damaged ("), msg
  assert f"; move {d} aside (mv {d} {d}.damaged) and rerun to fit it again" in msg, msg
  assert helpers.tree_bytes(tmp_path) == before  # Nothing deleted or rewritten.


def test_load_router_from_another_grid(routers, tmp_path):
  _, rs = routers
  rs["product_kmeans"].save(str(tmp_path))
  with pytest.raises(ValueError, match="router from another grid") as e:
    router_lib.Router.load(str(tmp_path), grid=(3, 2))
  # Names both shapes and how to fix it.
  assert "grid 2x3" in str(e.value) and "grid 3x2" in str(e.value)
  assert "refit" in str(e.value)
  with pytest.raises(ValueError, match="6 paths.*expects 4 paths"):
    router_lib.Router.load(str(tmp_path), num_paths=4)
  with pytest.raises(ValueError, match="feature dim 6.*expects feature dim 8"):
    router_lib.Router.load(str(tmp_path), feature_dim=8)
  with pytest.raises(FileNotFoundError, match="no saved router"):
    router_lib.Router.load(str(tmp_path / "nowhere"))


def test_route_rejects_bad_input(routers):
  x, rs = routers
  for r in rs.values():
    with pytest.raises(ValueError, match="dimension 5 but 6"):
      r.route(x[:, :5])
    with pytest.raises(ValueError, match="empty"):
      r.route(x[:0])
    with pytest.raises(ValueError, match="top_k"):
      r.route(x, 0)
    with pytest.raises(ValueError, match="top_k"):
      r.route(x, 7)
    bad = x.copy()
    bad[17, 0] = np.nan
    with pytest.raises(ValueError, match="first at row 17"):
      r.route(bad, batch_size=16)


def test_constructor_and_fit_checks():
  with pytest.raises(ValueError, match="kind"):
    router_lib.Router("moe", _GRID, {})
  with pytest.raises(ValueError, match="needs arrays"):
    router_lib.Router("kmeans", _GRID, {"centroids": np.zeros((4, 3))})  # 4 != 2*3 paths.
  x, scores = _data(n=20)
  with pytest.raises(ValueError, match="scores have 6 paths but grid 4x4"):
    router_lib.fit_linear_router(x, scores, (4, 4))


def _two_clusters():
  """90 documents at x = 0, 0.01, .., 0.89 and 10 at x = 10.0 .. 10.09 (second feature 0)."""
  x = np.concatenate([np.arange(90) * 0.01, 10.0 + np.arange(10) * 0.01])
  return np.stack([x, np.zeros_like(x)], axis=1).astype(np.float32)


def test_balanced_kmeans_floors_the_small_cluster_with_its_nearest_documents(tmp_path):
  x = _two_clusters()
  plain = router_lib.fit_kmeans_router(x, (2,), restarts=2)
  assert "bias" not in plain.arrays
  small = int(np.argmax(plain.arrays["centroids"][:, 0]))  # The cluster at 10.
  assert plain.info["docs_min"] == 10 and plain.info["moved_off_label"] == 0.0
  # min_share 0.5 floors each share at 0.5 / 2 = 25% of the documents: 25 for the small
  # cluster, within the calibration's tolerance (sizes +1 within a factor 1.1 of 26).
  r = router_lib.fit_kmeans_router(x, (2,), restarts=2, min_share=0.5)
  ids = r.route(x)[:, 0]
  n_small = int((ids == small).sum())
  assert np.log(26 / 1.1) <= np.log(n_small + 1) <= np.log(26 * 1.1)
  # It gains the large cluster's documents nearest to it: the top n_small - 10 by x.
  moved = np.flatnonzero(ids[:90] == small)
  np.testing.assert_array_equal(moved, np.arange(90 - len(moved), 90))
  assert (ids[90:] == small).all()
  assert r.info["docs_min"] == n_small and r.info["docs_max"] == 100 - n_small
  assert r.info["moved_off_label"] == pytest.approx(len(moved) / 100)
  assert r.info["min_share"] == 0.5
  assert (r.info["argmin_docs_min"], r.info["argmin_docs_max"]) == (10, 90)
  # The bias is saved with the centroids and routes the same after a reload.
  r.save(str(tmp_path / "r"))
  back = router_lib.Router.load(str(tmp_path / "r"), grid=(2,))
  np.testing.assert_array_equal(back.route(x), r.route(x))


def test_balanced_kmeans_without_a_small_cluster_is_the_plain_router():
  x = np.zeros((100, 2), np.float32)
  x[:, 0] = np.arange(100) * 0.01 + np.repeat([0.0, 10.0], 50)  # Two clusters of 50.
  r = router_lib.fit_kmeans_router(x, (2,), restarts=2, min_share=0.5)
  assert "bias" not in r.arrays and r.info["docs_min"] == 50
