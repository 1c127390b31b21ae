"""The inner phase: one path's step mapped over workers, and its special cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax.core import experiment
from dipaco_jax.core import inner
from dipaco_jax.core import model
from dipaco_jax.core import sharding

import helpers


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_paths_are_independent_during_an_inner_phase():
  # Changing worker 3's batch must leave workers 0-2 bit-identical.
  exp = experiment.Experiment(helpers.micro_config())
  c = exp.config
  rng = np.random.default_rng(0)
  batches = [helpers.synthetic_batch(rng, 4, 2, 16, 256) for _ in range(3)]

  def run(batches):
    st = exp.init_state(0)
    params, opt = st.params, st.inner_opt
    for b in batches:
      params, opt, m = exp.inner_step(params, opt, exp.put_batch(b))
      jax.block_until_ready(m)
    return params

  base = run(batches)
  changed = [dict(b) for b in batches]
  changed[1] = {k: v.copy() for k, v in batches[1].items()}
  changed[1]["targets"][3] = (changed[1]["targets"][3] + 1) % c.model.vocab_size
  other = run(changed)
  for a, b in zip(_leaves(base), _leaves(other)):
    np.testing.assert_array_equal(a[:3], b[:3])
  assert any(not np.array_equal(a[3], b[3]) for a, b in zip(_leaves(base), _leaves(other)))


@pytest.mark.slow  # ~7-12 s of CPU: the fast suite's budget is 3 minutes.
def test_h1_with_outer_sgd_lr1_equals_plain_adamw():
  # One path, H = 1, outer SGD lr 1 without momentum: θ_store ← θ_store −
  # (θ_store − θ) = θ after every step, so training is plain AdamW.
  cfg = helpers.micro_config(
    **{
      "dipaco.level_groups": ("embed,block_0-1,head",),
      "dipaco.modules_per_level": (1,),
      "dipaco.inner_steps": 1,
      "dipaco.outer_steps": 6,
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
    }
  )
  # One worker: a 1-device mesh (the 4 fake devices would split the batch).
  exp = experiment.Experiment(cfg, mesh=sharding.make_mesh(cfg.mesh, 1, devices=jax.devices()[:1]))
  rng = np.random.default_rng(1)
  batches = [helpers.synthetic_batch(rng, 1, 2, 16, 256) for _ in range(6)]
  st = exp.init_state(0)
  alpha = exp.recipe.alpha(np.ones(1))
  params, opt, store, oopt = st.params, st.inner_opt, st.store, st.outer_opt
  params_first = None
  for b in batches:
    params, opt, m = exp.inner_step(params, opt, exp.put_batch(b))
    store, oopt, params, _ = exp.outer_step(store, oopt, params, alpha)
    jax.block_until_ready(m)
    if params_first is None:  # Copied: the next step donates it.
      params_first = jax.tree.map(np.asarray, params)

  # The plain loop: the same AdamW step, vmapped over the single worker so
  # both programs reduce in the same order.
  tx = inner.optimizer(exp.recipe.inner_cfg)
  theta = jax.tree.map(lambda x: x[None], model.init_params(exp.model_cfg, jax.random.key(0)))
  opt_plain = jax.vmap(tx.init)(theta)
  step = jax.jit(
    jax.vmap(functools.partial(inner.train_step, model=exp.model, tx=tx, microbatches=1))
  )
  first = None
  for b in batches:
    theta, opt_plain, _ = step(theta, opt_plain, b)
    first = theta if first is None else first
  assert max(_maxdiff(params_first, first)) == 0.0
  # θ_s − (θ_s − θ) is exact whenever θ_s and θ are within a factor 2
  # (Sterbenz); an entry next to zero can be off by ~1e-10, which AdamW's
  # normalisation carries to ~1 float32 ulp at |θ| ≈ 1 within a few steps.
  np.testing.assert_allclose(
    np.concatenate([x.ravel() for x in _leaves(params)]),
    np.concatenate([x.ravel() for x in _leaves(theta)]),
    rtol=3e-7,
    atol=1e-9,
  )


def _maxdiff(a, b):
  return [np.max(np.abs(x - y)) for x, y in zip(_leaves(a), _leaves(b))]


def test_restart_schedule_resets_only_the_schedule_count(independent):
  exp, state = independent
  state = jax.tree.map(jnp.copy, state)  # The inner step donates its inputs.
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 2, 16, 256))
  p, o, m = exp.inner_step(state.params, state.inner_opt, batch)
  jax.block_until_ready(m)
  out = inner.restart_schedule(o)
  is_s = lambda x: isinstance(x, (optax.ScaleByScheduleState, optax.ScaleByAdamState))
  before = [x for x in jax.tree.leaves(o, is_leaf=is_s) if is_s(x)]
  after = [x for x in jax.tree.leaves(out, is_leaf=is_s) if is_s(x)]
  for b, a in zip(before, after):
    if isinstance(b, optax.ScaleByScheduleState):
      assert np.all(np.asarray(b.count) == 1) and np.all(np.asarray(a.count) == 0)
    else:  # Adam keeps its moments and bias-correction count.
      np.testing.assert_array_equal(a.count, b.count)
      for x, y in zip(jax.tree.leaves(a.mu), jax.tree.leaves(b.mu)):
        np.testing.assert_array_equal(x, y)
  assert jnp.asarray(after[0].count).sharding == jnp.asarray(before[0].count).sharding
