"""Phase-0 router, the discriminative schedule, saved routers (dipaco_jax/routing/phases.py)."""

import numpy as np
import pytest

from dipaco_jax import config_check
from dipaco_jax import data as data_lib
from dipaco_jax import errors
from dipaco_jax import routing
from dipaco_jax.core import topology
from dipaco_jax.routing import phases
from dipaco_jax.routing import router as router_lib

import helpers


def test_replica_shards_router_gives_each_worker_its_own_cluster():
  """DiLoCo non-i.i.d.: one path, 3 replicas, the k-means clusters are the workers' shards."""
  t = topology.build(("embed,block_0,block_1,head",), (1,), 2, replicas=3)
  rng = np.random.default_rng(0)
  centres = np.array([[9, 0], [0, 9], [-9, -9]], np.float32)
  x = (centres[np.arange(90) % 3] + rng.normal(size=(90, 2))).astype(np.float32)
  cfg = helpers.micro_config(**{"routing.router": "kmeans", "routing.replica_shards": "router"})
  assert phases.replicas_by_router(cfg, t)
  router = phases.fit_phase0(cfg, t, x)
  assert router.grid == (3,)
  pr = routing.PathRouter(t, router, by_worker=True)
  w = pr.workers(np.arange(90), x)[:, 0]
  # Each well-separated blob lands on exactly one worker, and each worker holds one blob.
  blob_of_worker = {int(wk): {int(i % 3) for i in np.flatnonzero(w == wk)} for wk in range(3)}
  assert sorted(len(v) for v in blob_of_worker.values()) == [1, 1, 1]
  assert set().union(*blob_of_worker.values()) == {0, 1, 2}
  np.testing.assert_array_equal(pr.paths(np.arange(90), x)[:, 0], np.zeros(90))
  # A path-grid router is refused where workers are routed, and vice versa.
  with pytest.raises(ValueError, match="router from another grid"):
    routing.PathRouter(t, router)
  cfg.routing.replica_shards = "cluster"
  with pytest.raises(ValueError, match="replica_shards='cluster'"):
    phases.replicas_by_router(cfg, t)
  cfg.routing.replica_shards = "router"
  cfg.dipaco.outer_steps, cfg.routing.discriminative_at_outer_step = 4, 2
  with pytest.raises(ValueError, match="phase 0 only"):
    phases.replicas_by_router(cfg, t)


@pytest.mark.parametrize(
  "at,phases,every,want",
  [
    (-1, 1, 1, []),
    (1, 1, 1, [1]),
    (1, 2, 2, [1, 3]),
    (0, 1, 1, "fit"),
    (2, 3, 1, "fit"),
    (1, 2, 0, "between"),
  ],
)
def test_discriminative_steps(at, phases, every, want):
  cfg = helpers.micro_config(**{"dipaco.outer_steps": 4})
  r = cfg.routing  # Set after load: load's config check would refuse the bad ones first.
  r.discriminative_at_outer_step, r.discriminative_phases, r.discriminative_every = (
    at,
    phases,
    every,
  )
  if isinstance(want, str):
    with pytest.raises(errors.ConfigError, match=want):
      routing.discriminative_steps(cfg)
    with pytest.raises(errors.ConfigError):
      config_check.validate(cfg, for_run=False)
  else:
    assert routing.discriminative_steps(cfg) == want


def test_unknown_router_kind_is_refused(tmp_path):
  with pytest.raises(errors.ConfigError, match="routing.router='hash'"):
    helpers.micro_config(**{"routing.router": "hash"})
  cfg = helpers.micro_config()
  cfg.routing.router = "hash"  # After load's check: the router refuses it itself.
  with pytest.raises(errors.ConfigError, match="routing.router='hash'"):
    routing.phase0_router(cfg, str(tmp_path), topology.from_config(cfg), None)


def test_a_saved_router_of_another_grid_is_refused(micro, tmp_path):
  cfg, ex = micro
  cfg = helpers.micro_config(**{"routing.router": "kmeans"})
  x = np.random.default_rng(0).normal(size=(40, ex.dim)).astype(np.float32)
  router_lib.fit_kmeans_router(x, (2, 3), restarts=1).save(routing.router_dir(str(tmp_path), 0))
  with pytest.raises(ValueError, match="router from another grid"):
    routing.phase0_router(cfg, str(tmp_path), topology.from_config(cfg), ex)


def test_balanced_kmeans_switch_reaches_the_fit_and_is_refused_for_product_kmeans(micro, tmp_path):
  _, ex = micro
  cfg = helpers.micro_config(**{"routing.router": "kmeans", "routing.kmeans_min_share": 0.5})
  t = topology.from_config(cfg)
  x = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
  assert phases.fit_phase0(cfg, t, x).info["min_share"] == 0.5
  # A saved router fitted with another min_share is refused, not silently reused.
  x = np.random.default_rng(0).normal(size=(40, ex.dim)).astype(np.float32)
  saved = router_lib.fit_kmeans_router(x, phases.phase0_grid(cfg, t), restarts=1)
  saved.info["features"] = ex.fingerprint
  saved.save(routing.router_dir(str(tmp_path), 0))
  with pytest.raises(errors.ConfigError, match="kmeans_min_share=0.5"):
    routing.phase0_router(cfg, str(tmp_path), t, ex)
  cfg.routing.router = "product_kmeans"
  with pytest.raises(errors.ConfigError, match="balances router='kmeans' only"):
    phases.phase0_grid(cfg, t)


@pytest.mark.slow  # ~15 s at load 2 (38 s at load 12): four passes over the embedded corpus.
def test_route_run_as_two_processes_writes_what_one_process_writes(tmp_path):
  cfg = helpers.micro_config(**{"data.subsample": 64})
  one = phases.route_run(cfg, str(tmp_path / "one"))
  two_dir = str(tmp_path / "two")
  said = phases.route_run(cfg, two_dir, process_index=1, num_processes=2)
  assert said.startswith("process 1 of 2: its part of ") and "process 0 joins" in said
  assert phases.route_run(cfg, two_dir, process_index=0, num_processes=2) == one  # the report
  a = data_lib.ShardSet(phases.shard_dir(cfg, str(tmp_path / "one"), 0))
  b = data_lib.ShardSet(phases.shard_dir(cfg, two_dir, 0))
  for split in ("train", "validation"):
    for w in range(a.num_workers):
      assert [d.doc_id for d in a.documents(w, split)] == [d.doc_id for d in b.documents(w, split)]
