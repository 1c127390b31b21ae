"""Damaged elastic storage: one line from the driver, and the rerun that redoes what was moved.

Every file of elastic storage is read checked (storage.py): a damaged one is a
DamagedFileError naming it and the file or folder to move aside. Raised inside a
worker or an executor, it reaches the driver as Ray's RayTaskError; `task_error`
turns it back into the error itself, so the command prints its one line, not
Ray's traceback. The queue's and executors' own records are read here first
(`check_records`), before an actor could fail on them at its start.

Each file is a pure function of others, so the rerun after the move writes the
same bytes again:
  * a task's outputs (`workers/w<w>/out<t>/`, its AdamW state and data position):
    `forget_lost_outputs` takes the task off the queue's results, so it runs again;
  * a module's version t, momentum or update (`store/...`): `rebuild_modules`
    applies phase t-1's outer step again in the driver (version 0: θ̄ again);
  * the queue's results of a phase: its tasks run again; the queue's snapshot, an
    executor's snapshot, a phase's α, meta.json: rebuilt by the rerun as it starts.
One damaged file at a time: a module rebuilt from deltas that were moved aside
too waits for their task, which the line then names.
"""

from absl import logging

from dipaco_jax import errors
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage


def task_error(err) -> BaseException:
  """A RayTaskError's own error when the user can act on it (damage, divergence); else Ray's."""
  cause = getattr(err, "cause", None)
  if isinstance(cause, BaseException) and errors.is_user_error(cause):
    return cause
  return err.as_instanceof_cause()


def check_records(workdir: str, grid: grid_lib.Grid) -> None:
  """Reads the queue's and executors' records and the phases' α: one line if one is damaged."""
  root = storage.root(workdir)
  if not root.exists():
    return
  if (root / coord_lib.SNAPSHOT).exists():
    storage.load_json(root / coord_lib.SNAPSHOT)
  coord_lib.read_results(workdir)
  for j in range(grid.config.elastic.num_executors):
    snap = exec_lib.snapshot_file(workdir, j)
    if snap.exists():
      storage.load_json(snap)
  for f in root.glob("alpha_phase*.json"):
    storage.load_json(f)


def forget_lost_outputs(workdir: str, grid: grid_lib.Grid) -> None:
  """Accepted tasks whose outputs were moved aside leave the queue's results: they run again."""
  folder = storage.root(workdir) / coord_lib.RESULTS
  for phase, f in storage.numbered(folder, "results").items():
    if phase >= grid.U:  # Evaluation-only tasks write no outputs.
      continue
    results = storage.load_json(f)
    lost = [
      w
      for w in results
      if not (storage.worker_out_dir(workdir, int(w), phase + 1) / "done.json").exists()
    ]
    for w in lost:
      out = storage.worker_out_dir(workdir, int(w), phase + 1)
      logging.info("elastic: task (phase %d, worker %s) runs again: %s is gone", phase, w, out)
      del results[w]
    if lost:
      storage.save_json(f, results)


def _versions(workdir: str) -> dict[str, int]:
  """The module versions the queue recorded (none if its snapshot is gone)."""
  snap = storage.root(workdir) / coord_lib.SNAPSHOT
  return dict(storage.load_json(snap)["versions"]) if snap.exists() else {}


def rebuild_modules(config, workdir: str, grid: grid_lib.Grid, alpha_W, initial) -> None:
  """Writes every module file missing below the newest version stored or recorded.

  `initial()`: {file: tree} of version 0 (θ̄, computed only if a version-0 file is missing).
  Phase t-1's outer step is applied again for a missing version t, as its executor did.
  """
  recorded = _versions(workdir)
  kinds = ("v", "opt") + (("u",) if grid.recipe.compressed and config.outer.enabled else ())
  owner = {
    g: j
    for j, groups in enumerate(
      exec_lib.assign_groups([s.name for s in grid.groups], config.elastic.num_executors)
    )
    for g in groups
  }
  missing = []  # (version, group, module)
  for s in grid.groups:
    for e in range(s.num_modules):
      folder = storage.module_file(workdir, s.name, e, 0).parent
      have = {k: set(storage.numbered(folder, k, ".npz")) for k in kinds}
      top = max(have["v"] | have["opt"] | {recorded.get(grid_lib.module_key(s.name, e), 0)})
      for t in range(top + 1):
        # Streamed (fragments.py): a version is written only after a unit that synced it.
        written = t == 0 or s.name in grid.sched.synced(t - 1)
        if written and any(t not in have[k] for k in kinds if k != "u" or t > 0):
          missing.append((t, s.name, e))
  version0 = None
  for t, group, module in sorted(missing):
    logging.info("elastic: rebuilding version %d of module %s/%d", t, group, module)
    if t == 0:
      version0 = initial() if version0 is None else version0
      for kind in ("v", "opt"):
        path = storage.module_file(workdir, group, module, 0, kind)
        if not path.exists():
          storage.save_tree(path, version0[path])
    else:
      exec_lib.rebuild(config, workdir, owner[group], group, module, t - 1, alpha_W)
