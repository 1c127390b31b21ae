"""Every shipped config builds its grid and abstract state (no allocation) and its routing."""

import os

import jax
import numpy as np
import pytest

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax import routing
from dipaco_jax import train
from dipaco_jax.config import paper
from dipaco_jax.core import experiment
from dipaco_jax.core import sharding
from dipaco_jax.core import topology
from dipaco_jax.routing import phases

from helpers import ROOT

# Counts by hand for the paper's 150M path (d 896, 16 heads x 64, MLP 3584,
# vocab 32000, tied): a block = attention 4*896*1024 + MLP 2*896*3584 + two
# norms 2*896 = 10,094,336; embed = 32000*896 = 28,672,000; head norm = 896.
BLOCK, EMBED, HEAD = 10_094_336, 28_672_000, 896
PATH = EMBED + 12 * BLOCK + HEAD  # 149,804,928
# 1.3B: d 2048, 16 x 128, MLP 8192: block = 4*2048*2048 + 2*2048*8192 + 2*2048.
BLOCK_1B = 4 * 2048 * 2048 + 2 * 2048 * 8192 + 2 * 2048
DENSE_1B = 32000 * 2048 + 24 * BLOCK_1B + 2048
CASES = [
  # (config, paths, replicas, params per path, store params)
  ("dense_150m", 1, 1, PATH, PATH),
  ("dense_1b", 1, 1, DENSE_1B, DENSE_1B),
  ("diloco_8", 1, 8, PATH, PATH),
  ("flat_moe_8", 8, 1, PATH, 8 * PATH),
  # Shared embed + head, then 6 blocks x 2 modules and 6 blocks x 4.
  ("dipaco_2x4", 8, 1, PATH, EMBED + HEAD + (6 * 2 + 6 * 4) * BLOCK),
  ("dipaco_8x8", 64, 1, PATH, EMBED + HEAD + (6 * 8 + 6 * 8) * BLOCK),
  # Private per path: embed + blocks 0, 5, 6, 11; shared: head norm and
  # blocks 1-4, 7-10 with 16 modules each.  = 18,968,707,968.
  ("dipaco_16x16", 256, 1, PATH, 256 * (EMBED + 4 * BLOCK) + HEAD + (4 * 16 + 4 * 16) * BLOCK),
]


def _load(name: str, **overrides):
  return config_check.load(os.path.join(ROOT, "configs", f"{name}.py"), **overrides)


@pytest.mark.parametrize("name,paths,replicas,per_path,store", CASES)
def test_paper_configs_build_abstract_state(name, paths, replicas, per_path, store):
  c = _load(name)
  mesh = sharding.make_mesh(
    {**c.mesh.to_dict(), "model": 1}, paths * replicas, devices=jax.devices()[:1]
  )
  exp = experiment.Experiment(c, mesh=mesh)
  assert exp.topo.num_paths == paths and exp.topo.replicas == replicas
  st = exp.abstract_state
  got_path = sum(np.prod(x.shape[1:]) for x in jax.tree.leaves(st.params))
  got_store = sum(x.size for x in jax.tree.leaves(st.store))
  assert got_path == per_path
  assert got_store == store
  assert all(x.shape[0] == paths * replicas for x in jax.tree.leaves(st.params))


def test_tiny_config_on_four_devices_puts_one_path_per_device():
  c = config_check.load(os.path.join(ROOT, "configs", "tiny.py"))
  exp = experiment.Experiment(c)
  assert dict(exp.mesh.shape) == {"path": 4, "data": 1, "model": 1}
  assert exp.topo.num_workers == 4


