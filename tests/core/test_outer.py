"""The outer step, against values worked out by hand, in each of its forms.

Every hand-derived test runs the spmd program (`outer_layouts.sharded_outer_step`, here
on a one-device mesh) and the numpy oracle (tests/outer_oracle.py); the
executor's `module_outer_step` has its own hand-derived test, and the sharded
program on real meshes is held against the oracle at the end.

Grid for most tests: level 0 = embed+head (K=1), level 1 = block_0 (K=2);
paths (0,0) and (0,1), two replicas each -> workers w0,w1 on module 0 and
w2,w3 on module 1. Every parameter is a length-2 vector of one value, the
store starts at 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import outer
from dipaco_jax.core import outer_layouts
from dipaco_jax.core import paths
from dipaco_jax.core import sharding
from dipaco_jax.core import topology

import helpers
import outer_oracle

TOPO = topology.build(("embed,head", "block_0"), (1, 2), 1, replicas=2)


def _tree(values_by_group):
  return {
    g: {"w": jnp.asarray(v, jnp.float32)[:, None] * jnp.ones((1, 2))}
    for g, v in values_by_group.items()
  }


def _zero_store():
  return _tree({"embed": [0.0], "block_0": [0.0, 0.0], "head": [0.0]})


def _workers(v):
  return _tree({"embed": v, "block_0": v, "head": v})


def _outer_config(**kw):
  """base()'s config.outer (the paper's lr 0.7, momentum 0.9, Nesterov) with `kw` changed."""
  return sections.OuterConfig(**kw)


def _first(tree, g):
  return np.asarray(tree[g]["w"][:, 0])


def _sharded_on_one_device(store, opt_state, params_W, alpha_W, *, topo, cfg):
  """The spmd program (shard_map over a 1-device mesh: every leaf replicated)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
  rep = lambda t: jax.tree.map(lambda _: P(), t)
  specs = (rep(store), rep(opt_state), rep(params_W))
  fn = outer_layouts.sharded_outer_step(topo, cfg, outer.optimizer(cfg), mesh, specs)
  return jax.jit(fn)(store, opt_state, params_W, jnp.asarray(alpha_W, jnp.float32))


FORMS = {"sharded": _sharded_on_one_device, "oracle": outer_oracle.outer_step}
forms = pytest.mark.parametrize("form", sorted(FORMS))


def _step(store, workers, alpha, form, **cfg):
  # Plain weighted means unless a test asks for the √P rescale.
  c = _outer_config(**{"sqrt_paths": "none", **cfg})
  state = outer.optimizer(c).init(store)
  return FORMS[form](store, state, workers, jnp.asarray(alpha, jnp.float32), topo=TOPO, cfg=c)


@forms
def test_weighted_average_with_sgd_lr1_sign_and_alpha(form):
  # SGD lr 1, no momentum: θ_e ← θ_e − Δ_e = the α-weighted mean of the workers.
  # Δ = Σ α (θ_store − θ_w) / Σ α: positive when workers went down (sign).
  # Workers hold 1, 2, 4, 6 with α = 1, 3, 1, 1.
  # module 0 (w0, w1): Δ = (1·(0−1) + 3·(0−2)) / 4 = −7/4 → θ = 1.75
  # module 1 (w2, w3): Δ = (0−4 + 0−6) / 2 = −5       → θ = 5
  # embed (all four):  Δ = −(1 + 6 + 4 + 6) / 6 = −17/6 → θ = 2.8333
  store, _, w, _ = _step(
    _zero_store(), _workers([1, 2, 4, 6]), [1, 3, 1, 1], form, lr=1.0, momentum=0.0
  )
  np.testing.assert_allclose(_first(store, "block_0"), [1.75, 5.0], rtol=1e-6)
  np.testing.assert_allclose(_first(store, "embed"), [17 / 6], rtol=1e-6)
  # Paths are re-assembled from the new store.
  np.testing.assert_allclose(_first(w, "block_0"), [1.75, 1.75, 5, 5], rtol=1e-6)


