"""The outer step: per-module averaged deltas (the pseudo-gradient), then Nesterov on the store.

For module e of a level (or a path-specific copy), over the workers w through
it and active this phase, with Δ_w = θ_e − θ_w each worker's own delta:

  Δ_e = Σ_w α_w Δ_w / Σ_w α_w      (α_w ∝ |D_w| or uniform)
  Δ_e ← Δ_e · √P_e  (or / √P_e, or unchanged: `sqrt_paths` config; √P_e capped
                     at `sqrt_paths_cap` when that is > 0)
  θ_e ← optax.sgd(lr, momentum, nesterov)(Δ_e)   — the pseudo-gradient Δ_e plays the gradient.

The pieces, shared by both runtimes (the lines to hold against the paper's
Algorithm 1): `weights` (α, √P per module and worker), `worker_deltas` and
`average` (the pseudo-gradient of each module from its workers' deltas: per
level one assignment matrix [K, W] times the deltas [W, ...], a single
reduction over the worker axis), `apply` (Nesterov; a module with no active
worker keeps its params and its momentum) and, with outer.compression, the
codec's calls (`sent` on the way out, `downlink` on the way back). Two forms put
them together: `module_outer_step` here, an elastic executor's step of one
module from the deltas its workers wrote, and `outer_layouts.sharded_outer_step`,
the spmd program over the mesh (one function per store layout), whose reduction
over 'path' is the one DCN exchange every H inner steps. The one-device formula
over all workers at once is the tests' oracle (tests/outer_oracle.py).
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax.config import sections
from dipaco_jax.core import compression as comp
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.types import PyTree


def optimizer(cfg: sections.OuterConfig) -> optax.GradientTransformation:
  """SGD with (Nesterov) momentum; momentum 0 means plain SGD."""
  return optax.sgd(
    cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov and cfg.momentum > 0
  )


def weights(s: topo_lib.StoreGroup, alpha_W: jax.Array, cfg: sections.OuterConfig):
  """Each worker's weight in each module's Δ [K, W] (α-mean and √P folded in), Σα [K], P [K]."""
  sqrt_paths, sqrt_paths_cap = cfg.sqrt_paths, cfg.sqrt_paths_cap
  onehot_KxW = jax.nn.one_hot(s.module_of_worker, s.num_modules, dtype=jnp.float32).T
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
  return a_KxW * (scale_K / jnp.maximum(norm_K, 1e-30))[:, None], norm_K, count_K


def worker_deltas(x_K: jax.Array, x_W: jax.Array, idx_W) -> jax.Array:
  """Each worker's own delta Δ_w = θ_k(w) − θ_w of one leaf, in float32."""
  return x_K[idx_W].astype(jnp.float32) - x_W.astype(jnp.float32)


def average(w_KxW: jax.Array, delta_W: jax.Array) -> jax.Array:
  """Σ_w w_kw Δ_w: each module's pseudo-gradient, one reduction over the workers."""
  return jnp.einsum("kw,w...->k...", w_KxW, delta_W)


def delta(x_K: jax.Array, x_W: jax.Array, w_KxW: jax.Array, idx_W) -> jax.Array:
  """The pseudo-gradient of one leaf from the workers' params (`average` of `worker_deltas`)."""
  return average(w_KxW, worker_deltas(x_K, x_W, idx_W))