# The forked runs' routing (paper §2): phase-0 router, its grid, re-shard outer
# steps, training top_k, replica_shards. Product k-means for the two-level grids
# (§7.3, Table 5), k-means for one routed level; one discriminative phase for every
# DiPaCo / flat MoE (§4), none for DiLoCo, whose non-i.i.d. shards are one k-means
# cluster per worker.
DISC = [paper.DISCRIMINATIVE_AT_OUTER_STEP]
ROUTING = [
  # (config, router, phase-0 grid, discriminative steps, top_k, replica_shards)
  ("dipaco_2x4", "product_kmeans", (2, 4), DISC, 1, "hash"),
  ("dipaco_8x8", "product_kmeans", (8, 8), DISC, 1, "hash"),
  ("dipaco_16x16", "product_kmeans", (16, 16), DISC, 2, "hash"),
  ("flat_moe_8", "kmeans", (8,), DISC, 1, "hash"),
  ("diloco_8", "kmeans", (8,), [], 1, "router"),
]
FORKED = [r[0] for r in ROUTING]
DENSE = ["dense_150m", "dense_1b"]


@pytest.mark.parametrize("name,router,grid,steps,top_k,replica_shards", ROUTING)
def test_paper_configs_route_as_the_paper(name, router, grid, steps, top_k, replica_shards):
  c = _load(name)
  topo = topology.from_config(c)
  assert c.routing.router == router
  # The trainer's check before fitting: product k-means needs the full grid of paths.
  assert routing.phase0_grid(c, topo) == grid
  assert phases.replicas_by_router(c, topo) == (replica_shards == "router")
  assert c.routing.replica_shards == replica_shards
  assert c.data.top_k == top_k
  got = routing.discriminative_steps(c)  # Raises unless every step is in 1..T-1.
  assert got == steps
  assert all(1 <= s <= c.dipaco.outer_steps - 1 for s in got)
  if steps:
    assert c.routing.restart_schedule  # Fig. 10: the cosine restarts at the re-shard.
    assert c.routing.router_max_docs == paper.ROUTER_MAX_DOCS
    # The restarted cosine ends with the run: H * (T - s) steps.
    H, T = c.dipaco.inner_steps, c.dipaco.outer_steps
    assert c.inner.total_steps == H * (T - steps[0]) == 48_000


def test_the_restarted_cosine_follows_an_overridden_reshard_step():
  c = _load(
    "dipaco_2x4", **{"routing.discriminative_at_outer_step": 200, "dipaco.outer_steps": 300}
  )
  assert routing.discriminative_steps(c) == [200]
  assert c.inner.total_steps == 150 * (300 - 200)
  c = _load("dipaco_2x4", **{"inner.total_steps": 1234})  # An explicit value wins.
  assert c.inner.total_steps == 1234


def test_no_paper_config_routes_randomly_or_reshards_a_dense_run():
  for name in DENSE:
    c = _load(name)
    assert c.routing.router == "random" and routing.discriminative_steps(c) == []


@pytest.mark.parametrize("name", FORKED)
def test_forked_configs_require_init_from(name, tmp_path):
  c = _load(name)
  with pytest.raises(ValueError, match=r"config.dipaco.init_from is required") as e:
    paper.check_init_from(c)
  assert "--config=configs/dense_150m.py" in str(e.value)
  assert "--config.dipaco.init_from=DENSE_WORKDIR" in str(e.value)
  # The trainer refuses before it writes anything to the workdir.
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"config.dipaco.init_from is required"):
    train.train_and_evaluate(c, str(workdir))
  assert not workdir.exists()
  paper.check_init_from(_load(name, **{"dipaco.init_from": "gs://b/dense_150m_24k"}))
  paper.check_init_from(_load(name, **{"dipaco.init_from": ""}))  # Random, on request.


@pytest.mark.parametrize("name", DENSE + ["tiny"])
def test_dense_and_tiny_configs_need_no_init_from(name):
  c = _load(name)
  assert c.dipaco.init_from == ""
  paper.check_init_from(c)


def test_phase0_grid_refuses_product_kmeans_off_the_full_grid():
  """What the routing test above would catch: a path subset or per-worker clusters.

  The config check runs phase0_grid, so loading such a config is refused.
  """
  with pytest.raises(errors.ConfigError, match="product_kmeans needs the full grid"):
    _load("dipaco_2x4", **{"dipaco.paths": ("0-0-0", "0-1-3")})
  with pytest.raises(errors.ConfigError, match="replica_shards='router' clusters per worker"):
    _load("diloco_8", **{"routing.router": "product_kmeans"})
