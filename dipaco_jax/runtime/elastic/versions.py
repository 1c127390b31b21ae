"""The store in storage: version 0 written, any version read back, the final checkpoint.

The final store, momentum, worker params, AdamW states and data positions (and
early stopping's best set) are written as one orbax checkpoint in the
synchronous mode's layout, so evaluation and serving read an elastic workdir
like any other.
"""
# pylint: disable=invalid-name

import jax
import numpy as np

from dipaco_jax.core import paths as paths_lib
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.io import checkpoint as ckpt_lib
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic.errors import FORMAT

META = "meta.json"  # Under <workdir>/elastic (errors.META).


def _by_path(tree) -> dict:
  return {jax.tree_util.keystr(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _group_of(key: str, groups) -> str | None:
  return next((g for g in groups if f"['{g}']" in key), None)


def _module_rows(full, template, group: str, module: int):
  """Module `module`'s rows of a store-shaped tree (params or momentum), shaped like `template`."""
  rows = _by_path(full)
  leaves = []
  for kp, t in jax.tree_util.tree_flatten_with_path(template)[0]:
    x = np.asarray(rows[jax.tree_util.keystr(kp)])
    leaves.append(
      x[module : module + 1] if t.shape and t.shape[0] == 1 and x.ndim == len(t.shape) else x
    )
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def init_storage(config, workdir: str, exp, grid: grid_lib.Grid, alpha_W, theta) -> None:
  """Version 0 of every module and its momentum (θ̄ as the synchronous mode builds it)."""
  for path, tree in _version0(config, exp, grid, workdir, theta).items():
    storage.save_tree(path, tree)
  storage.save_json(
    storage.root(workdir) / META,
    {
      "mode": "elastic",
      "format": FORMAT,
      "workers": grid.W,
      "alpha_W": [float(a) for a in alpha_W],
    },
  )


def _version0(config, exp, grid: grid_lib.Grid, workdir: str, theta) -> dict:
  """{file: tree} of every module's version 0 and its momentum."""
  state = exp.init_state(config.seed, theta)
  store, outer_opt = jax.device_get((state.store, state.outer_opt))
  out = {}
  for s in grid.groups:
    for e in range(s.num_modules):
      out[storage.module_file(workdir, s.name, e, 0)] = _module_rows(
        store, grid.module_template(s.name), s.name, e
      )
      out[storage.module_file(workdir, s.name, e, 0, "opt")] = _module_rows(
        outer_opt, grid.module_opt_template(s.name), s.name, e
      )
  return out


def initial_modules(config, workdir: str, exp, grid: grid_lib.Grid) -> dict:
  """_version0 of a started run (θ̄ read again): repair.rebuild_modules's version 0."""
  theta = theta_lib.initial(config.dipaco.init_from, exp.recipe.abstract_params())
  return _version0(config, exp, grid, workdir, theta)


def _latest(workdir: str, group: str, module: int, kind: str, upto: int):
  """The newest stored version <= `upto` of a module (an unused module stays at version 0)."""
  for v in range(upto, -1, -1):
    path = storage.module_file(workdir, group, module, v, kind)
    if path.exists():
      return path
  raise FileNotFoundError(f"no version of module {group}/{module} under {storage.root(workdir)}")


def _store_at(workdir: str, grid: grid_lib.Grid, version: int) -> dict:
  """The whole store after `version` outer steps, leaves [K, ...] (the driver only)."""
  store = {}
  for s in grid.groups:
    mods = [
      storage.load_tree(_latest(workdir, s.name, e, "v", version), grid.module_template(s.name))
      for e in range(s.num_modules)
    ]
    store[s.name] = jax.tree.map(lambda *xs: np.concatenate(xs), *[m[s.name] for m in mods])
  return store


def paths_at(exp, grid: grid_lib.Grid, workdir: str, version: int):
  """Every worker's params at module version `version`, on the driver's device."""
  params = paths_lib.assemble(_store_at(workdir, grid, version), grid.topo)
  return jax.device_put(params, exp.state_sharding.params)


def final_state(config, workdir: str, exp, grid: grid_lib.Grid):
  """The synchronous mode's TrainState after T outer steps, from storage (the one full copy)."""
  U = grid.U  # Versions and worker files count units (T, unless streamed: fragments.py).
  store = _store_at(workdir, grid, U)
  opt_parts = {
    s.name: [
      _by_path(
        storage.load_tree(_latest(workdir, s.name, e, "opt", U), grid.module_opt_template(s.name))
      )
      for e in range(s.num_modules)
    ]
    for s in grid.groups
  }
  groups = [s.name for s in grid.groups]
  full_opt = jax.eval_shape(grid.recipe.outer_tx.init, store)
  leaves = []
  for kp, t in jax.tree_util.tree_flatten_with_path(full_opt)[0]:
    key = jax.tree_util.keystr(kp)
    g = _group_of(key, groups)
    parts = [p[key] for p in opt_parts[g]] if g else [opt_parts[groups[0]][0][key]]
    leaves.append(np.concatenate(parts) if g and t.shape else np.asarray(parts[0]))
  outer_opt = jax.tree.unflatten(jax.tree.structure(full_opt), leaves)
  opts = [
    storage.load_tree(storage.worker_opt_file(workdir, w, U), grid.inner_opt_template())
    for w in range(grid.W)
  ]
  inner_opt = jax.tree.map(lambda *xs: np.concatenate(xs), *opts)
  data = {str(w): storage.load_json(storage.worker_data_file(workdir, w, U)) for w in range(grid.W)}
  state = recipe_lib.TrainState(
    step=np.asarray(grid.H * grid.T, np.int32),
    rng=np.asarray(jax.random.key_data(jax.random.key(config.seed))),
    store=store,
    outer_opt=outer_opt,
    params=paths_lib.assemble(store, grid.topo),
    inner_opt=inner_opt,
  )
  if grid.recipe.feedback:  # Each worker's error-feedback residual after the last phase.
    efs = [
      {
        g: storage.load_tree(storage.ef_file(workdir, w, U, g), grid.ef_template(g))[g]
        for g, _ in grid.modules_of_worker(w)
      }
      for w in range(grid.W)
    ]
    state = grid.recipe.with_ef(state, jax.tree.map(lambda *xs: np.concatenate(xs), *efs))
  if grid.recipe.overlap:  # The spmd state's update in flight: none after the last step.
    state = grid.recipe.with_jump(state, grid.recipe.init_jump(state.params))
  state = jax.device_put(state, exp.state_sharding)
  return state, data


def save_final(config, workdir: str, exp, grid: grid_lib.Grid, plan, best) -> None:
  """The run's final checkpoint after T outer steps (kept if a rerun finds it written)."""
  ckpt = ckpt_lib.Checkpointer(workdir, max_to_keep=config.ckpt.max_to_keep, async_save=False)
  if ckpt.latest_step() != grid.H * grid.T:
    state, data = final_state(config, workdir, exp, grid)
    assert plan.phase == grid.routing_phase(grid.T), (plan.phase, grid.reshard_steps)
    routing_state = {"phase": plan.phase, "assignment": plan.shard_set.meta.get("assignment")}
    data_state = {"train": data, "routing": routing_state}
    ckpt.save(grid.H * grid.T, state, data_state, best=best.saved() if best else None)
  ckpt.close()
