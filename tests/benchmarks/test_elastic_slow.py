"""benchmarks/elastic_slow.py's figures: goodputs and the issue's goals, by hand."""

import os
import sys

import pytest

import helpers

sys.path.insert(0, os.path.join(helpers.ROOT, "benchmarks"))
import elastic_slow  # pylint: disable=g-import-not-at-top,wrong-import-position


def _slow_run():
  """A 3x run: actor 1 trained 20 steps, the others 80; 50 s from the first lease."""
  return {
    "actors": 4,
    "steps_by_actor": {"0": 80, "1": 20, "2": 80, "3": 80},
    "steady_steps_by_actor": {"0": 60, "1": 15, "2": 60, "3": 60},
    "wall_s": 50.0,
    "first_step_s": 2.0,
    "steady_wall_s": 30.0,
    "val_loss_mean": 6.1,
    "wall_to_target_s": 36.0,
  }


def test_goodput_by_hand():
  run = _slow_run()
  elastic_slow._goodput(run, [0.25, 0.75, 0.25, 0.25])
  # Own: (3 x 80 x 0.25 + 20 x 0.75) / (4 x 50) = 75 / 200; clean: 260 x 0.25 / 200.
  assert run["goodput_own"] == pytest.approx(0.375)
  assert run["goodput_clean"] == pytest.approx(0.325)
  # From the first inner step: the same steps over 4 x (50 - 2) s.
  assert run["from_step_wall_s"] == pytest.approx(48.0)
  assert run["from_step_goodput_own"] == pytest.approx(75 / 192)
  # After phase 0: (3 x 60 x 0.25 + 15 x 0.75) / (4 x 30) = 56.25 / 120.
  assert run["steady_goodput_own"] == pytest.approx(0.46875)


def test_goals_by_hand():
  # Clean seed 0: T = 3, the target its loss after outer step 2 (6.5, read at 30 s), its final
  # 6.0 read at 40 s; seed 1's clean run ends at 6.2: the range [6.0, 6.2].
  clean0 = {
    "val_by_phase": {"1": 7.0, "2": 6.5, "3": 6.0},
    "seen_s_by_phase": {"1": 10.0, "2": 30.0, "3": 40.0},
    "val_loss_mean": 6.0,
    "first_step_s": 4.0,
  }
  clean1 = {"val_by_phase": {"3": 6.2}, "seen_s_by_phase": {"3": 41.0}, "val_loss_mean": 6.2}
  three = {"wall_s": 40.0, "from_step_wall_s": 38.0, **clean1}
  run = {**_slow_run(), "goodput_own": 0.91, "from_step_goodput_own": 0.95, "wall_s": 50.0}
  run.update(from_step_wall_s=48.0, val_by_phase={"1": 7.2, "2": 6.8, "3": 6.1})
  run["seen_s_by_phase"] = {"1": 10.0, "2": 20.0, "3": 36.0}
  long = {**run, "val_by_phase": {**run["val_by_phase"], "4": 6.05, "5": 5.9}, "val_loss_mean": 5.9}
  long["seen_s_by_phase"] = {**run["seen_s_by_phase"], "4": 45.0, "5": 50.0}
  seed0 = {"clean": clean0, "three_actors": three, "3x_pace": run, "3x_pace_long": long}
  res = {
    "seed0": {**seed0, "target_val_loss": 6.5},
    "seed1": {"clean": clean1, "target_val_loss": 6.6},
  }
  elastic_slow._goals(res)
  g = run["goals"]
  assert res["clean_final_loss_range"] == [6.0, 6.2]
  assert g["final_loss_in_range"]  # 6.1 in [6.0, 6.2].
  assert (clean0["wall_to_target_s"], clean0["wall_to_clean_final_s"]) == (30.0, 40.0)
  assert (run["wall_to_target_s"], run["wall_to_clean_final_s"]) == (36.0, None)  # 6.1 > 6.0.
  # The summed speed of 3 actors and one 3x slower: 3 + 1/3; bound = 30 x 4 / (10/3) = 36.
  assert g["target_over_bound"] == pytest.approx(1.0)
  # From the first inner step: (36 - 2) / ((30 - 4) x 1.2) = 34 / 31.2.
  assert g["from_step_target_over_bound"] == pytest.approx(34 / 31.2)
  assert g["clean_final_over_bound"] is None
  assert g["goodput_own_ge_0.90"] and g["from_step_goodput_own_ge_0.90"]
  assert g["wall_over_three_actors"] == pytest.approx(50 / 40)
  assert g["from_step_wall_over_three_actors"] == pytest.approx(48 / 38)
  # The longer run reaches the clean final 6.0 at its phase 5 (50 s): 50 / (40 x 1.2).
  gl = long["goals"]
  assert gl["clean_final_over_bound"] == pytest.approx(50 / 48)
  assert gl["val_loss_after_clean_T"] == 6.1 and not gl["final_loss_in_range"]  # 5.9 < 6.0.
