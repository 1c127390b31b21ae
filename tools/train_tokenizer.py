"""Trains the shipped SentencePiece model on the embedded corpus' train split.

  python tools/train_tokenizer.py                    # writes dipaco_jax/data/assets/<model>
  python tools/train_tokenizer.py --check            # retrains to a temp file and compares bytes

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

VOCAB_SIZE = 8192


def train(model_path: str) -> None:
  """Trains on whole train documents (newlines inside) and writes model_path."""
  texts = (r["text"] for r in corpus.read_records("train"))
  model = io.BytesIO()  # not a model_prefix: its temp path would be stored in the model
  spm.SentencePieceTrainer.train(
    sentence_iterator=texts,
    model_writer=model,
    vocab_size=VOCAB_SIZE,
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
  with open(model_path, "wb") as f:
    f.write(model.getvalue())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=vocab.DEFAULT_VOCAB_PATH)
  parser.add_argument("--check", action="store_true", help="retrain to a temp file and compare")
  args = parser.parse_args()
  if not args.check:
    train(args.out)
    print(f"Wrote {args.out} ({vocab.fingerprint(args.out)}).")
    return
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "check.model")
    train(path)
    if not filecmp.cmp(path, args.out, shallow=False):
      sys.exit(
        f"Retrained model {vocab.fingerprint(path)} differs from {args.out} "
        f"({vocab.fingerprint(args.out)})."
      )
    print(f"{args.out} is byte-identical to the retrained model.")


if __name__ == "__main__":
  main()
