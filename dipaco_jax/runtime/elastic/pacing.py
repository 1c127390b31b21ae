"""Work in proportion to speed: a task's inner steps and its actor from measured step times.

elastic.pace_steps: a task leased to an actor runs s = ⌊budget / step_a⌋ inner
steps, within [min_inner_steps, H], where step_a is the actor's measured seconds
per step (the median of its last tasks, each timed from its second step: no
compilation) and budget is elastic.phase_budget_s, or H × the fastest actor's step
time (0). So H stays the fast actors' count and a
3× slower actor runs H/3. An actor within SLACK of the fastest runs H (noise on a
shared host must not shorten equal actors' tasks).

An actor not measured yet (every actor in phase 0) runs up to H steps against a wall
deadline instead: once any actor is measured, its task stops at its first step after
`stop_after_s` seconds of steps (counted from the end of its own first step, so its
compilation and loads are not counted), no fewer than min_inner_steps. The deadline is
phase_budget_s, or SLACK × H × the fastest step time: the same budget the measured
actors' step counts divide, with the slack that keeps an equal actor at H.

elastic.lease="speed": idle actors take ready tasks fastest first, and a slow
actor (beyond SLACK) the least lagging runnable task, so a lagging path goes to
a fast actor whenever more paths than actors leave a choice; and a slow actor
takes nothing when the others would finish every ready task sooner than it
would finish one (`defer`): the phase does not wait for its task.

No JAX, no Ray: the driver holds one Pacer; config_check calls `check`.
"""
# pylint: disable=invalid-name

import statistics

from dipaco_jax.errors import ConfigError

SLACK = 1.25  # Step times within 25% of the fastest count as equal.
_RECENT = 3  # Tasks per actor the step time is the median of.
_SPEED_FIELDS = ("pace_steps", "token_weights", "lease")


def check(config) -> None:
  """The speed-proportional fields' relations, before anything starts (one line each)."""
  e, H = config.elastic, config.dipaco.inner_steps
  if config.dipaco.mode == "spmd":
    for name in _SPEED_FIELDS:
      value, default = e[name], {"pace_steps": False, "token_weights": False, "lease": "first"}
      if value != default[name]:
        raise ConfigError(
          f"config.elastic.{name}={value!r}: the spmd mode runs every path in lock-step, H "
          "inner steps each on one program, so no path trains less or waits on another; "
          f"set it back to {default[name]!r} or run dipaco.mode='elastic'."
        )
  if e.min_inner_steps > H:
    raise ConfigError(
      f"config.elastic.min_inner_steps={e.min_inner_steps} exceeds dipaco.inner_steps={H}: "
      f"a task runs at most H inner steps; set min_inner_steps <= {H}."
    )
  if not e.pace_steps and (e.phase_budget_s > 0 or e.min_inner_steps != 1):
    raise ConfigError(
      f"config.elastic.phase_budget_s={e.phase_budget_s}, min_inner_steps={e.min_inner_steps} "
      "act only with elastic.pace_steps=True: set pace_steps=True, or leave them at 0 and 1."
    )


def past_deadline(limit_s, first_step_end, steps_done: int, floor: int, now: float) -> bool:
  """A task's next step is past its deadline: limit_s seconds after its first step ended.

  `first_step_end`: [when this attempt's first step ended], or [] before it; no deadline
  (limit_s None) or fewer than `floor` steps done: never.
  """
  if limit_s is None or not first_step_end or steps_done < floor:
    return False
  return now - first_step_end[0] >= limit_s


