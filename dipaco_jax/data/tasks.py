"""Every data task's tokenizing front end: `iter_documents` and `part_size`, without TensorFlow.

`dipaco_embedded` reads the shipped corpus through tfds's array_record files, tokenized with
SentencePiece (data/embedded.py); `c4_en` goes through its seqio Task (data/c4.py), which
needs the `c4` extra (seqio and TensorFlow) and is imported only for that task.
"""

import importlib
from typing import Iterator

from dipaco_jax import errors
from dipaco_jax.config.sections import C4_TFDS_NAME
from dipaco_jax.config.sections import TASKS
from dipaco_jax.data import corpus
from dipaco_jax.data import embedded
from dipaco_jax.data import selection
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document


def _check_task(task: str) -> None:
  if task not in TASKS:
    raise ValueError(f"Unknown data task {task!r}; choose one of {TASKS} (config.data.task).")


def _c4():
  """data/c4.py, or one line naming the extra that installs seqio and TensorFlow."""
  try:
    return importlib.import_module("dipaco_jax.data.c4")
  except ModuleNotFoundError as e:
    if e.name not in ("seqio", "tensorflow", "tensorflow_text"):
      raise
    raise errors.ConfigError(
      f"config.data.task='c4_en' reads C4 through seqio and TensorFlow ({e.name} is not "
      "installed): pip install -c constraints.txt -e '.[c4]' (the embedded corpus needs neither)."
    ) from e


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
  selection.check_subsample(subsample)
  selection.check_part(part, num_parts)
  vocab.load(vocab.resolve(task, vocab_path))  # one clear error for a missing or wrong file
  kw = dict(data_dir=data_dir, vocab_path=vocab_path, subsample=subsample, part=part)
  if task == "dipaco_embedded":
    return embedded.iter_documents(split, **kw, num_parts=num_parts)
  selection.check_tfds_name(tfds_name)
  return _c4().iter_documents(split, **kw, num_parts=num_parts, tfds_name=tfds_name)


def part_size(task: str, split: str, *, data_dir=None, tfds_name=C4_TFDS_NAME, part=0, num_parts=1):
  """Source documents in a split's part (before subsampling), from tfds's metadata."""
  _check_task(task)
  if task == "dipaco_embedded":
    return embedded.part_size(split, data_dir=data_dir, part=part, num_parts=num_parts)
  kw = dict(data_dir=data_dir, tfds_name=tfds_name, part=part, num_parts=num_parts)
  return _c4().part_size(split, **kw)
