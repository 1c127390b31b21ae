"""The mesh ('path', 'data', 'model') and the shardings of every array.

The leading worker axis of per-path arrays lives on 'path'; on a TPU
multislice 'path' spans slices over DCN while 'data' and 'model' stay inside a
slice on ICI. Inside a path, matrices are split over 'model' (tensor
parallel) by parameter name and batches over 'data'. With FSDP
(config.mesh.fsdp) every matrix and its optimizer state is also split over
'data' on its largest dim not on 'model' (d_model in this model): the model
all-gathers it where a block uses it (`gathered`) and sums its gradient over
'data' into each device's shard (a reduce-scatter, or an all-reduce that each
device then slices, as the compiler chooses), both inside a path.
"""
# pylint: disable=invalid-name

import functools
import math
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax.core import compression as comp
from dipaco_jax.core import slices
from dipaco_jax.core import topology
from dipaco_jax.errors import ConfigError
from dipaco_jax.types import PyTree

AXES = ("path", "data", "model")

# Which dim of a parameter (by its name) is split over 'model'.
_MODEL_DIM = {
  "token": 0,
  "query": 1,
  "key": 1,
  "value": 1,
  "out": 0,
  "mlp_in": 1,
  "mlp_gate": 1,
  "mlp_out": 0,
  "unembed": 1,
}


class MeshError(ConfigError):
  """A mesh (config.mesh) that does not fit the devices or the grid."""


def _num_slices(devices: Sequence[Any], requested: int) -> int:
  """The slices the devices form; a requested count they do not form is refused (MeshError)."""
  found = len({getattr(d, "slice_index", 0) for d in devices})
  if requested > 0 and requested != found:
    raise MeshError(
      f"config.mesh.num_slices={requested} but the {len(devices)} {devices[0].platform} devices "
      f"form {found} slice(s): set num_slices={found}, or 0 to take it from the devices."
    )
  return found


def check_path_axis(path: int, num_workers: int) -> None:
  """Every group of the 'path' axis trains the same number of workers."""
  if num_workers % path:
    raise MeshError(
      f"the 'path' mesh axis has {path} device groups, which does not divide "
      f"the {num_workers} workers (paths x replicas): choose config.mesh.path "
      "among the divisors of the worker count, or change the grid."
    )


def check_batch_divides(batch_size: int, data_axis: int) -> None:
  """The 'data' mesh axis splits every path's batch evenly."""
  if batch_size % data_axis:
    raise MeshError(
      f"config.data.batch_size={batch_size} is not divisible by the 'data' mesh "
      f"axis ({data_axis}): make the batch a multiple of it or set "
      "config.mesh.data to a divisor of the batch."
    )


def check_microbatches(batch_size: int, microbatches: int, data_axis: int) -> None:
  """inner.microbatches splits every path's batch into microbatches the 'data' axis divides."""
  if batch_size % (microbatches * data_axis):
    raise MeshError(
      f"config.inner.microbatches={microbatches} does not split config.data.batch_size="
      f"{batch_size} into equal microbatches over the 'data' mesh axis ({data_axis}): choose a "
      "divisor of batch_size / mesh.data."
    )


