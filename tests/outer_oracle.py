"""The outer step's one-device formula, written out in numpy: the tests' oracle.

For module k of a store group, over the workers w through it (α_w > 0 counted as active):

  Δ_k = s_k Σ_w α_w (θ_k − θ_w) / Σ_w α_w,  s_k = √P_k, 1/√P_k or 1 (√P_k capped), P_k = active w
  θ_k ← optax.sgd(lr, momentum, nesterov) with Δ_k as the gradient; an untrained k keeps all.

Independent of dipaco_jax/core/outer.py's weights and sums (float64 loops), so the
production forms (the sharded spmd program, an executor's module step) are held
against it. Nesterov itself is optax's (the outer optimizer the run builds).
"""
# pylint: disable=invalid-name

import math

import jax
import numpy as np
import optax

from dipaco_jax.core import outer
from dipaco_jax.core import paths


def _scale(active: int, cfg) -> float:
  root = math.sqrt(max(active, 1))
  if cfg.sqrt_paths_cap > 0:
    root = min(root, cfg.sqrt_paths_cap)
  if cfg.sqrt_paths == "multiply":
    return root if active else 0.0
  return 1.0 / root if cfg.sqrt_paths == "divide" else 1.0


def pseudo_gradients(store, params_W, alpha_W, topo, cfg):
  """({group: Δ shaped like the store}, {group: trained [K] bool}) in float64 loops."""
  alpha = np.asarray(alpha_W, np.float64)
  grads, trained = {}, {}
  for s in topo.store_groups():
    K, idx = s.num_modules, np.asarray(s.module_of_worker)
    trained[s.name] = np.array([alpha[idx == k].sum() > 0 for k in range(K)])

    def leaf(x_K, x_W, idx=idx, K=K):
      x_K, x_W = np.asarray(x_K, np.float64), np.asarray(x_W, np.float64)
      out = np.zeros_like(x_K)
      for k in range(K):
        ws = np.flatnonzero(idx == k)
        total = alpha[ws].sum()
        if total > 0:
          s_k = _scale(int((alpha[ws] > 0).sum()), cfg)
          out[k] = s_k * sum(alpha[w] * (x_K[k] - x_W[w]) for w in ws) / total
      return out.astype(np.float32)

    grads[s.name] = jax.tree.map(leaf, store[s.name], params_W[s.name])
  return grads, trained


def outer_step(store, opt_state, params_W, alpha_W, *, topo, cfg):
  """(store, outer state, worker params, {"delta_norm": {level: [K]}}) after one outer step."""
  tx = outer.optimizer(cfg)
  grads, trained = pseudo_gradients(store, params_W, alpha_W, topo, cfg)
  updates, new_opt = tx.update(grads, opt_state, store)
  new_store = optax.apply_updates(store, updates)

  def keep(new, old, m):  # An untrained module keeps its params and its momentum.
    m = np.asarray(m).reshape((-1,) + (1,) * (np.ndim(new) - 1))
    return np.where(m, np.asarray(new), np.asarray(old))

  masks = {g: jax.tree.map(lambda _, m=trained[g]: m, store[g]) for g in store}
  new_store = jax.tree.map(keep, new_store, store, masks)
  # The momentum's param-shaped parts take their module's mask; the rest (counts) are kept new.
  opt_masks = optax.tree_utils.tree_map_params(
    tx, lambda _, m: m, new_opt, masks, transform_non_params=lambda _: None
  )
  new_opt = jax.tree.map(
    lambda n, o, m: n if m is None else keep(n, o, m),
    new_opt,
    opt_state,
    opt_masks,
    is_leaf=lambda x: x is None,
  )
  sq = {}
  for s in topo.store_groups():
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads[s.name])]
    sq[s.level] = sq.get(s.level, 0.0) + sum(
      np.square(x).sum(axis=tuple(range(1, x.ndim))) for x in leaves
    )
  norms = {lvl: np.sqrt(v) for lvl, v in sq.items()}
  return new_store, new_opt, paths.assemble(new_store, topo), {"delta_norm": norms}
