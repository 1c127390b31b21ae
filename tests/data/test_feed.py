"""This process's block of the global batch and its position (dipaco_jax/data/feed.py)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax import data as data_lib
from dipaco_jax.data import feed as feed_lib

import routing_testlib

W, B, T = 4, 4, 8  # workers, batch rows, sequence length
KW = {"seq_len": T, "batch_size": B, "seed": 3}


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
  """Workers 0, 1, 3 hold documents in both splits; worker 2 has no validation document."""
  shard_dir = str(tmp_path_factory.mktemp("shards"))
  by_id = lambda d: [d.doc_id % W]
  data_lib.write_shards(shard_dir, "train", routing_testlib.fake_documents(40, seed=1), by_id, W)
  val = [d for d in routing_testlib.fake_documents(20, seed=2) if d.doc_id % W != 2]
  data_lib.write_shards(shard_dir, "validation", val, by_id, W, empty_policy="allow")
  return data_lib.ShardSet(shard_dir)


def test_local_block_of_one_process_is_every_worker_and_row():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("path", "data"))
  workers, rows = feed_lib.local_block(NamedSharding(mesh, P("path", "data")), (W, B, T))
  assert workers == [0, 1, 2, 3] and rows == slice(0, B)


def test_a_workers_batches_do_not_depend_on_which_workers_a_process_loads(shard_set):
  # The stand-in for two processes: one loads every worker and row, the other workers 1 and 3,
  # rows 2-3. Each worker reads its own shard, so the blocks must be equal.
  full = feed_lib.Feed(shard_set, "train", range(W), slice(0, B), **KW)
  part = feed_lib.Feed(shard_set, "train", [1, 3], slice(2, B), **KW)
  for _ in range(3):
    a, b = full.next_batch(), part.next_batch()
    assert a["inputs"].shape == (W, B, T) and b["inputs"].shape == (2, 2, T)
    for k in a:
      np.testing.assert_array_equal(a[k][[1, 3], 2:], b[k], err_msg=k)
  # Unshuffled, worker 3's first batch is its own shard's documents laid end to end.
  alone = feed_lib.Feed(shard_set, "train", [3], slice(0, B), shuffle=False, **KW).next_batch()
  stream = np.concatenate([d.tokens for d in shard_set.documents(3, "train")])
  np.testing.assert_array_equal(alone["targets"][0].ravel(), stream[: B * T])


def test_empty_validation_shard_feeds_padding_only(shard_set):
  val = feed_lib.Feed(shard_set, "validation", range(W), slice(0, B), shuffle=False, **KW)
  batch = val.next_batch()
  assert not batch["weights"][2].any() and not batch["inputs"][2].any()
  assert all(batch["weights"][w].sum() > 0 for w in (0, 1, 3))
  assert val.local_state()["2"] == {"empty": True}


def test_state_resumes_the_same_batches_and_refuses_another_grid(shard_set):
  feed = feed_lib.Feed(shard_set, "train", range(W), slice(0, B), **KW)
  for _ in range(2):
    feed.next_batch()
  state = feed.get_state()
  assert sorted(state) == ["0", "1", "2", "3"]  # one process: gather_json is [local state]
  want = [feed.next_batch() for _ in range(3)]
  resumed = feed_lib.Feed(shard_set, "train", range(W), slice(0, B), **KW)
  resumed.set_state(state)
  for w in want:
    got = resumed.next_batch()
    for k in w:
      np.testing.assert_array_equal(got[k], w[k], err_msg=k)
  with pytest.raises(ValueError, match=r"no position for workers \[3\]"):
    resumed.set_state({k: v for k, v in state.items() if k != "3"})
