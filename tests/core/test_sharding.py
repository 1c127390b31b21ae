"""Proof from the compiled programs: inner steps never talk across paths.

On 4 fake devices as path=2 x data=2 with 4 workers, the inner step holds
collectives (the gradient all-reduce over 'data'), none of whose replica
groups spans two 'path' coordinates; the outer step does reduce over 'path',
and moves at most twice the module bytes of the paths each device holds.
"""

import functools
from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dipaco_jax import hlo
from dipaco_jax.core import experiment
from dipaco_jax.core import sharding
from dipaco_jax.errors import ConfigError

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


def _bytes_over_data(text: str, mesh, op: str) -> int:
  """Bytes (x trips) of the compiled program's `op` collectives that span 'data'."""
  return sum(
    c.nbytes * c.trips
    for c in hlo.collectives(text)
    if c.op.removesuffix("-start") == op and hlo.crosses_axis(c.groups, mesh, "data")
  )


def test_fsdp_step_gathers_weights_and_reduces_only_gradients_over_data():
  # FSDP's pattern: each weight all-gathered once for use, the gradients (not the activations)
  # summed over 'data', the activations left split by batch. By hand, the micro model (d=32,
  # 2 blocks, H K=32, F=128, V=256 tied): per path 8,192 (table) + 2 x (3 x 1,024 + 1,024 +
  # 2 x 4,096) = 32,768 matrix floats (131,072 bytes) and 160 norm floats: 131,712 bytes. Each
  # device holds W / path = 2 workers: 262,144 bytes of matrices, 263,424 of gradient. The
  # batch: 8 rows of 16 tokens a path, 4 rows per device.
  # - all-gather <= 262,144 + 1,024: every matrix once (no remat), and the 2 workers' token ids
  #   (2 x 8 x 16 int32), which the embedding's scatter-add gradient gathers;
  # - all-reduce <= 263,424 + 1,024: the gradient once (XLA:CPU forms no reduce-scatter: it
  #   sums, then each device keeps its shard) and a few float32 scalars (loss, weight, norms);
  # - all-to-all <= 16,384: at most the embedding output's cotangent on a device (2 workers x
  #   4 rows x 16 tokens x 32 float32), moved to the table's 'data' split for its scatter-add.
  # Before: XLA kept every matrix split and summed partial activations over 'data': 3.1x the
  # gradient in all-reduces, 5x the matrices in all-gathers, 18x that cotangent in all-to-alls.
  exp = _experiment(**{"mesh.fsdp": True, "data.batch_size": 8})
  st = exp.abstract_state
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 8, 16, 256))
  text = exp.inner_step.lower(st.params, st.inner_opt, batch).compile().as_text()
  per_device = lambda xs: sum(x.size * 4 for x in xs) // exp.mesh.shape["path"]
  leaves = jax.tree.leaves(st.params)
  assert per_device(leaves) == 263_424
  assert per_device(x for x in leaves if x.ndim > 2) == 262_144
  assert _bytes_over_data(text, exp.mesh, "all-gather") <= 262_144 + 1_024
  assert _bytes_over_data(text, exp.mesh, "all-reduce") <= 263_424 + 1_024
  assert _bytes_over_data(text, exp.mesh, "all-to-all") <= 16_384


def test_worker_axis_is_sharded_on_path():
  exp = _experiment()
  spec = jax.tree.leaves(exp.state_sharding.params)[0].spec
  assert spec[0] == "path"
  assert sharding.batch_spec() == jax.sharding.PartitionSpec("path", "data")


# Blocks with K=4 on 4 paths, which (on path=4) no worker shares with its
# module's block of the store; on path=2 block_0's do: its outer step is local.
K4_GRID = {
  "dipaco.modules_per_level": (1, 4, 4),
  "dipaco.paths": ("0-1-2", "0-0-0", "0-3-3", "0-2-1"),
}


class OuterBytes(NamedTuple):
  cross: int  # Bytes across 'path' per device (hlo.cross_axis_bytes).
  path: int  # Module bytes of one path: each group's store bytes / K.
  held: int  # Module bytes of the paths a device holds: W / path x `path`.
  metric: int  # The ‖Δ‖ metric: one float32 per module of each level.
  store: int  # The whole store.


