"""Module store <-> worker params: gather and exact round trip."""

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.core import paths
from dipaco_jax.core import topology


def _store(t):
  # Module e of group g holds the value 10 * index(g) + e.
  return {
    s.name: {
      "w": 10.0 * i + jnp.arange(s.num_modules, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))
    }
    for i, s in enumerate(t.store_groups())
  }


def test_assemble_gathers_each_workers_modules():
  t = topology.build(("embed,head", "block_0", "block_1"), (1, 2, 3), 2, path_specific="head")
  store = _store(t)
  wp = paths.assemble(store, t)
  # Path 4 = (0, 1, 1) in row-major order over K = (1, 2, 3).
  np.testing.assert_array_equal(t.paths[4], [0, 1, 1])
  order = [s.name for s in t.store_groups()]
  assert order == ["embed", "block_0", "block_1", "head"]
  assert float(wp["block_0"]["w"][4, 0]) == 10.0 + 1  # group 1, module 1
  assert float(wp["block_1"]["w"][4, 0]) == 20.0 + 1  # group 2, module 1
  assert float(wp["head"]["w"][4, 0]) == 30.0 + 4  # private: module = path 4
  assert float(wp["embed"]["w"][4, 0]) == 0.0


def test_round_trip_is_exact():
  t = topology.build(("embed,head", "block_0-1"), (1, 4), 2, replicas=2, path_specific="block_1")
  store = jax.tree.map(lambda x: x + 0.1234567, _store(t))
  back = paths.disassemble(paths.assemble(store, t), t)
  for a, b in zip(jax.tree.leaves(store), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
