"""Data layer: embedded corpus, tfds/seqio front end, per-path shards and packed batches.

Nothing here imports TensorFlow but the c4_en task's reader (data/c4.py, the `c4` extra): the
embedded corpus is read through tfds's array_record files and the trainer reads shards with numpy.
"""

from dipaco_jax.config import sections
from dipaco_jax.data.assign import random_assignment
from dipaco_jax.data.assign import with_description
from dipaco_jax.data.batcher import Holdout
from dipaco_jax.data.batcher import WorkerBatcher
from dipaco_jax.data.batcher import synthetic_batch
from dipaco_jax.data.document import Document
from dipaco_jax.data.prepare import check_shard_dir
from dipaco_jax.data.prepare import finish_shards
from dipaco_jax.data.prepare import one_writer
from dipaco_jax.data.prepare import prepare_shards
from dipaco_jax.data.prepare import wait_for_parts
from dipaco_jax.data.prepare import write_shard_part
from dipaco_jax.data.shard_writer import write_shards
from dipaco_jax.data.shards import EmptyShardError
from dipaco_jax.data.shards import IncompleteShardsError
from dipaco_jax.data.shards import ShardSet

__all__ = [
  "Document",
  "EmptyShardError",
  "IncompleteShardsError",
  "WorkerBatcher",
  "ShardSet",
  "check_shard_dir",
  "finish_shards",
  "one_writer",
  "iter_documents",
  "prepare_shards",
  "random_assignment",
  "wait_for_parts",
  "with_description",
  "write_shard_part",
  "write_shards",
]


def iter_documents(
  task: str,
  split: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
  tfds_name: str = sections.C4_TFDS_NAME,
  part: int = 0,
  num_parts: int = 1,
):
  """Streams tokenized documents of a task split (c4_en imports seqio and TensorFlow).

  part i of num_parts N: the documents of the split's i-th contiguous 1/N (tfds.even_splits).
  """
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  return tasks.iter_documents(
    task,
    split,
    data_dir=data_dir,
    vocab_path=vocab_path,
    subsample=subsample,
    tfds_name=tfds_name,
    part=part,
    num_parts=num_parts,
  )


def document_source(data_cfg) -> dict:
  """The config.data fields that decide which documents config_documents yields (a cache key)."""
  return {
    "data_dir": data_cfg.tfds_data_dir,
    "vocab_path": data_cfg.vocab_path,
    "subsample": data_cfg.subsample,
    "tfds_name": data_cfg.tfds_name,
  }


def config_documents(data_cfg, split: str, *, part: int = 0, num_parts: int = 1):
  """iter_documents of a run's config.data (task, tfds dir and name, vocabulary, subsample)."""
  return iter_documents(
    data_cfg.task, split, **document_source(data_cfg), part=part, num_parts=num_parts
  )
