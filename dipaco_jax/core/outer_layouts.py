"""The spmd outer step on the mesh: one function per store layout, and the shard_map program.

The math is outer.py's (`weights`, `worker_deltas`, `average`, `apply`, the codec
calls); this module says where each piece runs and what crosses 'path'. A device
holds L = W / path workers; per store leaf of m bytes per module, its layout
(sharding.store_specs) fixes the exchange:

  `_own`             K on 'path': the device's modules are its own workers' only;
                     nothing crosses.
  `_replicated`      K = 1 (or no dim split over 'path'): its workers' part of the
                     pseudo-gradient, summed over 'path' by one psum: m.
  `_replicated_coded`  the same, compressed: each worker's codes dealt by rows to
                     their owners (all_to_all: L m / r), decoded and summed in float32
                     there, the sums all_gathered back (m).
  `_split`           an inner dim on 'path': each device gets its slice of all W
                     workers' params (all_to_all: L m), updates its slice of every
                     module, and each worker gets its module's slices back (L m).
  `_split_coded`     the same, compressed: each worker's Δ_w (from its phase-start
                     copy) crosses as codes (L m / r); the update comes back as codes
                     too where the blocks allow, else as the new slices.

So at most 2 L m per leaf, whatever K and the 'data' axis, plus one psum of the
‖Δ‖ metric (ΣK float32). A slice-local group (core/slices.py: each module's workers
in one TPU slice) runs `_split`/`_split_coded` (or `_replicated*`) on its slice's
modules over 'in_slice' alone, the program on the sliced view of the mesh: none of
its bytes cross the DCN.
"""
# pylint: disable=invalid-name

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dipaco_jax.config import sections
from dipaco_jax.core import compression as comp
from dipaco_jax.core import outer
from dipaco_jax.core import sharding
from dipaco_jax.core import slices
from dipaco_jax.core import topology as topo_lib


def _data_part(x: jax.Array, dim: int, ndata: int) -> jax.Array:
  """This device's 1 / ndata of `x` along `dim` (its coordinate on 'data')."""
  n = x.shape[dim] // ndata
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("data") * n, n, axis=dim)


@dataclasses.dataclass(frozen=True)
class _Here:
  """One store group as this device sees it inside the shard_map: its workers and weights.

  A slice-local group (core/slices.py) sees its slice's modules and workers only, and
  its exchange crosses 'in_slice'; any other crosses all of 'path'.
  """

  s: topo_lib.StoreGroup  # The whole group (its K rows in the ‖Δ‖ metric).
  idx_W: np.ndarray  # Each worker's module among the rows here (of the slice's, if local).
  w_KxW: jax.Array  # Each worker's weight in each module's Δ (outer.weights).
  trained_K: jax.Array  # Modules with an active worker this phase.
  shape: dict  # The mesh's axis sizes.
  cfg: sections.OuterConfig
  ax: str | tuple = "path"  # The axis the exchange crosses ('path', or its sliced names).
  row0: int | jax.Array = 0  # The first row here's index in K (a local group's slice).

  @property
  def inner(self) -> str:  # The name that marks the exchanged dim in a spec (path_dim).
    return self.ax if isinstance(self.ax, str) else self.ax[-1]

  @property
  def npath(self) -> int:
    axes = (self.ax,) if isinstance(self.ax, str) else self.ax
    return int(np.prod([self.shape[a] for a in axes]))

  @property
  def ndata(self) -> int:
    return self.shape["data"]

  @property
  def p(self) -> jax.Array:
    return jax.lax.axis_index(self.ax)

  @property
  def L(self) -> int:  # Workers per device.
    return len(self.idx_W) // self.npath

  @property
  def idx_L(self) -> jax.Array:  # This device's workers' modules.
    return jnp.asarray(self.idx_W.reshape(self.npath, self.L))[self.p]

  @property
  def w_KxL(self) -> jax.Array:  # This device's workers' weights.
    return jax.lax.dynamic_slice_in_dim(self.w_KxW, self.p * self.L, self.L, axis=1)


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One store leaf's outer step here: what `sharded_outer_step` assembles."""

  d: jax.Array  # The pseudo-gradient of the rows here.
  trained: jax.Array  # Their trained mask.
  row: int | jax.Array  # The first row's index in K.
  to_workers: Callable  # (new rows here, the update's wire form or None) -> the L workers' params.
  e_new: jax.Array | None  # The L workers' next error-feedback residual (None: no feedback).


