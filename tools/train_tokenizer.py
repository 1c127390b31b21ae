"""Trains a SentencePiece model of any size on the embedded corpus' train split.

  python tools/train_tokenizer.py                    # the shipped 8k: dipaco_jax/data/assets/
  python tools/train_tokenizer.py --vocab_size=1024  # the shipped 1k, beside it
  python tools/train_tokenizer.py --vocab_size=2048 --out=/tmp/spm2k.model   # any other size
  python tools/train_tokenizer.py --check            # retrains every shipped size, compares bytes

T5-style ids (pad=0, eos=1, unk=2, no bos) so seqio treats it like the T5 32k vocabulary. The
normalizer is the identity and whitespace is kept (byte fallback for rare characters), so decoding
gives back the exact text: newlines and indentation carry the structure of code, verse and docs.
Trained with one thread: the result is then byte-identical from run to run.
"""

import argparse
import filecmp
import io
import os
import sys
import tempfile

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dipaco_jax.data import corpus  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax.data import vocab  # pylint: disable=g-import-not-at-top,wrong-import-position


def train(model_path: str, vocab_size: int = vocab.DEFAULT_VOCAB_SIZE) -> None:
  """Trains on whole train documents (newlines inside) and writes model_path.

  A size SentencePiece cannot train (fewer pieces than the byte fallback and the corpus'
  characters need, or more than the text holds) is one line, and nothing is written.
  """
  texts = (r["text"] for r in corpus.read_records("train"))
  model = io.BytesIO()  # not a model_prefix: its temp path would be stored in the model
  try:
    _train(texts, model, vocab_size)
  except RuntimeError as e:  # SentencePiece's own reason, e.g. "Vocabulary size is too high".
    reason = str(e).strip().splitlines()[-1].rpartition("] ")[2]
    sys.exit(
      f"--vocab_size={vocab_size}: SentencePiece cannot train it ({reason}); nothing written."
    )
  with open(model_path, "wb") as f:
    f.write(model.getvalue())


def _train(texts, model: io.BytesIO, vocab_size: int) -> None:
  spm.SentencePieceTrainer.train(
    sentence_iterator=texts,
    model_writer=model,
    vocab_size=vocab_size,
    model_type="unigram",
    pad_id=vocab.PAD_ID,
    eos_id=vocab.EOS_ID,
    unk_id=vocab.UNK_ID,
    bos_id=-1,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    user_defined_symbols=["\n"],
    allow_whitespace_only_pieces=True,
    byte_fallback=True,
    character_coverage=0.9995,
    max_sentence_length=4 * 8192,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    num_threads=1,
    minloglevel=2,
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--vocab_size",
    type=int,
    default=vocab.DEFAULT_VOCAB_SIZE,
    help=f"Pieces (shipped: {sorted(vocab.SHIPPED_VOCABS)}; other sizes need --out).",
  )
  parser.add_argument("--out", default=None, help="Default: the shipped model of that size.")
  parser.add_argument(
    "--check", action="store_true", help="retrain each shipped size to a temp file and compare"
  )
  args = parser.parse_args(argv)
  if args.check:
    sizes = [args.vocab_size] if args.out else sorted(vocab.SHIPPED_VOCABS)
    for size in sizes:
      check(size, args.out or vocab.shipped_path(size))
    return
  if args.vocab_size < 1:
    parser.error(f"--vocab_size={args.vocab_size}: give a positive number of pieces.")
  if args.out is None and args.vocab_size not in vocab.SHIPPED_VOCABS:
    parser.error(
      f"--vocab_size={args.vocab_size} is not a shipped size {sorted(vocab.SHIPPED_VOCABS)}: "
      "give --out=FILE."
    )
  out = args.out or vocab.shipped_path(args.vocab_size)
  train(out, args.vocab_size)
  print(f"Wrote {out} ({args.vocab_size} pieces, {vocab.fingerprint(out)}).")


def check(size: int, shipped: str) -> None:
  """Retrains `size` pieces to a temp file; exits naming both hashes when it differs."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "check.model")
    train(path, size)
    if not filecmp.cmp(path, shipped, shallow=False):
      sys.exit(
        f"Retrained model {vocab.fingerprint(path)} differs from {shipped} "
        f"({vocab.fingerprint(shipped)})."
      )
    print(f"{shipped} is byte-identical to the retrained model.")


if __name__ == "__main__":
  main()
