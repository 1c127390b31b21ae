"""The task queue: one task per (phase, worker), ready once the worker's modules hold that phase.

Task (t, w) runs worker w's H inner steps of phase t (t < T; tasks (T, w)
only evaluate the final params); it becomes ready when
every module worker w reads holds version t (t outer updates applied) and,
from a discriminative re-shard step t_r on (t >= t_r), once the driver has
written that re-shard's router and shards (`resharded`): a barrier at t_r, as
every module must hold version t_r before the router is fitted. Tasks
are leased to worker actors; a lease whose actor dies or passes its deadline
goes back to the FRONT of the queue. A result is accepted once per (t, w);
a duplicate (a timed-out task that finished after all) is refused. Every
change is snapshotted (each file written whole), so a coordinator restarted by
Ray, or a rerun of the whole command, resumes where it stood; leases are not
kept (their tasks are requeued on restore, unless their result was written).
Streamed (outer.fragments, outer.overlap), t counts units, not phases, and the
versions a task needs are its schedule's (fragments.py):

  coordinator.json              module versions, queue, leases, re-shards done
  coordinator/results<t>.json   phase t's accepted results (`summary`: no per-step losses)

Both stay small whatever the run's length: a change rewrites the queue (at most
a few entries per worker) and at most one phase's results (one per worker), so
a lease or a report costs the same at the last of the paper's ~110k tasks as at
the first (benchmarks/elastic_coordinator.py). A task's per-step losses are in
its own done.json (storage.py).
"""

import dataclasses
import os
import time

from dipaco_jax.runtime.elastic import fragments
from dipaco_jax.runtime.elastic import storage

SNAPSHOT = "coordinator.json"
RESULTS = "coordinator"  # Folder of the per-phase results files.


def _task_key(phase: int, worker: int) -> str:
  return f"{phase}/{worker}"


def _results_file(workdir: str, phase: int):
  return storage.root(workdir) / RESULTS / f"results{phase:05d}.json"


def summary(result: dict) -> dict:
  """A task's result as the queue keeps it: its per-step losses ("loss") down to the last one."""
  out = {k: v for k, v in result.items() if k != "loss"}
  if result.get("loss"):
    out["last_loss"] = result["loss"][-1]
  return out


def read_results(workdir: str) -> dict:
  """Every accepted task's `summary`, keyed "phase/worker" (a snapshot's, without the actor)."""
  done = {}
  for phase, f in storage.numbered(storage.root(workdir) / RESULTS, "results").items():
    done.update({_task_key(phase, w): r for w, r in storage.load_json(f).items()})
  return done


@dataclasses.dataclass(frozen=True)
class QueuePlan:
  """What the queue needs of the run (grid.Grid.queue_plan): plain values.

  The coordinator process builds no model shapes and imports no JAX, so it
  answers the driver's first lease ~0.2 s after Ray places it, not after a
  worker-sized start-up (measured in docs/elastic.md, on start-up).
  """

  workers: int  # W: tasks (t, w) for w < W.
  phases: int  # T (U, streamed): tasks (t, w) for t <= T (tasks (T, w) only evaluate).
  reshard_steps: tuple[int, ...]  # routing.discriminative_steps.
  modules_of_worker: tuple[tuple[str, ...], ...]  # Worker w's module keys ("group/e").
  timeout_s: float  # config.elastic.task_timeout_s.
  # With a quorum (config.elastic.quorum < 1) a module steps without some reports; they still
  # count for its next step (executor.py), so a restarted driver re-reports one phase further.
  slack: int = 0
  # Streamed (outer.fragments, outer.overlap): a task is a unit, and the versions it needs
  # are the schedule's (fragments.py); None: task t needs version t of every module.
  schedule: fragments.Schedule | None = None