def _own(x_K, x_L, here: _Here, e_L) -> _Leaf:
  """K on 'path': this device's modules, read by its own workers only; nothing crosses."""
  s, p = here.s, here.p
  if not sharding.owns_its_modules(s, here.npath):
    raise ValueError(f"store group {s.name}: K is on 'path' but its workers read other blocks.")
  k = s.num_modules // here.npath
  i_L = here.idx_L - p * k
  w = jax.lax.dynamic_slice_in_dim(here.w_KxL, p * k, k)
  d_L, e_new = outer.worker_deltas(x_K, x_L, i_L), None
  if here.cfg.compression != "none":  # The owner reads what its workers would send.
    _, d_L, e_new = outer.sent(here.cfg, d_L, e_L)
  d = outer.average(w, d_L)
  trained = jax.lax.dynamic_slice_in_dim(here.trained_K, p * k, k)
  return _Leaf(d, trained, p * k, lambda new, _: new[i_L], e_new)


def _replicated(x_K, x_L, spec, here: _Here) -> _Leaf:
  """K = 1: this device's workers' part of the pseudo-gradient, summed over 'path'."""
  ndata, idx_L = here.ndata, here.idx_L
  free = lambda d: [i for i in range(1, d.ndim) if d.shape[i] % ndata == 0]
  data_split = lambda d: ndata > 1 and "data" not in sharding.spec_axes(spec) and free(d)
  d = outer.delta(x_K, x_L, here.w_KxL, idx_L)  # The partial pseudo-gradient: what crosses.
  if data_split(d):
    # Each of a path's data-parallel devices sums its own part across paths.
    i = max(free(d), key=lambda i: d.shape[i])
    part = jax.lax.psum(_data_part(d, i, ndata), here.ax)
    d = jax.lax.all_gather(part, "data", axis=i, tiled=True)
  else:
    d = jax.lax.psum(d, here.ax)
  return _Leaf(d, here.trained_K, 0, lambda new, _: new[idx_L], None)


def _rows_to_owners(enc_L, n: int, cfg, w_KxL, ndata: int, split_data: bool, ax):
  """The L workers' wire rows to their owners, summed in float32 there, gathered back.

  Each worker's rows (every leading module dim folded into R rows of n values) are
  dealt over 'path' (all_to_all of the codes and scales: the low-precision payload
  crosses), the owner of a set of rows decodes every worker's and forms their
  weighted sum in float32, and an all_gather returns the float32 sums to every device.
  Returns the pseudo-gradient [K, R, n] (K = 1).
  """
  npath = jax.lax.axis_size(ax)
  parts = npath * (ndata if split_data else 1)
  R = enc_L["q"].shape[1]
  pad = -R % parts
  enc = {k: jnp.pad(v, [(0, 0), (0, pad), (0, 0)]) for k, v in enc_L.items()}
  if split_data:
    enc = {k: _data_part(v, 1, ndata) for k, v in enc.items()}
  got = {k: jax.lax.all_to_all(v, ax, 1, 0, tiled=True) for k, v in enc.items()}
  w_KxW = jax.lax.all_gather(w_KxL, ax, axis=1, tiled=True)
  d = outer.average(
    w_KxW, comp.decode(got, cfg.compression, cfg.compression_block, n, cfg.compression_keep)
  )
  d = jax.lax.all_gather(d, ax, axis=1, tiled=True)
  if split_data:
    d = jax.lax.all_gather(d, "data", axis=1, tiled=True)
  return d[:, :R]


def _replicated_coded(x_K, x_L, spec, here: _Here, e_L) -> _Leaf:
  """K = 1, compressed: the workers' codes cross 'path'; their owners sum in float32."""
  cfg, idx_L = here.cfg, here.idx_L
  d_L = outer.worker_deltas(x_K, x_L, idx_L)
  enc, _, e_new = outer.sent(cfg, d_L, e_L)
  rows = comp.as_rows(d_L)
  n = rows.shape[-1]
  enc = {k: v.reshape(v.shape[0], -1, v.shape[-1]) for k, v in enc.items()}
  split = here.ndata > 1 and "data" not in sharding.spec_axes(spec)
  d = _rows_to_owners(enc, n, cfg, here.w_KxL, here.ndata, split, here.ax)
  # K = 1, or a K > 1 leaf that no dim of splits over 'path' (sharding._with_path).
  return _Leaf(d.reshape(x_K.shape), here.trained_K, 0, lambda new, _: new[idx_L], e_new)


