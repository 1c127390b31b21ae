"""The seqio Task `c4_en` and its documents: C4 from a prepared tfds copy, through TensorFlow.

Imported by data/tasks.py for the c4_en task only (the `c4` extra: seqio, TensorFlow); the
embedded corpus never imports it (data/embedded.py).
"""

import os
from typing import Iterator

# isort: off
# TensorFlow first, its native start-up notices held back (tf_setup.py); seqio imports it.
from dipaco_jax.data import tf_setup  # noqa: F401

# isort: on
import numpy as np
import seqio
import tensorflow as tf
from etils import epath

from dipaco_jax.config.sections import C4_TFDS_NAME
from dipaco_jax.data import selection
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document

# seqio split -> C4 split. The router data is a held-out 1% of train, so validation stays intact.
C4_SPLITS = {"train": "train[1%:]", "router": "train[:1%]", "validation": "validation"}
TASK = "c4_en"


def _c4_fields(ex: dict) -> dict:
  # C4 has no ids: a 64-bit fingerprint of the text is stable across runs and machines.
  # Its "domain" is the web site (URL host): metadata to evaluate routers, never a signal.
  return {
    "targets": ex["text"],
    "doc_id": tf.strings.to_hash_bucket_fast(ex["text"], 2**62),
    "domain": tf.strings.regex_replace(ex["url"], r"^[a-zA-Z]+://([^/]+).*$", r"\1"),
  }


def _keep_one_in(n: int):
  """A preprocessor keeping the documents selection.keeps (doc-id hash 0 mod n)."""

  def keep(ex):
    h = tf.bitwise.right_shift(tf.cast(ex["doc_id"], tf.int64) * selection.HASH_MULTIPLIER, 16)
    return tf.equal(tf.math.floormod(h, n), 0)

  return lambda ds: ds.filter(keep)


def _source(data_dir, tfds_name: str, part: int, num_parts: int) -> seqio.DataSource:
  splits = {k: selection.part(v, part, num_parts) for k, v in C4_SPLITS.items()}
  return seqio.TfdsDataSource(
    tfds_name=selection.check_tfds_name(tfds_name),
    tfds_data_dir=data_dir,
    splits=splits,
    read_only=True,
  )


def register(
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
  tfds_name: str = C4_TFDS_NAME,
  part: int = 0,
  num_parts: int = 1,
) -> seqio.Task:
  """(Re-)registers `c4_en` in seqio's TaskRegistry with this source, vocabulary and subsample.

  subsample > 1 keeps one document in `subsample`, chosen by a hash of the doc
  id before tokenizing (quick experiments and smoke runs on a fraction of a split).
  part / num_parts: each split's part-th contiguous 1/num_parts (one writing process's share).
  tfds_name: the tfds dataset and version c4_en reads.
  """
  source = _source(data_dir, tfds_name, part, num_parts)
  sp_vocab = seqio.SentencePieceVocabulary(vocab_path or vocab.T5_VOCAB_PATH)
  seqio.TaskRegistry.remove(TASK)
  return seqio.TaskRegistry.add(
    TASK,
    source=source,
    preprocessors=[
      seqio.map_over_dataset(_c4_fields),
      *([_keep_one_in(subsample)] if subsample > 1 else []),
      seqio.preprocessors.tokenize,
      seqio.preprocessors.append_eos,
    ],
    output_features={"targets": seqio.Feature(sp_vocab, add_eos=True, dtype=tf.int32)},
  )


def iter_documents(
  split: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
  tfds_name: str = C4_TFDS_NAME,
  part: int = 0,
  num_parts: int = 1,
) -> Iterator[Document]:
  """Streams the tokenized documents of a C4 split (or of its part), in source order."""
  check_prepared(selection.check_tfds_name(tfds_name), data_dir)
  task = register(
    data_dir=data_dir,
    vocab_path=vocab_path,
    subsample=subsample,
    tfds_name=tfds_name,
    part=part,
    num_parts=num_parts,
  )
  ds = task.get_dataset(
    sequence_length=None, split=split, shuffle=False, num_epochs=1, use_cached=False
  )
  return (
    Document(int(ex["doc_id"]), ex["targets"].astype(np.int32), ex["domain"].decode())
    for ex in ds.as_numpy_iterator()
  )


def check_prepared(tfds_name: str, data_dir: str | None) -> None:
  """One clear error, naming the versions that are there, if tfds_name is not prepared."""
  root = epath.Path(data_dir or os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))
  root = root.expanduser()
  name, version = tfds_name.rsplit(":", 1)
  if (root / name / version / "dataset_info.json").exists():
    return
  have = []
  if (root / name).is_dir():
    have = sorted(p.name for p in (root / name).iterdir() if (p / "dataset_info.json").exists())
  there = f"; it holds {name} version(s) {', '.join(have)}" if have else ""
  raise FileNotFoundError(
    f"{tfds_name} is not prepared under data_dir={str(root)!r} (no {root / name / version}/"
    f"dataset_info.json){there}. Set config.data.tfds_data_dir to a prepared copy and "
    "config.data.tfds_name to its version, or prepare it (docs/data.md, 'Preparing C4'); "
    "nothing is downloaded here."
  )


def part_size(split: str, *, data_dir=None, tfds_name=C4_TFDS_NAME, part=0, num_parts=1) -> int:
  """Source documents in a split's part (before subsampling), from tfds's metadata."""
  check_prepared(selection.check_tfds_name(tfds_name), data_dir)
  return _source(data_dir, tfds_name, part, num_parts).num_input_examples(split)


register()  # Importing this module makes the task visible to seqio.get_mixture_or_task.
