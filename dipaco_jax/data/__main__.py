r"""Per-split, per-domain documents and tokens of a data task.

  python -m dipaco_jax.data --stats                       # the embedded corpus, all splits
  python -m dipaco_jax.data --stats --task c4_en --tfds_data_dir gs://BUCKET/tfds \
      --vocab_path gs://t5-data/vocabs/cc_all.32000/sentencepiece.model --max_docs 100000

Flags as in the other commands (absl): a bad flag or input is one stderr line and exit status 1
(cli.py); --verbose_errors shows its traceback. The command does not import cli.py (jax, the
trainer's flags): --verbose_errors is errors.py's.
"""

import collections
import sys

from absl import app
from absl import flags

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


# The command's own flags, apart from absl's global FLAGS: it takes these and no other (no
# trainer flag, required --workdir included, when a process has imported cli.py too).
_FV = flags.FlagValues()
_FLAGS: dict[str, flags.FlagHolder] = {}
_HELP = ("--help", "-help", "--helpshort", "--helpfull", "-h")


def _define_flags() -> None:
  """The command's flags (into _FV), defined when it runs: importing the module adds none."""
  if _FLAGS:
    return
  define = {"flag_values": _FV}
  _FLAGS["stats"] = flags.DEFINE_bool(
    "stats", False, "Print documents and tokens per domain.", **define
  )
  _FLAGS["task"] = flags.DEFINE_enum("task", "dipaco_embedded", TASKS, "The seqio task.", **define)
  _FLAGS["splits"] = flags.DEFINE_string(
    "splits", ",".join(corpus.SPLITS), "The splits to count, comma-separated.", **define
  )
  _FLAGS["tfds_data_dir"] = flags.DEFINE_string(
    "tfds_data_dir", None, "tfds dir (gs:// for C4); unset: the project's cache folder.", **define
  )
  _FLAGS["vocab_path"] = flags.DEFINE_string(
    "vocab_path", None, "SentencePiece model; unset: the task's shipped tokenizer.", **define
  )
  _FLAGS["max_docs"] = flags.DEFINE_integer(
    "max_docs", None, "Documents per split (for C4); unset: all.", **define
  )
  _FLAGS["json"] = flags.DEFINE_string(
    "json", None, "Also write the numbers to this file.", **define
  )
  # errors.py's --verbose_errors, the same flag object: errors.VERBOSE_ERRORS reads it.
  flags.DEFINE_flag(flags.FLAGS["verbose_errors"], flag_values=_FV)


def _run() -> None:
  f = {name: holder.value for name, holder in _FLAGS.items()}
  if not f["stats"]:
    raise errors.ArgumentError("nothing to do: pass --stats.")
  splits = f["splits"].split(",")
  if unknown := [s for s in splits if s not in corpus.SPLITS]:
    raise errors.ArgumentError(
      f"--splits={f['splits']}: unknown split(s) {unknown}; give some of "
      f"{','.join(corpus.SPLITS)}, comma-separated."
    )
  if f["max_docs"] is not None and f["max_docs"] < 1:
    raise errors.ArgumentError(
      f"--max_docs={f['max_docs']}: count at least 1 document per split (leave it out for all)."
    )
  # Before TensorFlow starts and minutes of streaming: the tokenizer and the output file.
  vocab.load(vocab.resolve(f["task"], f["vocab_path"]))
  if f["json"]:
    files.check_writable(f["json"], f"--json={f['json']}", file=True)
  table = stats(
    f["task"],
    splits,
    data_dir=f["tfds_data_dir"],
    vocab_path=f["vocab_path"],
    max_docs=f["max_docs"],
  )
  print(format_table(table))
  if f["json"]:
    files.write_json(f["json"], table, indent=1, sort_keys=False)


def _parse_flags(argv: list[str]) -> list[str]:
  """The command's flags parsed; a bad or unknown flag is one line (ArgumentError), status 1."""
  if any(a in _HELP for a in argv[1:]):
    print(f"{__doc__}\nflags:\n{_FV.get_help()}")
    sys.exit(0)
  _FV.unparse_flags()  # Each call parses from the defaults (tests call main again).
  try:
    rest = _FV(argv)
  except flags.Error as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    errors.fail(errors.ArgumentError(f"{reason}; see --help."), "--verbose_errors" in argv)
  flags.FLAGS.mark_as_parsed()  # absl's app.run needs it; this command takes none of them.
  return rest


def _main(argv: list[str]) -> None:
  try:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag=value.")
    _run()
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_user_error(e):
      raise  # A bug keeps its traceback.
    errors.fail(e, _FV["verbose_errors"].value)


def main(argv: list[str] | None = None) -> None:
  """`python -m dipaco_jax.data ARGS` (argv: ARGS; the command line when None); exits."""
  argv = sys.argv[1:] if argv is None else list(argv)
  _define_flags()
  app.run(_main, argv=["dipaco_jax.data", *argv], flags_parser=_parse_flags)


if __name__ == "__main__":
  main()
