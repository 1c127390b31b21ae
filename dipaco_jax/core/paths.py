"""Module store <-> per-worker path parameters.

The store maps each model group to a pytree whose leaves carry a leading
module axis K (see `topology.StoreGroup`). The params of all workers are the
same tree with a leading worker axis W; assembling them is one gather per
group, and `disassemble` inverts it exactly for a store every module of which
some worker reads.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.core import topology as topo_lib
from dipaco_jax.types import PyTree


def init_store(theta: PyTree, topo: topo_lib.Topology) -> PyTree:
  """Every module of every group starts from the same θ̄ (paper, Algorithm 1)."""
  return {
    s.name: jax.tree.map(
      lambda x, k=s.num_modules: jnp.broadcast_to(x, (k,) + x.shape), theta[s.name]
    )
    for s in topo.store_groups()
  }


def assemble(store: PyTree, topo: topo_lib.Topology) -> PyTree:
  """Params of all workers, leading axis W: `store[g][module_of_worker]`."""
  return {
    s.name: jax.tree.map(lambda x, i=s.module_of_worker: x[i], store[s.name])
    for s in topo.store_groups()
  }


def disassemble(params_W: PyTree, topo: topo_lib.Topology) -> PyTree:
  """Store from worker params, reading each module from its first worker."""
  out = {}
  for s in topo.store_groups():
    first = np.full(s.num_modules, -1)
    for w in range(len(s.module_of_worker) - 1, -1, -1):
      first[s.module_of_worker[w]] = w
    if (first < 0).any():
      raise ValueError(
        f"modules {np.flatnonzero(first < 0).tolist()} of group {s.name} are "
        "on no path; a store cannot be rebuilt for them from paths."
      )
    out[s.name] = jax.tree.map(lambda x, i=first: x[i], params_W[s.name])
  return out