def make_mesh(mesh_cfg, num_workers: int, devices=None) -> Mesh:
  """Builds the mesh; the 'path' axis (over DCN on multislice) must divide W.

  Physical torus axes may be split (data = 4 on an 8x8 v5e slice): a path
  then holds a 2x2 block of chips rather than a whole torus axis.
  """
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  path, data, model = int(mesh_cfg["path"]), int(mesh_cfg["data"]), int(mesh_cfg["model"])
  fixed = model * (data if data > 0 else 1) * (path if path > 0 else 1)
  if model < 1 or n % fixed:
    raise MeshError(
      f"mesh path={path} x data={data} x model={model} does not divide the "
      f"{n} devices: set config.mesh.* to divisors of the device count "
      "(-1 = derive)."
    )
  if path == -1:  # As many path groups as divide both the rest and W.
    path = math.gcd(num_workers, n // fixed)
  if data == -1:  # Whatever is left goes to data parallelism.
    data = n // (path * model)
  if path * data * model != n:
    raise MeshError(
      f"mesh path={path} x data={data} x model={model} = "
      f"{path * data * model} but there are {n} devices: make the product "
      "equal the device count (-1 derives an axis)."
    )
  check_path_axis(path, num_workers)
  slices = _num_slices(devices, int(mesh_cfg["num_slices"]))
  if slices > 1:
    if path % slices:
      raise MeshError(
        f"{slices} slices but path axis {path}: the path axis spans slices, "
        "so it must be a multiple of the slice count."
      )
    arr = mesh_utils.create_hybrid_device_mesh(
      (path // slices, data, model), (slices, 1, 1), devices, allow_split_physical_axes=True
    )
  else:
    arr = mesh_utils.create_device_mesh(
      (path, data, model), devices, allow_split_physical_axes=True
    )
  return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * 3)


def _inner_spec(name: str, shape: Sequence[int], model_size: int, fsdp_size: int = 0) -> list:
  """PartitionSpec entries for one path's parameter (no leading axis).

  fsdp_size > 0: a matrix also goes over 'data' (of that size) on its largest
  dim that is not the 'model' dim and that it divides; vectors stay whole.
  """
  spec = [None] * len(shape)
  dim = _MODEL_DIM.get(name)
  if dim is not None and dim < len(shape) and shape[dim] % model_size == 0:
    spec[dim] = "model"
  if fsdp_size and len(shape) >= 2:
    free = [i for i in range(len(shape)) if i != dim and shape[i] % fsdp_size == 0]
    if free:
      spec[max(free, key=lambda i: shape[i])] = "data"
  return spec


def _leaf_name(key_path) -> str:
  """The module name that owns a leaf, e.g. 'mlp_in' for .../mlp_in/kernel."""
  keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in key_path]
  keys = [str(k) for k in keys]
  if keys and keys[-1] in ("kernel", "scale") and len(keys) > 1:
    return keys[-2]
  return keys[-1] if keys else ""


