r"""Decoding tokens/s: the full forward pass per token (serving before) vs the KV cache.

  python benchmarks/serving.py --out benchmarks/results/serving_cpu_2core.json
  python benchmarks/serving.py --quick  # seconds

On configs/tiny.py's model shape (4 blocks, d_model 128, vocab 8192, RoPE)
with random params, greedy, no stop token (every call makes exactly
--new_tokens tokens per prompt), prompts of 16-48 random tokens:

* uncached_bB: decoding.generate_uncached, the loop PathServer.generate ran
  before: the whole model over the whole (bucketed) buffer for every new
  token, one prompt at a time, B prompts one after another.
* cached_bB: decoding.complete: B prompts in one batch, one prefill call,
  then one token per step in a jitted while_loop over the KV cache.

tokens/s counts new tokens only (prefill time included). Repetitions are
interleaved (timing.interleave); numbers are medians, speedups the median of
back-to-back paired ratios. Pin with `taskset -c 0,1 python ...` if wanted.
"""
# pylint: disable=invalid-name,g-import-not-at-top,wrong-import-position

import argparse
import os
import statistics
import sys

import jax
import numpy as np

from dipaco_jax import config_check
from dipaco_jax.config import sections
from dipaco_jax.core import decoding
from dipaco_jax.core import model as model_lib

from timing import Loop, interleave, paired_ratio, write_json  # Beside us.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.py"))
  p.add_argument("--batch", default="1,8", help="comma list of batch sizes")
  p.add_argument("--new_tokens", type=int, default=None, help="per prompt (default 64; quick: 8)")
  p.add_argument("--reps", type=int, default=None, help="repetitions (default 5; quick: 2)")
  p.add_argument("--quick", action="store_true", help="2 blocks, d_model 32, vocab 256")
  p.add_argument("--out", default="", help="JSON file to write")
  a = p.parse_args(argv)
  a.batch = [int(x) for x in a.batch.split(",")]
  a.new_tokens = a.new_tokens or (8 if a.quick else 64)
  a.reps = a.reps or (2 if a.quick else 5)
  if min(a.batch) < 1 or a.new_tokens < 1 or a.reps < 1:
    p.error("--batch sizes, --new_tokens and --reps must be >= 1")
  return a


def bench_model(args):
  """The config's model (shrunk with --quick) and random params."""
  c = config_check.load(args.config)
  if args.quick:
    c.model.vocab_size, c.model.d_model, c.model.num_layers = 256, 32, 2
    c.model.num_heads, c.model.head_dim = 2, 16
  cfg = sections.ModelConfig.of(c)
  params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.key(0))
  return model_lib.Transformer(cfg), params


def main(args) -> dict:
  load_start = os.getloadavg()
  model, params = bench_model(args)
  cfg, N = model.cfg, args.new_tokens
  rng = np.random.default_rng(0)
  prompts = [
    rng.integers(3, cfg.vocab_size, size=n).astype(np.int32)
    for n in rng.integers(16, 49, size=max(args.batch))
  ]
  decoding.check_length(cfg, max(len(p) for p in prompts) + 1, N)

  def uncached(batch):
    return [
      decoding.generate_uncached(model, params, p, max_new_tokens=N, eos_id=-1)[0] for p in batch
    ]

  def cached(batch):
    return decoding.complete(model, params, batch, max_new_tokens=N, eos_id=-1)

  loops = {}
  for B in args.batch:
    loops[f"uncached_b{B}"] = (Loop(lambda _, B=B: uncached(prompts[:B]), None, B * N), 1)
    loops[f"cached_b{B}"] = (Loop(lambda _, B=B: cached(prompts[:B]), None, B * N), 1)
  first_call_s = {k: loop.run(1) for k, (loop, _) in loops.items()}  # Compiles.
  agree = uncached(prompts[: max(args.batch)]) == cached(prompts[: max(args.batch)])
  secs, _ = interleave(loops, args.reps, list(loops))
  med = {k: statistics.median(v) for k, v in secs.items()}
  results = []
  for B in args.batch:
    old, new = f"uncached_b{B}", f"cached_b{B}"
    results.append(
      {
        "batch": B,
        "uncached_tokens_per_s": B * N / med[old],
        "cached_tokens_per_s": B * N / med[new],
        "speedup": paired_ratio(loops, secs, new, base=old)[0],
        "uncached_s_per_call": med[old],
        "cached_s_per_call": med[new],
        "first_call_s": {"uncached": first_call_s[old], "cached": first_call_s[new]},
      }
    )
  report = {
    "command": "python benchmarks/serving.py " + " ".join(sys.argv[1:]),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "host_cpus": os.cpu_count(),
    "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    "loadavg_start": load_start,
    "loadavg_end": os.getloadavg(),
    "model": {
      k: getattr(cfg, k)
      for k in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "positions", "mlp")
    },
    "params": sum(x.size for x in jax.tree.leaves(params)),
    "new_tokens": N,
    "prompt_tokens": [len(p) for p in prompts],
    "reps": args.reps,
    "greedy_tokens_agree": agree,
    "statistic": "medians over interleaved repetitions; speedup: median paired ratio",
    "results": results,
  }
  print(
    f"jax {jax.__version__} {jax.default_backend()}, {report['params']:,} params, "
    f"{N} new tokens per prompt, {args.reps} reps, tokens agree: {agree}"
  )
  print(f"{'batch':>6s} {'uncached tok/s':>15s} {'cached tok/s':>13s} {'speedup':>8s}")
  for r in results:
    print(
      f"{r['batch']:6d} {r['uncached_tokens_per_s']:15,.0f} {r['cached_tokens_per_s']:13,.0f} "
      f"{r['speedup']:8.1f}"
    )
  if args.out:
    write_json(args.out, report)
  if not agree:
    raise SystemExit("the cached and uncached greedy tokens differ")
  return report


if __name__ == "__main__":
  main(parse_args(sys.argv[1:]))
