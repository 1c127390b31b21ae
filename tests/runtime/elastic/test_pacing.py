"""Work in proportion to speed: a task's inner steps and its actor from measured step times."""

import types

import jax
import numpy as np
import pytest
import test_elastic_end_to_end

from dipaco_jax import train
from dipaco_jax.errors import ConfigError
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import pacing
from dipaco_jax.runtime.elastic import storage

import helpers

ray_cluster = test_elastic_end_to_end.ray_cluster  # The local Ray cluster fixture (4 CPUs).


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


def _speed_pool(walls=(10.0, 30.0, 10.0, 10.0)):
  """A lease="speed" pacer, unpaced, whose actors' tasks took `walls` s (H steps each)."""
  p = _pacer(H=10, pace_steps=False, lease="speed")
  for a, wall in enumerate(walls):
    p.observe(a, _task(10, wall), 99.0)  # The first task's wall (compilation): left out.
    p.observe(a, _task(10, wall), wall)
  return p


def test_a_slow_actor_defers_when_the_others_finish_every_ready_task_sooner():
  # 16 paths on 4 actors; actor 1 is 3x slower (task 30 s against 10 s). At t = 30 s it is
  # idle; actors 0, 2, 3 were leased tasks at t = 30 (free at 40). With 3 ready tasks: each
  # fast actor takes one, finishing at 50 s; actor 1 would finish at 30 + 30 = 60 > 50: defer
  # (the phase ends at 50 s, not 60 s).
  p = _speed_pool()
  busy = {0: 30.0 + 10.0, 2: 40.0, 3: 40.0}
  assert p.defer(1, busy, runnable=3, now=30.0)
  # 7 ready tasks: dealt earliest finish first, fast actors finish at 50, 50, 50, 60, 60,
  # 60 ... the 4th ties actor 1's 60 s: it takes one (no later than a fast actor would).
  assert not p.defer(1, busy, runnable=7, now=30.0)
  # At the phase's start (the fast actors leased at t = 0, free at 10; 13 more ready): rounds
  # of 3 end at 20, 30, 40, so the 7th ready task would end at 40 > 30: the slow one takes one.
  assert not p.defer(1, {0: 10.0, 2: 10.0, 3: 10.0}, runnable=13, now=0.0)
  # Two fast actors idle now, 2 ready tasks: both finish at now + 10 < now + 30: defer.
  assert p.defer(1, {0: 5.0, 2: 5.0, 3: 100.0}, runnable=2, now=5.0)


def test_defer_never_holds_back_a_fast_actor_or_without_measured_walls():
  p = _speed_pool()
  assert not p.defer(0, {1: 30.0, 2: 30.0, 3: 30.0}, runnable=1, now=30.0)  # Fast: takes.
  assert not p.defer(1, {0: None, 2: 40.0, 3: 40.0}, runnable=1, now=30.0)  # A wall unknown.
  assert not p.defer(1, {}, runnable=1, now=30.0)  # Nobody else to take it.
  assert not p.defer(1, {0: 40.0}, runnable=0, now=30.0)  # Nothing ready.
  first = _pacer(H=10, pace_steps=False, lease="first")
  for a, wall in enumerate((10.0, 30.0, 10.0, 10.0)):
    first.observe(a, _task(10, wall), wall)
    first.observe(a, _task(10, wall), wall)
  assert not first.defer(1, {0: 30.0}, runnable=1, now=30.0)  # lease="first": never.
  # An evaluation-only task (no step time) leaves the wall median alone.
  p.observe(1, {"loss": []}, 0.5)
  assert p.task_s(1) == 30.0
  # One training task only: no wall yet (its first holds the compilation), so no deferral.
  once = _pacer(H=10, pace_steps=False, lease="speed")
  for a, wall in enumerate((10.0, 30.0)):
    once.observe(a, _task(10, wall), wall)
  assert once.task_s(1) is None and not once.defer(1, {0: 40.0}, runnable=1, now=30.0)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_slow_actor_defers_and_the_run_trains_the_same_as_leasing_first(tmp_path):
  # 4 paths on 2 actors, H = 4, T = 3, pacing off: every task trains H steps. Actor 1 sleeps
  # 2 s a step (a task ~8 s), actor 0 none (a task well under a second of steps and loads).
  # Phases 0 and 1: actor 1 takes a task (no wall measured yet: its first holds the
  # compilation). Phase 2: actor 0 takes one, and actor 1 defers the other 3 (actor 0 ends
  # all 4 before actor 1 would end one). The outer steps wait for every delta, so the run
  # ends bit for bit where the same run leasing first-come with no slow actor ends.
  base = {
    "data.shard_dir": str(tmp_path / "shards"),
    "dipaco.inner_steps": 4,
    "dipaco.outer_steps": 3,
    "eval.every_steps": 4,
    "ckpt.every_steps": 4,
    "elastic.num_workers": 2,
  }
  runs = {}
  for name, lease, delays in (("speed", "speed", (0.0, 2.0)), ("first", "first", (0.0, 0.0))):
    cfg = helpers.elastic_config(**{**base, "elastic.lease": lease})
    wd = runs[name] = str(tmp_path / name)
    out = train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=delays))
    assert out["step"] == 12 and out["status"]["done"] == 16, out["status"]
  events = storage.read_task_log(runs["speed"])
  on_slow = sorted(e["phase"] for e in events if e["event"] == "done" and e["actor"] == 1)
  assert on_slow[:2] == [0, 1] and 2 not in on_slow, on_slow
  a, b = (test_elastic_end_to_end._final(runs[n]) for n in ("speed", "first"))
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


