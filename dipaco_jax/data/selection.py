"""Which documents a reader takes: a split's part (one process's share), one in N by doc id.

Shared by both tasks' readers (data/embedded.py without TensorFlow, data/c4.py through seqio),
so a subsample or a part holds the same documents whichever reads it.
"""

import re

import tensorflow_datasets as tfds

from dipaco_jax.config.sections import C4_TFDS_NAME
from dipaco_jax.config.sections import TFDS_NAME_PATTERN

# Knuth's multiplicative hash: doc id x this, shifted right 16 bits, mod N picks one in N.
HASH_MULTIPLIER = 2654435761
_INT64 = 1 << 64


def keeps(doc_id: int, n: int) -> bool:
  """Whether subsample n keeps the document: ((id * HASH_MULTIPLIER) >> 16) mod n == 0 in int64."""
  h = (int(doc_id) * HASH_MULTIPLIER) % _INT64
  h = h - _INT64 if h >= _INT64 // 2 else h  # Wraps as int64 does; >> is arithmetic, % floors.
  return (h >> 16) % n == 0


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


def part(split: str, index: int, num_parts: int):
  """The tfds split, or its index-th contiguous 1/num_parts (in source order)."""
  return split if num_parts == 1 else tfds.even_splits(split, num_parts)[index]