class Pacer:
  """Each actor's measured step time; how many steps its next task runs; lease order."""

  def __init__(self, elastic_config, H: int):
    e = elastic_config
    self.on, self.by_speed = bool(e.pace_steps), e.lease == "speed"
    self.budget_s, self.floor, self.H = float(e.phase_budget_s), int(e.min_inner_steps), int(H)
    self.times: dict[int, list[float]] = {}  # Actor -> its last tasks' seconds per step.
    self.walls: dict[int, list[float]] = {}  # Actor -> its last tasks' seconds, lease to result.
    self.trained: dict[int, int] = {}  # Actor -> its training tasks so far.

  def observe(self, actor: int, result: dict, wall_s: float | None = None) -> None:
    """A finished task's result: its seconds per inner step ("step_s"), and its whole wall."""
    step_s = result.get("step_s")  # None for a task that trained < 2 steps (evaluation only).
    if step_s:
      self.trained[int(actor)] = self.trained.get(int(actor), 0) + 1
    # A wall from an actor's second training task on: its first holds the compilation.
    wall_s = wall_s if step_s and self.trained[int(actor)] >= 2 else None
    for times, value in ((self.times, step_s), (self.walls, wall_s)):
      if value:
        times.setdefault(int(actor), []).append(float(value))
        times[int(actor)] = times[int(actor)][-_RECENT:]

  def step_s(self, actor: int) -> float | None:
    recent = self.times.get(int(actor))
    return statistics.median(recent) if recent else None

  def task_s(self, actor: int) -> float | None:
    """The median wall of `actor`'s last training tasks (lease to result), its first left out."""
    recent = self.walls.get(int(actor))
    return statistics.median(recent) if recent else None

  def _fastest(self) -> float | None:
    measured = [self.step_s(a) for a in self.times]
    return min(measured) if measured else None

  def slow(self, actor: int) -> bool:
    """Measured beyond SLACK × the fastest actor's step time."""
    s, f = self.step_s(actor), self._fastest()
    return s is not None and s > SLACK * f

  def steps(self, actor: int) -> int:
    """Inner steps of `actor`'s next task: H unless pacing shortens it."""
    s, f = self.step_s(actor), self._fastest()
    if not self.on or s is None:
      return self.H
    self._check_budget(f)
    if not self.budget_s:
      if s <= SLACK * f:
        return self.H
      return max(self.floor, min(self.H, int(self.H * f / s)))
    return max(self.floor, min(self.H, int(self.budget_s / s)))

  def stop_after_s(self) -> float | None:
    """Seconds of steps after its first an unmeasured actor's task may run (None: no limit)."""
    f = self._fastest()
    if not self.on or f is None:
      return None
    self._check_budget(f)
    return self.budget_s or SLACK * self.H * f

  def _check_budget(self, fastest: float) -> None:
    """phase_budget_s must hold one inner step of the fastest actor."""
    if self.budget_s and self.budget_s < fastest:
      raise ConfigError(
        f"config.elastic.phase_budget_s={self.budget_s} is shorter than one inner step of the "
        f"fastest actor ({fastest:.3g} s measured): raise it, or set 0 (H x that step time)."
      )

  def order(self, actors) -> list[int]:
    """Idle actors in the order they take tasks: by index, or fastest first ("speed")."""
    actors = list(actors)
    if not self.by_speed:
      return actors
    return sorted(actors, key=lambda a: (self.step_s(a) or 0.0, a))

  def defer(self, actor: int, free_at: dict, runnable: int, now: float) -> bool:
    """A slow idle `actor` leaves the `runnable` ready tasks to the others (lease="speed").

    The tasks are dealt earliest finish first over the other available actors (`free_at`:
    actor -> when it is free: now when idle, its running task's lease time + its task wall
    when busy, None when that wall is not known); `actor` defers when every task finishes
    sooner on another actor than its own would (it finishes a task at now + its wall). Never
    for a fast actor, lease="first", or any wall not measured yet.
    """
    if not (self.by_speed and self.slow(actor)) or not free_at or runnable < 1:
      return False
    walls = {a: self.task_s(a) for a in [actor, *free_at]}
    if None in walls.values() or None in free_at.values():
      return False
    free = {a: max(now, t) for a, t in free_at.items()}
    mine = now + walls[actor]
    for _ in range(runnable):
      best = min(free, key=lambda a: (free[a] + walls[a], a))
      if mine <= free[best] + walls[best]:
        return False
      free[best] += walls[best]
    return True