@forms
def test_uniform_weights_are_algorithm_1(form):
  # Same workers, α = 1 each: module 0 → (1 + 2) / 2 = 1.5.
  store, _, _, _ = _step(
    _zero_store(), _workers([1, 2, 4, 6]), [1, 1, 1, 1], form, lr=1.0, momentum=0.0
  )
  np.testing.assert_allclose(_first(store, "block_0"), [1.5, 5.0], rtol=1e-6)


@pytest.mark.parametrize(
  "mode,scale_module,scale_embed",
  [("multiply", np.sqrt(2), 2.0), ("divide", 1 / np.sqrt(2), 0.5), ("none", 1.0, 1.0)],
)
@forms
def test_sqrt_paths_rescale(mode, scale_module, scale_embed, form):
  # Workers all at −1 → Δ = 1 everywhere before rescaling. P_{1,e} = 2 per
  # block module and P_{0,0} = 4 for the embedding: Δ·√2 and Δ·√4 = 2 (multiply).
  # SGD lr 1 without momentum: θ = −Δ.
  store, _, _, m = _step(
    _zero_store(),
    _workers([-1, -1, -1, -1]),
    [1, 1, 1, 1],
    form,
    lr=1.0,
    momentum=0.0,
    sqrt_paths=mode,
  )
  np.testing.assert_allclose(_first(store, "block_0"), [-scale_module] * 2, rtol=1e-6)
  np.testing.assert_allclose(_first(store, "embed"), [-scale_embed], rtol=1e-6)
  # ‖Δ‖ of a level-1 module: one group (block_0), 2 entries of scale → scale·√2.
  np.testing.assert_allclose(m["delta_norm"]["level_1"], [scale_module * np.sqrt(2)] * 2, rtol=1e-6)


@pytest.mark.parametrize(
  "mode,cap,scale_module,scale_embed",
  [
    # Cap 1.5: the embedding's √4 = 2 becomes 1.5; a block module's √2 ≈ 1.414 stays.
    ("multiply", 1.5, np.sqrt(2), 1.5),
    ("divide", 1.5, 1 / np.sqrt(2), 1 / 1.5),
    # Cap 1: no rescale at all, as sqrt_paths="none".
    ("multiply", 1.0, 1.0, 1.0),
  ],
)
@forms
def test_sqrt_paths_cap_bounds_the_rescale(mode, cap, scale_module, scale_embed, form):
  # As test_sqrt_paths_rescale: Δ = 1 everywhere before rescaling, lr 1, no momentum: θ = −scale.
  store, _, _, _ = _step(
    _zero_store(),
    _workers([-1, -1, -1, -1]),
    [1, 1, 1, 1],
    form,
    lr=1.0,
    momentum=0.0,
    sqrt_paths=mode,
    sqrt_paths_cap=cap,
  )
  np.testing.assert_allclose(_first(store, "block_0"), [-scale_module] * 2, rtol=1e-6)
  np.testing.assert_allclose(_first(store, "embed"), [-scale_embed], rtol=1e-6)


@forms
def test_nesterov_over_two_phases(form):
  # lr 0.7, μ 0.9, Nesterov (optax): m ← Δ + μ m; θ ← θ − lr (Δ + μ m).
  # Phase 1: workers at −1 → Δ1 = 1; m1 = 1; θ1 = −0.7 (1 + 0.9) = −1.33.
  # Phase 2: workers at θ1 − 2 = −3.33 → Δ2 = 2; m2 = 2 + 0.9 = 2.9;
  #          θ2 = −1.33 − 0.7 (2 + 0.9·2.9) = −1.33 − 3.227 = −4.557.
  c = _outer_config(sqrt_paths="none")
  store, st = _zero_store(), outer.optimizer(c).init(_zero_store())
  alpha = jnp.ones(4)
  store, st, _, _ = FORMS[form](store, st, _workers([-1] * 4), alpha, topo=TOPO, cfg=c)
  np.testing.assert_allclose(_first(store, "block_0"), [-1.33, -1.33], rtol=1e-6)
  store, st, _, _ = FORMS[form](store, st, _workers([-3.33] * 4), alpha, topo=TOPO, cfg=c)
  np.testing.assert_allclose(_first(store, "block_0"), [-4.557, -4.557], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(st[0].trace["block_0"]["w"][:, 0]), [2.9, 2.9], rtol=1e-6)


