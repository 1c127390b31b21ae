"""The outer step: per-module averaged deltas, then Nesterov on the store.

For module e of a level (or a path-specific copy), over the workers w through
it and active this phase:

  Δ_e = Σ_w α_w (θ_e − θ_w) / Σ_w α_w      (α_w ∝ |D_w| or uniform)
  Δ_e ← Δ_e · √P_e  (or / √P_e, or unchanged: `sqrt_paths` config; √P_e capped
                     at `sqrt_paths_cap` when that is > 0)
  θ_e ← optax.sgd(lr, momentum, nesterov)(Δ_e)   — Δ plays the gradient.

Per level this is one assignment matrix A[K, W] times the deltas [W, ...]: a
single reduction over the worker (path) axis, which on a multislice is the one
DCN reduction every H inner steps. A module with no active worker keeps its
params and its momentum.
"""
# pylint: disable=invalid-name

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax import paths as paths_lib
from dipaco_jax import topology as topo_lib
from dipaco_jax.types import PyTree

WEIGHTINGS = ("shard_size", "uniform")  # α_p ∝ |D_p|, or equal.
SQRT_MODES = ("multiply", "divide", "none")  # √P_{l,e} rescale of Δ (paper §2.7).


@dataclasses.dataclass(frozen=True)
class OuterConfig:
  """Outer optimizer (config.outer, paper §3.3, §3.5; defaults in config_defaults.base)."""

  lr: float
  momentum: float
  nesterov: bool
  weighting: str  # One of WEIGHTINGS.
  sqrt_paths: str  # One of SQRT_MODES ("multiply": the paper's, direction inferred).
  sqrt_paths_cap: float  # > 0: the √P factor is at most this (a bounded ×√P); 0 = none.

  def __post_init__(self):
    if self.weighting not in WEIGHTINGS:
      raise ValueError(f"outer.weighting={self.weighting!r}: use one of {WEIGHTINGS}.")
    if self.sqrt_paths not in SQRT_MODES:
      raise ValueError(f"outer.sqrt_paths={self.sqrt_paths!r}: use one of {SQRT_MODES}.")
    if not self.sqrt_paths_cap >= 0:
      raise ValueError(
        f"outer.sqrt_paths_cap={self.sqrt_paths_cap}: use a number >= 1 (a cap), or 0 (none)."
      )


def optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
  """SGD with (Nesterov) momentum; momentum 0 means plain SGD."""
  return optax.sgd(
    cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0
  )


def module_deltas(
  store: PyTree,
  params_W: PyTree,
  alpha_W: jax.Array,
  topo: topo_lib.Topology,
  sqrt_paths: str = "multiply",
  sqrt_paths_cap: float = 0.0,
):
  """Averaged outer gradient per module, which modules were trained, counts.

  Args:
    store: global modules, leaves [K, ...] per group.
    params_W: params after the inner phase, leaves [W, ...].
    alpha_W: weight of each worker (0 = did not train this phase).
    topo: the grid.
    sqrt_paths: how to rescale by √P_{l,e}.
    sqrt_paths_cap: > 0: √P_{l,e} is capped at this before it multiplies or divides.

  Returns:
    (deltas shaped like store, {group: trained_K bool}, {group: count_K}).
  """
  deltas, trained, counts = {}, {}, {}
  for s in topo.store_groups():
    idx_W = s.module_of_worker
    onehot_KxW = jax.nn.one_hot(idx_W, s.num_modules, dtype=jnp.float32).T
    a_KxW = onehot_KxW * alpha_W[None, :]
    norm_K = a_KxW.sum(axis=1)
    count_K = (onehot_KxW * (alpha_W > 0)[None, :]).sum(axis=1)
    root_K = jnp.sqrt(jnp.maximum(count_K, 1.0))
    if sqrt_paths_cap > 0:  # The bounded variant: at most ×cap however many paths share e.
      root_K = jnp.minimum(root_K, sqrt_paths_cap)
    if sqrt_paths == "multiply":
      scale_K = jnp.where(count_K > 0, root_K, 0.0)
    elif sqrt_paths == "divide":
      scale_K = 1.0 / root_K
    else:
      scale_K = jnp.ones_like(count_K)
    # Weighted mean and √P scale folded into one [K, W] matrix: one reduction.
    w_KxW = a_KxW * (scale_K / jnp.maximum(norm_K, 1e-30))[:, None]

    def reduce(x_K, x_W, w_KxW=w_KxW, idx_W=idx_W):
      d_W = x_K[idx_W].astype(jnp.float32) - x_W.astype(jnp.float32)
      return jnp.einsum("kw,w...->k...", w_KxW, d_W).astype(x_K.dtype)

    deltas[s.name] = jax.tree.map(reduce, store[s.name], params_W[s.name])
    trained[s.name] = norm_K > 0
    counts[s.name] = count_K
  return deltas, trained, counts


