"""Route a text to one path, load only that path from the checkpoint, generate or score.

python -m dipaco_jax.serve --workdir=DIR --text="..."

The config is the run's saved <workdir>/config.json unless --config is given;
--config.a.b=v overrides apply on top (cli.py).

Repeat --text for several inputs: each is routed by its own first tokens, and
texts on one path are decoded together (--batch_size at a time, KV cache).
"""

from absl import app
from absl import flags

from dipaco_jax import cli

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.
# Checked in main, not by absl: importing this module leaves other commands' parsing alone.
_TEXT = flags.DEFINE_multi_string(
  "text", None, "The input text, required (repeat for several: a JSON list of results)."
)
_MODE = flags.DEFINE_enum(
  "mode",
  "generate",
  ["generate", "score"],
  "generate: continue the text; score: perplexity after the prefix.",
)
_SOURCE = flags.DEFINE_enum(
  "source", "store", ["store", "best"], "store: the trained modules; best: per-path early stopping."
)
_PATH = flags.DEFINE_integer("path", None, "Serve this path instead of the routed one.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0: greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Texts of one path decoded together.")


def main(argv):
  if _TEXT.value is None:
    raise app.UsageError("--text is required: the text to route, then continue or score.")
  config, workdir = cli.start(argv)
  from dipaco_jax import serving  # pylint: disable=g-import-not-at-top

  print(
    serving.serve(
      config,
      workdir,
      _TEXT.value,
      mode=_MODE.value,
      source=_SOURCE.value,
      path=_PATH.value,
      max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value,
      batch_size=_BATCH.value,
    )
  )


if __name__ == "__main__":
  cli.run(main, saved_config=True)
