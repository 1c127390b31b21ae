"""A tokenized document."""

from typing import NamedTuple

import numpy as np


class Document(NamedTuple):
  """One tokenized document; `domain` is metadata only, never a training signal."""

  doc_id: int  # stable id, unique within the corpus
  tokens: np.ndarray  # int32 ids, ends with EOS (id 1)
  domain: str
