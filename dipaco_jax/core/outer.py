"""The outer step: per-module averaged deltas (the pseudo-gradient), then Nesterov on the store.

For module e of a level (or a path-specific copy), over the workers w through
it and active this phase, with Δ_w = θ_e − θ_w each worker's own delta:

  Δ_e = Σ_w α_w Δ_w / Σ_w α_w      (α_w ∝ |D_w| or uniform)
  Δ_e ← Δ_e · √P_e  (or / √P_e, or unchanged: `sqrt_paths` config; √P_e capped
                     at `sqrt_paths_cap` when that is > 0)
  θ_e ← optax.sgd(lr, momentum, nesterov)(Δ_e)   — the pseudo-gradient Δ_e plays the gradient.

The pieces, shared by both runtimes: `weights` (α, √P per module and worker),
`average` (the pseudo-gradient of each module from its workers' deltas: per
level one assignment matrix [K, W] times the deltas [W, ...], a single
reduction over the worker axis), `apply` (Nesterov; a module with no active
worker keeps its params and its momentum). Two forms put them together:
`sharded_outer_step`, the spmd program over the mesh, whose reduction over
'path' is the one DCN exchange every H inner steps; and `module_outer_step`,
an elastic executor's step of one module from the deltas its workers wrote.
The one-device formula over all workers at once is the tests' oracle.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from dipaco_jax.config import sections
from dipaco_jax.core import sharding
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


def _delta(x_K: jax.Array, x_W: jax.Array, w_KxW: jax.Array, idx_W) -> jax.Array:
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


def _data_part(x: jax.Array, dim: int, ndata: int) -> jax.Array:
  """This device's 1 / ndata of `x` along `dim` (its coordinate on 'data')."""
  n = x.shape[dim] // ndata
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("data") * n, n, axis=dim)


def _leaf_on_mesh(x_K, x_L, spec, param_spec, s: topo_lib.StoreGroup, w_KxW, trained_K, shape):
  """One store leaf's pseudo-gradient on its layout, inside the shard_map (`sharded_outer_step`).

  Returns (the pseudo-gradient of the rows here, their trained mask, first
  row's index in K, a function from the new rows here to this device's L
  workers' params).
  """
  npath, ndata = shape["path"], shape["data"]
  p = jax.lax.axis_index("path")
  L = len(s.module_of_worker) // npath
  idx_W = s.module_of_worker
  idx_L = jnp.asarray(idx_W.reshape(npath, L))[p]
  w_KxL = jax.lax.dynamic_slice_in_dim(w_KxW, p * L, L, axis=1)
  j = sharding.path_dim(spec)
  if j == 0:  # K on 'path': this device's modules, read by its own workers only.
    if not sharding.owns_its_modules(s, npath):
      raise ValueError(f"store group {s.name}: K is on 'path' but its workers read other blocks.")
    k = s.num_modules // npath
    i_L = idx_L - p * k
    d = _delta(x_K, x_L, jax.lax.dynamic_slice_in_dim(w_KxL, p * k, k), i_L)
    return d, jax.lax.dynamic_slice_in_dim(trained_K, p * k, k), p * k, lambda new: new[i_L]
  if j is None:  # Replicated (K = 1): this device's workers' part, summed over 'path'.
    d = _delta(x_K, x_L, w_KxL, idx_L)  # The partial pseudo-gradient: what crosses 'path'.
    free = [i for i in range(1, d.ndim) if d.shape[i] % ndata == 0]
    if ndata > 1 and "data" not in sharding.spec_axes(spec) and free:
      # Each of a path's data-parallel devices sums its own part across paths.
      i = max(free, key=lambda i: d.shape[i])
      part = jax.lax.psum(_data_part(d, i, ndata), "path")
      d = jax.lax.all_gather(part, "data", axis=i, tiled=True)
    else:
      d = jax.lax.psum(d, "path")
    return d, trained_K, 0, lambda new: new[idx_L]
  # Dim j on 'path': every worker's slice j here; the pseudo-gradient of this slice of every
  # module. No device holds a whole module here, so a worker cannot form its own Δ_w: its params'
  # slices cross 'path' and the slice's owner forms the deltas. With 'data' there too (and not in
  # the params'), a device moves its part.
  split = "data" in sharding.spec_axes(spec[j : j + 1]) - sharding.spec_axes(param_spec[j : j + 1])
  x_W = jax.lax.all_to_all(_data_part(x_L, j, ndata) if split else x_L, "path", j, 0, tiled=True)
  d = _delta(x_K, x_W, w_KxW, idx_W)

  def to_workers(new):
    y = jax.lax.all_to_all(new[idx_W], "path", 0, j, tiled=True)
    return jax.lax.all_gather(y, "data", axis=j, tiled=True) if split else y

  return d, trained_K, 0, to_workers


