"""The embedded corpus' tokenized documents, read without TensorFlow or seqio.

tfds prepares the corpus once as array_record files (data/tfds_builder.py) and reads them
back as a random-access data source (`as_data_source`: numpy, no TensorFlow); SentencePiece
tokenizes each text and EOS ends it, as the seqio Task did before (the same ids).
"""

from typing import Iterator

import numpy as np

from dipaco_jax.data import selection
from dipaco_jax.data import tfds_builder
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document

_READ = 256  # Records per read from the array_record files.


def _source(split: str, data_dir: str | None, part: int, num_parts: int):
  builder = tfds_builder.prepare(data_dir)
  return builder.as_data_source(split=selection.part(split, part, num_parts))


def iter_documents(
  split: str,
  *,
  data_dir: str | None = None,
  vocab_path: str | None = None,
  subsample: int = 1,
  part: int = 0,
  num_parts: int = 1,
) -> Iterator[Document]:
  """Streams a split's documents (or its part's), in doc-id order, one in `subsample` kept."""
  sp = vocab.load(vocab.resolve("dipaco_embedded", vocab_path))
  source = _source(split, data_dir, part, num_parts)
  for start in range(0, len(source), _READ):
    for ex in source.__getitems__(list(range(start, min(start + _READ, len(source))))):
      doc_id = int(ex["doc_id"])
      if subsample > 1 and not selection.keeps(doc_id, subsample):
        continue
      tokens = sp.encode(ex["text"].decode("utf-8")) + [vocab.EOS_ID]
      yield Document(doc_id, np.asarray(tokens, np.int32), ex["domain"].decode("utf-8"))


def part_size(split: str, *, data_dir: str | None = None, part: int = 0, num_parts: int = 1) -> int:
  """Documents in a split's part (before subsampling)."""
  return len(_source(split, data_dir, part, num_parts))
