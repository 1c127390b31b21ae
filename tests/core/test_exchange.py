"""The spmd loop's outer exchange (core/exchange.py): its form per config, what each call does."""

import jax
import numpy as np
import pytest

from dipaco_jax.core import exchange
from dipaco_jax.core import experiment

import helpers


@pytest.mark.parametrize(
  "over,form",
  [
    ({"outer.enabled": False}, exchange.NoOuter),
    ({}, exchange.Plain),
    ({"outer.compression": "int8"}, exchange.Compressed),
    ({"outer.compression": "fp4", "outer.error_feedback": False}, exchange.Compressed),
    ({"outer.fragments": 2}, exchange.Streamed),
    ({"outer.fragments": 2, "outer.compression": "int8"}, exchange.Streamed),
  ],
)
def test_the_experiment_builds_the_configs_exchange(over, form):
  exp = experiment.Experiment(helpers.micro_config(**over))
  got = exp.exchange()
  assert type(got) is form, got.describe()
  assert type(exp.exchange(link=object())) is exchange.Streamed  # The benchmarks' slow network.


def _trained(exp, state, steps: int):
  """`state` after `steps` inner steps on random batches (no outer step)."""
  rng = np.random.default_rng(0)
  W, B, T = exp.batch_shape
  for _ in range(steps):
    batch = exp.put_batch(helpers.synthetic_batch(rng, W, B, T, exp.model_cfg.vocab_size))
    params, inner_opt, m = exp.inner_step(state.params, state.inner_opt, batch)
    jax.block_until_ready(m["loss"])
    state = state.replace(params=params, inner_opt=inner_opt, step=state.step + 1)
  return state


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_between_phases_nothing_happens_at_a_phase_end_the_outer_step_does():
  # H = 2: after step 1 the state passes through untouched; after step 2 it is exactly what
  # Experiment.outer_step makes of it (the same program, called once).
  exp = experiment.Experiment(helpers.micro_config())
  ex = exp.exchange()
  state = _trained(exp, exp.init_state(0), 1)
  ex.begin(state)
  before = _leaves(state)
  state, norms = ex(state, 1, np.ones(4, np.float32))
  assert norms is None
  for x, y in zip(before, _leaves(state), strict=True):
    np.testing.assert_array_equal(x, y)
  state = _trained(exp, state, 1)
  alpha = np.ones(4, np.float32)
  copy = jax.tree.map(lambda x: x.copy(), state)  # outer_step donates its inputs.
  want = exp.outer_step(copy.store, copy.outer_opt, copy.params, alpha)
  got, norms = ex(state, 2, alpha)
  for x, y in zip(_leaves(want[:3]), _leaves((got.store, got.outer_opt, got.params)), strict=True):
    np.testing.assert_array_equal(x, y)
  assert set(norms) == set(want[3]["delta_norm"])


def test_without_an_outer_step_the_store_takes_the_workers_params_each_phase():
  # outer.enabled=False: at step H the store is the workers' params (each module from its
  # first worker: no average, no optimizer), and nothing else changes.
  exp = experiment.Experiment(helpers.micro_config(**{"outer.enabled": False}))
  ex = exp.exchange()
  state = _trained(exp, exp.init_state(0), 2)
  ex.begin(state)
  want = _leaves(exp.sync_store(jax.tree.map(lambda x: x.copy(), state.params)))
  params = _leaves(state.params)
  state, norms = ex(state, 2, np.ones(4, np.float32))
  assert norms is None
  for x, y in zip(want, _leaves(state.store), strict=True):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(params, _leaves(state.params), strict=True):
    np.testing.assert_array_equal(x, y)