def sharded_outer_step(topo: topo_lib.Topology, cfg: sections.OuterConfig, tx, mesh, specs):
  """The outer step over `mesh` (a shard_map), its collectives across 'path' written out.

  specs: the PartitionSpecs of (store, outer_opt, params). A device holds
  L = W / path workers; per store leaf of m bytes per module, its layout
  (sharding.store_specs) fixes what crosses 'path':
    K on 'path': the device's modules are its own workers' only: nothing.
    replicated (K = 1): its workers' part of the pseudo-gradient (their weighted
      deltas), summed over 'path' by one psum: m.
    an inner dim on 'path': an all_to_all gives each device its slice of all
      W workers' params (L m), it updates its slice of every module, and an
      all_to_all returns each worker its module's slices (L m).
  So at most 2 L m per leaf, whatever K and the 'data' axis, plus one psum of
  the ‖Δ‖ metric (ΣK float32). The same `weights`, `average` and `apply` as
  `module_outer_step` and the one-device formula; only the order of the sums
  may differ. `tx`: the outer optimizer (`optimizer(cfg)`, the recipe's).
  """
  store_specs, opt_specs, param_specs = specs

  def body(store, opt_state, params_L, alpha_W):
    pseudo_grads, masks, back, sq = {}, {}, {}, {}
    for s in topo.store_groups():
      w_KxW, norm_K, _ = weights(s, alpha_W, cfg)
      x_K, treedef = jax.tree.flatten(store[s.name])
      x_L = treedef.flatten_up_to(params_L[s.name])
      spec = treedef.flatten_up_to(store_specs[s.name])
      pspec = treedef.flatten_up_to(param_specs[s.name])
      d_K, m_K, back[s.name] = [], [], (treedef, [])
      for x, xl, sp, psp in zip(x_K, x_L, spec, pspec):
        d, m, row, to_workers = _leaf_on_mesh(x, xl, sp, psp, s, w_KxW, norm_K > 0, mesh.shape)
        d = d.astype(x.dtype)
        d_K.append(d)
        m_K.append(m)
        back[s.name][1].append(to_workers)
        part = jnp.sum(jnp.square(d.astype(jnp.float32)), axis=tuple(range(1, d.ndim)))
        part = jax.lax.dynamic_update_slice(jnp.zeros(s.num_modules, jnp.float32), part, (row,))
        for a in mesh.axis_names:  # A copy replicated over `a` is counted once.
          if a not in sharding.spec_axes(sp):
            part = jnp.where(jax.lax.axis_index(a) == 0, part, 0.0)
        sq[s.level] = sq.get(s.level, 0.0) + part
      pseudo_grads[s.name], masks[s.name] = treedef.unflatten(d_K), treedef.unflatten(m_K)
    new_store, new_opt_state = apply(tx, store, opt_state, pseudo_grads, masks)
    new_params = {
      g: t.unflatten([f(x) for f, x in zip(fs, t.flatten_up_to(new_store[g]))])
      for g, (t, fs) in back.items()
    }
    # The ‖Δ‖ metric in one psum of ΣK floats.
    levels = list(sq)
    total_sq = jax.lax.psum(jnp.concatenate([sq[lvl] for lvl in levels]), mesh.axis_names)
    cuts = np.cumsum([sq[lvl].shape[0] for lvl in levels])[:-1]
    norms = dict(zip(levels, jnp.split(jnp.sqrt(total_sq), cuts)))
    return new_store, new_opt_state, new_params, {"delta_norm": norms}

  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(store_specs, opt_specs, param_specs, PartitionSpec()),
    out_specs=(store_specs, opt_specs, param_specs, PartitionSpec()),
    # all_gather over 'data' returns equal copies, which the checker would
    # call varying; the metric's psum counts each copy once by masking.
    check_vma=False,
  )


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
  return new_theta, new_opt, {"delta_norm": norm}