def _slices_back(here: _Here, j: int, split: bool, x0_L) -> Callable:
  """The split layouts' way back: each worker's module's new slices (or the update's codes)."""
  idx_W, cfg = here.idx_W, here.cfg

  def to_workers(new, wire):
    if wire is not None:  # The update's codes cross; each worker rebuilds from its start copy.
      got = {k: jax.lax.all_to_all(v[idx_W], here.ax, 0, j, tiled=True) for k, v in wire.items()}
      if split:
        got = {k: jax.lax.all_gather(v, "data", axis=j, tiled=True) for k, v in got.items()}
      return outer.apply_update(x0_L, got, cfg)
    y = jax.lax.all_to_all(new[idx_W], here.ax, 0, j, tiled=True)
    return jax.lax.all_gather(y, "data", axis=j, tiled=True) if split else y

  return to_workers


def _split_axis(spec, param_spec, here: _Here) -> tuple[int, bool]:
  """(j, the dim on 'path'; whether 'data' splits it in the store but not in the params)."""
  j = sharding.path_dim(spec, here.inner)
  data = sharding.spec_axes(spec[j : j + 1]) - sharding.spec_axes(param_spec[j : j + 1])
  return j, "data" in data


def _split(x_K, x_L, spec, param_spec, here: _Here) -> _Leaf:
  """Dim j on 'path': each worker's params' slices to the slice's owner, which forms the deltas.

  No device holds a whole module here, so a worker cannot form its own Δ_w; the owner of
  slice j forms the pseudo-gradient of that slice of every module. With 'data' there too
  (and not in the params'), a device moves its part.
  """
  j, split = _split_axis(spec, param_spec, here)
  part = _data_part(x_L, j, here.ndata) if split else x_L
  x_W = jax.lax.all_to_all(part, here.ax, j, 0, tiled=True)
  d = outer.delta(x_K, x_W, here.w_KxW, here.idx_W)
  return _Leaf(d, here.trained_K, 0, _slices_back(here, j, split, None), None)


def _split_coded(x_K, x_L, spec, param_spec, here: _Here, e_L, x0_L) -> _Leaf:
  """Dim j on 'path', compressed: each worker's Δ_w (from its phase-start copy x0_L) as codes.

  Its codes and scales cross 'path' cut along dim j, as its params were, and the
  slice's owner decodes them. Where j is the last dim and a block would straddle two
  owners, the decoded float32 values cross instead (the same numbers).
  """
  cfg, kind, npath, ndata = here.cfg, here.cfg.compression, here.npath, here.ndata
  j, split = _split_axis(spec, param_spec, here)
  d_L = x0_L.astype(jnp.float32) - x_L.astype(jnp.float32)
  enc, value, e_new = outer.sent(cfg, d_L, e_L)
  n = comp.as_rows(d_L).shape[-1]
  last = j == x_L.ndim - 1
  parts = npath * (ndata if split else 1)
  part = n // parts
  aligned = "s" not in enc or (
    n % parts == 0
    and part % comp.block_size(n, cfg.compression_block) == 0
    and (kind != "fp4" or part % 2 == 0)
  )
  if last and not aligned:  # Blocks would straddle the owners: the decoded values cross.
    enc, kind_here = {"q": value}, "none"
  else:
    kind_here = kind
  cut = lambda v: _data_part(v, j, ndata) if split else v
  got = {k: jax.lax.all_to_all(cut(v), here.ax, j, 0, tiled=True) for k, v in enc.items()}
  n_here = part if last else n
  dec = comp.decode(got, kind_here, cfg.compression_block, n_here, cfg.compression_keep)
  d = outer.average(here.w_KxW, dec)
  return _Leaf(d, here.trained_K, 0, _slices_back(here, j, split, x0_L), e_new)


def _leaf(x_K, x_L, spec, param_spec, here: _Here, e_L, x0_L) -> _Leaf:
  """One store leaf's outer step on its layout (the module docstring's table)."""
  j = sharding.path_dim(spec, here.inner)
  coded = here.cfg.compression != "none"
  if j == 0:
    return _own(x_K, x_L, here, e_L)
  if j is None:
    return (
      _replicated_coded(x_K, x_L, spec, here, e_L) if coded else _replicated(x_K, x_L, spec, here)
    )
  if coded:
    return _split_coded(x_K, x_L, spec, param_spec, here, e_L, x0_L)
  return _split(x_K, x_L, spec, param_spec, here)