@functools.lru_cache
def _outer_bytes(**overrides) -> OuterBytes:
  exp = experiment.Experiment(helpers.micro_config(**overrides))
  st, topo = exp.abstract_state, exp.topo
  alpha = jax.ShapeDtypeStruct((topo.num_workers,), np.float32)
  args = (st.store, st.outer_opt, st.params, alpha)
  if exp.recipe.compressed:  # (..., ef, start): the residuals and the phase-start params.
    args += (st.ef if exp.recipe.feedback else {}, st.params)
  text = exp.outer_step.lower(*args).compile().as_text()
  group_bytes = {
    s.name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st.store[s.name]))
    for s in topo.store_groups()
  }
  path = sum(group_bytes[s.name] // s.num_modules for s in topo.store_groups())
  levels = {s.level: s.num_modules for s in topo.store_groups()}
  return OuterBytes(
    cross=hlo.cross_axis_bytes(text, exp.mesh, "path"),
    path=path,
    held=topo.num_workers // exp.mesh.shape["path"] * path,
    metric=4 * sum(levels.values()),
    store=sum(group_bytes.values()),
  )


@pytest.mark.parametrize("path,data", [(4, 1), (2, 2)])
def test_outer_step_moves_at_most_twice_the_held_module_bytes(path, data):
  """Per device, bytes across 'path' <= 2 x the module bytes of the paths it holds (+ ‖Δ‖).

  Bytes as hlo.cross_axis_bytes counts them: for every collective of the
  compiled outer step whose replica groups span two 'path' coordinates, the
  larger of its per-device input and output buffers, once per device (an
  all-reduce: its buffer; an all-to-all: what a device sends, = what it
  receives; a reduce-scatter: its input; an all-gather: its output), not the
  wire traffic of the algorithm XLA picks. A device holds W / path workers,
  each reading one module per group; the ‖Δ‖ metric adds one float32 per
  module. Here: embedding + head K=1 (a psum of one module) and two block
  levels of K=4 (module slices all_to_all'ed out and back: 2 x the modules;
  on path=2 block_0 moves nothing, and each of a path's 2 'data' devices moves
  half). The store is 3.3 paths, so an all-reduce of the [K, ...] deltas
  would exceed the bound.
  """
  b = _outer_bytes(**{"mesh.path": path, "mesh.data": data, **K4_GRID})
  assert b.store > 3 * b.path
  assert 0 < b.cross <= 2 * b.held + b.metric


def test_outer_step_path_bytes_do_not_grow_with_k():
  # The same 4 paths of the same size (W = 4 on path=4), with K=2 and K=4
  # modules in each block level: the store grows (old all-reduce of [K, ...]
  # deltas: ~K x module bytes) but the bytes across 'path' do not, except the
  # ‖Δ‖ metric's one float32 per module. In both, every block level is sliced.
  k2 = _outer_bytes(**{"mesh.path": 4, "mesh.data": 1})
  k4 = _outer_bytes(**{"mesh.path": 4, "mesh.data": 1, **K4_GRID})
  assert k4.store > 1.5 * k2.store
  assert k4.held == k2.held
  assert k4.cross - k4.metric == k2.cross - k2.metric
  assert k4.cross <= 2 * k4.held + k4.metric


def test_a_leaf_splits_over_path_off_its_last_axis_where_it_can():
  # A compressed outer step codes blocks along a leaf's last axis: a cut across it can split a
  # block between owners (float32 crosses then), so any other dim that divides goes first.
  mesh = SimpleNamespace(shape={"path": 4, "data": 1, "model": 1})
  none = P(None, None, None)
  assert sharding._with_path(none, (2, 8, 128), mesh, False) == P(None, ("path",), None)
  assert sharding._with_path(none, (2, 6, 128), mesh, False) == P(None, None, ("path",))
  # No dim divides (e.g. dipaco_16x16's attention projections on path=256): unchanged, so the
  # leaf stays replicated over 'path'.
  assert sharding._with_path(none, (2, 6, 10), mesh, False) == none
  # With 'data' too: the non-last dim where ('data', 'path') divides it.
  mesh2 = SimpleNamespace(shape={"path": 4, "data": 2, "model": 1})
  assert sharding._with_path(none, (2, 8, 128), mesh2, False) == P(None, ("data", "path"), None)
  # A coded step (int8, fp4, topk2: blocks along the last axis) cuts a matrix stack's last
  # axis only where each owner's part holds whole blocks (fp4: whole byte pairs too); else
  # the leaf stays replicated, and its codes still cross 'path' on the way up. A vector stack
  # [K, n] is cut as before (its few rows, dealt to every owner, would be mostly padding).
  last = P(None, None, ("path",))
  assert sharding._with_path(none, (2, 6, 128), mesh, False, ("int8", 32)) == last
  assert sharding._with_path(none, (2, 6, 128), mesh, False, ("int8", 64)) == none
  assert sharding._with_path(none, (2, 6, 128), mesh, False, ("topk2", 64)) == none
  assert sharding._with_path(none, (2, 6, 4), mesh, False, ("int8", 1)) == last
  assert sharding._with_path(none, (2, 6, 4), mesh, False, ("fp4", 1)) == none
  assert sharding._with_path(none, (2, 8, 128), mesh, False, ("int8", 64)) == P(
    None, ("path",), None
  )


def _attention_store_specs(exp) -> dict:
  """The store's attention kernel specs of the block groups, by name."""
  out = {}
  for kp, sh in jax.tree_util.tree_flatten_with_path(exp.state_sharding.store)[0]:
    names = [str(getattr(k, "key", k)) for k in kp]
    if "attn" in names and names[-1] == "kernel":
      out["/".join(names)] = sh.spec
  return out


def test_matrix_attention_kernels_split_over_path_by_heads_times_head_dim():
  # dipaco_16x16's case in small (model.attention_kernels): on path=4, d_model 6, 2 heads and
  # head_dim 2 give [D, H, K] kernels no dim of which 4 divides: replicated over 'path', each
  # summed as a K-module stack. As [D, H K] and [H K, D] matrices, H K = 4 splits over 'path'
  # and the outer step keeps to the bound, moving fewer bytes.
  over = {
    "mesh.path": 4,
    "mesh.data": 1,
    **K4_GRID,
    "model.d_model": 6,
    "model.num_heads": 2,
    "model.head_dim": 2,
  }
  heads = _attention_store_specs(experiment.Experiment(helpers.micro_config(**over)))
  matrix_over = {**over, "model.attention_kernels": "matrix"}
  matrix = _attention_store_specs(experiment.Experiment(helpers.micro_config(**matrix_over)))
  assert set(heads) == set(matrix) and len(matrix) == 2 * 4  # Two groups of K = 4, 4 kernels.
  assert all(sharding.path_dim(spec) is None for spec in heads.values()), heads
  assert all(sharding.path_dim(spec) is not None for spec in matrix.values()), matrix
  b_heads, b_matrix = _outer_bytes(**over), _outer_bytes(**matrix_over)
  assert b_matrix.held == b_heads.held
  assert 0 < b_matrix.cross <= 2 * b_matrix.held + b_matrix.metric
  assert b_matrix.cross < b_heads.cross


@pytest.mark.parametrize("kind", ["int8", "fp4"])
def test_a_compressed_outer_step_moves_under_half_the_float32_bytes(kind):
  """Codes cross 'path', not float32: under half of the uncompressed step's bytes.

  K4_GRID on path=4, blocks of 16: the two block levels (K=4) and, compressed, the shared
  embedding (K=1) split on an inner dim that is not a leaf's last axis where one divides:
  codes out, codes back. With 'path' on the last axis of mlp_out and attention's out (the
  layout before: parts of 8 values against blocks of 16) their float32 updates crossed
  instead, and int8 moved more bytes than float32 (284,372 against 230,564).
  """
  grid = {"mesh.path": 4, "mesh.data": 1, **K4_GRID}
  fp32 = _outer_bytes(**grid)
  coded = _outer_bytes(**grid, **{"outer.compression": kind, "outer.compression_block": 16})
  assert 0 < coded.cross < fp32.cross / 2, (coded.cross, fp32.cross)


def test_matrix_attention_kernels_refuse_a_model_axis_that_cuts_a_head():
  over = {"mesh.path": 1, "mesh.data": 1, "mesh.model": 4, "model.num_heads": 2}
  experiment.Experiment(helpers.micro_config(**over))  # Heads: replicated over 'model'.
  with pytest.raises(ConfigError, match=r"does not divide model.num_heads=2") as e:
    experiment.Experiment(helpers.micro_config(**over, **{"model.attention_kernels": "matrix"}))
  assert "\n" not in str(e.value) and "attention_kernels='heads'" in str(e.value)
