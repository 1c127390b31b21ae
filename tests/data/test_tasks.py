"""seqio/tfds front end: embedded task, C4 task on a fake tfds dir, prepare_shards, errors."""

import os
import sys

import ml_collections
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from dipaco_jax import data
from dipaco_jax.config import schema
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab


@pytest.fixture(name="tfds_dir", scope="module")
def _tfds_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def data_cfg(tfds_dir: str, **overrides) -> ml_collections.ConfigDict:
  """base()'s config.data on this tfds dir, short sequences."""
  cfg = schema.base().data
  cfg.update(dict(tfds_data_dir=tfds_dir, seq_len=64, batch_size=2, **overrides))
  return cfg


@pytest.mark.slow  # ~7-12 s of CPU: the fast suite's budget is 3 minutes.
def test_embedded_task_streams_tokenized_documents(tfds_dir):
  docs = list(data.iter_documents("dipaco_embedded", "router", data_dir=tfds_dir))
  records = list(corpus.read_records("router"))
  assert [d.doc_id for d in docs] == [r["doc_id"] for r in records]
  assert {d.domain for d in docs} == set(corpus.DOMAINS)
  sp = vocab.load(vocab.DEFAULT_VOCAB_PATH)
  for doc, record in list(zip(docs, records))[::50]:
    assert doc.tokens.dtype == np.int32 and doc.tokens[-1] == vocab.EOS_ID
    assert doc.tokens.tolist() == sp.encode(record["text"]) + [vocab.EOS_ID]  # serve's ids
  assert "seqio" not in sys.modules or "dipaco_embedded" not in seqio.TaskRegistry.names()


def test_subsample_keeps_one_document_in_n_by_doc_id_hash(tfds_dir):
  full = list(data.iter_documents("dipaco_embedded", "router", data_dir=tfds_dir))
  part = list(data.iter_documents("dipaco_embedded", "router", data_dir=tfds_dir, subsample=4))
  # The same hash, computed here in numpy: ((id * 2654435761) >> 16) mod 4 == 0.
  want = [d.doc_id for d in full if ((d.doc_id * 2654435761) >> 16) % 4 == 0]
  assert [d.doc_id for d in part] == want
  assert 0.15 < len(part) / len(full) < 0.35
  assert {d.domain for d in part} == {d.domain for d in full}  # Every domain keeps documents.
  by_id = {d.doc_id: d for d in full}
  np.testing.assert_array_equal(part[0].tokens, by_id[part[0].doc_id].tokens)
  for bad in (0, 2.5, True):
    with pytest.raises(ValueError, match="data.subsample"):
      data.iter_documents("dipaco_embedded", "router", data_dir=tfds_dir, subsample=bad)


def test_stats_counts_documents_and_tokens_per_domain(tfds_dir):
  from dipaco_jax.data import __main__ as cli  # pylint: disable=g-import-not-at-top

  table = cli.stats("dipaco_embedded", ["router"], data_dir=tfds_dir, max_docs=40)
  assert sum(d for d, _ in table["router"].values()) == 40
  text = cli.format_table(table)
  assert "| **total** | 40 | " in text and "router tokens" in text


def test_unknown_task_split_and_wrong_vocab_are_clear_errors(tfds_dir, tmp_path):
  with pytest.raises(ValueError, match="Unknown data task 'c5'"):
    data.iter_documents("c5", "train")
  with pytest.raises(ValueError, match="Unknown split 'test'"):
    data.iter_documents("dipaco_embedded", "test", data_dir=tfds_dir)
  bad = tmp_path / "x.model"
  bad.write_text("nope")
  with pytest.raises(ValueError, match="is not a SentencePiece model"):
    data.iter_documents("dipaco_embedded", "train", data_dir=tfds_dir, vocab_path=str(bad))
  with pytest.raises(FileNotFoundError, match="c4/en:3.0.1 is not prepared"):
    data.iter_documents(
      "c4_en", "train", data_dir=str(tmp_path), vocab_path=vocab.DEFAULT_VOCAB_PATH
    )
  with pytest.raises(ValueError, match="data.tfds_name='c4/en': must be a tfds name with its"):
    data.iter_documents("c4_en", "train", tfds_name="c4/en", vocab_path=vocab.DEFAULT_VOCAB_PATH)


def test_the_c4_version_is_the_configured_one_and_a_missing_one_names_those_there(tmp_path):
  write_fake_c4(str(tmp_path), {"train": 100, "validation": 5}, version="3.1.0")
  kw = dict(data_dir=str(tmp_path), vocab_path=vocab.DEFAULT_VOCAB_PATH)
  docs = list(data.iter_documents("c4_en", "validation", tfds_name="c4/en:3.1.0", **kw))
  assert len(docs) == 5
  with pytest.raises(FileNotFoundError) as e:
    data.iter_documents("c4_en", "validation", **kw)  # the default, 3.0.1
  msg = str(e.value)
  assert msg.startswith(f"c4/en:3.0.1 is not prepared under data_dir='{tmp_path}'"), msg
  assert "it holds c4/en version(s) 3.1.0" in msg and "config.data.tfds_name" in msg, msg


def write_fake_c4(root: str, sizes: dict[str, int], version: str = "3.0.1") -> None:
  """A tiny tfds dir laid out like c4/en (text, url, timestamp)."""
  out = os.path.join(root, "c4", "en", version)
  os.makedirs(out)
  features = tfds.features.FeaturesDict(
    {k: tfds.features.Text() for k in ("text", "url", "timestamp")}
  )
  for split, n in sizes.items():
    with tf.io.TFRecordWriter(os.path.join(out, f"c4-{split}.tfrecord-00000-of-00001")) as w:
      for i in range(n):
        w.write(
          features.serialize_example(
            {
              "text": f"Page {i} of the {split} split.\nIt talks about gardens and rivers.",
              "url": f"https://site{i % 3}.example.org/path/{i}",
              "timestamp": "2019-04-20",
            }
          )
        )
  tfds.folder_dataset.write_metadata(data_dir=out, features=features, check_data=False)