def _downlink_here(old, new, spec, cfg, shape):
  """This device's part of one store leaf: (old + decoded update, its wire form or None).

  The blocks are the whole leaf's (as an elastic executor's on a whole module): where
  the leaf's last axis is split over devices and a block would straddle two of them, the
  float32 update is gathered along that axis, coded whole, and this device takes its
  part; the wire is then None (the rebuilt params cross instead: the same numbers).
  """
  axes = sharding.last_axes(spec, old.ndim)
  parts = int(np.prod([shape[a] for a in axes])) if axes else 1
  kind, block = cfg.compression, cfg.compression_block
  n = comp.as_rows(old).shape[-1]
  b = comp.block_size(n * parts, block)
  if parts == 1 or kind == "bf16" or n % b == 0:
    enc = outer.encode_update(old, new, cfg)
    packs = parts == 1 or kind != "fp4" or n % 2 == 0  # fp4 pairs that no cut splits.
    return outer.apply_update(old, enc, cfg), (enc if packs else None)
  u = comp.as_rows(new.astype(jnp.float32) - old.astype(jnp.float32))
  whole = jax.lax.all_gather(u, axes, axis=u.ndim - 1, tiled=True)
  dec = comp.roundtrip(whole, kind, block, cfg.compression_keep)
  mine = jax.lax.dynamic_slice_in_dim(dec, jax.lax.axis_index(axes) * n, n, axis=u.ndim - 1)
  return (old.astype(jnp.float32) + mine.reshape(old.shape)).astype(old.dtype), None


def _here(s: topo_lib.StoreGroup, alpha_W, cfg, shape, ax) -> _Here:
  """Group `s` as this device sees it; ax None: slice-local, its slice's modules and workers."""
  w_KxW, norm_K, _ = outer.weights(s, alpha_W, cfg)
  if ax is not None:
    return _Here(s, s.module_of_worker, w_KxW, norm_K > 0, shape, cfg, ax)
  v = slices.local_view(s, shape[slices.SLICE])
  K, W = v.num_modules, len(v.module_of_worker)
  i = jax.lax.axis_index(slices.SLICE)
  w = jax.lax.dynamic_slice(w_KxW, (i * K, i * W), (K, W))
  trained = jax.lax.dynamic_slice_in_dim(norm_K > 0, i * K, K)
  return _Here(s, v.module_of_worker, w, trained, shape, cfg, slices.IN_SLICE, i * K)


def _group(store_g, params_g, specs_g, pspecs_g, here: _Here, ef_g, start_g, mesh, sq):
  """One store group's leaves on their layouts: (pseudo-gradients, masks, way back, ‖Δ‖², ef).

  sq: its level's ‖Δ‖² per module so far, which each leaf's adds to.
  """
  x_K, treedef = jax.tree.flatten(store_g)
  flat = lambda t: [None] * len(x_K) if t is None else treedef.flatten_up_to(t)
  leaves = zip(x_K, flat(params_g), flat(specs_g), flat(pspecs_g), flat(ef_g), flat(start_g))
  d_K, m_K, e_K, back = [], [], [], []
  for x, xl, sp, psp, e, x0 in leaves:
    leaf = _leaf(x, xl, sp, psp, here, e, x0)
    e_K.append(leaf.e_new)
    d = leaf.d.astype(x.dtype)
    d_K.append(d)
    m_K.append(leaf.trained)
    back.append(leaf.to_workers)
    part = jnp.sum(jnp.square(d.astype(jnp.float32)), axis=tuple(range(1, d.ndim)))
    part = jax.lax.dynamic_update_slice(
      jnp.zeros(here.s.num_modules, jnp.float32), part, (here.row0 + leaf.row,)
    )
    for a in mesh.axis_names:  # A copy replicated over `a` is counted once.
      if a not in sharding.spec_axes(sp):
        part = jnp.where(jax.lax.axis_index(a) == 0, part, 0.0)
    sq = sq + part
  ef = None if ef_g is None else treedef.unflatten(e_K)
  return treedef.unflatten(d_K), treedef.unflatten(m_K), (treedef, back), sq, ef


