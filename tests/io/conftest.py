"""Fixtures of the checkpoint tests (test_checkpoint, test_checkpoint_integrity)."""

import jax
import numpy as np
import pytest

from dipaco_jax.core import experiment
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import early_stopping

import helpers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Checkpoints 2 and 4 of a run with an early-stopping set, as the trainer saves them."""
  cfg = helpers.micro_config()
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  workdir = str(tmp_path_factory.mktemp("run"))
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  data = {"train": {"position": 3}, "routing": {"phase": 0, "assignment": "random"}}
  best_at = {}
  for step in (2, 4):
    state = state.replace(params=jax.tree.map(lambda x: x + 1.0, state.params), step=state.step + 2)
    best.update(step, np.full(exp.topo.num_workers, 5.0 - step), state.params, phase=0)
    ck.save(step, state, data, best=best.saved())
    best_at[step] = jax.tree.map(np.asarray, best.params)
  ck.close()
  host = jax.tree.map(np.asarray, state)
  want = {
    "state": host,
    "data": data,
    "best": best_at[4],
    "best_2": best_at[2],
    "records": dict(best.meta),
  }
  return cfg, exp, workdir, want
