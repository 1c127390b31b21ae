"""Per-path shards: write/read round trip with top-2 overlap, sizes, and the errors on bad input."""

import json
import os

import numpy as np
import pytest

from dipaco_jax import data
from dipaco_jax import errors
from dipaco_jax.data import assign as assign_lib
from dipaco_jax.data import shard_writer
from dipaco_jax.data import shards
from dipaco_jax.io import files

import helpers


def make_docs(n: int, seed: int = 0, max_len: int = 300) -> list[data.Document]:
  """Synthetic tokenized documents ending in EOS; a few use ids above uint16 range."""
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    body = rng.integers(3, 8192 if i % 50 else 70_000, size=int(rng.integers(1, max_len)))
    docs.append(data.Document(1000 + i, np.append(body, 1).astype(np.int32), f"dom{i % 3}"))
  return docs


def part_file(worker: int, part: int = 0, num_parts: int = 1, chunk: int = 0) -> str:
  """A path's file in a split dir: worker_<w>/part-<i>-of-<N>-<chunk>.array_record."""
  return f"{shards.worker_dir(worker)}/{shards.part_name(part, num_parts)}-{chunk:05d}.array_record"


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
  os.remove(tmp_path / "validation" / part_file(1))
  with pytest.raises(errors.DamagedFileError, match="is damaged \\(missing\\); move"):
    data.ShardSet(str(tmp_path)).documents(1, "validation")


@pytest.mark.parametrize("name", [shards.META, f"train/{shards.META}", f"train/{part_file(1)}"])
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
  monkeypatch.setattr(files, "is_remote", lambda path: True)
  monkeypatch.setattr(shards, "CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(shards, "REMOTE_CHUNK_BYTES", 2000)  # ~10 documents per file
  staged = []  # files on local disk each time a chunk is closed
  monkeypatch.setattr(shard_writer.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "stage"))
  os.makedirs(tmp_path / "stage")
  orig_close = shard_writer._PathWriter.close  # pylint: disable=protected-access

  def close(self):  # What is staged on local disk each time a chunk is closed and copied up.
    staged.append(len(os.listdir(tmp_path / "stage")))
    orig_close(self)

  monkeypatch.setattr(shard_writer._PathWriter, "close", close)  # pylint: disable=protected-access
  docs = make_docs(80)
  assign = data.random_assignment(2, seed=0)
  sizes = data.write_shards(str(tmp_path / "remote"), "train", docs, assign, 2)
  assert max(staged) == 2  # One open chunk per path (2 paths) on local disk, never the split.
  assert not (tmp_path / "stage").exists()  # Staging removed once the part is stored.
  got = data.ShardSet(str(tmp_path / "remote")).documents(1, "train")
  assert len(list((tmp_path / "remote" / "train" / shards.worker_dir(1)).iterdir())) > 3
  assert [d.doc_id for d in got] == [d.doc_id for d in docs if assign(d) == [1]]
  assert sum(len(d.tokens) for d in got) == sizes[1]
  cached = list((tmp_path / "cache").rglob("*.array_record"))
  assert len(cached) == len(data.ShardSet(str(tmp_path / "remote")).files(1, "train")) > 3


def write_in_parts(root, docs, assign, num_workers: int, num_parts: int, **kw) -> np.ndarray:
  """What N processes write: each its contiguous 1/N of docs (as tfds.even_splits cuts them)."""
  bounds = np.linspace(0, len(docs), num_parts + 1).astype(int)
  for i in reversed(range(num_parts)):  # Any order: the parts are joined by index.
    part_docs = docs[bounds[i] : bounds[i + 1]]
    shard_writer.write_part(
      str(root), "train", part_docs, assign, num_workers, part=i, num_parts=num_parts, **kw
    )
  return shard_writer.finish_split(
    str(root), "train", num_parts, num_workers=num_workers, assignment=assign.description
  )