# ---- The wall deadline of an actor not measured yet (phase 0's tasks). ----


def test_an_unmeasured_actors_deadline_is_slack_times_h_fast_steps_or_the_budget():
  p = _pacer(H=10)
  assert p.stop_after_s() is None  # Nobody measured: no deadline, every task runs H.
  p.observe(0, _task(10, 3.4))  # 0.34 s a step -> 1.25 · 10 · 0.34 = 4.25 s of steps.
  assert p.stop_after_s() == pytest.approx(4.25)
  assert _pacer(H=10, pace_steps=False).stop_after_s() is None  # Pacing off: never.
  budget = _pacer(H=10, phase_budget_s=2.0)
  budget.observe(0, _task(10, 3.4))
  assert budget.stop_after_s() == 2.0  # phase_budget_s as set.
  short = _pacer(H=10, phase_budget_s=0.2)  # Below one measured step (0.34 s): one line.
  short.observe(0, _task(10, 3.4))
  with pytest.raises(ConfigError, match=r"phase_budget_s=0.2 is shorter than one inner step"):
    short.stop_after_s()


def _steps_until_deadline(H, step_s, limit_s, floor=1) -> int:
  """Steps a task of H steps of step_s seconds runs under pacing.past_deadline (worker.py's loop).

  Before each step the worker asks past_deadline with the end of its first step (t = step_s,
  its start at 0) and the steps done so far.
  """
  done = 0
  while done < H:
    first = [step_s] if done else []
    if pacing.past_deadline(limit_s, first, done, floor, now=done * step_s):
      break
    done += 1
  return done


def test_a_task_stops_at_its_first_step_past_the_deadline_and_not_below_the_floor():
  f, H = 0.34, 10
  limit = pacing.SLACK * H * f  # 4.25 s, as the pacer's above.
  # 3x slower (1.02 s): steps end at 1.02, 2.04, ... 5.10; the check before step n+1 is at
  # n · 1.02, i.e. (n - 1) · 1.02 s after the first step: 4 · 1.02 = 4.08 < 4.25, 5 · 1.02 =
  # 5.10 >= 4.25 -> it stops after 6 steps, not 10 (the pacer then gives ⌊10/3⌋ = 3).
  assert _steps_until_deadline(H, 3 * f, limit) == 6
  # 10x slower (3.4 s): 1 · 3.4 < 4.25 <= 2 · 3.4 -> 3 steps instead of 10 (34 s -> 10.2 s).
  assert _steps_until_deadline(H, 10 * f, limit) == 3
  # Equal actors within SLACK never stop early: H steps of up to 1.25 f take (H - 1) · 1.25 f
  # = 3.825 s after the first < 4.25 s, so with pacing on and equal speeds every task still
  # runs H steps, the same inner steps as with pacing off (the results bit-identical).
  assert _steps_until_deadline(H, 1.25 * f, limit) == H
  # The floor: a deadline already past (0 s) still lets min_inner_steps run.
  assert _steps_until_deadline(H, f, 0.0, floor=4) == 4
  assert _steps_until_deadline(H, f, None) == H  # No deadline: H.


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_slow_actors_phase_0_task_stops_at_the_deadline(tmp_path):
  # Actor 1 sleeps 3 s after each inner step, actor 0 0.2 s; H = 6, T = 1, 4 paths on the 2.
  # Actor 0's task (0, 0) ends first: 0.2 s a step -> the deadline 1.25 · 6 · 0.2 = 1.5 s of
  # steps for actor 1's running (0, 1), which stops at its first step past it, after the
  # floor of 2: 2 steps (~6 s of sleeps) instead of 6 (~18 s). Actor 0, measured, runs H on
  # the rest. (Its wall is mostly the actors' start-up and compilation: not asserted.)
  H = 6
  cfg = helpers.elastic_config(
    **{
      "data.shard_dir": str(tmp_path / "shards"),
      "dipaco.inner_steps": H,
      "dipaco.outer_steps": 1,
      "eval.every_steps": H,
      "ckpt.every_steps": H,
      "elastic.num_workers": 2,
      "elastic.pace_steps": True,
      "elastic.min_inner_steps": 2,
    }
  )
  wd = str(tmp_path / "run")
  out = train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=(0.2, 3.0)))
  assert out["step"] == H and out["status"]["done"] == 8 and np.isfinite(out["train_loss_mean"])
  events = storage.read_task_log(wd)
  done = {(e["phase"], e["worker"]): e for e in events if e["event"] == "done"}
  slow = [e for (t, _), e in done.items() if t == 0 and e["actor"] == 1]
  fast = [e for (t, _), e in done.items() if t == 0 and e["actor"] == 0]
  assert slow and fast, done
  first = slow[0]  # Its phase-0 task leased before any step time: stopped by the deadline.
  assert 2 <= first["steps"] < H and first["deadline_s"] > 0, first
  assert all(e["steps"] == H and "deadline_s" not in e for e in fast), fast
  told = [e for e in events if e["event"] in ("deadline", "start") and e.get("actor") == 1]
  assert any(e["event"] == "deadline" or "stop_after_s" in e for e in told), told
