"""Per-path shards: write/read round trip with top-2 overlap, sizes, and the errors on bad input."""

import json
import os

import numpy as np
import pytest

from dipaco_jax import data
from dipaco_jax import errors
from dipaco_jax.data import assign as assign_lib
from dipaco_jax.data import shards

import helpers


def make_docs(n: int, seed: int = 0, max_len: int = 300) -> list[data.Document]:
  """Synthetic tokenized documents ending in EOS; a few use ids above uint16 range."""
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    body = rng.integers(3, 8192 if i % 50 else 70_000, size=int(rng.integers(1, max_len)))
    docs.append(data.Document(1000 + i, np.append(body, 1).astype(np.int32), f"dom{i % 3}"))
  return docs


def test_random_assignment_is_deterministic_distinct_and_balanced():
  docs = make_docs(2000)
  assign = data.random_assignment(4, seed=7, top_k=2)
  picks = [assign(d) for d in docs]
  assert picks == [data.random_assignment(4, seed=7, top_k=2)(d) for d in docs]
  assert picks != [data.random_assignment(4, seed=8, top_k=2)(d) for d in docs]
  assert all(len(p) == 2 and len(set(p)) == 2 and all(0 <= q < 4 for q in p) for p in picks)
  counts = np.bincount([q for p in picks for q in p], minlength=4)
  assert counts.min() > 0.8 * counts.mean()  # i.i.d.: about 1000 each
  assert assign.description == "random(num_workers=4,seed=7,top_k=2)"


def test_write_read_round_trip_with_top2_overlap(tmp_path):
  docs = make_docs(200)
  assign = data.random_assignment(3, seed=1, top_k=2)
  sizes = data.write_shards(str(tmp_path), "train", docs, assign, 3)
  shard_set = data.ShardSet(str(tmp_path))
  assert shard_set.num_workers == 3 and shard_set.splits == ("train",)
  np.testing.assert_array_equal(sizes, shard_set.sizes("train"))
  expected = {p: [d for d in docs if p in assign(d)] for p in range(3)}
  for p in range(3):
    got = shard_set.documents(p, "train")
    assert len(got) == len(expected[p]) == shard_set.num_docs("train")[p]
    assert sizes[p] == sum(len(d.tokens) for d in expected[p])
    for want, have in zip(expected[p], got):
      assert (have.doc_id, have.domain) == (want.doc_id, want.domain)
      assert have.tokens.dtype == np.int32
      np.testing.assert_array_equal(have.tokens, want.tokens)
    assert [d.doc_id for d in got.read_many([2, 0])] == [
      expected[p][2].doc_id,
      expected[p][0].doc_id,
    ]
    assert got[-1].doc_id == expected[p][-1].doc_id
  # top-2: every document is in exactly two shards, so the sizes add up to twice the corpus.
  assert sizes.sum() == 2 * sum(len(d.tokens) for d in docs)


def test_empty_path_is_a_clear_error_and_leaves_split_incomplete(tmp_path):
  docs = make_docs(10)
  only_path_0 = assign_lib.with_description(lambda d: [0], "all-to-0")
  with pytest.raises(data.EmptyShardError, match=r"2 of 3 workers got no train document: \[1, 2\]"):
    data.write_shards(str(tmp_path), "train", docs, only_path_0, 3)
  assert not os.path.exists(tmp_path / "train" / shards.META)
  with pytest.raises(ValueError, match="no complete split"):
    data.ShardSet(str(tmp_path))
  # The explicit policy keeps the empty shards (size 0); reading that path for batches fails.
  sizes = data.write_shards(str(tmp_path), "train", docs, only_path_0, 3, empty_policy="allow")
  assert sizes[1] == sizes[2] == 0
  with pytest.raises(ValueError, match="empty 'train' shard"):
    data.WorkerBatcher(data.ShardSet(str(tmp_path)), "train", [1], seq_len=8, batch_size=1, seed=0)


