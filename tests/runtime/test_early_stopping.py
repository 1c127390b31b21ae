"""Per-worker early stopping (dipaco_jax/runtime/early_stopping.py), with empty validation shards.

data.empty_shard_policy='allow_validation': a worker without validation documents reads a NaN
loss, still trains, and early stopping keeps its latest params. The set is saved with (and only
with) each checkpoint: a resume from step s sees it as of s.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from dipaco_jax import data as data_lib
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.data import feed as feed_lib
from dipaco_jax.data import prepare
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import early_stopping

import helpers
import routing_testlib


@pytest.fixture(name="shards")
def _shards(tmp_path, monkeypatch):
  docs = {
    "train": routing_testlib.fake_documents(40, seed=1),
    "validation": routing_testlib.fake_documents(12, seed=2, first_id=1000),
  }
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tasks, "iter_documents", lambda task, split, **kw: iter(docs[split]))
  cfg = helpers.micro_config(**{"data.top_k": 4})
  # Every training document goes to all 4 workers; validation keeps the first: worker 0.
  everyone = data_lib.with_description(lambda d: [0, 1, 2, 3], "all-four")
  with pytest.raises(data_lib.EmptyShardError, match="3 of 4 workers got no validation"):
    prepare.prepare_shards(cfg.data, 4, str(tmp_path / "strict"), assign=everyone)
  cfg.data.empty_shard_policy = "allow_validation"
  # Training shards may never be empty, whatever the policy.
  only_0 = data_lib.with_description(lambda d: [0], "all-to-0")
  with pytest.raises(data_lib.EmptyShardError, match="3 of 4 workers got no train"):
    prepare.prepare_shards(cfg.data, 4, str(tmp_path / "train_empty"), assign=only_0)
  return cfg, prepare.prepare_shards(cfg.data, 4, str(tmp_path / "s"), assign=everyone)


def test_empty_validation_reads_nan_and_early_stopping_keeps_the_latest(shards):
  cfg, shard_set = shards
  np.testing.assert_array_equal(shard_set.num_docs("validation"), [12, 0, 0, 0])
  exp = experiment.Experiment(cfg)
  workers, rows = feed_lib.local_block(exp.batch_sharding, exp.batch_shape)
  val = feed_lib.Feed(
    shard_set,
    "validation",
    workers,
    rows,
    seq_len=cfg.data.seq_len,
    batch_size=cfg.data.batch_size,
    seed=0,
    shuffle=False,
  )
  batch = val.next_batch()
  assert batch["weights"][0].sum() > 0 and not batch["weights"][1:].any()
  state = exp.init_state(0)
  loss_W = exp.evaluate(state.params, [batch])
  assert np.isfinite(loss_W[0]) and np.isnan(loss_W[1:]).all()
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  assert best.update(10, loss_W, state.params, phase=0) == [0, 1, 2, 3]
  worse = np.array([loss_W[0] + 1.0, np.nan, np.nan, np.nan])
  later = jax.tree.map(lambda x: x + 1.0, state.params)
  # Worker 0 got worse: its step-10 params stay; workers 1-3 have no evidence: latest params.
  assert best.update(20, worse, later, phase=0) == [1, 2, 3]
  assert best.meta["step"] == [10, 20, 20, 20] and best.meta["loss"][1] == float("inf")
  leaf = lambda t: np.asarray(jax.tree.leaves(t)[0])
  np.testing.assert_array_equal(leaf(best.params)[0], leaf(state.params)[0])
  np.testing.assert_array_equal(leaf(best.params)[1:], leaf(later)[1:])


def _config(shard_dir, **kw):
  over = {
    "model.vocab_size": 8192,
    "data.shard_dir": shard_dir,
    "dipaco.inner_steps": 2,
    "dipaco.outer_steps": 3,
    "eval.every_steps": 2,
    "ckpt.every_steps": 2,
    "ckpt.max_to_keep": 2,
  }
  over.update(kw)
  return helpers.micro_config(**over)


def _best(workdir, cfg, step=None):
  exp = experiment.Experiment(cfg)
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  params, records = ck.restore_best(exp.abstract_state.params, step)
  state, _ = ck.restore(exp.abstract_state, step)
  ck.close()
  return jax.tree.map(np.asarray, params), records, jax.tree.map(np.asarray, state)


@pytest.mark.slow  # three training runs on the embedded corpus
def test_a_resume_from_step_s_sees_the_best_set_as_of_s(tmp_path):
  shard_dir = str(tmp_path / "shards")
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  with helpers.compile_cache(tmp_path / "jax_cache"):
    train.train_and_evaluate(_config(shard_dir), full)
    train.train_and_evaluate(_config(shard_dir, stop_at_step=4), part)
  later = early_stopping.read_meta(part)
  assert later["checkpoint_step"] == 4 and 4 in later["step"]  # Step 4 improved some worker.
  # Back to step 2, as after a crash that lost checkpoint 4: nothing of step 4 may show.
  shutil.rmtree(os.path.join(part, "checkpoints", "4"))
  meta = early_stopping.read_meta(part)
  assert meta["checkpoint_step"] == 2 and meta["step"] == [2, 2, 2, 2]
  params, records, state = _best(part, _config(shard_dir))
  assert records["step"] == [2, 2, 2, 2]
  # Every worker improved at the first evaluation: the set is step 2's params.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  with helpers.compile_cache(tmp_path / "jax_cache"):
    train.train_and_evaluate(_config(shard_dir), part)  # Resumes from step 2.
  pa, ra, _ = _best(full, _config(shard_dir))
  pb, rb, _ = _best(part, _config(shard_dir))
  assert ra == rb and ra["step"] != [2, 2, 2, 2]
  for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(a, b)
  # The trainer saves the set with the checkpoint only: no other directory holds params.
  assert not {"best_paths", "checkpoints_best"} & set(os.listdir(part))
  assert json.load(open(os.path.join(part, "config.json")))["early_stopping"]["enabled"]
