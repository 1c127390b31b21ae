"""Data layer: embedded corpus, seqio/tfds front end, per-path shards and packed batches.

Everything here but `iter_documents` runs without TensorFlow: the trainer reads shards with numpy.
"""

from dipaco_jax.data.assign import random_assignment
from dipaco_jax.data.assign import with_description
from dipaco_jax.data.batcher import WorkerBatcher
from dipaco_jax.data.batcher import synthetic_batch
from dipaco_jax.data.document import Document
from dipaco_jax.data.prepare import prepare_shards
from dipaco_jax.data.shards import EmptyShardError
from dipaco_jax.data.shards import ShardSet
from dipaco_jax.data.shards import write_shards

TASKS = ("dipaco_embedded", "c4_en")  # The seqio tasks data/tasks.py registers.

__all__ = [
  "Document",
  "EmptyShardError",
  "WorkerBatcher",
  "ShardSet",
  "TASKS",
  "iter_documents",
  "prepare_shards",
  "random_assignment",
  "with_description",
  "write_shards",
]


def iter_documents(
  task: str,
  split: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
):
  """Streams tokenized documents of a seqio task split (imports TensorFlow on first use)."""
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  return tasks.iter_documents(
    task, split, data_dir=data_dir, vocab_path=vocab_path, subsample=subsample
  )
