"""Per-split, per-domain documents and tokens of a data task.

  python -m dipaco_jax.data --stats                       # the embedded corpus, all splits
  python -m dipaco_jax.data --stats --task c4_en --tfds_data_dir gs://BUCKET/tfds \
      --vocab_path gs://t5-data/vocabs/cc_all.32000/sentencepiece.model --max_docs 100000

A bad flag or input is one stderr line and exit status 1, as in the other commands
(cli.py); --verbose_errors shows its traceback.
"""

import argparse
import collections
import sys

from dipaco_jax import errors
from dipaco_jax.config.sections import TASKS
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab
from dipaco_jax.io import files


def stats(task: str, splits, *, data_dir=None, vocab_path=None, max_docs=None) -> dict:
  """{split: {domain: [documents, tokens]}} by streaming the task's tokenized documents."""
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  out = {}
  for split in splits:
    counts = collections.defaultdict(lambda: [0, 0])
    for i, doc in enumerate(
      tasks.iter_documents(task, split, data_dir=data_dir, vocab_path=vocab_path)
    ):
      if max_docs is not None and i >= max_docs:
        break
      counts[doc.domain][0] += 1
      counts[doc.domain][1] += len(doc.tokens)
    out[split] = dict(sorted(counts.items()))
  return out


def format_table(table: dict, max_rows: int = 50) -> str:
  """A markdown table: one row per domain, documents and tokens for each split."""
  splits = list(table)
  domains = sorted(
    {d for s in splits for d in table[s]},
    key=lambda d: -sum(table[s].get(d, [0, 0])[1] for s in splits),
  )
  head = "| domain | " + " | ".join(f"{s} docs | {s} tokens" for s in splits) + " |"
  lines = [head, "|---" * (1 + 2 * len(splits)) + "|"]

  def row(name, cells):
    return f"| {name} | " + " | ".join(f"{d:,} | {t:,}" for d, t in cells) + " |"

  for domain in domains[:max_rows]:
    lines.append(row(domain, [table[s].get(domain, [0, 0]) for s in splits]))
  if len(domains) > max_rows:
    lines.append(f"| ... {len(domains) - max_rows} more domains | " + " | " * 2 * len(splits))
  totals = [[sum(v[i] for v in table[s].values()) for i in (0, 1)] for s in splits]
  lines.append(row("**total**", totals))
  return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line (errors.ArgumentError), not usage and exit status 2."""

  def error(self, message: str):
    raise errors.ArgumentError(f"{message}; see --help.")


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stats", action="store_true", help="print documents and tokens")
  parser.add_argument("--task", default="dipaco_embedded", choices=TASKS)
  parser.add_argument("--splits", default=",".join(corpus.SPLITS))
  parser.add_argument("--tfds_data_dir", default=None)
  parser.add_argument("--vocab_path", default=None)
  parser.add_argument("--max_docs", type=int, default=None, help="per split (for C4)")
  parser.add_argument("--json", default=None, help="also write the numbers to this file")
  parser.add_argument("--verbose_errors", action="store_true", help="show a bad input's traceback")
  return parser


def _run(args) -> None:
  if not args.stats:
    raise errors.ArgumentError("nothing to do: pass --stats.")
  splits = args.splits.split(",")
  if unknown := [s for s in splits if s not in corpus.SPLITS]:
    raise errors.ArgumentError(
      f"--splits={args.splits}: unknown split(s) {unknown}; give some of "
      f"{','.join(corpus.SPLITS)}, comma-separated."
    )
  if args.max_docs is not None and args.max_docs < 1:
    raise errors.ArgumentError(
      f"--max_docs={args.max_docs}: count at least 1 document per split (leave it out for all)."
    )
  # Before TensorFlow starts and minutes of streaming: the tokenizer and the output file.
  vocab.load(vocab.resolve(args.task, args.vocab_path))
  if args.json:
    files.check_writable(args.json, f"--json={args.json}", file=True)
  table = stats(
    args.task,
    splits,
    data_dir=args.tfds_data_dir,
    vocab_path=args.vocab_path,
    max_docs=args.max_docs,
  )
  print(format_table(table))
  if args.json:
    files.write_json(args.json, table, indent=1, sort_keys=False)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  try:
    _run(_parser().parse_args(argv))
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_user_error(e):
      raise  # A bug keeps its traceback.
    errors.fail(e, "--verbose_errors" in argv)


if __name__ == "__main__":
  main()