def test_bad_assignments_and_inputs_are_clear_errors(tmp_path):
  docs = make_docs(5)
  with pytest.raises(ValueError, match="returned no worker for document 1000"):
    data.write_shards(str(tmp_path / "a"), "train", docs, lambda d: [], 2)
  with pytest.raises(ValueError, match=r"distinct worker ids in \[0, 2\)"):
    data.write_shards(str(tmp_path / "b"), "train", docs, lambda d: [0, 2], 2)
  with pytest.raises(ValueError, match="ending with EOS"):
    data.write_shards(
      str(tmp_path / "c"), "train", [data.Document(0, np.array([5, 6]), "x")], lambda d: [0], 1
    )
  with pytest.raises(ValueError, match="Unknown empty_policy"):
    data.write_shards(str(tmp_path / "d"), "train", docs, lambda d: [0], 1, empty_policy="skip")
  with pytest.raises(ValueError, match="top_k <= num_workers"):
    data.random_assignment(2, seed=0, top_k=3)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.ShardSet(str(tmp_path / "nowhere"))


def test_shards_are_written_once_and_damage_is_detected(tmp_path):
  docs = make_docs(30)
  data.write_shards(str(tmp_path), "validation", docs, data.random_assignment(2, seed=0), 2)
  with pytest.raises(FileExistsError, match="written once"):
    data.write_shards(str(tmp_path), "validation", docs, data.random_assignment(2, seed=0), 2)
  shard_set = data.ShardSet(str(tmp_path))
  with pytest.raises(ValueError, match="no complete 'train' split"):
    shard_set.sizes("train")
  with pytest.raises(ValueError, match="out of range"):
    shard_set.documents(2, "validation")
  meta = json.loads((tmp_path / "validation" / shards.META).read_text())
  assert meta["assignment"] == "random(num_workers=2,seed=0,top_k=1)"
  os.remove(tmp_path / "validation" / shards.shard_file(1))
  with pytest.raises(errors.DamagedFileError, match="is damaged \\(missing\\); move"):
    data.ShardSet(str(tmp_path)).documents(1, "validation")


@pytest.mark.parametrize(
  "name", [shards.META, f"train/{shards.META}", f"train/{shards.shard_file(1)}"]
)
def test_a_truncated_shard_file_gives_one_line_naming_it(tmp_path, name):
  root = tmp_path / "shards"
  data.write_shards(str(root), "train", make_docs(30), data.random_assignment(2, seed=0), 2)
  (root / shards.META).write_text(json.dumps({"format": shards.FORMAT}) + "\n")
  data.ShardSet(str(root)).documents(1, "train")  # Intact before.
  helpers.truncate(root / name)
  before = helpers.tree_bytes(tmp_path)
  with pytest.raises(errors.DamagedFileError) as e:
    data.ShardSet(str(root)).documents(1, "train")
  msg = str(e.value)
  assert "\n" not in msg, msg
  assert msg.startswith(f"shard file {root / name} is damaged ("), msg
  assert f"; move {root} aside (mv {root} {root}.damaged) and rerun" in msg, msg
  assert helpers.tree_bytes(tmp_path) == before  # Nothing deleted or rewritten.


def test_remote_shard_dir_goes_through_staging_and_local_cache(tmp_path, monkeypatch):
  # ArrayRecord opens local files only; a gs:// dir is written via staging and read via a cache.
  monkeypatch.setattr(shards, "_is_remote", lambda path: True)
  monkeypatch.setattr(shards, "CACHE_DIR", str(tmp_path / "cache"))
  docs = make_docs(40)
  sizes = data.write_shards(
    str(tmp_path / "remote"), "train", docs, data.random_assignment(2, seed=0), 2
  )
  got = data.ShardSet(str(tmp_path / "remote")).documents(1, "train")
  assert sum(len(d.tokens) for d in got) == sizes[1]
  assert len(list((tmp_path / "cache").rglob("*.array_record"))) == 1
