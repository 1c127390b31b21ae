"""What a streamed unit's task reads and keeps (outer.fragments, outer.overlap; fragments.py).

A unit starts from the store's modules where its schedule says so (`fresh`), from the
worker's own params that the task before it kept (`params_<group>.npz` in its outputs)
everywhere else, and, with overlap, lands the update of the sync two units back as the
spmd loop does (Experiment.jump, Experiment.land: θ + (θ_new − θ_t), each in the params'
dtype). Its deltas are taken against the store as the unit reads it, for the groups its
end syncs.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.runtime.elastic import storage


def params_file(workdir: str, worker: int, unit: int, group: str):
  """Worker `worker`'s own params of `group` after unit `unit` − 1 (in that task's outputs)."""
  return storage.worker_out_dir(workdir, worker, unit) / f"params_{group}.npz"


def store(grid, workdir: str, worker: int, unit: int, groups) -> tuple[dict, int]:
  """The worker's modules of `groups` as unit `unit` reads the store, and the bytes read."""
  parts, nbytes = {}, 0
  for g, e in grid.modules_of_worker(worker):
    if g in groups:
      f = storage.module_file(workdir, g, e, grid.sched.stored(unit, g))
      parts.update(storage.load_tree(f, grid.module_template(g)))
      nbytes += storage.size(f)
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


def start(grid, workdir: str, worker: int, unit: int) -> tuple[dict, int]:
  """The worker's params at unit `unit`'s start, and the store's bytes read for them."""
  s, names = grid.sched, [g for g, _ in grid.modules_of_worker(worker)]
  fresh = s.fresh(unit)
  params, nbytes = store(grid, workdir, worker, unit, fresh)
  params.update(own(grid, workdir, worker, unit, [g for g in names if g not in fresh]))
  land = s.landing(unit)
  if land:  # The sync at unit − 2's end: θ_new (version unit − 1) and the θ_t it was sent from.
    new, n = store(grid, workdir, worker, unit - 1, land)
    old = own(grid, workdir, worker, unit - 1, land)
    for g in land:  # Two operations, each rounded to the params' dtype, as the spmd programs.
      jump = jax.tree.map(jnp.subtract, new[g], old[g])
      params[g] = jax.device_get(jax.tree.map(jnp.add, params[g], jump))
    nbytes += n
  return {g: params[g] for g in names}, nbytes


def phase_params(exp, grid, workdir: str, phase: int):
  """Every worker's params at phase `phase`'s start (the spmd loop's at step phase * H)."""
  unit = grid.sched.first_unit(phase)
  per_worker = [start(grid, workdir, w, unit)[0] for w in range(grid.W)]
  params = jax.tree.map(lambda *xs: np.concatenate(xs), *per_worker)
  return jax.device_put(params, exp.state_sharding.params)
