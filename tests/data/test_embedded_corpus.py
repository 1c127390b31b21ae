"""The embedded corpus without TensorFlow: prepared silently, read by numpy and SentencePiece."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from dipaco_jax.data import selection

import helpers

# A fresh process prepares the corpus into an empty cache and reads the router split; what it
# prints, and whether TensorFlow or seqio got imported, is what a first run shows.
_FIRST_READ = """
import sys
from dipaco_jax.data import tasks
docs = list(tasks.iter_documents("dipaco_embedded", "router"))
print(len(docs), "tensorflow" in sys.modules, "seqio" in sys.modules)
"""


@pytest.mark.slow  # Prepares the whole corpus (~20k documents) in a fresh cache: ~30-60 s.
def test_a_first_read_prepares_silently_and_imports_no_tensorflow(tmp_path):
  env = {**os.environ, "DIPACO_CACHE_DIR": str(tmp_path)}
  r = subprocess.run(
    [sys.executable, "-c", _FIRST_READ], capture_output=True, text=True, env=env, cwd=helpers.ROOT
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["591", "False", "False"]  # The router split: 591 documents.
  shown = r.stdout + r.stderr
  # tfds's "Downloading and preparing dataset Unknown size ..." and "... downloaded and
  # prepared", and its warning that the new version folder "has no dataset_info.json".
  for noise in ("Downloading", "Unknown size", "downloaded and prepared", "Variant folder"):
    assert noise not in shown, shown
  prepared = tmp_path / "tfds" / "dipaco_embedded"
  assert list(prepared.glob("*/1.1.0/*.array_record*")), list(prepared.rglob("*"))


def test_the_subsample_hash_is_tensorflows_int64_one():
  # The c4 task keeps ((id * 2654435761) >> 16) mod n == 0 in TensorFlow's int64 (wrapping,
  # arithmetic shift, floor mod); data/embedded.py computes it in Python. Ids past 2^32 wrap.
  ids = np.array([0, 1, 7, 12345, 2**31 + 3, 2**40 + 17, 2**61 + 5, 2**62 - 1], np.int64)
  for n in (2, 3, 4, 16):
    h = tf.bitwise.right_shift(tf.constant(ids) * selection.HASH_MULTIPLIER, 16)
    want = tf.equal(tf.math.floormod(h, n), 0).numpy().tolist()
    assert [selection.keeps(int(i), n) for i in ids] == want, n
