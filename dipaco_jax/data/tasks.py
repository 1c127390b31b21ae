"""seqio Tasks `dipaco_embedded` and `c4_en`, and `iter_documents`, the tokenizing front end."""

from typing import Iterator

import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from dipaco_jax.data import TASKS
from dipaco_jax.data import corpus
from dipaco_jax.data import tf_setup  # noqa: F401  (side effect: TensorFlow set up before tfds)
from dipaco_jax.data import tfds_builder
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document

C4_TFDS_NAME = "c4/en:3.1.0"
# seqio split -> C4 split. The router data is a held-out 1% of train, so validation stays intact.
C4_SPLITS = {"train": "train[1%:]", "router": "train[:1%]", "validation": "validation"}
_DEFAULT_VOCABS = {"dipaco_embedded": vocab.DEFAULT_VOCAB_PATH, "c4_en": vocab.T5_VOCAB_PATH}


def _embedded_fields(ex: dict) -> dict:
  return {"targets": ex["text"], "doc_id": ex["doc_id"], "domain": ex["domain"]}


def _c4_fields(ex: dict) -> dict:
  # C4 has no ids: a 64-bit fingerprint of the text is stable across runs and machines.
  # Its "domain" is the web site (URL host): metadata to evaluate routers, never a signal.
  return {
    "targets": ex["text"],
    "doc_id": tf.strings.to_hash_bucket_fast(ex["text"], 2**62),
    "domain": tf.strings.regex_replace(ex["url"], r"^[a-zA-Z]+://([^/]+).*$", r"\1"),
  }


def _check_task(task: str) -> None:
  if task not in TASKS:
    raise ValueError(f"Unknown data task {task!r}; choose one of {TASKS} (config.data.task).")


def _keep_one_in(n: int):
  """A preprocessor keeping the documents whose doc-id hash is 0 mod n (all domains alike)."""

  def keep(ex):
    h = tf.bitwise.right_shift(tf.cast(ex["doc_id"], tf.int64) * 2654435761, 16)
    return tf.equal(tf.math.floormod(h, n), 0)

  return lambda ds: ds.filter(keep)


def check_subsample(subsample) -> int:
  if not isinstance(subsample, int) or isinstance(subsample, bool) or subsample < 1:
    raise ValueError(
      f"config.data.subsample={subsample!r}: must be an integer >= 1 (keep one "
      "document in N; 1 = all)."
    )
  return subsample


def register(
  task: str, *, data_dir: str | None = None, vocab_path: str | None = None, subsample: int = 1
) -> seqio.Task:
  """(Re-)registers `task` in seqio's TaskRegistry with this data_dir, vocabulary and subsample.

  subsample > 1 keeps one document in `subsample`, chosen by a hash of the doc
  id before tokenizing (quick experiments and smoke runs on a fraction of a split).
  """
  _check_task(task)
  check_subsample(subsample)
  if task == "dipaco_embedded":
    source = seqio.TfdsDataSource(
      tfds_name=f"dipaco_embedded/{tfds_builder.DipacoEmbedded.BUILDER_CONFIGS[0].name}:1.0.0",
      tfds_data_dir=data_dir or tfds_builder.DEFAULT_DATA_DIR,
      splits=corpus.SPLITS,
      read_only=True,
    )
    fields = _embedded_fields
  else:
    source = seqio.TfdsDataSource(
      tfds_name=C4_TFDS_NAME, tfds_data_dir=data_dir, splits=C4_SPLITS, read_only=True
    )
    fields = _c4_fields
  sp_vocab = seqio.SentencePieceVocabulary(vocab_path or _DEFAULT_VOCABS[task])
  seqio.TaskRegistry.remove(task)
  return seqio.TaskRegistry.add(
    task,
    source=source,
    preprocessors=[
      seqio.map_over_dataset(fields),
      *([_keep_one_in(subsample)] if subsample > 1 else []),
      seqio.preprocessors.tokenize,
      seqio.preprocessors.append_eos,
    ],
    output_features={"targets": seqio.Feature(sp_vocab, add_eos=True, dtype=tf.int32)},
  )


def iter_documents(
  task: str,
  split: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
) -> Iterator[Document]:
  """Streams the tokenized documents of a task split, in the source's order (no shuffling)."""
  _check_task(task)
  if split not in corpus.SPLITS:
    raise ValueError(f"Unknown split {split!r}; choose one of {corpus.SPLITS}.")
  vocab.load(vocab.resolve(task, vocab_path))  # one clear error for a missing or wrong file
  if task == "dipaco_embedded":
    tfds_builder.prepare(data_dir)  # offline, cached after the first call
  elif not tfds.builder(C4_TFDS_NAME, data_dir=data_dir).is_prepared():
    raise FileNotFoundError(
      f"{C4_TFDS_NAME} is not prepared under data_dir={data_dir!r}. Point data.tfds_data_dir at "
      "a prepared copy (e.g. a gs:// bucket holding c4/en/3.1.0); it is never downloaded here."
    )
  seqio_task = register(task, data_dir=data_dir, vocab_path=vocab_path, subsample=subsample)
  ds = seqio_task.get_dataset(
    sequence_length=None, split=split, shuffle=False, num_epochs=1, use_cached=False
  )
  return (
    Document(int(ex["doc_id"]), ex["targets"].astype(np.int32), ex["domain"].decode())
    for ex in ds.as_numpy_iterator()
  )


for _task in TASKS:  # importing this module makes both tasks visible to seqio.get_mixture_or_task
  register(_task)
