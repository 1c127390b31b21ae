"""Outer executors: each owns some store groups and steps a module once all its workers reported.

`report(phase, worker)` records that task (phase, worker) is complete and
loads that worker's params for the executor's groups (online gathering). When
every worker through a module has reported, the module takes the outer step of
`outer.py` (`module_outer_step`: α, √P, Nesterov) on the workers' params in
WORKER order, so the result does not depend on the order reports arrive in.
Version t+1 of a module is a pure function of version t and the phase's task
outputs, written once to its own file: a delta can never be applied twice.

The executor's own state (reports received, modules stepped, per phase) is
snapshotted before each call returns, so an executor killed mid-phase comes
back (Ray restarts it without state) and carries on from the snapshot.
"""
# pylint: disable=invalid-name

import functools
import os

import jax
import numpy as np

from dipaco_jax import outer as outer_lib
from dipaco_jax.elastic import grid as grid_lib
from dipaco_jax.elastic import storage


def snapshot_file(workdir: str, index: int):
  return storage.root(workdir) / "executors" / f"x{index}.json"


def assign_groups(group_names, num_executors: int) -> list[list[str]]:
  """Store groups dealt round-robin to the executors (each gets at least one or none)."""
  out = [[] for _ in range(num_executors)]
  for i, g in enumerate(group_names):
    out[i % num_executors].append(g)
  return out


class OuterExecutor:
  """Owns `groups`; applies each module's outer step when its phase is complete."""

  def __init__(self, config, workdir: str, index: int, groups, alpha_W):
    self.grid = grid_lib.Grid(config)
    self.workdir, self.index, self.groups = str(workdir), int(index), list(groups)
    self.alpha_W = np.asarray(alpha_W, np.float32)
    self.outer_enabled = config.outer.enabled
    self._snap = snapshot_file(self.workdir, self.index)
    state = storage.load_json(self._snap) if self._snap.exists() else {}
    self.received = {int(k): set(v) for k, v in state.get("received", {}).items()}
    self.applied = {int(k): set(v) for k, v in state.get("applied", {}).items()}
    self._cache = {}  # (phase, group, worker) -> that worker's params of the group.
    self._steps = {}

  def pid(self) -> int:
    return os.getpid()

  def _snapshot(self) -> None:
    storage.save_json(
      self._snap,
      {
        "groups": self.groups,
        "received": {str(k): sorted(v) for k, v in self.received.items()},
        "applied": {str(k): sorted(v) for k, v in self.applied.items()},
      },
    )

  def _step_fn(self, group: str):
    if group not in self._steps:
      self._steps[group] = jax.jit(
        functools.partial(
          outer_lib.module_outer_step,
          group=group,
          level=self.grid.group[group].level,
          cfg=self.grid.outer_cfg,
        )
      )
    return self._steps[group]

  def _worker_params(self, phase: int, group: str, worker: int):
    key = (phase, group, worker)
    if key not in self._cache:
      path = storage.worker_out_dir(self.workdir, worker, phase + 1) / f"{group}.npz"
      self._cache[key] = storage.load_tree(path, self.grid.module_template(group))
    return self._cache[key]

  def _apply(self, phase: int, group: str, module: int, workers: list[int]) -> None:
    """Module (group, module): version phase -> phase + 1 from the workers, in worker order."""
    wd = self.workdir
    theta = storage.load_tree(
      storage.module_file(wd, group, module, phase), self.grid.module_template(group)
    )
    opt = storage.load_tree(
      storage.module_file(wd, group, module, phase, "opt"), self.grid.module_opt_template(group)
    )
    parts = [self._worker_params(phase, group, w) for w in workers]
    params_N = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
    if self.outer_enabled:
      theta, opt, _ = jax.device_get(
        self._step_fn(group)(theta, opt, params_N, self.alpha_W[workers])
      )
    else:  # No outer step: the module mirrors its first worker (train.py's sync_store).
      theta = parts[0]
    storage.save_tree(storage.module_file(wd, group, module, phase + 1, "opt"), opt)
    storage.save_tree(storage.module_file(wd, group, module, phase + 1), theta)

  def report(self, phase: int, worker: int) -> list[str]:
    """Task (phase, worker) is done; returns the modules this executor stepped in `phase`."""
    phase, worker = int(phase), int(worker)
    received = self.received.setdefault(phase, set())
    applied = self.applied.setdefault(phase, set())
    if worker not in received:
      received.add(worker)
      self._snapshot()
    for group in self.groups:
      module = int(self.grid.group[group].module_of_worker[worker])
      key = grid_lib.module_key(group, module)
      if key in applied:
        continue
      self._worker_params(phase, group, worker)  # Gathered as it arrives.
      workers = self.grid.workers_through(group, module)
      if all(w in received for w in workers):
        self._apply(phase, group, module, workers)
        applied.add(key)
        self._snapshot()
        for w in workers:
          self._cache.pop((phase, group, w), None)
    return sorted(k for k in applied if k.split("/")[0] in self.groups)
