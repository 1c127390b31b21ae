"""Serving one path: route a text, read only that path's params, generate or score.

    python -m dipaco_jax.serve --workdir=DIR --text="..."

The params of path p are read straight from a run's checkpoint
(checkpoint.read_rows): for each store group, row `module_of(p)` of every
leaf. Nothing else is materialised — not the other modules, not the worker
params, not the optimizer states — whatever the grid size. Disk reads follow
the chunking: one row per chunk (the early-stopping set, and checkpoints saved
with `checkpoint.module_chunks`) reads one path's bytes; a whole-leaf chunk
reads that leaf's K rows. `checkpoint.bytes_read()` counts them.

The command's config is the run's saved <workdir>/config.json unless --config
is given; --config.a.b=v overrides apply on top (cli.py). Repeat --text for
several inputs: each is routed by its own first tokens, and texts on one path
are decoded together (--batch_size at a time, KV cache).
"""
# pylint: disable=invalid-name

import dataclasses
import hashlib
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from absl import logging

from dipaco_jax import cli
from dipaco_jax import errors
from dipaco_jax import routing
from dipaco_jax import saved_config
from dipaco_jax.config import sections
from dipaco_jax.core import decoding
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.core.path_params import load as load_path_params
from dipaco_jax.data import vocab as vocab_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import console
from dipaco_jax.types import PyTree

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
# Refused when parsed, in one line (absl: "flag --NAME=VALUE: MESSAGE"); the defaults pass.
for _flag, _ok, _need in (
  (_PATH, lambda v: v is None or v >= 0, "a path is numbered from 0: give --path >= 0"),
  (_MAX_NEW, lambda v: v >= 1, "generate at least 1 token: give --max_new_tokens >= 1"),
  (_TEMPERATURE, lambda v: v >= 0, "give --temperature >= 0 (0: greedy)"),
  (_TOP_K, lambda v: v >= 0, "give --top_k >= 0 (0: every token)"),
  (_BATCH, lambda v: v >= 1, "decode at least 1 text at a time: give --batch_size >= 1"),
):
  flags.register_validator(_flag, _ok, _need)


@dataclasses.dataclass
class PathServer:
  """Routes texts and serves the chosen path (one path's params in memory at a time)."""

  config: Any
  workdir: str
  source: str = "store"
  step: int | None = None

  def __post_init__(self):
    saved_config.check_readable(self.workdir, self.config)
    self.topo = topo_lib.from_config(self.config)
    c = self.config
    self.sp = vocab_lib.load(vocab_lib.resolve(c.data.task, c.data.vocab_path))
    self.model = model_lib.Transformer(sections.ModelConfig.of(c))
    self.step = checkpoint.latest_step(self.workdir) if self.step is None else self.step
    self.phase = checkpoint.routing_phase(checkpoint.read_data_state(self.workdir, self.step))
    self.prefix_len = routing.check_prefix_len(c.routing.prefix_len)
    kind = c.routing.router
    needs = self.phase > 0 or kind != "random"
    self.extractor = routing.extractor_from_config(c) if needs else None
    self.router = routing.load_phase_router(c, self.workdir, self.topo, self.phase, self.extractor)
    self._path, self._params, self.load_info = None, None, None
    self.model_cfg = sections.ModelConfig.of(c)
    self._logits = jax.jit(lambda p, x: self.model.apply({"params": p}, x))

  def tokenize(self, text: str) -> np.ndarray:
    ids = np.asarray(self.sp.encode(text), np.int32)
    if not len(ids):
      raise errors.ArgumentError(
        "the text has no tokens: an empty prefix cannot be routed. Pass some text."
      )
    return ids

  def _past_length(self, tokens: int, what: str, fix: Callable[[int], str]) -> str | None:
    """Refuses `tokens` positions past learned positions; the warning past the trained length.

    `fix(limit)`: what brings them within `limit` positions. The caller logs the warning
    once its output is made.
    """
    cfg, trained = self.model_cfg, self.config.data.seq_len
    if cfg.positions == "learned" and tokens > cfg.max_len:
      raise errors.ArgumentError(
        f"{what} needs {tokens} positions but the model's learned positions end at "
        f"model.max_len={cfg.max_len}: {fix(cfg.max_len)}."
      )
    if tokens <= trained:
      return None
    return (
      f"{what} runs to {tokens} tokens, past the {trained} the model was trained on "
      f"(config.data.seq_len): what lies past them is extrapolated; {fix(trained)} to stay "
      "within them."
    )

  def route(self, text: str) -> int:
    """The path the run's router picks from the text's first prefix_len tokens."""
    ids = self.tokenize(text)
    doc_id = int.from_bytes(hashlib.sha256(ids.tobytes()).digest()[:7], "little")
    feats = self.extractor.prefix_features([ids]) if self.router.needs_features else None
    return int(self.router.paths([doc_id], feats)[0, 0])

  def params(self, path: int) -> PyTree:
    """Loads path `path` (dropping any other path held)."""
    if path != self._path:
      self._params, self.load_info = load_path_params(
        self.workdir, self.config, path, source=self.source, step=self.step
      )
      self._path = path
    return self._params

  def score(self, text: str, path: int | None = None) -> dict:
    """Loss and perplexity of the text's tokens after the prefix under one path."""
    ids = self.tokenize(text)
    if len(ids) <= self.prefix_len:
      raise errors.ArgumentError(
        f"a text of {len(ids)} tokens cannot be scored: its first {self.prefix_len} route it "
        f"(config.routing.prefix_len) and are not scored; give a text of at least "
        f"{self.prefix_len + 1} tokens."
      )
    warning = self._past_length(len(ids), "the text", lambda n: f"shorten it to {n} tokens")
    path = self.route(text) if path is None else path
    inputs = np.concatenate([[0], ids[:-1]]).astype(np.int32)[None]
    logp = jax.nn.log_softmax(self._logits(self.params(path), inputs)[0])
    lp = np.asarray(jnp.take_along_axis(logp, ids[:, None], -1))[:, 0]
    scored = lp[self.prefix_len :]
    loss = float(-scored.mean())
    if warning:
      logging.warning(warning)
    return {
      "path": path,
      "tokens": len(ids),
      "scored_tokens": len(scored),
      "loss": loss,
      "ppl": float(np.exp(loss)),
    }

  def generate(
    self,
    text: str,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    path: int | None = None,
  ) -> dict:
    """Continues the text with one path (greedy at temperature 0); stops at EOS."""
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return self.generate_batch([text], path=path, **kw)[0]

  def generate_batch(
    self,
    texts: list[str],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    path: int | None = None,
    batch_size: int = 8,
  ) -> list[dict]:
    """generate() for each text: texts routed to one path decode together, batch_size at once.

    Each text's path is the router's pick from its own first tokens (or `path`). A row's
    tokens do not depend on the other rows of its batch (decoding.py); with sampling, its
    random draws do (one key per batch and step).
    """
    if batch_size < 1:
      raise errors.ArgumentError(f"batch_size={batch_size}: decode at least 1 text at a time.")
    ids = [self.tokenize(t) for t in texts]
    longest = max(len(i) for i in ids)
    warning = self._past_length(
      longest + max_new_tokens,
      f"a prompt of {longest} tokens plus --max_new_tokens={max_new_tokens}",
      lambda n: (
        f"lower --max_new_tokens to {n - longest}"
        if n > longest
        else f"shorten the text below {n} tokens"
      ),
    )
    paths = [self.route(t) if path is None else path for t in texts]
    out: list[dict] = [{} for _ in texts]
    for p in sorted(set(paths)):  # One path's params in memory at a time.
      rows = [i for i, q in enumerate(paths) if q == p]
      params = self.params(p)
      for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        new = decoding.complete(
          self.model,
          params,
          [ids[i] for i in chunk],
          max_new_tokens=max_new_tokens,
          eos_id=vocab_lib.EOS_ID,
          temperature=temperature,
          top_k=top_k,
          seed=seed,
        )
        for i, tokens in zip(chunk, new):
          out[i] = {
            "path": p,
            "text": self.sp.decode(tokens),
            "tokens": tokens,
            "new_tokens": len(tokens),
          }
    if warning:
      logging.warning(warning)
    return out


