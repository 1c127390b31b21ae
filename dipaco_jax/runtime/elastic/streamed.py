"""What a streamed unit's task reads and keeps (outer.fragments, outer.overlap; fragments.py).

A unit starts from the store's modules where its schedule says so (`fresh`), from the
worker's own params that the task before it kept (`params_<group>.npz` in its outputs)
everywhere else, and, with overlap, lands the update of the sync two units back as the
spmd loop does (Experiment.jump, Experiment.land: θ + (θ_new − θ_t), each in the params'
dtype). Its deltas are taken against the store as the unit reads it, for the groups its
end syncs. The store's modules come through the actor's downlink (downlink.py): with
outer.compression, a fragment's new version is rebuilt from the executor's update codes,
as an unstreamed task's modules are, wherever the actor holds the version before it.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.runtime.elastic import downlink
from dipaco_jax.runtime.elastic import storage


def params_file(workdir: str, worker: int, unit: int, group: str):
  """Worker `worker`'s own params of `group` after unit `unit` − 1 (in that task's outputs)."""
  return storage.worker_out_dir(workdir, worker, unit) / f"params_{group}.npz"


def store(grid, worker: int, unit: int, groups, link) -> tuple[dict, int]:
  """The worker's modules of `groups` as unit `unit` reads the store, and the bytes read.

  Through `link` (downlink.py): with outer.compression, rebuilt from the update's codes
  where the actor holds the version the update starts from.
  """
  parts, nbytes = {}, 0
  for g, e in grid.modules_of_worker(worker):
    if g in groups:
      tree, n = link.module(g, e, grid.sched.stored(unit, g))
      parts.update(tree)
      nbytes += n
  return parts, nbytes


def own(grid, workdir: str, worker: int, unit: int, groups) -> dict:
  """The worker's own params of `groups` as task `unit` − 1 left them."""
  parts = {}
  for g, _ in grid.modules_of_worker(worker):
    if g in groups:
      parts.update(
        storage.load_tree(params_file(workdir, worker, unit, g), grid.module_template(g))
      )
  return parts


def start(grid, workdir: str, worker: int, unit: int, link) -> tuple[dict, int]:
  """The worker's params at unit `unit`'s start, and the store's bytes read for them."""
  s, names = grid.sched, [g for g, _ in grid.modules_of_worker(worker)]
  fresh = s.fresh(unit)
  params, nbytes = store(grid, worker, unit, fresh, link)
  params.update(own(grid, workdir, worker, unit, [g for g in names if g not in fresh]))
  land = s.landing(unit)
  if land:  # The sync at unit − 2's end: θ_new (version unit − 1) and the θ_t it was sent from.
    new, n = store(grid, worker, unit - 1, land, link)
    old = own(grid, workdir, worker, unit - 1, land)
    for g in land:  # Two operations, each rounded to the params' dtype, as the spmd programs.
      jump = jax.tree.map(jnp.subtract, new[g], old[g])
      params[g] = jax.device_get(jax.tree.map(jnp.add, params[g], jump))
    nbytes += n
  return {g: params[g] for g in names}, nbytes


def inputs(grid, workdir: str, worker: int, unit: int, link, need_ref: bool = True):
  """Unit `unit`'s reads, all before it trains: (start, against, phase start, bytes read).

  `start`: its params; `against`: the store its deltas are taken against (its end's
  groups at the version the unit reads: written once, so the same at its end);
  `phase start`: the params its phase's first unit started from (the guard's reference),
  None where `need_ref` is false (the actor kept their norms). That one is read on the
  side (a new actor mid-phase), whole, not through `link`: an older version there would
  displace the one the next update rebuilds from. The link then keeps this path's
  modules only.
  """
  s = grid.sched
  params, nbytes = start(grid, workdir, worker, unit, link)
  against = {}
  if unit < s.U:
    against, n = store(grid, worker, unit, s.synced(unit), link)
    nbytes += n
  first, ref = s.first_unit(s.phase(unit)), None
  if unit == first:
    ref = params
  elif need_ref:
    ref, n = start(grid, workdir, worker, first, downlink.Downlink(grid, workdir))
    nbytes += n
  link.keep(grid.modules_of_worker(worker))
  return params, against, ref, nbytes


def phase_params(exp, grid, workdir: str, phase: int):
  """Every worker's params at phase `phase`'s start (the spmd loop's at step phase * H)."""
  unit, link = grid.sched.first_unit(phase), downlink.Downlink(grid, workdir)
  per_worker = [start(grid, workdir, w, unit, link)[0] for w in range(grid.W)]
  params = jax.tree.map(lambda *xs: np.concatenate(xs), *per_worker)
  return jax.device_put(params, exp.state_sharding.params)
