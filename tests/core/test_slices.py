"""Slice-local store groups (core/slices.py): found by the grid, and the same outer step.

The 4 CPU devices stand for 2 slices of 2 'path' coordinates (a multislice mesh's
`slice_index`, which CPU devices lack, is patched in). The micro grid: paths (i, j) of
i, j in {0, 1}, path p = 2 i + j on coordinate p; block_0 (level 1) module i is trained
by paths 2i, 2i + 1, both in slice i: local. block_1 (level 2) module j by paths j and
2 + j, one in each slice: not local. The embedding (K = 1) spans both.
"""

import jax
import numpy as np
import pytest

from dipaco_jax import hlo
from dipaco_jax.core import experiment
from dipaco_jax.core import paths
from dipaco_jax.core import sharding
from dipaco_jax.core import slices
from dipaco_jax.core import topology

import helpers
import outer_oracle


def test_is_local_finds_the_levels_whose_modules_sit_in_one_slice():
  topo = topology.build(("embed,head", "block_0", "block_1"), (1, 2, 2), 2)
  level = {s.name: s for s in topo.store_groups()}
  np.testing.assert_array_equal(level["block_0"].module_of_worker, [0, 0, 1, 1])
  np.testing.assert_array_equal(level["block_1"].module_of_worker, [0, 1, 0, 1])
  assert slices.is_local(level["block_0"], npath=4, S=2)
  assert not slices.is_local(level["block_1"], npath=4, S=2)  # Module 0: slices 0 and 1.
  assert not slices.is_local(level["embed"], npath=4, S=2)  # K = 1.
  assert not slices.is_local(level["block_0"], npath=4, S=1)  # One slice: nothing to keep in.
  assert not slices.is_local(level["block_0"], npath=4, S=4)  # K = 2 < 4 slices.
  # dipaco_16x16's grid on 4 slices of 64: level 1's module i on paths 16 i .. 16 i + 15.
  big = topology.build(("embed,head", "block_0", "block_1"), (1, 16, 16), 2)
  level = {s.name: s for s in big.store_groups()}
  assert slices.is_local(level["block_0"], npath=256, S=4)
  assert not slices.is_local(level["block_1"], npath=256, S=4)
  view = slices.local_view(level["block_0"], 4)  # Slice i's 4 modules, 64 workers.
  assert view.num_modules == 4 and list(view.module_of_worker[::16]) == [0, 1, 2, 3]


def test_on_slices_reads_path_as_its_two_parts():
  P = jax.sharding.PartitionSpec
  assert slices.on_slices(P("path", None)) == P(("slice", "in_slice"), None)
  assert slices.on_slices(P(None, ("data", "path"))) == P(None, ("data", "slice", "in_slice"))
  local = P("slice", ("data", "in_slice"))
  assert slices.on_slices(local) == local


def _experiment(monkeypatch, sliced: bool, **overrides):
  """The micro grid on path 4 x data 1; sliced: its 4 devices read as 2 slices from now on.

  (Build an unsliced one first: its layout is fixed when it is built.)
  """
  if sliced:
    monkeypatch.setattr(slices, "mesh_slices", lambda mesh: 2 if "path" in mesh.axis_names else 1)
  return experiment.Experiment(
    helpers.micro_config(**{"mesh.path": 4, "mesh.data": 1, **overrides})
  )


def _put(exp, t, s):
  return jax.device_put(t, getattr(exp.state_sharding, s))


def _step(exp, store, momentum, params, alpha):
  """One outer step from host arrays; a compressed one from zero residuals and `store`."""
  args = (_put(exp, store, "store"), _put(exp, momentum, "outer_opt"))
  args += (_put(exp, params, "params"), np.asarray(alpha, np.float32))
  if exp.recipe.compressed:
    ef = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), params)
    args += (_put(exp, ef, "params"), exp.start_params(_put(exp, store, "store")))
  return jax.device_get(exp.outer_step(*args)[:3])


