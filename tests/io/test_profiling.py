"""config.profile's window (io/profiling.py) in both runtimes."""

import glob
import os

import ml_collections
import pytest

from dipaco_jax.io import profiling
from dipaco_jax.runtime.elastic import driver
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import worker as worker_lib

import helpers


def _window(monkeypatch, start, n):
  calls = []
  monkeypatch.setattr(profiling.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
  monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  cfg = ml_collections.ConfigDict({"profile": {"start_step": start, "num_steps": n}})
  return profiling.Window(cfg, "/logs"), calls


def test_the_window_traces_its_steps_once(monkeypatch):
  w, calls = _window(monkeypatch, 3, 2)
  for step in range(1, 7):  # Steps 3 and 4 inside the trace.
    w.before(step)
    assert calls == ([] if step < 3 else [("start", "/logs")] + ([("stop",)] if step > 4 else []))
    w.after(step, [])
  w.close()
  assert calls == [("start", "/logs"), ("stop",)]
  # A resumed run (or an elastic task) that starts inside the window traces what it runs.
  w, calls = _window(monkeypatch, 3, 4)
  w.before(5)
  w.close()  # The task ends at step 5: the trace stops with it.
  assert calls == [("start", "/logs"), ("stop",)]
  w, calls = _window(monkeypatch, 1, 0)  # Off.
  for step in range(1, 4):
    w.before(step)
    w.after(step, [])
  w.close()
  assert calls == []


@pytest.mark.slow  # ~15 s: an elastic worker's task compiles its step.
def test_an_elastic_task_traces_the_window_into_its_workers_folder(tmp_path):
  cfg = helpers.micro_config(
    **{
      "model.vocab_size": 8192,
      "model.num_layers": 1,
      "dipaco.level_groups": ("embed,head", "block_0"),
      "dipaco.modules_per_level": (1, 2),
      "dipaco.outer_steps": 1,
      "early_stopping.enabled": False,
      "data.shard_dir": str(tmp_path / "shards"),
      "dipaco.mode": "elastic",
      "profile.start_step": 2,
      "profile.num_steps": 1,
    }
  )
  wd = str(tmp_path / "run")
  grid = grid_lib.Grid(cfg)
  driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
  worker_lib.PathWorker(cfg, wd, 0).run(0, 1)
  traces = glob.glob(os.path.join(wd, "profile", "w1", "plugins", "profile", "*", "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
  assert not os.path.exists(os.path.join(wd, "profile", "w0"))  # Worker 0's task did not run.
