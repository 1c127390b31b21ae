"""Slice-local store groups: a level whose every module's workers sit in one TPU slice.

On a multislice mesh (sharding.make_mesh) 'path' spans S slices in blocks of
path / S coordinates. A store group whose module k is trained only by workers in
slice k // (K / S) (dipaco_16x16's level 1: 16 modules of 16 paths, four modules
a slice) needs no byte over the DCN in its outer step, yet splitting each module
over all of 'path' sends 1 - 1/S of its exchange between slices. Such a group is
stored with K over the slices and an inner dim over the part of 'path' inside a
slice, on a view of the same devices with 'path' cut in two (`slice_mesh`):
('slice', 'in_slice', 'data', 'model'). Its outer step then reduces over
'in_slice' alone (core/outer_layouts.py); every other array reads 'path' there as
('slice', 'in_slice'), the same devices in the same order.
"""
# pylint: disable=invalid-name

import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from dipaco_jax.core import topology

SLICE, IN_SLICE = "slice", "in_slice"
AXES = (SLICE, IN_SLICE, "data", "model")
PATH = (SLICE, IN_SLICE)  # 'path' on the sliced view.


def mesh_slices(mesh: Mesh) -> int:
  """The slices 'path' spans in equal blocks of coordinates (1 on one slice or another order)."""
  if "path" not in mesh.axis_names:
    return 1
  devs = np.asarray(mesh.devices)
  ids = np.vectorize(lambda d: getattr(d, "slice_index", 0))(devs)
  S = len(np.unique(ids))
  npath = mesh.shape["path"]
  if S < 2 or npath % S:
    return 1
  blocks = ids.reshape(S, -1)
  whole = np.all(blocks == blocks[:, :1]) and len(np.unique(blocks[:, 0])) == S
  return S if whole else 1


def slice_mesh(mesh: Mesh) -> Mesh:
  """The same devices as ('slice', 'in_slice', 'data', 'model'): 'path' cut at the slices."""
  S = mesh_slices(mesh)
  devs = np.asarray(mesh.devices).reshape(S, -1, mesh.shape["data"], mesh.shape["model"])
  return Mesh(devs, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def is_local(s: topology.StoreGroup, npath: int, S: int) -> bool:
  """Whether module k's workers all sit in slice k // (K / S), the same pattern in each slice.

  Workers sit on 'path' in blocks of W / npath (sharding.worker_specs), so slice i
  holds workers [i W / S, (i + 1) W / S).
  """
  K, W = s.num_modules, len(s.module_of_worker)
  if S < 2 or K % S or W % S or npath % S or K == 1:
    return False
  local = s.module_of_worker.reshape(S, W // S) - (np.arange(S) * (K // S))[:, None]
  return bool(np.all((local >= 0) & (local < K // S)) and np.all(local == local[:1]))


def local_view(s: topology.StoreGroup, S: int) -> topology.StoreGroup:
  """Slice i's part of a local group: K / S modules, W / S workers (the same in every slice)."""
  K, W = s.num_modules, len(s.module_of_worker)
  return topology.StoreGroup(s.name, s.level, s.module_of_worker[: W // S], K // S)


def names_slices(spec: P) -> bool:
  """Whether a spec is on the sliced view (it names 'slice' or 'in_slice')."""
  for entry in spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    if SLICE in names or IN_SLICE in names:
      return True
  return False


def on_slices(spec: P) -> P:
  """A spec of the ('path', 'data', 'model') mesh read on the sliced view (same devices)."""
  if names_slices(spec):
    return spec

  def one(entry):
    if entry == "path":
      return PATH
    if isinstance(entry, tuple) and "path" in entry:
      return tuple(a for e in entry for a in (PATH if e == "path" else (e,)))
    return entry

  return P(*(one(e) for e in spec))