@pytest.mark.parametrize("num_parts,chunk_bytes", [(2, None), (3, 1500)])
def test_shards_written_in_parts_read_as_one_process_wrote_them(tmp_path, num_parts, chunk_bytes):
  docs = make_docs(120)
  assign = data.random_assignment(3, seed=4, top_k=2)
  one = data.write_shards(str(tmp_path / "one"), "train", docs, assign, 3)
  many = write_in_parts(tmp_path / "many", docs, assign, 3, num_parts, chunk_bytes=chunk_bytes)
  np.testing.assert_array_equal(one, many)
  a, b = data.ShardSet(str(tmp_path / "one")), data.ShardSet(str(tmp_path / "many"))
  for p in range(3):
    want, got = a.documents(p, "train"), b.documents(p, "train")
    # The same documents in the same order: the batcher's seeded order does not depend on N.
    assert (
      [d.doc_id for d in got]
      == [d.doc_id for d in want]
      == [d.doc_id for d in docs if p in assign(d)]
    )
    assert len(b.files(p, "train")) >= num_parts  # one file per part at least
    order = [len(got) - 1, 0, len(got) // 2, 1, len(got) - 2]  # across file boundaries
    for x, y in zip(got.read_many(order), want.read_many(order)):
      assert x.doc_id == y.doc_id and np.array_equal(x.tokens, y.tokens)
    assert got[-1].doc_id == want[-1].doc_id


def test_a_missing_part_is_one_error_naming_it_and_the_fix_and_loses_nothing(tmp_path):
  docs, assign = make_docs(60), data.random_assignment(2, seed=0)
  shard_writer.write_part(str(tmp_path), "train", docs[:30], assign, 2, part=0, num_parts=2)
  # Process 1 crashed mid-write: files, no done-marker.
  shard_writer.write_part(str(tmp_path), "train", docs[30:], assign, 2, part=1, num_parts=2)
  os.remove(tmp_path / "train" / shards.PARTS_DIR / "part-00001-of-00002.json")
  before = helpers.tree_bytes(tmp_path)
  with pytest.raises(data.IncompleteShardsError) as e:
    shard_writer.finish_split(
      str(tmp_path), "train", 2, num_workers=2, assignment=assign.description
    )
  msg = str(e.value)
  assert "\n" not in msg and "1 of 2 parts have no done-marker" in msg, msg
  assert str(tmp_path / "train" / "parts" / "part-00001-of-00002.json") in msg, msg
  assert "Rerun process(es) 1 (" in msg and "--num_processes=2 --process_id=I" in msg, msg
  assert "the finished parts are kept" in msg, msg
  with pytest.raises(ValueError, match="interrupted write \\(train has parts\\): rerun the same"):
    data.ShardSet(str(tmp_path))
  assert helpers.tree_bytes(tmp_path) == before  # Nothing deleted or rewritten.
  with pytest.raises(data.IncompleteShardsError, match="another number of processes"):
    shard_writer.finish_split(
      str(tmp_path), "train", 3, num_workers=2, assignment=assign.description
    )
  # The fix: rerun process 1 alone; part 0 is kept as it was.
  marker_0 = (tmp_path / "train" / "parts" / "part-00000-of-00002.json").read_bytes()
  shard_writer.write_part(str(tmp_path), "train", docs[30:], assign, 2, part=1, num_parts=2)
  shard_writer.finish_split(str(tmp_path), "train", 2, num_workers=2, assignment=assign.description)
  assert (tmp_path / "train" / "parts" / "part-00000-of-00002.json").read_bytes() == marker_0
  got = data.ShardSet(str(tmp_path))
  assert sum(len(got.documents(p, "train")) for p in range(2)) == 60


def test_an_old_format_dir_is_refused_with_the_way_out(tmp_path):
  root = tmp_path / "shards"
  data.write_shards(str(root), "train", make_docs(20), data.random_assignment(2, seed=0), 2)
  meta = json.loads((root / "train" / shards.META).read_text())
  (root / "train" / shards.META).write_text(json.dumps({**meta, "format": 2}))
  before = helpers.tree_bytes(tmp_path)
  with pytest.raises(shards.OldFormatError) as e:
    data.ShardSet(str(root))
  assert str(e.value).startswith(f"shard dir {root} holds format-2 shards"), e.value
  assert f"mv {root} {root}.format2" in str(e.value) and "nothing in it was changed" in str(e.value)
  assert helpers.tree_bytes(tmp_path) == before