def stacked_specs(tree: PyTree, mesh: Mesh, *, leading: str | None, fsdp: bool = False) -> PyTree:
  """Specs for a tree whose leaves have a leading stacked axis (W or K).

  `leading` names the mesh axis for that axis ('path', 'slice' or None = replicate);
  fsdp also splits each matrix over 'data' (see _inner_spec).
  """
  msize = mesh.shape["model"]
  fsize = mesh.shape["data"] if fsdp else 0

  def spec(kp, x):
    return P(leading, *_inner_spec(_leaf_name(kp), x.shape[1:], msize, fsize))

  return jax.tree_util.tree_map_with_path(spec, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _for_use(x, use: NamedSharding, held: NamedSharding):
  return jax.lax.with_sharding_constraint(x, use)


def _for_use_fwd(x, use, held):
  return _for_use(x, use, held), None


def _for_use_bwd(use, held, _, g):
  # The gradient goes straight to the held (FSDP) layout: each device reduces only its own
  # shard over 'data' (a reduce-scatter), never the whole gradient (an all-reduce).
  return (jax.lax.with_sharding_constraint(g, held),)


_for_use.defvjp(_for_use_fwd, _for_use_bwd)


def gathered(tree: PyTree, mesh: Mesh) -> PyTree:
  """One path's FSDP params (no leading axis) all-gathered over 'data' for use.

  Each leaf is constrained to its spec without 'data' (split over 'model' only), its
  gradient to its FSDP spec (worker_specs'): the step then gathers each weight where it is
  used and reduce-scatters its gradient, rather than keeping the weight split and summing the
  activations over 'data'. Under the workers' vmap (spmd_axis_name='path') 'path' joins each.
  """
  msize, fsize = mesh.shape["model"], mesh.shape["data"]

  def one(kp, x):
    name = _leaf_name(kp)
    use = NamedSharding(mesh, P(*_inner_spec(name, x.shape, msize)))
    held = NamedSharding(mesh, P(*_inner_spec(name, x.shape, msize, fsize)))
    return _for_use(x, use, held)

  return jax.tree_util.tree_map_with_path(one, tree)


def worker_specs(params_W: PyTree, mesh: Mesh, fsdp: bool = False) -> PyTree:
  return stacked_specs(params_W, mesh, leading="path", fsdp=fsdp)


def owns_its_modules(s: topology.StoreGroup, npath: int) -> bool:
  """Whether splitting K over 'path' gives each device exactly its own workers' modules.

  Workers sit on 'path' in blocks of W / npath (worker_specs); module k in
  blocks of K / npath. A private copy per path always qualifies, so does the
  first level of a grid when its K is a multiple of the 'path' axis.
  """
  K, W = s.num_modules, len(s.module_of_worker)
  return K % npath == 0 and bool(
    np.all(s.module_of_worker // (K // npath) == np.arange(W) // (W // npath))
  )


def _with_path(
  spec: P,
  shape: Sequence[int],
  mesh: Mesh,
  fsdp: bool,
  coding: tuple[str, int] | None = None,
  axis: str = "path",
) -> P:
  """`spec` with 'path' (or `axis`: 'in_slice', core/slices.py) also on one inner dim.

  Without FSDP the modules are also split over 'data' on that dim where it
  divides, so that each of a path's data-parallel devices moves its own part.
  Of the dims that divide, one no other axis (of more than one device) uses
  goes first, then one that is not the last (a compressed outer step codes
  blocks along the last axis, outer.compression, and a cut across it may split
  a block between owners, which then get float32 values, not codes), then the
  largest. `coding` = (outer.compression, its block) where the step codes
  blocks: a stack of matrices [K, ..., n] is not cut on its last dim where an
  owner's part would not hold whole blocks (it stays replicated instead, and its
  codes still cross up, dealt by rows); a stack of vectors [K, n] is (its rows
  are few: dealt over every owner they would be mostly padding).
  Unchanged when no dim divides: that leaf stays replicated over 'path'.
  """
  added = [(axis,)] if fsdp or mesh.shape["data"] == 1 else [("data", axis), (axis,)]
  for axes in added:
    best = None
    for i in range(1, len(shape)):
      other = spec[i] if i < len(spec) else None
      n = math.prod(mesh.shape[a] for a in axes) * (mesh.shape[other] if other else 1)
      free = other is None or mesh.shape[other] == 1  # An axis of one device splits nothing.
      key = (free, i < len(shape) - 1, shape[i])
      if coding and len(shape) >= 3 and i == len(shape) - 1 and shape[i] % n == 0:
        kind, block = coding
        part = shape[i] // n
        if part % comp.block_size(shape[i], block) or (kind == "fp4" and part % 2):
          continue  # Blocks would straddle owners: float32 would cross, not codes.
      if shape[i] % n == 0 and (best is None or key > best[0]):
        best = (key, i, other)
    if best is not None:
      entries = list(spec) + [None] * (len(shape) - len(spec))
      _, i, other = best
      entries[i] = ((other,) if other else ()) + axes
      return P(*entries)
  return spec


def store_specs(
  store: PyTree,
  mesh: Mesh,
  topo: topology.Topology,
  fsdp: bool = False,
  compression: tuple[str, int] | None = None,
) -> PyTree:
  """Each store group's layout over 'path', which fixes the outer step's collectives.

  K on 'path' where each device then holds just its own workers' modules
  (`owns_its_modules`); replicated when K = 1; otherwise every module split
  over 'path' on one inner dim (`_with_path`), so that no device holds, and
  no outer step moves, the dense [K, ...] store (outer.sharded_outer_step).
  `compression` = (outer.compression, outer.compression_block), None when the
  step sends float32: K = 1 is split on an inner dim too, so that its update
  crosses back coded (the replicated layout sends codes up but gathers the
  float32 sums back, as each device runs Nesterov on the whole module); a kind
  that codes blocks also fixes where a leaf may be cut (`_with_path`).
  On a multislice mesh, a group whose modules' workers each sit in one slice
  (`slices.is_local`) has K on 'slice' and an inner dim on 'in_slice' of the
  sliced view (core/slices.py): its exchange stays inside each slice (the
  same numbers as the whole-'path' layout, fewer bytes and less memory: no switch).
  """
  npath = mesh.shape["path"]
  S = slices.mesh_slices(mesh)
  compressed = compression is not None
  coding = compression if compressed and compression[0] in comp.BLOCKED else None
  out = {}
  for s in topo.store_groups():
    sub = store[s.name]
    if owns_its_modules(s, npath):
      out[s.name] = stacked_specs(sub, mesh, leading="path", fsdp=fsdp)
    elif slices.is_local(s, npath, S):
      view = slices.slice_mesh(mesh)
      specs = stacked_specs(sub, mesh, leading=slices.SLICE, fsdp=fsdp)
      out[s.name] = jax.tree.map(
        lambda sp, x, v=view: _with_path(sp, x.shape, v, fsdp, coding, slices.IN_SLICE),
        specs,
        sub,
        is_leaf=lambda x: isinstance(x, P),
      )
    elif s.num_modules == 1 and not compressed:
      out[s.name] = stacked_specs(sub, mesh, leading=None, fsdp=fsdp)
    else:
      specs = stacked_specs(sub, mesh, leading=None, fsdp=fsdp)
      out[s.name] = jax.tree.map(
        lambda sp, x: _with_path(sp, x.shape, mesh, fsdp, coding),
        specs,
        sub,
        is_leaf=lambda x: isinstance(x, P),
      )
  return out


def path_dim(spec: P, axis: str = "path") -> int | None:
  """The dim that 'path' (or `axis`) splits in a spec (alone or with another axis), or None."""
  for i, entry in enumerate(spec):
    if entry == axis or (isinstance(entry, tuple) and axis in entry):
      return i
  return None


def spec_axes(spec: P) -> set[str]:
  """Every mesh axis a spec names."""
  out = set()
  for entry in spec:
    out.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
  return out


def opt_state_specs(
  tx: optax.GradientTransformation, state: PyTree, param_specs: PyTree, *, leading: str | None
) -> PyTree:
  """Optimizer state specs: param-shaped parts follow the params.

  A part that holds only some of the params (optax.partition's, inner.optimizer="muon") keeps a
  MaskedNode where it holds none.
  """

  def other(x):
    nd = getattr(x, "ndim", 0)
    return P(leading) if (nd >= 1 and leading) else P()

  return optax.tree_utils.tree_map_params(
    tx,
    lambda x, s: x if isinstance(x, optax.MaskedNode) else s,
    state,
    param_specs,
    transform_non_params=other,
    is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)),
  )