@forms
def test_untrained_module_keeps_params_and_momentum(form):
  # Phase 1 trains everything (workers at −1): momentum of block_0 module 1 is 1.
  # Phase 2: w2, w3 (the only workers on module 1) are inactive (α = 0), so
  # module 1 must keep θ1 = −1.33 and m1 = 1 — plain optax would still move it
  # by −0.7·0.9·0.9·1 through momentum.
  c = _outer_config(sqrt_paths="none")
  store, st = _zero_store(), outer.optimizer(c).init(_zero_store())
  store, st, _, _ = FORMS[form](store, st, _workers([-1] * 4), jnp.ones(4), topo=TOPO, cfg=c)
  store, st, _, _ = FORMS[form](
    store, st, _workers([-3.33] * 4), jnp.asarray([1.0, 1.0, 0.0, 0.0]), topo=TOPO, cfg=c
  )
  np.testing.assert_allclose(_first(store, "block_0"), [-4.557, -1.33], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(st[0].trace["block_0"]["w"][:, 0]), [2.9, 1.0], rtol=1e-6)
  # The embedding still trains from w0, w1: Δ2 = 2 as for module 0.
  np.testing.assert_allclose(_first(store, "embed"), [-4.557], rtol=1e-5)


@forms
def test_module_on_no_path_is_untouched(form):
  t = topology.build(("embed,head", "block_0"), (1, 3), 1, paths=("0-0", "0-2"))
  store = _tree({"embed": [0.0], "block_0": [0.0, 7.0, 0.0], "head": [0.0]})
  c = _outer_config(sqrt_paths="none")
  st = outer.optimizer(c).init(store)
  w = _tree({g: [-1.0, -1.0] for g in ("embed", "block_0", "head")})
  new, _, _, _ = FORMS[form](store, st, w, jnp.ones(2), topo=t, cfg=c)
  # Modules 0 and 2: Δ = 1 → −1.33; module 1 has no path: stays 7.
  np.testing.assert_allclose(_first(new, "block_0"), [-1.33, 7.0, -1.33], rtol=1e-6)


@forms
def test_private_groups_get_their_own_nesterov_step(form):
  # head private: one copy per path, each moved by its own paths' Δ.
  # Path (0,0) = w0, w1 at −1 → Δ = 1 → −1.33; path (0,1) = w2, w3 at −2
  # → Δ = 2 → −2.66. The shared embedding sees all four: Δ = 1.5 → −1.995.
  t = topology.build(("embed,head", "block_0"), (1, 2), 1, replicas=2, path_specific="head")
  store = _tree({"embed": [0.0], "block_0": [0.0, 0.0], "head": [0.0, 0.0]})
  c = _outer_config(sqrt_paths="none")
  w = _workers([-1, -1, -2, -2])
  new, _, _, _ = FORMS[form](store, outer.optimizer(c).init(store), w, jnp.ones(4), topo=t, cfg=c)
  np.testing.assert_allclose(_first(new, "head"), [-1.33, -2.66], rtol=1e-6)
  np.testing.assert_allclose(_first(new, "embed"), [-1.995], rtol=1e-6)


