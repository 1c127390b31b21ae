"""Per-worker early stopping (dipaco_jax/early_stopping.py), with empty validation shards.

data.empty_shard_policy='allow_validation': a worker without validation documents reads a NaN
loss, still trains, and early stopping keeps its latest params.
"""

import jax
import numpy as np
import pytest

import helpers
import routing_testlib
from dipaco_jax import data as data_lib
from dipaco_jax import early_stopping
from dipaco_jax import experiment
from dipaco_jax import feed as feed_lib
from dipaco_jax.data import prepare


@pytest.fixture(name="shards")
def _shards(tmp_path, monkeypatch):
  docs = {"train": routing_testlib.fake_documents(40, seed=1),
          "validation": routing_testlib.fake_documents(12, seed=2, first_id=1000)}
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


def test_empty_validation_reads_nan_and_early_stopping_keeps_the_latest(shards, tmp_path):
  cfg, shard_set = shards
  np.testing.assert_array_equal(shard_set.num_docs("validation"), [12, 0, 0, 0])
  exp = experiment.Experiment(cfg)
  workers, rows = feed_lib.local_block(exp.batch_sharding, exp.batch_shape)
  val = feed_lib.Feed(shard_set, "validation", workers, rows, seq_len=cfg.data.seq_len,
                      batch_size=cfg.data.batch_size, seed=0, shuffle=False)
  batch = val.next_batch()
  assert batch["weights"][0].sum() > 0 and not batch["weights"][1:].any()
  state = exp.init_state(0)
  loss_W = exp.evaluate(state.params, [batch])
  assert np.isfinite(loss_W[0]) and np.isnan(loss_W[1:]).all()
  best = early_stopping.BestPaths(str(tmp_path / "run"), exp.state_sharding.params,
                                  exp.abstract_state.params, exp.topo.num_workers)
  assert best.update(10, loss_W, state.params, phase=0) == [0, 1, 2, 3]
  worse = np.array([loss_W[0] + 1.0, np.nan, np.nan, np.nan])
  later = jax.tree.map(lambda x: x + 1.0, state.params)
  # Worker 0 got worse: its step-10 params stay; workers 1-3 have no evidence: latest params.
  assert best.update(20, worse, later, phase=0) == [1, 2, 3]
  assert best.meta["step"] == [10, 20, 20, 20] and best.meta["loss"][1] == float("inf")
  leaf = lambda t: np.asarray(jax.tree.leaves(t)[0])
  np.testing.assert_array_equal(leaf(best.params)[0], leaf(state.params)[0])
  np.testing.assert_array_equal(leaf(best.params)[1:], leaf(later)[1:])
  best.close()