def _where_trained(new: PyTree, old: PyTree, masks: PyTree) -> PyTree:
  """Leaf-wise `where(trained_K, new, old)`; a None mask keeps `new`."""
  mask_leaves = jax.tree.leaves(masks, is_leaf=lambda x: x is None)
  kept = [
    n if m is None else jnp.where(m.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    for n, o, m in zip(jax.tree.leaves(new), jax.tree.leaves(old), mask_leaves)
  ]
  return jax.tree.unflatten(jax.tree.structure(new), kept)


def apply(tx, store: PyTree, opt_state: PyTree, pseudo_grads: PyTree, masks: PyTree):
  """The store's step with the pseudo-gradient as the gradient; a module masked False keeps all."""
  updates, new_opt_state = tx.update(pseudo_grads, opt_state, store)
  # An untrained module keeps its params and momentum (its Δ is 0, but
  # momentum alone would still move it).
  new_store = _where_trained(optax.apply_updates(store, updates), store, masks)
  opt_masks = optax.tree_utils.tree_map_params(
    tx, lambda _, m: m, new_opt_state, masks, transform_non_params=lambda _: None
  )
  return new_store, _where_trained(new_opt_state, opt_state, opt_masks)


def encode_update(old: jax.Array, new: jax.Array, cfg) -> dict:
  """The downlink's wire form of one leaf's update new − old (float32 rows, no feedback)."""
  u = comp.as_rows(new.astype(jnp.float32) - old.astype(jnp.float32))
  return comp.encode(u, cfg.compression, cfg.compression_block, cfg.compression_keep)


def apply_update(old: jax.Array, enc: dict, cfg) -> jax.Array:
  """old + decode(update): a module as every holder of `old` rebuilds it from the downlink."""
  n = comp.as_rows(old).shape[-1]
  dec = comp.decode(enc, cfg.compression, cfg.compression_block, n, cfg.compression_keep)
  dec = dec.reshape(old.shape)
  return (old.astype(jnp.float32) + dec).astype(old.dtype)


def downlink(old: PyTree, new: PyTree, cfg) -> tuple[PyTree, PyTree]:
  """(wire, rebuilt): each leaf's update new − old encoded, and old + its decoded value.

  The owner of a module sends the update of its outer step, compressed as the workers'
  deltas are (outer.compression, blocks along the last axis), and every holder (the
  store too) takes old + decode(update). No error feedback on the way back: what the
  codes drop of one step's update is lost (docs/communication.md).
  """
  wire = jax.tree.map(lambda o, n: encode_update(o, n, cfg), old, new)
  is_wire = lambda x: isinstance(x, dict) and "q" in x
  rebuilt = jax.tree.map(lambda o, e: apply_update(o, e, cfg), old, wire, is_leaf=is_wire)
  return wire, rebuilt


def sent(cfg, d_L, e_L):
  """Each worker's sent value of one leaf [L, ...]: (wire form of rows, its decoded value, e').

  The codec's call with error feedback (core/compression.py): the rows of Δ + e coded,
  their decoded value, and the next residual Δ + e − C(Δ + e) (None without feedback).
  """
  rows = comp.as_rows(d_L)
  e = None if e_L is None else comp.as_rows(e_L)
  enc, value, e_new = comp.with_feedback(
    rows, e, cfg.compression, cfg.compression_block, cfg.compression_keep
  )
  back = lambda y: None if y is None else y.reshape(d_L.shape)
  return enc, back(value), back(e_new)


def module_outer_step(
  theta: PyTree,
  opt_state: PyTree,
  deltas_N: PyTree,
  alpha_N: jax.Array,
  *,
  tx: optax.GradientTransformation,
  cfg: sections.OuterConfig,
):
  """The outer step of ONE module from the deltas of the N workers through it (an executor's).

  theta: {group: leaves [1, ...]}; opt_state: `tx.init(theta)`; deltas_N:
  {group: leaves [N, ...]}, each worker's own Δ_w = θ − θ_w (`worker_deltas`),
  in worker order. The same `weights` (α, √P with P = the N active workers),
  `average` and `apply` as the spmd program; returns (theta, opt_state, metrics).
  With `cfg.compression` the update crosses compressed (`downlink`): theta is old +
  decode(C(update)) and metrics["update"] the wire form the executor writes.
  """
  (group,) = theta
  n = jax.tree.leaves(deltas_N)[0].shape[0]
  one = topo_lib.StoreGroup(group, "", np.zeros(n, np.int32), 1)
  w_1xN, norm_1, _ = weights(one, alpha_N, cfg)
  pseudo_grads = jax.tree.map(
    lambda x, d: average(w_1xN, d.astype(jnp.float32)).astype(x.dtype), theta, deltas_N
  )
  masks = jax.tree.map(lambda _: norm_1 > 0, theta)
  new_theta, new_opt = apply(tx, theta, opt_state, pseudo_grads, masks)
  norm = jnp.sqrt(
    sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(pseudo_grads))
  )
  if cfg.compression == "none":
    return new_theta, new_opt, {"delta_norm": norm}
  wire, new_theta = downlink(theta, new_theta, cfg)
  return new_theta, new_opt, {"delta_norm": norm, "update": wire}