def test_module_step_of_an_executor_by_hand():
  # One module read by three workers with deltas Δ_w = θ − θ_w = 1, 2, 4 and α = 1, 1, 2:
  # the α-mean is (1 + 2 + 2·4) / 4 = 2.75; ×√3 (P = 3 active, "multiply") = 4.7631.
  # Nesterov from zero momentum, lr 0.7, μ 0.9: m = 4.7631; θ = 10 − 0.7·(4.7631 + 0.9·4.7631)
  # = 10 − 6.3349 = 3.6651. A worker with α = 0 changes nothing (P counts active workers).
  c = _outer_config()
  tx = outer.optimizer(c)
  theta = {"block_0": {"w": jnp.full((1, 2), 10.0)}}
  deltas = {"block_0": {"w": jnp.asarray([1.0, 2.0, 4.0, 9.0])[:, None] * jnp.ones((1, 2))}}
  alpha = jnp.asarray([1.0, 1.0, 2.0, 0.0])
  new, st, m = outer.module_outer_step(theta, tx.init(theta), deltas, alpha, tx=tx, cfg=c)
  g = 2.75 * np.sqrt(3)
  np.testing.assert_allclose(np.asarray(new["block_0"]["w"]), 10 - 0.7 * 1.9 * g, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(st[0].trace["block_0"]["w"]), g, rtol=1e-6)
  np.testing.assert_allclose(float(m["delta_norm"]), g * np.sqrt(2), rtol=1e-6)
  # No active worker: the module keeps its params and its momentum.
  new, st2, _ = outer.module_outer_step(theta, st, deltas, jnp.zeros(4), tx=tx, cfg=c)
  np.testing.assert_array_equal(np.asarray(new["block_0"]["w"]), 10.0)
  np.testing.assert_array_equal(st2[0].trace["block_0"]["w"], st[0].trace["block_0"]["w"])


def test_config_errors():
  with pytest.raises(ValueError, match="outer.weighting"):
    _outer_config(weighting="tokens")
  with pytest.raises(ValueError, match="outer.sqrt_paths"):
    _outer_config(sqrt_paths="square")
  with pytest.raises(ValueError, match="outer.sqrt_paths_cap"):
    _outer_config(sqrt_paths_cap=-1.0)


@pytest.mark.parametrize(
  "overrides",
  [
    # Embedding K=1 (replicated, psum), blocks K=2 < path (slices, all_to_all),
    # the head private (K on 'path', no collective).
    {"mesh.path": 4, "mesh.data": 1, "dipaco.path_specific": "head"},
    # block_0 K=2 on 'path' (its workers sit together), block_1 sliced; each of a
    # path's two 'data' devices moves half of every module.
    {"mesh.path": 2, "mesh.data": 2},
    # The same with FSDP: params and store already split over 'data'.
    pytest.param({"mesh.path": 2, "mesh.data": 2, "mesh.fsdp": True}, marks=pytest.mark.slow),
  ],
)
def test_sharded_step_equals_the_one_device_formula(overrides):
  # The Experiment's outer step (shard_map, explicit collectives over 'path')
  # against the numpy oracle, from a random store, random momentum, workers
  # near their modules and one inactive worker (α = 0).
  exp = experiment.Experiment(helpers.micro_config(**overrides))
  rng = np.random.default_rng(0)
  st = exp.abstract_state

  def normal(tree, scale=1.0):
    return jax.tree.map(lambda x: (scale * rng.normal(size=x.shape)).astype(np.float32), tree)

  store, momentum = normal(st.store), normal(st.outer_opt)
  params = jax.tree.map(np.add, paths.assemble(store, exp.topo), normal(st.params, 0.01))
  alpha = np.array([0.5, 1.0, 2.0, 0.0], np.float32)
  want = outer_oracle.outer_step(
    store, momentum, params, alpha, topo=exp.topo, cfg=exp.recipe.outer_cfg
  )
  got = exp.outer_step(
    jax.device_put(store, exp.state_sharding.store),
    jax.device_put(momentum, exp.state_sharding.outer_opt),
    jax.device_put(params, exp.state_sharding.params),
    alpha,
  )
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
  # The inactive worker's private head copy (module 3) kept its params.
  if "head" in exp.topo.private_groups:
    np.testing.assert_array_equal(
      np.asarray(got[0]["head"]["norm"]["scale"][3]), store["head"]["norm"]["scale"][3]
    )
