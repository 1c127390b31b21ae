"""Lease timeouts against the tasks' real durations, judged by the worker's own progress."""

import math

from dipaco_jax.runtime.elastic.errors import ElasticConfigError


def _nice_s(seconds: float) -> int:
  """Seconds rounded up to a multiple of 10 (at least 10)."""
  return max(10, math.ceil(seconds / 10) * 10)


def stepping(seen: dict | None) -> bool:
  """A worker's progress (PathWorker.progress) shows it was still stepping when asked.

  At least one inner step done in this attempt, the last one recent: within 30 s
  or 3x the attempt's mean time per step so far (load and compile included).
  """
  if not seen or not seen["steps"] or seen["since_step_s"] is None:
    return False
  return seen["since_step_s"] <= max(30.0, 3 * seen["elapsed_s"] / seen["steps"])


class Timeouts:
  """config.elastic.task_timeout_s against the tasks' real durations (docs/elastic.md, Failures).

  The rule: each expired lease is one warning line (and a `timeout` event in the
  task log with the worker's progress). The run stops with ElasticConfigError,
  naming the field, the measured time and a value, when the same task expires
  `STEPPING` times while its worker was stepping (the timeout is shorter than
  the task: every retry would be cut again), or `ANSWERED` times whatever the
  worker was doing when asked (loading, compiling, hung). One expiry is what the
  timeout is for (a straggler, a hung worker: the task moves on), and a worker
  that does not answer (not placed or started yet, or gone) is not counted:
  those are the pool's normal troubles, not the timeout's.
  """

  STEPPING = 2
  ANSWERED = 3

  def __init__(self, timeout_s: float, H: int):
    self.timeout_s, self.H = float(timeout_s), int(H)
    self.counts = {}  # task -> [expiries while stepping, expiries answered]

  def _field(self) -> str:
    return f"config.elastic.task_timeout_s={self.timeout_s:g}"

  def expired(self, task, actor: int, seen: dict | None) -> str:
    """Task (phase, worker) expired on `actor`; returns the warning line, raises at the limit."""
    name = f"task (phase {task[0]}, worker {task[1]})"
    c = self.counts.setdefault(tuple(task), [0, 0])
    was_stepping = stepping(seen)
    c[0] += was_stepping
    c[1] += seen is not None
    est = None
    if seen is None:
      state = "its worker did not answer (not placed or started yet, or gone)"
    else:
      state = f"{seen['steps']} of {seen['of']} inner steps done in {seen['elapsed_s']:.1f} s"
      if was_stepping:  # This attempt's pace, its load and compile included: errs long.
        est = seen["elapsed_s"] * self.H / seen["steps"]
        state += f", about {est:.0f} s for the task's {self.H}"
      else:
        state += ", none lately (loading, compiling or hung)"
    if c[0] >= self.STEPPING:
      raise ElasticConfigError(
        f"{self._field()} is shorter than a task: {name} timed out {c[0]} times while its "
        f"worker was stepping (the last attempt: {state}); set "
        f"--config.elastic.task_timeout_s={_nice_s(3 * est)} (3x that) or more and rerun "
        "the same command (it resumes)."
      )
    if c[1] >= self.ANSWERED:
      value = _nice_s(3 * est) if est else _nice_s(10 * self.timeout_s)
      raise ElasticConfigError(
        f"{self._field()}: {name} timed out {c[1]} times (the last attempt: {state}); set "
        f"--config.elastic.task_timeout_s={value} or more (the `done` events of "
        "elastic/tasks.jsonl hold the tasks' real seconds) and rerun the same command."
      )
    return (
      f"elastic: {name} passed {self._field()} on actor {actor}: {state}; requeued, the "
      f"actor restarted (this task's timeouts: {c[0]} while stepping, {c[1]} answered; "
      f"{self.STEPPING} or {self.ANSWERED} stop the run)."
    )

  def expired_score(self, path: int, actor: int, elapsed_s: float) -> str:
    """A re-shard's scoring task on `actor` expired: a line; raises the `ANSWERED`-th time."""
    c = self.counts.setdefault(("score", path), [0, 0])
    c[1] += 1
    if c[1] >= self.ANSWERED:
      raise ElasticConfigError(
        f"{self._field()}: the scoring task of path {path} (a discriminative re-shard) timed out "
        f"{c[1]} times, the last after {elapsed_s:.1f} s; set "
        f"--config.elastic.task_timeout_s={_nice_s(10 * self.timeout_s)} or more and rerun the "
        "same command."
      )
    return (
      f"elastic: the scoring task of path {path} passed {self._field()} on actor {actor} after "
      f"{elapsed_s:.1f} s; scored again ({c[1]} of {self.ANSWERED} such timeouts stop the run)."
    )


def progress(ray, ray_errors, actor, task) -> dict | None:
  """The worker actor's progress on `task` (PathWorker.progress), or None if it does not answer."""
  try:
    seen = ray.get(actor.progress.remote(), timeout=2.0)
  except ray_errors.RayError:  # GetTimeoutError (busy starting, or not placed), a dead actor.
    return None
  if not seen or (seen["phase"], seen["worker"]) != tuple(task):
    return None
  return seen