def sharded_outer_step(
  topo: topo_lib.Topology, cfg: sections.OuterConfig, tx, mesh, specs, groups=None
):
  """The outer step over `mesh` (a shard_map), its collectives across 'path' written out.

  specs: the PartitionSpecs of (store, outer_opt, params); each store leaf runs on its
  layout (the module docstring). tx: the outer optimizer (`outer.optimizer(cfg)`). The
  same `weights`, `average` and `apply` as `outer.module_outer_step` and the one-device
  formula: only the order of the sums may differ. groups: the store groups this step
  syncs (a fragment of outer.fragments), None for all; another group crosses nothing and
  keeps its modules, momentum, workers' params, residuals, and stays out of the ‖Δ‖ metric.

  Compressed (`cfg.compression` != "none"): (store, opt, params, α, ef, start) -> (store,
  opt, params, metrics, ef), ef each worker's error-feedback residual ({} without feedback),
  start each worker's phase-start params (`paths.assemble(store)`); the update comes back
  coded too (`outer.downlink`, on the store and at every worker).
  """
  is_spec = lambda x: isinstance(x, PartitionSpec)
  names_slices = lambda t: any(
    slices.names_slices(sp) for sp in jax.tree.leaves(t, is_leaf=is_spec)
  )
  local = {s.name for s in topo.store_groups() if names_slices(specs[0][s.name])}
  if local:  # Every array read on the sliced view (the same devices; core/slices.py).
    mesh = slices.slice_mesh(mesh)
    specs = jax.tree.map(slices.on_slices, specs, is_leaf=is_spec)
  ax = slices.PATH if local else "path"
  store_specs, opt_specs, param_specs = specs
  compressed = cfg.compression != "none"
  feedback = compressed and cfg.error_feedback

  def body(store, opt_state, params_L, alpha_W, ef_L=None, start_L=None):
    ef_L = ef_L if feedback else None
    pseudo_grads, masks, back, sq, new_ef = {}, {}, {}, {}, {}
    for s in topo.store_groups():
      if groups is not None and s.name not in groups:  # Not this fragment's: it stays.
        pseudo_grads[s.name] = jax.tree.map(jnp.zeros_like, store[s.name])
        masks[s.name] = jax.tree.map(lambda x: jnp.zeros(x.shape[:1], bool), store[s.name])
        if ef_L is not None:
          new_ef[s.name] = ef_L[s.name]
        continue
      here = _here(s, alpha_W, cfg, mesh.shape, ax if s.name not in local else None)
      pick = lambda t, g=s.name: None if t is None else t[g]
      d, m, back[s.name], sq[s.level], e = _group(
        store[s.name],
        params_L[s.name],
        store_specs[s.name],
        param_specs[s.name],
        here,
        pick(ef_L),
        pick(start_L),
        mesh,
        sq.get(s.level, 0.0),
      )
      pseudo_grads[s.name], masks[s.name] = d, m
      if ef_L is not None:
        new_ef[s.name] = e
    new_store, new_opt_state = outer.apply(tx, store, opt_state, pseudo_grads, masks)
    wires = {}
    if compressed:  # The downlink: old + decode(C(update)) on the store and at every worker.
      for g, (t, _) in back.items():
        here = [
          _downlink_here(o, n, sp, cfg, mesh.shape)
          for o, n, sp in zip(
            t.flatten_up_to(store[g]),
            t.flatten_up_to(new_store[g]),
            t.flatten_up_to(store_specs[g]),
          )
        ]
        new_store[g] = t.unflatten([x for x, _ in here])
        wires[g] = [w for _, w in here]
    new_params = {
      g: t.unflatten(
        [
          f(x, w)
          for f, x, w in zip(fs, t.flatten_up_to(new_store[g]), wires.get(g, [None] * len(fs)))
        ]
      )
      for g, (t, fs) in back.items()
    }
    new_params = {g: new_params.get(g, params_L[g]) for g in params_L}  # Unsynced groups stay.
    out = new_store, new_opt_state, new_params, {"delta_norm": _norms(sq, mesh)}
    return (*out, new_ef) if compressed else out

  in_specs = (store_specs, opt_specs, param_specs, PartitionSpec())
  out_specs = (store_specs, opt_specs, param_specs, PartitionSpec())
  if compressed:
    ef_specs = param_specs if feedback else {}
    in_specs, out_specs = (*in_specs, ef_specs, param_specs), (*out_specs, ef_specs)
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    # all_gather over 'data' returns equal copies, which the checker would
    # call varying; the metric's psum counts each copy once by masking.
    check_vma=False,
  )


def _norms(sq: dict, mesh) -> dict:
  """‖Δ‖ per module of each level from this device's squares: one psum of ΣK floats."""
  levels = list(sq)
  total_sq = jax.lax.psum(jnp.concatenate([sq[lvl] for lvl in levels]), mesh.axis_names)
  cuts = np.cumsum([sq[lvl].shape[0] for lvl in levels])[:-1]
  return dict(zip(levels, jnp.split(jnp.sqrt(total_sq), cuts)))
