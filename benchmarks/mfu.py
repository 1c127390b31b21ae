r"""Measured model FLOPs utilisation of a config's inner step, beside its roofline estimate.

  python benchmarks/mfu.py --config=configs/dense_150m.py --batch=32 --out=/tmp/mfu.json
  python benchmarks/mfu.py --config=configs/dense_150m.py --batch=32 --set model.remat=none

Compiles `Experiment.inner_step` (the trainer's jitted step: forward, backward, AdamW) for one
worker on one device, times it on synthetic tokens and reports tokens/s, model FLOP/s by
`flops.model_flops_per_token` and, **measured**, their fraction of the device's dense peak
(--peak_tflops, or `flops.PEAK_TFLOPS` by device kind; a device missing from the table is a
one-line error) under both conventions (docs/tpu.md): `mfu` causal (6 N + 6 L T H K per token),
`mfu_full` (6 N + 12 L T H K, PaLM). Beside it, the **roofline estimate** from XLA's cost
analysis of the same compiled program: the MFU ceiling (compute and memory traffic perfectly
overlapped) and floor (no overlap), as `python -m dipaco_jax.aot` estimates a TPU step; and the
memory: the compiled program's and the device allocator's peak. The config's other switches
(dtype, remat, loss_chunk, microbatches) apply as set; --set overrides any field (repeatable).
--platform=gpu (or tpu) refuses, in one line, a host whose jax has no such device.
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
from dipaco_jax import errors
from dipaco_jax.core import attention
from dipaco_jax.core import experiment
from dipaco_jax.core import flops
from dipaco_jax.core import sharding

from timing import field_overrides  # Beside us.

BLOCK_EVERY = 16  # Steps dispatched between waits (docs: every loop blocks at least this often).


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="a config file, e.g. configs/dense_150m.py")
  p.add_argument("--batch", type=int, default=32, help="sequences per step (one worker)")
  p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
  p.add_argument("--reps", type=int, default=3, help="repetitions (median)")
  p.add_argument("--set", action="append", default=[], help="field=value override (repeatable)")
  p.add_argument("--peak_tflops", type=float, default=0.0, help="device peak (0: the table)")
  p.add_argument("--hbm_gbps", type=float, default=0.0, help="HBM GB/s (0: the table)")
  p.add_argument("--platform", default="", help="gpu / tpu: refuse a host without one")
  p.add_argument("--time_budget_s", type=float, default=0.0, help="no repetition starts after")
  p.add_argument("--out", default="", help="JSON file to write")
  return p.parse_args(argv)


def check_platform(want: str, flag: str = "--platform", fix: str = "") -> jax.Device:
  """The first device, or a UserError when it is not on the platform asked for (`flag`)."""
  device = jax.devices()[0]
  if want and device.platform != want:
    raise errors.UserError(
      f"{flag}={want}: this host's jax sees no {want} device (it runs on {device.platform}: "
      f"{device.device_kind!r}); run on a {want} host, with jax's {want} plugin{fix}."
    )
  return device


def bandwidth(device: jax.Device, hbm_gbps: float) -> float:
  """HBM bytes/s: --hbm_gbps, else the table (a UserError naming it where it has none)."""
  bw = hbm_gbps * 1e9 or flops.hbm_bytes_per_s(device.device_kind)
  if not bw:
    raise errors.UserError(
      f"no HBM bandwidth for device kind {device.device_kind!r} in dipaco_jax/core/flops.py "
      "HBM_BYTES_PER_S: add the device's data-sheet figure there, or pass --hbm_gbps."
    )
  return bw


def counted_from(c, attention_runs: str) -> str:
  """What XLA's cost analysis of this step leaves out (it counts loop bodies once)."""
  gaps = []
  if c.inner.microbatches > 1:
    gaps.append(f"{c.inner.microbatches - 1} of {c.inner.microbatches} microbatches")
  chunk, T = int(c.model.loss_chunk), int(c.data.seq_len)
  if chunk and T // chunk > 1:
    gaps.append(f"{T // chunk - 1} of {T // chunk} loss chunks")
  if attention_runs in ("cudnn", "splash"):
    gaps.append(f"the {attention_runs} attention kernel's FLOPs (a custom call counts 0)")
  if not gaps:
    return "XLA's cost analysis of the compiled step: every op once"
  return "XLA's cost analysis of the compiled step, without " + "; ".join(gaps)


def memory_report(compiled, device: jax.Device) -> dict:
  """The compiled program's buffers and the device allocator's counters (bytes)."""
  m = compiled.memory_analysis()
  out = {}
  if m is not None:
    out["compiled"] = {
      "arguments": int(m.argument_size_in_bytes),
      "temporaries": int(m.temp_size_in_bytes),
      "outputs_not_aliased": int(m.output_size_in_bytes - m.alias_size_in_bytes),
      "code": int(m.generated_code_size_in_bytes),
    }
  stats = device.memory_stats() or {}  # None on a CPU.
  out["device"] = {
    k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats
  }
  return out


