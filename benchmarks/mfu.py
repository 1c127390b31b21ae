r"""Model FLOPs utilisation of a config's inner step on this machine's accelerator.

  python benchmarks/mfu.py --config=configs/dense_150m.py --batch=32 --out=/tmp/mfu.json
  python benchmarks/mfu.py --config=configs/dense_150m.py --batch=32 --set model.remat=none

Times `Experiment.inner_step` (the trainer's jitted step: forward, backward,
AdamW) on synthetic tokens for one worker on one device, and reports tokens/s,
model FLOP/s by `flops.model_flops_per_token` and their fraction of the device's dense peak
(--peak_tflops, or `flops.PEAK_TFLOPS` by device kind) under both conventions (docs/tpu.md):
`mfu` causal (6 N + 6 L T H K per token), `mfu_full` (6 N + 12 L T H K, PaLM). The config's
other switches (dtype, remat, loss_chunk, microbatches) apply as set; --set overrides any field
(repeatable).
"""
# pylint: disable=invalid-name

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from dipaco_jax import config_check
from dipaco_jax import data as data_lib
from dipaco_jax.core import experiment
from dipaco_jax.core import flops
from dipaco_jax.core import sharding

from timing import field_overrides  # Beside us.


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="a config file, e.g. configs/dense_150m.py")
  p.add_argument("--batch", type=int, default=32, help="sequences per step (one worker)")
  p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
  p.add_argument("--reps", type=int, default=3, help="repetitions (median)")
  p.add_argument("--set", action="append", default=[], help="field=value override (repeatable)")
  p.add_argument("--peak_tflops", type=float, default=0.0, help="device peak (0: the table)")
  p.add_argument("--out", default="", help="JSON file to write")
  return p.parse_args(argv)


def main(argv) -> dict:
  args = parse_args(argv)
  over = {
    "dipaco.modules_per_level": (1,),
    "dipaco.replicas": 1,
    "outer.enabled": False,
    "data.batch_size": args.batch,
    "mesh.data": 1,
    **field_overrides(args.set),
  }
  # One module holding the whole model (a dense path), whatever the config's grid.
  layers = int(over.get("model.num_layers", config_check.load(args.config).model.num_layers))
  c = config_check.load(
    args.config, **over, **{"dipaco.level_groups": (f"embed,block_0-{layers - 1},head",)}
  )
  device = jax.devices()[0]
  exp = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, 1, devices=[device]))
  T = c.data.seq_len
  batch = exp.put_batch(
    data_lib.synthetic_batch(np.random.default_rng(0), 1, args.batch, T, c.model.vocab_size)
  )
  st = exp.init_state(0)
  params, opt = st.params, st.inner_opt
  t0 = time.perf_counter()
  params, opt = exp.inner_step(params, opt, batch)[:2]
  jax.block_until_ready(params)
  first_s = time.perf_counter() - t0
  secs = []
  for _ in range(args.reps):
    t0 = time.perf_counter()
    for _ in range(args.steps):
      params, opt = exp.inner_step(params, opt, batch)[:2]
    jax.block_until_ready(params)
    secs.append((time.perf_counter() - t0) / args.steps)
  step_s = statistics.median(secs)
  fpt = flops.model_flops_per_token(exp.model_cfg, T, "causal")
  fpt_full = flops.model_flops_per_token(exp.model_cfg, T, "full")
  tok_s = args.batch * T / step_s
  peak = args.peak_tflops or flops.peak_tflops(device.device_kind, c.model.dtype) or 0.0
  report = {
    "command": "python benchmarks/mfu.py " + " ".join(argv),
    "jax": jax.__version__,
    "device_kind": device.device_kind,
    "dtype": c.model.dtype,
    "attention": c.model.attention,
    "remat": c.model.remat,
    "loss_chunk": c.model.loss_chunk,
    "microbatches": c.inner.microbatches,
    "batch": args.batch,
    "seq_len": T,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "first_call_s": first_s,
    "step_s": step_s,
    "step_s_per_repetition": secs,
    "tokens_per_s": tok_s,
    "model_flops_per_token": fpt,
    "model_tflops_per_s": fpt * tok_s / 1e12,
    "peak_tflops": peak or None,
    "mfu": fpt * tok_s / (peak * 1e12) if peak else None,
    "model_flops_per_token_full": fpt_full,
    "mfu_full": fpt_full * tok_s / (peak * 1e12) if peak else None,
  }
  print(json.dumps(report, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