def test_c4_task_definition_on_a_fake_tfds_dir(tmp_path):
  write_fake_c4(str(tmp_path), {"train": 200, "validation": 10})
  read = lambda split: list(
    data.iter_documents(  # pylint: disable=g-long-lambda
      "c4_en", split, data_dir=str(tmp_path), vocab_path=vocab.DEFAULT_VOCAB_PATH
    )
  )
  train, router, validation = read("train"), read("router"), read("validation")
  assert (len(train), len(router), len(validation)) == (198, 2, 10)  # router = train[:1%]
  assert not {d.doc_id for d in train} & {d.doc_id for d in router}
  assert {d.domain for d in train} == {
    "site0.example.org",
    "site1.example.org",
    "site2.example.org",
  }
  assert len({d.doc_id for d in train}) == 198 and all(d.tokens[-1] == 1 for d in train)
  assert [d.doc_id for d in read("validation")] == [d.doc_id for d in validation]  # stable ids
  task = seqio.get_mixture_or_task("c4_en")
  assert task.source.tfds_dataset.data_dir == str(tmp_path)


def test_prepare_shards_writes_once_reuses_and_refuses_mismatch(tmp_path):
  write_fake_c4(str(tmp_path / "tfds"), {"train": 300, "validation": 30})
  shard_dir = str(tmp_path / "shards")
  cfg = data_cfg(str(tmp_path / "tfds"), task="c4_en", vocab_path=vocab.DEFAULT_VOCAB_PATH, top_k=2)
  shard_set = data.prepare_shards(cfg, 3, shard_dir)
  train_tokens = sum(
    len(d.tokens)
    for d in data.iter_documents(
      "c4_en", "train", data_dir=cfg.tfds_data_dir, vocab_path=cfg.vocab_path
    )
  )
  assert shard_set.sizes("train").sum() == 2 * train_tokens  # top-2 overlap in training
  assert shard_set.num_docs("validation").sum() == 30  # never overlapping in evaluation
  assert shard_set.meta["assignment"] == "random(num_workers=3,seed=0,top_k=2)"
  assert shard_set.meta["vocab"] == vocab.fingerprint(vocab.DEFAULT_VOCAB_PATH)
  mtime = os.path.getmtime(os.path.join(shard_dir, "meta.json"))
  again = data.prepare_shards(cfg, 3, shard_dir)  # reused, not rewritten
  assert os.path.getmtime(os.path.join(shard_dir, "meta.json")) == mtime
  np.testing.assert_array_equal(again.sizes("train"), shard_set.sizes("train"))
  with pytest.raises(ValueError, match=r"another config.*'seed': \(0, 1\)"):
    data.prepare_shards(
      data_cfg(cfg.tfds_data_dir, task="c4_en", vocab_path=cfg.vocab_path, top_k=2, seed=1),
      3,
      shard_dir,
    )
  with pytest.raises(ValueError, match="num_workers"):
    data.prepare_shards(cfg, 4, shard_dir)
  with pytest.raises(ValueError, match=r"another config.*'subsample': \(1, 2\)"):
    data.prepare_shards(
      data_cfg(cfg.tfds_data_dir, task="c4_en", vocab_path=cfg.vocab_path, top_k=2, subsample=2),
      3,
      shard_dir,
    )
  # C4's 62-bit doc ids overflow the hash's int64 product: it must still keep about 1 in 2.
  half = data.prepare_shards(
    data_cfg(cfg.tfds_data_dir, task="c4_en", vocab_path=cfg.vocab_path, subsample=2),
    3,
    str(tmp_path / "half"),
  )
  assert 90 < half.num_docs("train").sum() < 210 and half.meta["subsample"] == 2
  with pytest.raises(data.EmptyShardError, match="got no train document"):
    data.prepare_shards(
      cfg, 3, str(tmp_path / "empty"), assign=data.with_description(lambda d: [0], "all-to-path-0")
    )


def test_shards_written_by_two_processes_equal_one_process(tmp_path):
  write_fake_c4(str(tmp_path / "tfds"), {"train": 301, "validation": 11})
  cfg = data_cfg(str(tmp_path / "tfds"), task="c4_en", vocab_path=vocab.DEFAULT_VOCAB_PATH, top_k=2)
  one = data.prepare_shards(cfg, 3, str(tmp_path / "one"))
  two_dir = str(tmp_path / "two")
  for i in (1, 0):  # Two processes' parts (here one after the other), then process 0 joins them.
    data.write_shard_part(cfg, 3, two_dir, part=i, num_parts=2)
  with pytest.raises(ValueError, match="no complete split"):
    data.ShardSet(two_dir)
  two = data.finish_shards(cfg, 3, two_dir, num_parts=2)
  assert {k: v for k, v in two.meta.items() if k != "tfds_data_dir"} == {
    k: v for k, v in one.meta.items() if k != "tfds_data_dir"
  }
  for split in ("train", "validation"):
    np.testing.assert_array_equal(one.sizes(split), two.sizes(split))
    for p in range(3):
      a, b = one.documents(p, split), two.documents(p, split)
      assert [d.doc_id for d in a] == [d.doc_id for d in b]  # same documents, same order
      assert len(two.files(p, split)) == 2  # one file per process
  assert two.num_docs("train").sum() == 2 * 298  # train[1%:] of 301, top-2