class Coordinator:
  """Queue, leases, accepted results and module versions of an elastic run."""

  def __init__(self, plan: QueuePlan, workdir: str):
    self.plan = plan
    self.workdir = str(workdir)
    self._path = storage.root(workdir) / SNAPSHOT
    self.done = read_results(workdir)
    if self._path.exists():
      s = storage.load_json(self._path)
      if "done" in s:  # Written before the per-phase results files: moved into them once.
        self.done.update({key: summary(result) for key, result in s["done"].items()})
        for phase in sorted({int(key.split("/")[0]) for key in s["done"]}):
          self._write_results(phase)
      self.versions = dict(s["versions"])
      # A result written just before a restart (its task still leased in the snapshot): done.
      leased = [tuple(t) for t in s["leased"] if _task_key(*t) not in self.done]
      self.pending = [tuple(t) for t in s["pending"] if _task_key(*t) not in self.done] + leased
      self.requeued = int(s.get("requeued", 0)) + len(leased)
      self.reshards = [int(x) for x in s.get("reshards", [])]
    else:
      self.versions = {key: 0 for keys in plan.modules_of_worker for key in keys}
      self.pending, self.requeued, self.reshards = [], 0, []
    # Per worker, its tasks are accepted in phase order: the first phase not done yet.
    self._next = [0] * plan.workers
    self.leases = {}  # task key -> (task, actor, deadline); not snapshotted.
    self._enqueue_ready()
    self._save()

  def pid(self) -> int:
    return os.getpid()

  def _save(self) -> None:
    storage.save_json(
      self._path,
      {
        "versions": self.versions,
        "pending": [list(t) for t in self.pending],
        "leased": [list(v[0]) for v in self.leases.values()],
        "requeued": self.requeued,
        "reshards": self.reshards,
      },
    )

  def _ready(self, phase: int, worker: int) -> bool:
    if any(s <= phase and s not in self.reshards for s in self.plan.reshard_steps):
      return False  # Its routing phase's shards are not written yet.
    s = self.plan.schedule
    if s is None or not s.streamed:
      return all(self.versions[key] >= phase for key in self.plan.modules_of_worker[worker])
    return all(
      self.versions[key] >= s.need(phase, key.split("/")[0])
      for key in self.plan.modules_of_worker[worker]
    )

  def _enqueue_ready(self) -> None:
    """Appends each worker's next phase once its modules hold it (phase order, then worker)."""
    known = {_task_key(*t) for t in self.pending} | set(self.leases)
    new = []
    for w in range(self.plan.workers):
      while _task_key(self._next[w], w) in self.done:
        self._next[w] += 1
      phase = self._next[w]
      if phase <= self.plan.phases and _task_key(phase, w) not in known and self._ready(phase, w):
        new.append((phase, w))
    self.pending.extend(sorted(new))

  def _runnable(self) -> list[int]:
    """Indices of the pending tasks that can start now."""
    # A task reads its worker's previous phase's outputs: after a repair took that phase's
    # task off the results (its outputs moved aside), a later phase restored from the
    # snapshot waits for it. Otherwise every pending task's previous phase is done.
    return [
      i for i, (t, w) in enumerate(self.pending) if t == 0 or _task_key(t - 1, w) in self.done
    ]

  def runnable(self) -> int:
    """How many pending tasks can start now."""
    return len(self._runnable())

  def lease(self, actor: int, newest: bool = False):
    """The next ready task for `actor` ((phase, worker)), or None; `newest`: the least lagging."""
    runnable = self._runnable()
    if not runnable:
      return None
    pick = max(runnable, key=lambda i: self.pending[i]) if newest else runnable[0]
    task = self.pending.pop(pick)
    self.leases[_task_key(*task)] = (task, int(actor), time.time() + self.plan.timeout_s)
    self._save()
    return task

  def complete(self, phase: int, worker: int, result: dict) -> bool:
    """Accepts task (phase, worker)'s result once; False for a duplicate."""
    key = _task_key(phase, worker)
    self.leases.pop(key, None)
    if key in self.done:
      return False
    self.pending = [t for t in self.pending if _task_key(*t) != key]
    self.done[key] = summary(result)
    self._write_results(int(phase))  # First: from here on the task is done, whatever happens.
    self._save()
    return True

  def _write_results(self, phase: int) -> None:
    """Phase `phase`'s accepted results to its own file (one entry per worker at most)."""
    keys = ((str(w), _task_key(phase, w)) for w in range(self.plan.workers))
    mine = {w: self.done[key] for w, key in keys if key in self.done}
    storage.save_json(_results_file(self.workdir, phase), mine)

  def failed(self, phase: int, worker: int) -> bool:
    """The task's actor died or timed out: back to the front of the queue (unless done)."""
    key = _task_key(phase, worker)
    if self.leases.pop(key, None) is None or key in self.done:
      return False
    self.pending.insert(0, (int(phase), int(worker)))
    self.requeued += 1
    self._save()
    return True

  def expired(self) -> list:
    """Leases past their deadline: requeued; returns [(task, actor)]."""
    now = time.time()
    late = [(task, actor) for task, actor, deadline in self.leases.values() if deadline < now]
    for task, _ in late:
      self.failed(*task)
    return late

  def modules_updated(self, phase: int, keys) -> None:
    """Modules `keys` took phase `phase`'s outer step; enqueues the tasks that became ready."""
    changed = False
    for key in keys:
      if self.versions[key] < phase + 1:
        self.versions[key] = phase + 1
        changed = True
    if changed:
      self._enqueue_ready()
      self._save()

  def reshard_due(self):
    """(step, done steps): the first re-shard step not yet done once every module holds it.

    step is None when no re-shard is due now; done lists the re-shards already done.
    """
    due = next((s for s in self.plan.reshard_steps if s not in self.reshards), None)
    if due is not None and min(self.versions.values()) < due:
      due = None
    return due, list(self.reshards)

  def resharded(self, step: int) -> None:
    """The driver wrote re-shard `step`'s router, shards and α: its tasks may run."""
    if int(step) not in self.reshards:
      self.reshards.append(int(step))
      self._enqueue_ready()
      self._save()

  def unreported(self) -> list:
    """Accepted tasks whose modules have not all stepped yet (to re-report after a restart)."""
    out = []
    for key in self.done:
      phase, w = (int(x) for x in key.split("/"))
      if phase < self.plan.phases and any(
        self.versions[m] <= phase + self.plan.slack for m in self.plan.modules_of_worker[w]
      ):
        out.append((phase, w))
    return sorted(out)

  def finished(self) -> bool:
    T = self.plan.phases
    return len(self.done) == (T + 1) * self.plan.workers and all(
      v >= T for v in self.versions.values()
    )

  def status(self) -> dict:
    return {
      "done": len(self.done),
      "pending": len(self.pending),
      "leased": len(self.leases),
      "requeued": self.requeued,
      "min_version": min(self.versions.values()),
      "reshards": list(self.reshards),
    }

  def results(self) -> dict:
    """Every accepted task's `summary` (the driver asks once, then keeps its own copy)."""
    return dict(self.done)
