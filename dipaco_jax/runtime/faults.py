"""Fault injection for tests and benchmarks: a plan object, called through one hook.

Production code does nothing about faults but call `plan.at(point, **where)` at
a few named points; the plan decides. Without a `Faults` (a run's case) the plan is
`NONE`, whose hook does nothing, so a real run pays one method call per point.
The chaos tests and benchmarks hand `train.train_and_evaluate(config, workdir,
faults=Faults(...))` what to inject; it is not a config field, so no user config
carries it. The points:

  the elastic driver
    "lease"        a worker task goes to actor `actor` -> the task's fault spec (passed with it)
    "lease_score"  a re-shard scoring task goes to actor `actor` -> its fault spec
    "leased"       the call `future` (a task, or `scoring`) carries `spec`
    "report"       a result goes to executor `executor`
    "tick"         each turn of the loop (`ray`, the actor handles, which are busy)
    "failed"       the call `future` died
    "accepted"     `count` results accepted by this driver -> True: stop here
    "wait_s"       -> a shorter wait for results while a kill is due, else None
    "counts"       -> the kills done so far
  an elastic worker task (the plan `task_plan` builds from the spec)
    "step"         after each inner step
    "wrote"        after file `n` of the `of` files of a `kind` of write (or before a score's)
    "received"     the task read `bytes` of its modules' new versions or updates (phase >= 1)
    "sent"         the task wrote `bytes` of deltas (the outer exchange's uplink)

A task's spec may carry {"link_bps": b, "link_scale": s} (benchmarks/link.py): the task
then sleeps bytes x s x 8 / b at "received" and "sent", a link of b bits a second
carrying s times the bytes the run exchanged (s scales a small model's bytes up).
"""

import dataclasses
import os
import random
import signal
import time
from typing import Any

from absl import logging


@dataclasses.dataclass(frozen=True)
class Faults:
  """What to inject into an elastic run (tests, benchmarks); all off by default."""

  worker_kills: int = 0  # SIGKILL a busy worker actor this many times at random moments.
  executor_kills: int = 0  # SIGKILL an outer executor this many times.
  seed: int = 0  # Seed of the fault schedule.
  step_delay_s: tuple = ()  # Sleep after each inner step of worker actor i (heterogeneity).
  stop_after_tasks: int = -1  # The driver exits after this many accepted results (-1: never).


NO_FAULTS = Faults()


def from_overrides(over: dict) -> tuple[dict, Faults | None]:
  """Dotted overrides less their "faults.FIELD" keys, and the `Faults` those set (None: none).

  The benchmarks' spelling: one dict of config fields and faults for a child command.
  """
  mine = {k.split(".", 1)[1]: v for k, v in over.items() if k.startswith("faults.")}
  rest = {k: v for k, v in over.items() if not k.startswith("faults.")}
  return rest, (Faults(**mine) if mine else None)


class Plan:
  """No faults: the hook does nothing."""

  def at(self, point: str, **where) -> Any:  # pylint: disable=unused-argument
    return None


NONE = Plan()


def driver_plan(cfg: Faults, tasks: int, paths: int, executors: int, log) -> Plan:
  """The driver's plan for `cfg` (`tasks` left to run, `paths` to score): NONE if off."""
  if not (cfg.worker_kills or cfg.executor_kills or cfg.stop_after_tasks >= 0):
    return NONE
  return Chaos(cfg, tasks, paths, executors, log)


def task_plan(cfg: Faults, actor: int, spec: dict | None) -> Plan:
  """A worker task's plan: its actor's step delay (`cfg`) and the driver's spec."""
  delays = tuple(cfg.step_delay_s)
  delay = float(delays[actor]) if actor < len(delays) else 0.0
  if not (spec or delay):
    return NONE
  return _TaskFaults(delay, dict(spec or {}))


class _TaskFaults(Plan):
  """Inside a worker actor: sleeps after each step; SIGKILLs itself mid-write when told."""

  def __init__(self, delay: float, spec: dict):
    self.delay, self.spec = delay, spec

  def at(self, point: str, **where) -> Any:
    if point == "step" and self.delay:
      time.sleep(self.delay)
    elif point in ("received", "sent") and self.spec.get("link_bps"):
      time.sleep(where["bytes"] * self.spec.get("link_scale", 1.0) * 8 / self.spec["link_bps"])
    elif point == "wrote":
      after = self.spec.get(f"die_in_{where['kind']}", 0)
      if after and where["n"] == min(after, where["of"]):
        self.spec.pop(f"die_in_{where['kind']}")  # Once per task (a progress save recurs).
        os.kill(os.getpid(), signal.SIGKILL)
    return None