def batch_spec() -> P:
  """[W, B, T] batches: workers on 'path', examples on 'data'."""
  return P("path", "data")


def named(mesh: Mesh, specs: PyTree) -> PyTree:
  """NamedShardings of `specs` on `mesh`, a slice-local store's on its sliced view."""
  view = None

  def one(s):
    nonlocal view
    if not slices.names_slices(s):
      return NamedSharding(mesh, s)
    view = view or slices.slice_mesh(mesh)
    return NamedSharding(view, s)

  return jax.tree.map(one, specs, is_leaf=lambda x: isinstance(x, P))


def describe(mesh: Mesh) -> str:
  return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES) + (
    f" on {np.asarray(mesh.devices).size} {jax.devices()[0].platform} devices"
  )


def check_block(params: PyTree, specs: PyTree, shape, cfg) -> None:
  """ConfigError unless each device's part of a last axis split over 'model' holds whole blocks.

  (Or over 'data', with FSDP.)
  A worker codes its Δ_w where it lies, each device its own part of a leaf: the blocks
  are the whole leaf's (an elastic worker's) only where no block straddles two parts.
  params: [W, ...] leaves (shapes), specs: their PartitionSpecs, shape: the mesh's.
  """
  if cfg.compression in ("none", "bf16"):
    return
  block, bad, parts_all = cfg.compression_block, None, []
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (kp, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
    # Axes of one device split nothing: the leaf's row is whole there (padded as any row).
    axes = [a for a in last_axes(spec, x.ndim) if a != "path" and shape[a] > 1]
    if not axes:
      continue
    n = x.shape[-1]
    part = n // int(np.prod([shape[a] for a in axes]))
    parts_all.append(part)
    if bad is None and part % comp.block_size(n, block):
      bad = (jax.tree_util.keystr(kp), n, "x".join(f"'{a}'" for a in axes), part)
  if bad is None:
    return
  g = int(np.gcd.reduce(parts_all))
  fit = max(d for d in range(1, min(block, g) + 1) if g % d == 0)
  leaf, n, axes, part = bad
  raise ConfigError(
    f"config.outer.compression_block={block} puts a block across devices: {leaf}'s last axis "
    f"({n}) is split over {axes} into parts of {part}; choose a block that divides every "
    f"such part, e.g. config.outer.compression_block={fit}."
  )


def last_axes(spec, ndim: int) -> tuple:
  """The mesh axes splitting a leaf's last axis (as `as_rows` sees it: none for a 1-D leaf)."""
  if ndim < 2 or len(spec) < ndim or spec[ndim - 1] is None:
    return ()
  e = spec[ndim - 1]
  return tuple(e) if isinstance(e, tuple) else (e,)
