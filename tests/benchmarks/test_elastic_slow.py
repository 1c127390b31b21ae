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
  clean0 = {"val_loss_mean": 6.0, "wall_to_target_s": 30.0, "first_step_s": 4.0}
  three = {"wall_s": 40.0, "from_step_wall_s": 38.0}
  run = {**_slow_run(), "goodput_own": 0.91, "from_step_goodput_own": 0.95, "wall_s": 50.0}
  run["from_step_wall_s"] = 48.0
  res = {
    "seed0": {"clean": clean0, "three_actors": three, "3x_pace": run, "target_val_loss": 7.0},
    "seed1": {"clean": {"val_loss_mean": 6.2, "wall_to_target_s": 31.0, "first_step_s": 3.0}},
  }
  elastic_slow._goals(res)
  g = run["goals"]
  assert res["clean_final_loss_range"] == [6.0, 6.2]
  assert g["final_loss_in_range"]  # 6.1 in [6.0, 6.2].
  # The summed speed of 3 actors and one 3x slower: 3 + 1/3; bound = 30 x 4 / (10/3) = 36.
  assert g["target_over_bound"] == pytest.approx(1.0)
  # From the first inner step: (36 - 2) / ((30 - 4) x 1.2) = 34 / 31.2.
  assert g["from_step_target_over_bound"] == pytest.approx(34 / 31.2)
  assert g["goodput_own_ge_0.90"] and g["from_step_goodput_own_ge_0.90"]
  assert g["wall_over_three_actors"] == pytest.approx(50 / 40)
  assert g["from_step_wall_over_three_actors"] == pytest.approx(48 / 38)
  run["val_loss_mean"] = 6.25  # Above the range's top.
  elastic_slow._goals(res)
  assert not run["goals"]["final_loss_in_range"]
