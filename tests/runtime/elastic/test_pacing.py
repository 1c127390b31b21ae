"""Work in proportion to speed: a task's inner steps and its actor from measured step times."""

import types

import pytest

from dipaco_jax.errors import ConfigError
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import pacing


def _pacer(H=30, **kw):
  e = {"pace_steps": True, "phase_budget_s": 0.0, "min_inner_steps": 1, "lease": "first", **kw}
  return pacing.Pacer(types.SimpleNamespace(**e), H)


def _task(steps: int, seconds: float) -> dict:
  """A result whose steps after the first took seconds / steps each (worker.py's step_s)."""
  return {"loss": [1.0] * steps, "step_s": seconds / steps}


def test_steps_follow_the_measured_step_time_within_h_and_the_floor():
  p = _pacer(H=30, min_inner_steps=4)
  assert [p.steps(a) for a in range(3)] == [30, 30, 30]  # Nobody measured yet: H.
  p.observe(0, _task(30, 3.0))  # 0.1 s per step.
  p.observe(1, _task(30, 9.0))  # 0.3 s: 3x slower -> ⌊30 · 0.1 / 0.3⌋ = 10.
  p.observe(2, _task(30, 36.0))  # 1.2 s: 12x slower -> ⌊30 / 12⌋ = 2, below the floor: 4.
  p.observe(3, _task(30, 3.6))  # 0.12 s: within SLACK (1.25x) of the fastest -> H.
  assert [p.steps(a) for a in range(4)] == [30, 10, 4, 30]
  assert [p.slow(a) for a in range(4)] == [False, True, True, False]


def test_equal_speeds_keep_every_task_at_h():
  p = _pacer(H=50)
  for a, s in enumerate((1.00, 1.10, 1.23, 0.99)):  # Within 25% of the fastest (0.99).
    p.observe(a, _task(50, 50 * s))
  assert [p.steps(a) for a in range(4)] == [50] * 4


def test_step_time_is_the_median_of_the_last_three_tasks():
  p = _pacer(H=30)
  p.observe(0, _task(30, 3.0))  # 0.1 s
  p.observe(1, _task(10, 9.0))  # 0.9 s: pushed out by the next three.
  p.observe(1, _task(10, 3.0))  # 0.3 s
  p.observe(1, _task(10, 6.0))  # 0.6 s
  p.observe(1, _task(10, 2.0))  # 0.2 s -> median(0.3, 0.6, 0.2) = 0.3: ⌊30 · 0.1 / 0.3⌋ = 10.
  p.observe(1, {"loss": [1.0]})  # One step: no step time (evaluation-only tasks: no loss).
  assert p.step_s(1) == pytest.approx(0.3)
  assert p.steps(1) == 10


def test_an_explicit_budget_divides_by_each_actors_step_and_refuses_one_below_a_step():
  p = _pacer(H=30, phase_budget_s=2.0)
  p.observe(0, _task(30, 3.0))  # 0.1 s: ⌊2.0 / 0.1⌋ = 20 (< H).
  p.observe(1, _task(30, 15.0))  # 0.5 s: ⌊2.0 / 0.5⌋ = 4.
  assert [p.steps(0), p.steps(1)] == [20, 4]
  short = _pacer(H=30, phase_budget_s=0.05)
  short.observe(0, _task(30, 3.0))
  with pytest.raises(ConfigError, match=r"phase_budget_s=0.05 is shorter than one inner step"):
    short.steps(0)


def test_pacing_off_always_runs_h_and_speed_lease_orders_fastest_first():
  p = _pacer(H=30, pace_steps=False, lease="speed")
  p.observe(0, _task(30, 9.0))  # 0.3 s
  p.observe(2, _task(30, 3.0))  # 0.1 s; actor 1 not measured yet: first.
  assert p.steps(0) == 30
  assert p.order([0, 1, 2]) == [1, 2, 0]
  assert _pacer(lease="first").order([2, 0, 1]) == [2, 0, 1]


def test_a_slow_actor_leases_the_least_lagging_runnable_task(tmp_path):
  plan = coord_lib.QueuePlan(
    workers=3,
    phases=4,
    timeout_s=60.0,
    modules_of_worker=[["m/0"], ["m/1"], ["m/2"]],
    reshard_steps=[],
  )
  q = coord_lib.Coordinator(plan, str(tmp_path))
  assert q.lease(0) == (0, 0)
  q.complete(0, 0, {"loss": [1.0]})
  q.modules_updated(0, ["m/0"])  # Worker 0's phase 1 is ready: pending (0, 1), (0, 2), (1, 0).
  assert q.lease(1, True) == (1, 0)  # Slow: the path furthest ahead.
  assert q.lease(2) == (0, 1)  # Fast: the most lagging.
