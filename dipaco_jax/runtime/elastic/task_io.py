"""A worker task's inputs and outputs in storage: shards, modules, residuals, progress saves.

Mixed into worker.PathWorker (which sets config, workdir, grid, recipe, the
programs and the caches these read). A task reads only versioned inputs (the
path's modules at version `phase`, the worker's AdamW state and data position
at `phase`) and writes versioned outputs for `phase + 1`, so a retry writes the
same bytes. With outer.compression a module the actor still holds from its last
task is rebuilt from the compressed update (`_receive`, downlink.py).
"""
# pylint: disable=invalid-name

import functools

import jax

from dipaco_jax import data as data_lib
from dipaco_jax import routing
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import storage


def write_all(writes, plan: faults_lib.Plan, kind: str) -> None:
  """Runs `writes` in order, telling the fault plan after each one."""
  for n, write in enumerate(writes, 1):
    write()
    plan.at("wrote", kind=kind, n=n, of=len(writes))


class TaskStorage:
  """PathWorker's reads and writes of its tasks' files (a mixin: see the module)."""

  def _shards(self, k: int) -> data_lib.ShardSet:
    """Routing phase k's shard set."""
    if k not in self._shard_sets:
      self._shard_sets[k] = data_lib.ShardSet(routing.shard_dir(self.config, self.workdir, k))
    return self._shard_sets[k]

  def _batcher(self, worker: int, k: int) -> data_lib.WorkerBatcher:
    d = self.config.data
    return data_lib.WorkerBatcher(
      self._shards(k),
      "train",
      [worker],
      seq_len=d.seq_len,
      batch_size=d.batch_size,
      seed=d.seed,
      holdout=self._rest,
      interleave=d.interleave,
    )

  def _load_groups(self, worker: int, file_of, template=None):
    """Worker `worker`'s params (or a params-shaped tree): each group's from file_of(group, e)."""
    template = template or self.grid.module_template
    parts = {}
    for g, e in self.grid.modules_of_worker(worker):
      parts.update(storage.load_tree(file_of(g, e), template(g)))
    return parts

  def _load_params(self, phase: int, worker: int):
    """The path's modules at version `phase` (the store)."""
    return self._load_groups(worker, lambda g, e: storage.module_file(self.workdir, g, e, phase))

  def _receive(self, phase: int, worker: int):
    """The path's modules at version `phase` and the bytes read for them (the downlink).

    With outer.compression, a module this actor holds at version phase − 1 (its last
    task read it) is rebuilt from the compressed update u<phase> (downlink.py: the same
    bytes as v<phase>); any other is read whole.
    """
    parts, nbytes = {}, 0
    mods = self.grid.modules_of_worker(worker)
    for g, e in mods:
      tree, n = self._link.module(g, e, phase)
      parts.update(tree)
      nbytes += n
    self._link.keep(mods)
    return parts, nbytes

  def _group_writes(self, file_of, tree, worker: int, groups=None) -> list:
    """Writes of worker `worker`'s groups (those in `groups`, if given) of `tree` to file_of(g)."""
    return [
      functools.partial(storage.save_tree, file_of(g), {g: tree[g]})
      for g, _ in self.grid.modules_of_worker(worker)
      if groups is None or g in groups
    ]

  def _residual(self, phase: int, worker: int):
    """The worker's error-feedback residual at the start of `phase` (zeros at phase 0)."""
    if phase == 0:
      return self.recipe.init_ef(self.grid.params_template())
    return self._load_groups(
      worker,
      lambda g, _: storage.ef_file(self.workdir, worker, phase, g),
      template=lambda g: self.grid.ef_template(g),
    )

  def _saved_progress(self, phase: int, worker: int):
    """Task (phase, worker)'s newest complete mid-task save: (record, folder), or None."""
    at = storage.progress_dir(self.workdir, worker, phase) / "at.json"
    if not at.exists():
      return None
    rec = storage.load_json(at)
    if rec.get("H") != self.grid.H or not 0 < rec.get("step", 0) < self.grid.H:
      raise ValueError(
        f"{at} records step {rec.get('step')} of a task of {rec.get('H')} inner steps, but "
        f"dipaco.inner_steps is {self.grid.H}: rerun with the config that wrote this workdir, "
        "or use a new --workdir."
      )
    return rec, at.parent / f"s{rec['step']:06d}"

  def _save_progress(self, phase, worker, rec, params, opt, batcher, plan) -> None:
    """A mid-task save after rec["step"] inner steps; at.json names it once it is complete."""
    top = storage.progress_dir(self.workdir, worker, phase)
    folder = top / f"s{rec['step']:06d}"
    params, opt = jax.device_get((params, opt))
    writes = self._group_writes(lambda g: folder / f"{g}.npz", params, worker)
    writes.append(functools.partial(storage.save_tree, folder / "opt.npz", opt))
    writes.append(functools.partial(storage.save_json, folder / "data.json", batcher.get_state()))
    writes.append(functools.partial(storage.save_json, top / "at.json", rec))
    write_all(writes, plan, "progress")
    for old in top.glob("s*"):  # The saves before this one.
      if old.name != folder.name:
        old.rmtree(missing_ok=True)
