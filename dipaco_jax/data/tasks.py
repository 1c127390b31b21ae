"""seqio Tasks `dipaco_embedded` and `c4_en`, and `iter_documents`, the tokenizing front end."""

import os
import re
from typing import Iterator

# isort: off
# TensorFlow first, its native start-up notices held back (tf_setup.py); seqio imports it.
from dipaco_jax.data import tf_setup  # noqa: F401

# isort: on
import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds
from etils import epath

from dipaco_jax.config.sections import C4_TFDS_NAME
from dipaco_jax.config.sections import TASKS
from dipaco_jax.config.sections import TFDS_NAME_PATTERN
from dipaco_jax.data import corpus
from dipaco_jax.data import tfds_builder
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document

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


def check_tfds_name(tfds_name) -> str:
  if not isinstance(tfds_name, str) or not re.match(TFDS_NAME_PATTERN, tfds_name):
    raise ValueError(
      f"config.data.tfds_name={tfds_name!r}: must be a tfds name with its version pinned, "
      f"such as {C4_TFDS_NAME!r}."
    )
  return tfds_name


def check_part(part: int, num_parts: int) -> None:
  if not all(isinstance(x, int) for x in (part, num_parts)) or not 0 <= part < num_parts:
    raise ValueError(
      f"part {part!r} of {num_parts!r}: need num_processes >= 1 and "
      "0 <= process_index < num_processes."
    )


def _split_map(splits: dict[str, str], part: int, num_parts: int) -> dict:
  """Each seqio split's tfds split, or its part-th contiguous 1/num_parts (in source order)."""
  if num_parts == 1:
    return dict(splits)
  return {k: tfds.even_splits(v, num_parts)[part] for k, v in splits.items()}


def _source(task: str, data_dir, tfds_name: str, part: int, num_parts: int) -> seqio.DataSource:
  if task == "dipaco_embedded":
    return seqio.TfdsDataSource(
      tfds_name=f"dipaco_embedded/{tfds_builder.DipacoEmbedded.BUILDER_CONFIGS[0].name}:1.0.0",
      tfds_data_dir=data_dir or tfds_builder.default_data_dir(),
      splits=_split_map({s: s for s in corpus.SPLITS}, part, num_parts),
      read_only=True,
    )
  return seqio.TfdsDataSource(
    tfds_name=check_tfds_name(tfds_name),
    tfds_data_dir=data_dir,
    splits=_split_map(C4_SPLITS, part, num_parts),
    read_only=True,
  )


def register(
  task: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
  tfds_name: str = C4_TFDS_NAME,
  part: int = 0,
  num_parts: int = 1,
) -> seqio.Task:
  """(Re-)registers `task` in seqio's TaskRegistry with this source, vocabulary and subsample.

  subsample > 1 keeps one document in `subsample`, chosen by a hash of the doc
  id before tokenizing (quick experiments and smoke runs on a fraction of a split).
  part / num_parts: each split's part-th contiguous 1/num_parts (one writing process's share).
  tfds_name: the tfds dataset and version c4_en reads (the embedded task has its own).
  """
  _check_task(task)
  check_subsample(subsample)
  check_part(part, num_parts)
  source = _source(task, data_dir, tfds_name, part, num_parts)
  fields = _embedded_fields if task == "dipaco_embedded" else _c4_fields
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
  tfds_name: str = C4_TFDS_NAME,
  part: int = 0,
  num_parts: int = 1,
) -> Iterator[Document]:
  """Streams the tokenized documents of a task split (or of its part), in source order."""
  _check_task(task)
  if split not in corpus.SPLITS:
    raise ValueError(f"Unknown split {split!r}; choose one of {corpus.SPLITS}.")
  vocab.load(vocab.resolve(task, vocab_path))  # one clear error for a missing or wrong file
  _check_source(task, data_dir, tfds_name)
  seqio_task = register(
    task,
    data_dir=data_dir,
    vocab_path=vocab_path,
    subsample=subsample,
    tfds_name=tfds_name,
    part=part,
    num_parts=num_parts,
  )
  ds = seqio_task.get_dataset(
    sequence_length=None, split=split, shuffle=False, num_epochs=1, use_cached=False
  )
  return (
    Document(int(ex["doc_id"]), ex["targets"].astype(np.int32), ex["domain"].decode())
    for ex in ds.as_numpy_iterator()
  )


def _check_source(task: str, data_dir: str | None, tfds_name: str) -> None:
  """The embedded corpus prepared (offline, cached after the first call), or C4's one error."""
  if task == "dipaco_embedded":
    tfds_builder.prepare(data_dir)
  else:
    check_prepared(check_tfds_name(tfds_name), data_dir)


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


def part_size(task: str, split: str, *, data_dir=None, tfds_name=C4_TFDS_NAME, part=0, num_parts=1):
  """Source documents in a split's part (before subsampling), from tfds's metadata."""
  _check_source(task, data_dir, tfds_name)
  source = _source(task, data_dir, tfds_name, part, num_parts)
  return source.num_input_examples(split)


for _task in TASKS:  # importing this module makes both tasks visible to seqio.get_mixture_or_task
  register(_task)