def _where_trained(new: PyTree, old: PyTree, masks: PyTree) -> PyTree:
  """Leaf-wise `where(trained_K, new, old)`; a None mask keeps `new`."""
  mask_leaves = jax.tree.leaves(masks, is_leaf=lambda x: x is None)
  kept = [
    n if m is None else jnp.where(m.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    for n, o, m in zip(jax.tree.leaves(new), jax.tree.leaves(old), mask_leaves)
  ]
  return jax.tree.unflatten(jax.tree.structure(new), kept)


def outer_step(
  store: PyTree,
  opt_state: PyTree,
  params_W: PyTree,
  alpha_W: jax.Array,
  *,
  topo: topo_lib.Topology,
  cfg: OuterConfig,
):
  """One outer step; returns (store, opt_state, worker params, metrics)."""
  tx = optimizer(cfg)
  deltas, trained, _ = module_deltas(
    store, params_W, alpha_W, topo, cfg.sqrt_paths, cfg.sqrt_paths_cap
  )
  updates, new_opt_state = tx.update(deltas, opt_state, store)
  # An untrained module keeps its params and momentum (its Δ is 0, but
  # momentum alone would still move it).
  masks = {g: jax.tree.map(lambda _, m=trained[g]: m, store[g]) for g in store}
  new_store = _where_trained(optax.apply_updates(store, updates), store, masks)
  opt_masks = optax.tree_utils.tree_map_params(
    tx, lambda _, m: m, new_opt_state, masks, transform_non_params=lambda _: None
  )
  new_opt_state = _where_trained(new_opt_state, opt_state, opt_masks)
  metrics = {"delta_norm": delta_norms(deltas, topo)}
  return new_store, new_opt_state, paths_lib.assemble(new_store, topo), metrics


def delta_norms(deltas: PyTree, topo: topo_lib.Topology) -> dict[str, jax.Array]:
  """‖Δ‖ per module, per level (and per private copy): {level: [K]}."""
  sq: dict[str, jax.Array] = {}
  for s in topo.store_groups():
    leaves = jax.tree.leaves(deltas[s.name])
    g_K = sum(
      jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim))) for x in leaves
    )
    sq[s.level] = sq.get(s.level, 0.0) + g_K
  return {lvl: jnp.sqrt(v) for lvl, v in sq.items()}


class _OneModule:
  """A topology of one store group with one module that all N given workers read."""

  def __init__(self, group: str, level: str, num_workers: int):
    self._group = topo_lib.StoreGroup(group, level, np.zeros(num_workers, np.int32), 1)

  def store_groups(self):
    return (self._group,)


def module_outer_step(
  theta: PyTree,
  opt_state: PyTree,
  params_N: PyTree,
  alpha_N: jax.Array,
  *,
  group: str,
  level: str,
  cfg: OuterConfig,
):
  """`outer_step` of ONE module from the N workers through it (the elastic executors).

  theta: {group: leaves [1, ...]}; opt_state: `optimizer(cfg).init(theta)`;
  params_N: {group: leaves [N, ...]}, the workers' params in worker order.
  The same code as `outer_step`, so α, √P (P = N active workers) and Nesterov
  are the synchronous mode's; returns (theta, opt_state, metrics).
  """
  topo = _OneModule(group, level, jax.tree.leaves(params_N)[0].shape[0])
  new_theta, new_opt, _, metrics = outer_step(
    theta, opt_state, params_N, alpha_N, topo=topo, cfg=cfg
  )
  return new_theta, new_opt, metrics
