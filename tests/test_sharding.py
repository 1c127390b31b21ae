"""Proof from the compiled programs: inner steps never talk across paths.

On 4 fake devices as path=2 x data=2 with 4 workers, the inner step holds
collectives (the gradient all-reduce over 'data'), none of whose replica
groups spans two 'path' coordinates; the outer step does reduce over 'path'.
"""

import jax
import numpy as np

from dipaco_jax import experiment
from dipaco_jax import hlo
from dipaco_jax import sharding

import helpers


def _experiment(**overrides):
  cfg = helpers.micro_config(**{"mesh.path": 2, "mesh.data": 2, **overrides})
  exp = experiment.Experiment(cfg)
  assert dict(exp.mesh.shape) == {"path": 2, "data": 2, "model": 1}
  return exp


def test_inner_step_has_no_cross_path_collective_and_outer_step_has():
  exp = _experiment()
  st = exp.abstract_state
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 2, 16, 256))
  inner_hlo = exp.inner_step.lower(st.params, st.inner_opt, batch).compile().as_text()
  outer_hlo = (
    exp.outer_step.lower(st.store, st.outer_opt, st.params, jax.ShapeDtypeStruct((4,), np.float32))
    .compile()
    .as_text()
  )

  inner_colls = hlo.collectives(inner_hlo)
  assert inner_colls, "expected the data-parallel gradient all-reduce"
  assert any(hlo.crosses_axis(c.groups, exp.mesh, "data") for c in inner_colls)
  assert not any(hlo.crosses_axis(c.groups, exp.mesh, "path") for c in inner_colls)
  assert hlo.cross_axis_bytes(inner_hlo, exp.mesh, "path") == 0

  outer_colls = hlo.collectives(outer_hlo)
  assert any(hlo.crosses_axis(c.groups, exp.mesh, "path") for c in outer_colls)
  assert hlo.cross_axis_bytes(outer_hlo, exp.mesh, "path") > 0


def test_fsdp_inner_step_gathers_inside_paths_only():
  # FSDP: the weights are all-gathered and the gradients reduced over 'data',
  # still with no group spanning two paths.
  exp = _experiment(**{"mesh.fsdp": True})
  st = exp.abstract_state
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 2, 16, 256))
  inner_hlo = exp.inner_step.lower(st.params, st.inner_opt, batch).compile().as_text()
  colls = hlo.collectives(inner_hlo)
  assert any(c.op.startswith("all-gather") for c in colls), "FSDP gathers weights"
  assert any(hlo.crosses_axis(c.groups, exp.mesh, "data") for c in colls)
  assert not any(hlo.crosses_axis(c.groups, exp.mesh, "path") for c in colls)


def test_worker_axis_is_sharded_on_path():
  exp = _experiment()
  spec = jax.tree.leaves(exp.state_sharding.params)[0].spec
  assert spec[0] == "path"
  assert sharding.batch_spec() == jax.sharding.PartitionSpec("path", "data")
