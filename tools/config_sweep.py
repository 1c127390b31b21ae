r"""Every config field at its edge values, alone and in pairs: which ones reach a traceback.

Derived sizes, found systematically: a value each field's own rule accepts may
still not fit the sizes the recipe and the data path derive from several fields.
For every declared field (config/sections.py), each value of a few that its rule
accepts (0, 1, 2, 3, 7, large; each choice; tuples cut and doubled) on the small
base config below (or, with --pairs, every pair of values of two size fields that
feed derived sizes together), the config goes through what a command does before
it trains:

  1. config_check.validate (every command's first step);
  2. the recipe on the mesh: Experiment(config) (grid, model, shardings, jitted
     programs) and the inner step's shapes (`jax.eval_shape` on [W, B, T] batches).

An outcome is "ok" (it runs), "refused" (a ConfigError/UserError: one line), or
"traceback" (anything else: a bug). tests/config/test_config_derived.py holds each
traceback this found to its one line.

    python tools/config_sweep.py [--pairs [--values=1,2,3,7]] [--out FILE.json]
"""

import argparse
import ast
import dataclasses
import itertools
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import jax
import numpy as np

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax.config import micro
from dipaco_jax.config import schema
from dipaco_jax.core import experiment

# The base: configs/tiny.py at a micro size (4 workers on 4 fake devices), as the tests'.
BASE = micro.overrides()
# Fields whose values name files, hosts or run-time behaviour only (no size derives from them).
SKIP_SECTIONS = ("faults", "profile")
SKIP = {
  "data.vocab_path",
  "data.tfds_data_dir",
  "data.shard_dir",
  "data.shard_cache",
  "dipaco.init_from",
  "elastic.address",
  "elastic.compile_cache",
  "ckpt.async_save",
  "seed",
}
# Size fields that feed the same derived sizes (checked in pairs with --pairs).
SIZES = (
  "model.d_model",
  "model.num_heads",
  "model.head_dim",
  "model.max_len",
  "model.num_layers",
  "data.seq_len",
  "data.batch_size",
  "inner.microbatches",
  "routing.prefix_len",
  "eval.seq_len",
  "dipaco.inner_steps",
  "eval.every_steps",
  "ckpt.every_steps",
  "mesh.cpu_devices",
)


def _choices(need: str) -> list | None:
  """The choices a rule's `need` lists ("one of 'a', 'b'"), or None."""
  if not need.startswith("one of "):
    return None
  try:
    return list(ast.literal_eval("[" + need[len("one of ") :] + "]"))
  except (ValueError, SyntaxError):
    return None


def candidates(key: str, f: dataclasses.Field) -> list:
  """Values of field `key` its own rule accepts, at the edges."""
  rule, default = f.metadata["rule"], f.default
  picks = _choices(rule.need)
  if picks is None:
    if isinstance(default, bool):
      picks = [not default]
    elif isinstance(default, int):
      picks = [0, 1, 2, 3, 7, 2 * default + 1, 10**6, -1]
    elif isinstance(default, float):
      picks = [1e-9, 0.5, 1.0, 2.0, 1e9]
    elif isinstance(default, tuple):
      picks = [(), default[:1], default * 2, ("0-1",), (1,), (0.5,), ("a-b",)]
    elif isinstance(default, str) or default is None:
      picks = ["", "x", "0", "a-b", "(1, 2)"]
    else:
      picks = []
  return [v for v in picks if v != default and _ok(rule, v)]


def _ok(rule, v) -> bool:
  try:
    return bool(rule.ok(v))
  except Exception:  # pylint: disable=broad-except
    return False


def _config(over: dict):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return config_check.load(os.path.join(root, "configs", "tiny.py"), **{**BASE, **over})


def run(over: dict) -> tuple[str, str]:
  """(outcome, the one line or the traceback's last lines) of a config with `over`."""
  try:
    config = _config(over)
    config_check.validate(config)
    exp = experiment.Experiment(config)
    W, B, T = exp.batch_shape
    batch = {
      k: jax.ShapeDtypeStruct((W, B, T), np.float32 if k == "weights" else np.int32)
      for k in ("inputs", "targets", "segment_ids", "positions", "weights")
    }
    state = exp.abstract_state
    jax.eval_shape(exp.inner_step, state.params, state.inner_opt, batch)
  except Exception as e:  # pylint: disable=broad-except
    if errors.is_user_error(e):
      return "refused", errors.one_line(e)
    return "traceback", "".join(traceback.format_exception(e)[-3:]).strip()
  return "ok", ""


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pairs", action="store_true", help="every pair of SIZES fields, not each field")
  p.add_argument("--values", default="1,2,3,7", help="--pairs: each size field's values")
  p.add_argument("--out", default="", help="write every outcome here (JSON)")
  args = p.parse_args()
  fields = {
    k: f for k, f in schema.declared().items() if k not in SKIP and not k.startswith(SKIP_SECTIONS)
  }
  trials = [] if args.pairs else [{k: v} for k, f in fields.items() for v in candidates(k, f)]
  if args.pairs:
    values = {int(v) for v in args.values.split(",")}
    small = {k: [v for v in candidates(k, fields[k]) if v in values] for k in SIZES}
    for a, b in itertools.combinations(SIZES, 2):
      trials += [{a: x, b: y} for x in small[a] for y in small[b]]
  out = []
  for n, over in enumerate(trials):
    outcome, text = run(over)
    out.append({"config": {k: repr(v) for k, v in over.items()}, "outcome": outcome, "text": text})
    if outcome == "traceback":
      print(f"[{n}/{len(trials)}] TRACEBACK {over}:\n  {text}", flush=True)
  counts = {o: sum(r["outcome"] == o for r in out) for o in ("ok", "refused", "traceback")}
  print(json.dumps(counts))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