def test_a_local_level_by_hand(monkeypatch):
  # SGD lr 1, no momentum, no √P: θ_k ← the α-mean of its workers (test_outer.py). Store 0,
  # worker w holds w + 1 everywhere, α = 1, 1, 1, 3:
  #   block_0 (local) module 0 (w0, w1): (1 + 2) / 2 = 1.5; module 1 (w2, w3): (3 + 12) / 4 = 3.75
  #   block_1 module 0 (w0, w2): (1 + 3) / 2 = 2; module 1 (w1, w3): (2 + 12) / 4 = 3.5
  #   embed (all): (1 + 2 + 3 + 12) / 6 = 3
  over = {"outer.lr": 1.0, "outer.momentum": 0.0, "outer.sqrt_paths": "none"}
  exp = _experiment(monkeypatch, True, **over)
  assert all(
    x.spec[0] == "slice" and "in_slice" in sharding.spec_axes(x.spec)
    for x in jax.tree.leaves(exp.state_sharding.store["block_0"])
  )
  st = exp.abstract_state
  store = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), st.store)
  momentum = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), st.outer_opt)
  params = jax.tree.map(
    lambda x: (
      np.broadcast_to(np.arange(1.0, 5.0).reshape(4, *[1] * (x.ndim - 1)), x.shape)
      .astype(np.float32)
      .copy()
    ),
    st.params,
  )
  new, _, workers = _step(exp, store, momentum, params, [1, 1, 1, 3])
  for g, want in (("block_0", [1.5, 3.75]), ("block_1", [2.0, 3.5]), ("embed", [3.0])):
    for leaf in jax.tree.leaves(new[g]):
      got = np.asarray(leaf).reshape(leaf.shape[0], -1)
      np.testing.assert_allclose(got, np.broadcast_to(np.asarray(want)[:, None], got.shape))
  # Each worker holds its module again: w2 and w3 the new block_0 module 1.
  for leaf in jax.tree.leaves(workers["block_0"]):
    np.testing.assert_allclose(np.asarray(leaf).reshape(4, -1)[:, 0], [1.5, 1.5, 3.75, 3.75])


@pytest.mark.parametrize("compression", ["none", "fp4"])
def test_the_sliced_layout_is_the_whole_path_layout(monkeypatch, compression):
  # From a random store and momentum, workers near their modules, one inactive worker:
  # the same step, level 1 exchanged inside each slice or over all of 'path' (and the
  # numpy oracle, uncompressed). fp4 codes the same Δ_w in the same blocks either way.
  over = {"outer.compression": compression}
  old, new = _experiment(monkeypatch, False, **over), _experiment(monkeypatch, True, **over)
  assert "slice" not in str(old.state_sharding.store["block_0"])
  rng = np.random.default_rng(0)
  st = new.abstract_state
  normal = lambda t, s=1.0: jax.tree.map(
    lambda x: (s * rng.normal(size=x.shape)).astype(np.float32), t
  )
  store, momentum = normal(st.store), normal(st.outer_opt)
  params = jax.tree.map(np.add, paths.assemble(store, new.topo), normal(st.params, 0.01))
  alpha = [0.5, 1.0, 2.0, 0.0]
  got, want = (_step(e, store, momentum, params, alpha) for e in (new, old))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  if compression == "none":
    ref = outer_oracle.outer_step(
      store,
      momentum,
      params,
      np.asarray(alpha, np.float32),
      topo=new.topo,
      cfg=new.recipe.outer_cfg,
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref[:3]), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_the_local_level_crosses_no_slice(monkeypatch):
  # block_0's step alone (a fragment): on the sliced layout no collective but the ‖Δ‖
  # metric's psum groups devices of two slices; on the whole-'path' layout its
  # all-to-alls do (so the check can fail).
  def crossing(exp):
    text = exp.outer_fragment({"block_0"}).lower(*_abstract_args(exp)).compile().as_text()
    view = jax.sharding.Mesh(np.asarray(exp.mesh.devices).reshape(2, 2, 1, 1), slices.AXES)
    return {c.op for c in hlo.collectives(text) if hlo.crosses_axis(c.groups, view, "slice")}

  old = _experiment(monkeypatch, False)
  new = _experiment(monkeypatch, True)
  assert crossing(new) <= {"all-reduce"}
  assert "all-to-all" in crossing(old)


def _abstract_args(exp):
  st = exp.abstract_state
  alpha = jax.ShapeDtypeStruct((exp.topo.num_workers,), np.float32)
  return st.store, st.outer_opt, st.params, alpha
