"""tools/train_tokenizer.py --vocab_size and the shipped tokenizers of each size."""

import os
import subprocess
import sys

import pytest

from dipaco_jax import errors
from dipaco_jax.data import vocab

import helpers

ROOT = helpers.ROOT
TOOL = os.path.join(ROOT, "tools", "train_tokenizer.py")


@pytest.mark.parametrize("size", sorted(vocab.SHIPPED_VOCABS))
def test_every_shipped_size_loads_with_its_pieces_and_the_t5_ids(size):
  sp = vocab.load(vocab.shipped_path(size))
  assert sp.vocab_size() == size
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  # Identity normalisation and kept whitespace: decoding gives the text back exactly.
  text = "def f(x):\n    return x  # two spaces\n\nAnd it came to pass"
  assert sp.decode(sp.encode(text)) == text


def test_the_small_tokenizer_cuts_text_into_more_shorter_pieces():
  text = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
  small = vocab.load(vocab.shipped_path(1024)).encode(text)
  big = vocab.load(vocab.shipped_path(8192)).encode(text)
  assert len(small) > len(big)


def test_an_unshipped_size_is_one_config_error_naming_the_sizes_and_the_tool():
  with pytest.raises(errors.ConfigError, match=r"\[1024, 8192\].*--vocab_size=999"):
    vocab.shipped_path(999)


def _tool(*args, tmp_path):
  return subprocess.run(
    [sys.executable, TOOL, *args], capture_output=True, text=True, cwd=tmp_path, check=False
  )


@pytest.mark.cli
def test_an_unshipped_size_without_out_is_refused_before_training(tmp_path):
  proc = _tool("--vocab_size=5000", tmp_path=tmp_path)
  assert proc.returncode == 2
  assert "--vocab_size=5000 is not a shipped size [1024, 8192]: give --out=FILE." in proc.stderr
  assert os.listdir(tmp_path) == []


@pytest.mark.cli
def test_a_non_positive_size_is_refused(tmp_path):
  proc = _tool("--vocab_size=0", "--out=x.model", tmp_path=tmp_path)
  assert proc.returncode == 2
  assert "give a positive number of pieces" in proc.stderr
  assert os.listdir(tmp_path) == []


# SentencePiece reads the whole train split before it checks the size: ~10 s.
@pytest.mark.slow
@pytest.mark.cli
def test_a_size_sentencepiece_cannot_train_is_one_line_and_writes_nothing(tmp_path):
  proc = _tool("--vocab_size=100", "--out=small.model", tmp_path=tmp_path)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("--vocab_size=100: SentencePiece cannot train it (")
  assert "Vocabulary size is smaller than required_chars" in lines[0]
  assert lines[0].endswith("nothing written.")
  assert os.listdir(tmp_path) == []
