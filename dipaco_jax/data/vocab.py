"""The SentencePiece vocabulary: shipped model path, special ids, loading with clear errors."""

import functools
import hashlib
import os

import sentencepiece as spm
from etils import epath

from dipaco_jax import errors
from dipaco_jax.data import corpus

# SentencePiece's own INFO lines ("precompiled_charsmap is empty") stay off the console.
spm.set_min_log_level(1)

# T5 conventions, shared with the T5 32k C4 vocabulary: pad doubles as the BOS of shifted inputs.
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# The shipped SentencePiece models of the embedded corpus, by size (tools/train_tokenizer.py):
# 8k is the default; 1k (2.08 characters per token against 3.19) gives small paths more tokens
# per parameter from the same text and a smaller embedding (docs/results/capacity.md).
SHIPPED_VOCABS = {8192: "dipaco_spm8k.model", 1024: "dipaco_spm1k.model"}
DEFAULT_VOCAB_SIZE = 8192


def shipped_path(size: int = DEFAULT_VOCAB_SIZE) -> str:
  """The shipped model of `size` pieces; one line naming the sizes there are otherwise."""
  if size not in SHIPPED_VOCABS:
    raise errors.ConfigError(
      f"No shipped tokenizer has {size} pieces; the shipped sizes are {sorted(SHIPPED_VOCABS)} "
      f"(train another with `python tools/train_tokenizer.py --vocab_size={size} --out=FILE` "
      "and pass it as data.vocab_path)."
    )
  return os.path.join(corpus.ASSETS_DIR, SHIPPED_VOCABS[size])


DEFAULT_VOCAB_PATH = shipped_path()
# The T5 32k SentencePiece model for C4 runs (on GCS; copy it next to the data for offline use).
T5_VOCAB_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"


def _read(path: str) -> bytes:
  p = epath.Path(path)
  if not p.exists():
    raise FileNotFoundError(
      f"Vocabulary file {path} does not exist; pass an existing "
      "SentencePiece .model file as vocab_path."
    )
  return p.read_bytes()


@functools.lru_cache(maxsize=8)
def fingerprint(path: str) -> str:
  """Short content hash of a vocabulary file (recorded in shard metadata)."""
  return "sha256:" + hashlib.sha256(_read(path)).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def load(path: str) -> spm.SentencePieceProcessor:
  """Loads and checks a SentencePiece model: T5 special ids (pad 0, eos 1, unk 2, no bos)."""
  sp, proto = spm.SentencePieceProcessor(), _read(path)
  try:
    sp.LoadFromSerializedProto(proto)
  except (RuntimeError, OSError) as e:
    raise errors.ConfigError(
      f"{path} is not a SentencePiece model ({e}); pass a .model file as vocab_path."
    ) from e
  ids = (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id())
  if ids != (PAD_ID, EOS_ID, UNK_ID, -1):
    raise errors.ConfigError(
      f"{path} has special ids (pad, eos, unk, bos) = {ids}; dipaco_jax needs the "
      f"T5 layout ({PAD_ID}, {EOS_ID}, {UNK_ID}, -1)."
    )
  return sp


def resolve(task: str, vocab_path: str | None) -> str:
  """The vocabulary path a task uses: the shipped model for the embedded corpus."""
  if vocab_path is not None:
    return vocab_path
  if task == "dipaco_embedded":
    return DEFAULT_VOCAB_PATH
  raise errors.ConfigError(f"Task {task!r} needs data.vocab_path (e.g. {T5_VOCAB_PATH} for c4_en).")