def measure(args, argv) -> dict:
  device = check_platform(args.platform)
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
  peak = args.peak_tflops or flops.require_peak_tflops(device.device_kind, c.model.dtype)
  bw = bandwidth(device, args.hbm_gbps)
  exp = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, 1, devices=[device]))
  T = c.data.seq_len
  batch = exp.put_batch(
    data_lib.synthetic_batch(np.random.default_rng(0), 1, args.batch, T, c.model.vocab_size)
  )
  st = exp.init_state(0)
  params, opt = st.params, st.inner_opt
  t0 = time.perf_counter()
  compiled = exp.inner_step.lower(params, opt, batch).compile()
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  params, opt = compiled(params, opt, batch)[:2]
  jax.block_until_ready(params)
  first_s = time.perf_counter() - t0
  deadline = t0 + args.time_budget_s if args.time_budget_s else float("inf")
  secs = []
  while len(secs) < args.reps and (not secs or time.perf_counter() < deadline):
    t0 = time.perf_counter()
    for i in range(args.steps):
      params, opt = compiled(params, opt, batch)[:2]
      if (i + 1) % BLOCK_EVERY == 0:
        jax.block_until_ready(params)
    jax.block_until_ready(params)
    secs.append((time.perf_counter() - t0) / args.steps)
  step_s = statistics.median(secs)
  fpt = flops.model_flops_per_token(exp.model_cfg, T, "causal")
  fpt_full = flops.model_flops_per_token(exp.model_cfg, T, "full")
  tok_s = args.batch * T / step_s
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  xla_flops, xla_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  model_flops = fpt * args.batch * T
  runs = attention.resolve(exp.model_cfg, device.platform, T)
  # Never fewer FLOPs than the model's: XLA counts a custom call (cuDNN's, splash's) as 0.
  step_flops = max(xla_flops, model_flops)
  return {
    "command": "python benchmarks/mfu.py " + " ".join(argv),
    "jax": jax.__version__,
    "platform": device.platform,
    "device_kind": device.device_kind,
    "dtype": c.model.dtype,
    "attention": c.model.attention,
    "attention_runs": runs,
    "remat": c.model.remat,
    "loss_chunk": c.model.loss_chunk,
    "microbatches": c.inner.microbatches,
    "batch": args.batch,
    "seq_len": T,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "compile_s": compile_s,
    "first_call_s": first_s,
    "mfu_is": "measured: model FLOPs of the tokens timed / wall-clock step time / peak_tflops",
    "step_s": step_s,
    "step_s_per_repetition": secs,
    "tokens_per_s": tok_s,
    "model_flops_per_token": fpt,
    "model_tflops_per_s": fpt * tok_s / 1e12,
    "peak_tflops": peak,
    "mfu": fpt * tok_s / (peak * 1e12),
    "model_flops_per_token_full": fpt_full,
    "mfu_full": fpt_full * tok_s / (peak * 1e12),
    "xla_cost": {
      "flops": xla_flops,
      "bytes": xla_bytes,
      "counted": counted_from(c, runs),
    },
    "roofline": {
      "is": "estimate from the compiled counts, not a timing: mfu_ceiling = model FLOPs / "
      "(max(flops / peak, bytes / bandwidth) x peak), mfu_floor the same with the sum (no "
      "overlap); causal convention",
      "flops": step_flops,
      "flops_from": "xla" if xla_flops >= model_flops else "model (XLA counted fewer)",
      "bytes": xla_bytes,
      "hbm_bytes_per_s": bw,
      **flops.roofline(step_flops, xla_bytes, peak * 1e12, bw, model_flops),
    },
    "memory": memory_report(compiled, device),
  }


def summary(r: dict) -> str:
  """One line: the measured MFU beside the roofline estimate's ceiling and floor."""
  f = r["roofline"]
  return (
    f"{r['device_kind']} attention={r['attention_runs']}: measured {r['tokens_per_s']:,.0f} "
    f"tokens/s, measured MFU {r['mfu']:.1%} causal ({r['mfu_full']:.1%} full); roofline "
    f"estimate from XLA's counts: ceiling {f['mfu_ceiling']:.1%} (perfect overlap), floor "
    f"{f['mfu_floor']:.1%} (no overlap), {f['bound']}-bound"
  )


def main(argv) -> dict:
  args = parse_args(argv)
  try:
    report = measure(args, argv)
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_user_error(e):
      raise
    errors.fail(e, verbose=False)
  print(json.dumps(report, indent=1))
  print(summary(report))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main(sys.argv[1:])
