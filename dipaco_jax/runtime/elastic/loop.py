"""The driver's event loop: leases tasks, answers each kind of future, moves versions on."""
# pylint: disable=invalid-name

import dataclasses
import time

from absl import logging

from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import leases
from dipaco_jax.runtime.elastic import pacing
from dipaco_jax.runtime.elastic import records as records_lib
from dipaco_jax.runtime.elastic import resharder as resharder_lib
from dipaco_jax.runtime.elastic import versions


@dataclasses.dataclass
class Pool:
  """The run's actors on Ray: the queue, the worker actors, the executors and their groups."""

  ray: object
  ray_errors: object  # ray.exceptions.
  coord: object
  workers: list
  executors: list
  owned: list  # Executor j's store groups (an empty list: it owns none).

  def call(self, method, *args):
    """A coordinator call, retried once if the actor died (it restores from its snapshot)."""
    for attempt in range(3):
      try:
        return self.ray.get(method.remote(*args))
      except self.ray_errors.RayActorError:
        if attempt == 2:
          raise
        time.sleep(1.0)


class EventLoop:
  """Leases tasks to idle workers, forwards results to executors, versions to the queue.

  The futures it waits on, one `_on_*` method per kind: worker tasks
  (`running`), a re-shard's scoring tasks (`scoring`), executors' reports
  (`outer`) and polls (`polls`), and pings of actors coming back from a failure
  (`probes`, `ex_probes`): such an actor gets nothing new until it answers.
  """

  def __init__(
    self,
    config,
    workdir,
    grid: grid_lib.Grid,
    pool: Pool,
    task_log,
    exp,
    plan,
    starting,
    faults: faults_lib.Faults = faults_lib.NO_FAULTS,
  ):
    """`starting`: the actors not started yet; `faults`: what to inject (runtime/faults.py)."""
    e = self.e = config.elastic
    self.config, self.workdir, self.grid, self.pool = config, workdir, grid, pool
    self.exp, self.plan = exp, plan
    self.ray, self.ray_errors, self.coord = pool.ray, pool.ray_errors, pool.coord
    self.workers, self.executors, self.owned = pool.workers, pool.executors, pool.owned
    self.starting = starting  # resources.StartWatch of the actors not started yet, or None.
    self.timeouts = leases.Timeouts(e.task_timeout_s, grid.H)  # Stops what cuts every task.
    self.log = lambda **kw: task_log.append({"t": time.time(), **kw})
    self.running, self.outer = {}, {}  # future -> (actor, task, start); -> (executor, phase, w)
    self.scoring = {}  # future -> (actor, path, start): a re-shard's scoring tasks.
    self.timed_out = set()  # Scoring futures whose actor was killed for the task timeout.
    self.results = pool.call(self.coord.results)
    left = (grid.U + 1) * grid.W - len(self.results)  # Faults are drawn among this run's tasks.
    self.faults = faults_lib.driver_plan(
      faults, left, grid.topo.num_paths, len(self.executors), self.log
    )
    self.task_time = 1.0  # The last task's seconds (the faults' timing of a kill).
    self.accepted_here = 0
    self.saves_progress = 0 < e.progress_every_steps < grid.H
    self.pacer = pacing.Pacer(e, grid.H)  # Steps and lease order from measured speed.
    self.told = set()  # Running futures given the pacer's wall deadline (once each).
    self.probes = {}  # future of pid() -> worker actor coming back from a failure.
    self.ex_probes, self.held = {}, {}  # The same for executors; reports held while they restart.
    self.records = records_lib.PhaseRecords(config, workdir, exp, grid, self.results)
    self.resharder = resharder_lib.Resharder(exp, grid, workdir, plan, self.log)
    for step in sorted(pool.call(self.coord.reshard_due)[1]):  # Done before a restart: reopened.
      self.resharder.reopen(step)
    self.reshard_check = True  # Module versions changed: a re-shard may be due.
    # Quorum with a grace window: executors step on the clock too, so the driver polls them.
    self.polls, self.waiting, self.next_poll = {}, {}, 0.0
    self.poll_s = 0.1 if e.quorum < 1.0 and e.grace_s > 0 else None

  def call(self, method, *args):
    return self.pool.call(method, *args)

  def run(self) -> dict:
    """Runs until every task is accepted (or the faults' planned stop); returns the summary."""
    for phase, worker in self.call(self.coord.unreported):  # Executors are idempotent.
      self._report(phase, worker)
    try:
      while True:
        self._reshard_barrier()
        if self.starting is not None:
          self.starting.tick()
        self._expire()
        self._lease()
        self._poll_executors()
        if self._finished():
          break
        busy_workers = {a for a, _, _ in self.running.values()} | set(self._scoring_actors())
        self.faults.at(
          "tick",
          ray=self.ray,
          workers=self.workers,
          executors=self.executors,
          busy_workers=busy_workers,
          busy_executors={j for j, _, _ in self.outer.values()},
        )
        futures = [self.running, self.outer, self.probes, self.ex_probes, self.polls, self.scoring]
        ready, _ = self.ray.wait(
          [f for kind in futures for f in kind],
          num_returns=1,
          timeout=self.faults.at("wait_s") or self.poll_s or 1.0,
        )
        for f in ready:
          self._answer(f)
        self.records.early_stop()
        self.records.write(self.resharder.records)
        if self.faults.at("accepted", count=self.accepted_here):
          logging.info("elastic: stopping after %d accepted tasks (faults)", self.accepted_here)
          return {"stopped": True, "status": self._status()}
    finally:
      self.records.close()
    self.records.early_stop()  # A rerun that finds every task done replays it here.
    grid = self.grid
    out = {"step": grid.H * grid.T, **records_lib.record(grid, self.results, grid.T - 1)}
    best = self.records.best
    versions.save_final(self.config, self.workdir, self.exp, grid, self.plan, best)
    return {**out, "status": self._status()}

  def _status(self) -> dict:
    return {**self.call(self.coord.status), **(self.faults.at("counts") or {})}

  def _scoring_actors(self) -> list:
    return [a for a, _, _ in self.scoring.values()]

  def _report(self, phase: int, worker: int) -> None:
    """Task (phase, worker)'s result to every executor that owns a group."""
    if phase == self.grid.U:  # Evaluation only: nothing to average.
      return
    for j, ex in enumerate(self.executors):
      if self.owned[j]:
        self.outer[ex.report.remote(phase, worker)] = (j, phase, worker)
        self.faults.at("report", executor=j)

  def _stepped(self, j: int, keys: dict) -> None:
    """Executor j's {phase: modules it stepped} to the queue (and the task log)."""
    for phase, mods in sorted(keys.items()):
      self.call(self.coord.modules_updated, phase, mods)
      if mods:
        self.log(event="outer", phase=phase, executor=j, modules=mods)
        self.reshard_check = True

  def _reshard_barrier(self) -> None:
    """Tasks of a re-shard's phase wait for its scores, router and shards."""
    resharder = self.resharder
    if self.reshard_check and resharder.due is None:
      self.reshard_check = False
      due = self.call(self.coord.reshard_due)[0]
      if due is not None:
        resharder.begin(due)
    if resharder.due is not None and not (resharder.todo or self.scoring):
      self.call(self.coord.resharded, resharder.finish())
      self.reshard_check = True

  def _expire(self) -> None:
    """Leases past config.elastic.task_timeout_s: their actors killed (Ray restarts them)."""
    for task, actor in self.call(self.coord.expired):
      seen = leases.progress(
        self.ray, self.ray_errors, self.workers[actor], task
      )  # Before the kill.
      self.log(event="timeout", phase=task[0], worker=task[1], actor=actor, progress=seen)
      logging.warning("%s", self.timeouts.expired(task, actor, seen))  # Raises at the limit.
      self.ray.kill(self.workers[actor], no_restart=False)  # Comes back; its future raises.
    for f, (actor, path, start) in self.scoring.items():
      if f not in self.timed_out and time.time() - start > self.e.task_timeout_s:
        self.timed_out.add(f)  # Killed once; rescored when its future raises.
        self.log(event="timeout_score", path=path, actor=actor)
        logging.warning("%s", self.timeouts.expired_score(path, actor, time.time() - start))
        self.ray.kill(self.workers[actor], no_restart=False)

  def _lease(self) -> None:
    """Each idle worker actor gets a scoring task if a re-shard waits, else the queue's next."""
    busy = {a for a, _, _ in self.running.values()} | set(self.probes.values())
    busy |= set(self._scoring_actors())
    for i in self.pacer.order(range(len(self.workers))):
      if i in busy:
        continue
      if self.resharder.todo:  # Scoring first: the re-shard's phase waits for it.
        step, path = self.resharder.due, self.resharder.todo.pop(0)
        spec = self.faults.at("lease_score", actor=i, est_s=self.task_time)
        future = self.workers[i].score.remote(step, path, faults=spec)
        self.faults.at("leased", future=future, actor=i, spec=spec, scoring=True)
        self.scoring[future] = (i, path, time.time())
        self.log(event="start_score", step=step, path=path, actor=i)
        continue
      # A slow actor takes the least lagging task (elastic.lease="speed"); the others the most.
      slow = self.pacer.by_speed and self.pacer.slow(i)
      if slow and self._defer(i, busy):
        continue
      task = self.call(self.coord.lease, i, slow)
      if task is None:
        return
      steps = self.pacer.steps(i)
      paced = {"steps": steps} if steps < self.grid.H else {}
      stop = self.pacer.stop_after_s() if self.pacer.step_s(i) is None else None
      if stop is not None:  # Not measured yet: a wall deadline (pacing.py).
        paced["stop_after_s"] = stop
      spec = self.faults.at(
        "lease",
        actor=i,
        est_s=self.task_time,
        writes=task[0] < self.grid.U,
        progress=self.saves_progress,
      )
      future = self.workers[i].run.remote(*task, faults=spec, **paced)
      self.faults.at("leased", future=future, actor=i, spec=spec)
      self.running[future] = (i, tuple(task), time.time())
      if stop is not None:
        self.told.add(future)
      self.log(event="start", phase=task[0], worker=task[1], actor=i, **paced)

  def _defer(self, actor: int, busy: set) -> bool:
    """The slow idle `actor` leaves the ready tasks to faster actors that finish them sooner."""
    now, task_s = time.time(), self.pacer.task_s
    free_at = {a: now for a in range(len(self.workers)) if a not in busy and a != actor}
    for a, _, start in self.running.values():
      free_at[a] = None if task_s(a) is None else start + task_s(a)
    return self.pacer.defer(actor, free_at, self.call(self.coord.runnable), now)

  def _poll_executors(self) -> None:
    """With a grace window, asks each owning executor every poll_s what its clock stepped."""
    if self.poll_s and time.time() >= self.next_poll:
      self.next_poll = time.time() + self.poll_s
      for j, ex in enumerate(self.executors):
        if self.owned[j] and j not in self.polls.values():
          self.polls[ex.poll.remote()] = j

  def _finished(self) -> bool:
    """True once the queue has every result; raises if nothing could make a task ready."""
    if self.running or self.outer or self.probes or self.ex_probes or self.scoring:
      return False
    if self.resharder.due is not None:
      return False
    if self.call(self.coord.finished):
      return True
    if not (self.polls or any(self.waiting.values())):  # Nothing can make a task ready any more.
      raise RuntimeError(f"elastic: no task ready and none running: {self.call(self.coord.status)}")
    return False

  def _answer(self, f) -> None:
    """A ready future to its kind's method."""
    if f in self.ex_probes:
      self._on_executor_probe(f)
    elif f in self.probes:
      self._on_worker_probe(f)
    elif f in self.scoring:
      self._on_scored(f)
    elif f in self.running:
      self._on_task(f)
    elif f in self.polls:
      self._on_poll(f)
    else:
      self._on_report(f)

  def _on_executor_probe(self, f) -> None:
    """A restarted executor answers: the reports held for it go again."""
    j = self.ex_probes.pop(f)
    try:
      self.ray.get(f)
    except self.ray_errors.RayActorError:  # Still restarting: ask again shortly.
      time.sleep(0.2)
      self.ex_probes[self.executors[j].pid.remote()] = j
      return
    for phase, worker in self.held.pop(j, []):
      self.outer[self.executors[j].report.remote(phase, worker)] = (j, phase, worker)

  def _on_worker_probe(self, f) -> None:
    """A restarted worker actor answers: it is idle again."""
    actor = self.probes.pop(f)
    try:
      self.ray.get(f)
    except self.ray_errors.RayActorError:  # Still restarting: ask again shortly.
      time.sleep(0.2)
      self.probes[self.workers[actor].pid.remote()] = actor

  def _on_scored(self, f) -> None:
    """A scoring task's end: logged, or its path scored again if its actor died."""
    actor, path, _ = self.scoring.pop(f)
    try:
      done = self.ray.get(f)
    except self.ray_errors.RayActorError as err:  # Scored again, on the next idle worker.
      self.faults.at("failed", future=f)
      self.resharder.todo.insert(0, path)
      self.log(event="failed_score", path=path, actor=actor, error=type(err).__name__)
      self.probes[self.workers[actor].pid.remote()] = actor
      return
    except self.ray_errors.RayTaskError as err:
      raise err.as_instanceof_cause() from None
    self.log(event="scored", path=path, actor=actor, docs=done["docs"], seconds=done["seconds"])

  def _on_task(self, f) -> None:
    """A task's result to the queue (once per task) and the executors; a dead actor's requeued."""
    actor, task, start = self.running.pop(f)
    self.told.discard(f)
    try:
      result = self.ray.get(f)
    except self.ray_errors.RayActorError as err:
      self.faults.at("failed", future=f)
      self.call(self.coord.failed, *task)
      error = type(err).__name__
      self.log(event="failed", phase=task[0], worker=task[1], actor=actor, error=error)
      self.probes[self.workers[actor].pid.remote()] = actor  # No new task until it is back.
      return
    except self.ray_errors.RayTaskError as err:  # The task's own error (e.g. NaN): stop.
      raise err.as_instanceof_cause() from None
    self.task_time = time.time() - start
    self.pacer.observe(actor, result, self.task_time)
    self._deadlines()
    if not self.call(self.coord.complete, task[0], task[1], result):
      self.log(event="duplicate", phase=task[0], worker=task[1], actor=actor)
      return
    self.results[f"{task[0]}/{task[1]}"] = coord_lib.summary(result)  # The queue's copy, here.
    self.accepted_here += 1
    self.log(
      event="done",
      phase=task[0],
      worker=task[1],
      actor=actor,
      seconds=result["end"] - result["start"],
      pid=result["pid"],
      steps=len(result["loss"]),
      **{k: result[k] for k in ("resumed_at_step", "cpus", "step_s", "deadline_s") if k in result},
    )
    self._report(*task)

  def _deadlines(self) -> None:
    """Running tasks of actors not measured yet get the pacer's wall deadline (pace_steps).

    Once each, when a finished task first gives the pacer a step time: the phase-0
    tasks of a slow actor then stop near the fast actors' wall instead of after H steps.
    """
    limit = self.pacer.stop_after_s()
    if limit is None:
      return
    for f, (actor, task, _) in self.running.items():
      if f not in self.told and self.pacer.step_s(actor) is None:
        self.told.add(f)
        self.workers[actor].stop_after.remote(*task, limit)  # Answers at once; not awaited.
        self.log(event="deadline", phase=task[0], worker=task[1], actor=actor, seconds=limit)

  def _on_poll(self, f) -> None:
    """An executor's poll: the modules its clock stepped, and whether it still waits."""
    j = self.polls.pop(f)
    try:
      keys, self.waiting[j] = self.ray.get(f)
    except self.ray_errors.RayActorError:  # Restarting: the next poll asks again.
      return
    self._stepped(j, keys)

  def _on_report(self, f) -> None:
    """An executor took a report: the modules it stepped; held for it if it died."""
    j, phase, worker = self.outer.pop(f)
    try:
      keys = self.ray.get(f)
    except self.ray_errors.RayActorError:
      self.log(event="executor_failed", executor=j, phase=phase, worker=worker)
      # Ray restarts it (from its snapshot); the report goes again once it answers.
      self.held.setdefault(j, []).append((phase, worker))
      if j not in set(self.ex_probes.values()):
        self.ex_probes[self.executors[j].pid.remote()] = j
      return
    self._stepped(j, keys)