# Below this many parameters a path continues text with its most frequent pieces (spaces,
# "the", punctuation) rather than sentences: configs/tiny.py's 1.5M-parameter paths do. Models
# of a few million parameters write sentences only on a narrow corpus (TinyStories-like).
SMALL_MODEL_PARAMS = 10_000_000


def small_model_note(config) -> str | None:
  """What generate's output says of a path too small to write text, or None."""
  n = console.params_per_path(config)
  if n >= SMALL_MODEL_PARAMS:
    return None
  return (
    f"this path has {n / 1e6:.2f}M parameters: a model under {SMALL_MODEL_PARAMS // 10**6}M "
    "continues text with its most frequent pieces (spaces, common words), not sentences, so "
    "this output shows the pipeline works, not what DiPaCo writes; --mode=score gives its "
    "perplexity, and a path of ~100M parameters (configs/dense_150m.py) writes text."
  )


def serve(
  config,
  workdir: str,
  text: str | list[str],
  *,
  mode: str = "generate",
  source: str = "store",
  path: int | None = None,
  max_new_tokens: int = 32,
  temperature: float = 0.0,
  top_k: int = 0,
  batch_size: int = 8,
) -> str:
  """The serve CLI's one call: route, load one path, generate or score; JSON out.

  Several texts give a list of results (generated in batches grouped by path).
  """
  server = PathServer(config, workdir, source=source)
  texts = [text] if isinstance(text, str) else list(text)
  if mode == "score":
    out = [server.score(t, path=path) for t in texts]
  elif mode == "generate":
    out = server.generate_batch(
      texts,
      path=path,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_k=top_k,
      batch_size=batch_size,
    )
  else:
    raise errors.ArgumentError(f"mode={mode!r}: use 'generate' or 'score'.")
  out = [{k: v for k, v in o.items() if k != "tokens"} for o in out]  # Text for the console.
  note = small_model_note(config) if mode == "generate" else None
  extra = {"loaded": server.load_info, **({"note": note} if note else {})}
  if len(out) == 1:
    return json.dumps({**out[0], **extra}, indent=1)
  return json.dumps({"results": out, **extra}, indent=1)


def main(argv):
  if _TEXT.value is None:
    raise app.UsageError("--text is required: the text to route, then continue or score.")
  config, workdir = cli.start(argv, writes=False)  # Serving reads the run, writes nothing.
  print(
    serve(
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