class _Kills:
  """SIGKILLs of actor processes while they work: `kills` of the first `slots` dispatches.

  Of those (seeded), `in_write` make a worker SIGKILL itself with files half
  written: the task's outputs, or, for tasks that save progress, every other
  one its first mid-task save; the others kill the actor at a random moment of
  the call (mid-step, mid-load, mid-write alike); if the call ends first, the
  actor's next call takes it. Each kill is logged (`log`) as event "kill".
  """

  def __init__(self, kills: int, slots: int, seed: int, log, target: str, in_write: int = 0):
    self.rng = random.Random(seed)
    self.at = set(self.rng.sample(range(slots), min(kills, slots))) if kills else set()
    self.write_at = set(self.rng.sample(sorted(self.at), min(in_write, len(self.at))))
    self.count, self.killed, self.log, self.target = 0, 0, log, target
    self.due, self._carry = {}, set()  # actor index -> kill time; actors owed a kill.
    self.armed = {}  # future -> (actor, how, after) of a dispatch told to die mid-write.
    self._writes = 0  # Mid-write kills armed so far (alternating outputs and progress).

  def on_dispatch(self, index: int, est_s: float, writes: bool = True, progress=False) -> dict:
    """Arms this dispatch's kill if drawn; returns the task's fault spec ({}: none).

    A call that writes nothing (`writes` False: an evaluation-only task) takes a
    timed kill; `progress`: the task makes a mid-task save.
    """
    n, self.count = self.count, self.count + 1
    if n in self.write_at and writes:
      self._writes += 1
      key = "die_in_progress" if progress and self._writes % 2 == 0 else "die_in_output"
      return {key: self.rng.randint(1, 3)}
    if n in self.at or index in self._carry:
      self._carry.discard(index)
      self.due[index] = time.time() + self.rng.uniform(0, est_s)
    return {}

  def arm(self, future, index: int, spec: dict) -> None:
    for key, after in spec.items():
      how = "progress" if key == "die_in_progress" else "write"
      self.armed[future] = (index, how, after)

  def failed(self, future) -> None:
    """The call `future` died: counts and logs it if it was told to die mid-write."""
    if future in self.armed:
      index, how, after = self.armed.pop(future)
      self.killed += 1
      self.log(event="kill", target=self.target, actor=index, how=how, after_writes=after)

  def fire(self, ray, handles, busy) -> None:
    """Kills the actors whose time has come and that are still busy."""
    for index, when in list(self.due.items()):
      if time.time() < when:
        continue
      del self.due[index]
      if index not in busy:
        self._carry.add(index)
        continue
      try:
        pid = ray.get(handles[index].pid.remote(), timeout=120)
        os.kill(pid, signal.SIGKILL)
        self.killed += 1
        self.log(event="kill", target=self.target, actor=index, how="timed", pid=pid)
        logging.info("chaos: SIGKILL actor %d (pid %d)", index, pid)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("chaos: kill of actor %d failed (%s); owed to its next call", index, e)
        self._carry.add(index)


class Chaos(Plan):
  """`Faults` in the elastic driver: worker and executor kills, a stop after N results.

  Kills are drawn among this invocation's dispatches (`tasks` worker tasks,
  `tasks` x `executors` reports); half the worker kills hit a task mid-write.
  With worker kills on, one re-shard scoring task per invocation dies before
  its write.
  """

  def __init__(self, cfg, tasks: int, paths: int, executors: int, log):
    self.stop_after = cfg.stop_after_tasks
    kw = cfg.worker_kills
    self.workers = _Kills(kw, tasks, cfg.seed, log, "worker", in_write=kw // 2)
    self.executors = _Kills(cfg.executor_kills, tasks * executors, cfg.seed + 1, log, "executor")
    one = int(kw > 0)
    self.scoring = _Kills(one, paths, cfg.seed + 2, log, "worker", in_write=one)

  def at(self, point: str, **where) -> Any:
    if point == "lease":
      return self.workers.on_dispatch(
        where["actor"], where["est_s"], where["writes"], where["progress"]
      )
    if point == "lease_score":
      spec = self.scoring.on_dispatch(where["actor"], where["est_s"])
      return {"die_in_score": next(iter(spec.values()))} if spec else {}
    if point == "leased":
      kills = self.scoring if where.get("scoring") else self.workers
      kills.arm(where["future"], where["actor"], where["spec"] or {})
    elif point == "report":
      self.executors.on_dispatch(where["executor"], 0.2)
    elif point == "tick":
      self.workers.fire(where["ray"], where["workers"], where["busy_workers"])
      self.executors.fire(where["ray"], where["executors"], where["busy_executors"])
    elif point == "failed":
      for kills in (self.workers, self.scoring):
        kills.failed(where["future"])
    elif point == "accepted":
      return 0 <= self.stop_after <= where["count"]
    elif point == "wait_s":
      return 0.05 if self.workers.due or self.executors.due else None
    elif point == "counts":
      return {
        "worker_kills": self.workers.killed + self.scoring.killed,
        "executor_kills": self.executors.killed,
      }
    return None
