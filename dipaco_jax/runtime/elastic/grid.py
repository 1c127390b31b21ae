"""What every elastic process derives from the config: modules, who reads them, array templates.

A *module* is one row e of one store group g (`"g/e"`); worker w reads module
`(g, module_of_worker[w])` of every group. Templates are abstract shapes, so a
process holds only the arrays it loads.
"""
# pylint: disable=invalid-name

import jax
import numpy as np

from dipaco_jax import routing
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.core import streaming
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import fragments
from dipaco_jax.types import PyTree


def module_key(group: str, module: int) -> str:
  return f"{group}/{module}"


class Grid:
  """The run's grid, modules and the abstract shapes of every stored item."""

  def __init__(self, config):
    self.config = config
    # The run's recipe: the model, both optimizers and the steps every process uses.
    self.recipe = recipe_lib.Recipe.from_config(config)
    self.topo = self.recipe.topo
    self.groups = self.topo.store_groups()
    self.group = {s.name: s for s in self.groups}
    self.W = self.topo.num_workers
    self.H, self.T = config.dipaco.inner_steps, config.dipaco.outer_steps
    # Outer steps after which a discriminative re-shard runs: tasks (t, ·) with t >= the k-th
    # read routing phase k's shards, and the outer steps of those phases use its α.
    self.reshard_steps = routing.discriminative_steps(config)
    self.theta = jax.eval_shape(self.recipe.init_params, jax.random.key(0))
    # The tasks' units (fragments.py): one per phase, or cut at a streamed sync's events.
    self.sched = self._schedule()
    self.U = self.sched.U  # Training tasks per worker; tasks (U, w) only evaluate.

  def _schedule(self) -> fragments.Schedule:
    r, names = self.recipe, [s.name for s in self.groups]
    if r.fragments == 1 and not r.overlap:
      return fragments.Schedule(self.H, self.T, fragment_of=tuple((g, 0) for g in names))
    # The spmd loop's split (Experiment.fragments): by the store's bytes, leaves [K, ...].
    store = jax.eval_shape(lambda k: r.init_state(k).store, jax.random.key(0))
    fragment_of = {g: f for f, part in enumerate(streaming.split(store, r.fragments)) for g in part}
    return fragments.Schedule(
      self.H,
      self.T,
      offsets=tuple(streaming.offset(f, r.fragments, self.H) for f in range(r.fragments - 1)),
      tau=r.overlap,
      fragment_of=tuple((g, fragment_of[g]) for g in names),
    )

  def routing_phase(self, phase: int) -> int:
    """The routing phase whose shards task `phase` trains on (re-shards at or before it)."""
    return sum(s <= phase for s in self.reshard_steps)

  def modules_of_worker(self, w: int) -> list[tuple[str, int]]:
    return [(s.name, int(s.module_of_worker[w])) for s in self.groups]

  def workers_through(self, group: str, module: int) -> list[int]:
    """Workers that read module `module` of `group`, in worker order."""
    return [int(w) for w in np.flatnonzero(self.group[group].module_of_worker == module)]

  def queue_plan(self) -> coord_lib.QueuePlan:
    """The coordinator's view of this run (plain values: its process imports no JAX)."""
    e = self.config.elastic
    return coord_lib.QueuePlan(
      workers=self.W,
      phases=self.U,
      reshard_steps=tuple(int(s) for s in self.reshard_steps),
      modules_of_worker=tuple(
        tuple(module_key(g, m) for g, m in self.modules_of_worker(w)) for w in range(self.W)
      ),
      timeout_s=float(e.task_timeout_s),
      slack=1 if e.quorum < 1.0 else 0,
      schedule=self.sched,
    )

  def used_modules(self) -> list[tuple[str, int]]:
    """Every module some worker reads (others never change)."""
    return [
      (s.name, e)
      for s in self.groups
      for e in range(s.num_modules)
      if self.workers_through(s.name, e)
    ]

  def module_template(self, group: str) -> PyTree:
    """One module of `group` as a one-row store: {group: leaves [1, ...]}."""
    return {
      group: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((1,) + x.shape, x.dtype), self.theta[group]
      )
    }

  def module_opt_template(self, group: str) -> PyTree:
    return jax.eval_shape(self.recipe.outer_tx.init, self.module_template(group))

  def ef_template(self, group: str) -> PyTree:
    """A worker's error-feedback residual of one group: the module's shapes, float32."""
    return jax.tree.map(
      lambda t: jax.ShapeDtypeStruct(t.shape, np.float32), self.module_template(group)
    )

  def delta_template(self, group: str) -> PyTree:
    """What a worker's delta file of `group` holds: float32, or the wire form's arrays."""
    if not self.recipe.compressed:
      return self.module_template(group)
    return self.recipe.wire_template(self.module_template(group))

  def params_template(self) -> PyTree:
    """One worker's params with a leading axis of 1 (as the SPMD program's per-device block)."""
    return {s.name: self.module_template(s.name)[s.name] for s in self.groups}

  def inner_opt_template(self) -> PyTree:
    return jax.eval_shape(jax.vmap(self.recipe.init_opt), self.params_template())
