r"""Where the CPU inner step's time goes: XLA op time by kind, from a profiler trace.

  python benchmarks/op_profile.py --preset llama_toy --out /tmp/ops.json
  python benchmarks/op_profile.py --preset llama_toy --set model.weight_grads=autodiff
  python benchmarks/op_profile.py --quick --out /tmp/q.json  # seconds

Builds the P-path inner step as benchmarks/throughput.py does (its presets and
--set, one fake CPU device per path), warms it up, traces --steps steps with
jax.profiler.trace and reads the trace back with jax.profiler.ProfileData. The
op events of XLA:CPU's worker threads are summed by op name and by kind (the
name without its numeric suffix: ynn_fusion = the XNNPACK/YNNPACK matmuls,
copy_bitcast_fusion = layout copies, ...), per step and device. The executor's
own spans (names with "::") are left out: they hold the ops. The top ops are
printed with the line of the compiled HLO that defines them.

Fractions are of the summed op time; wall time per step under the profiler is
printed too (tracing costs some: time steps with throughput.py).
"""
# pylint: disable=invalid-name

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np
from jax import profiler

from dipaco_jax import data as data_lib
from dipaco_jax.core import experiment
from dipaco_jax.core import sharding
from dipaco_jax.io import hugepages
from dipaco_jax.io import native

import throughput  # Beside us: the presets and the step loop.
from timing import write_json  # Beside us.


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--preset", default="llama_toy", choices=sorted(throughput.PRESETS), help="model shapes"
  )
  p.add_argument("--paths", type=int, default=4, help="P paths, one fake CPU device each")
  p.add_argument("--steps", type=int, default=5, help="steps traced (after 3 warm-up steps)")
  p.add_argument("--top", type=int, default=12, help="ops listed with their HLO")
  p.add_argument("--quick", action="store_true", help="throughput.py's seconds-long sizes")
  p.add_argument("--set", action="append", default=[], help="field=value (repeatable)")
  p.add_argument("--out", default="", help="JSON file to write")
  a = p.parse_args(argv)
  if a.paths < 1 or a.steps < 1 or a.top < 0:
    p.error("--paths and --steps must be >= 1, --top >= 0")
  if any("=" not in kv for kv in a.set):
    p.error(f"--set {a.set}: each is field=value, e.g. --set model.weight_grads=autodiff")
  return a


_SUFFIX = re.compile(r"\.\d+$")


def op_times(trace_dir: str) -> dict[str, float]:
  """Summed nanoseconds per op name over XLA:CPU's worker threads of a trace."""
  (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  totals: dict[str, float] = collections.Counter()
  for plane in profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      if "XLAEigen" not in line.name:  # XLA:CPU's intra-op pool: where the ops run.
        continue
      for event in line.events:
        if "::" not in event.name:
          totals[event.name] += event.duration_ns
  return dict(totals)


def by_kind(ops: dict[str, float]) -> dict[str, float]:
  kinds: dict[str, float] = collections.Counter()
  for name, ns in ops.items():
    kinds[_SUFFIX.sub("", name)] += ns
  return dict(kinds)


def main(args) -> dict:
  c = throughput.bench_config(
    32 if args.quick else int(throughput.PRESETS[args.preset]["d_model"].split(",")[0]),
    args.paths,
    args.quick,
    args.preset,
    args.set,
  )
  W, B, T = args.paths, c.data.batch_size, c.data.seq_len
  exp = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, W, devices=jax.devices()[:W]))
  batch_np = data_lib.synthetic_batch(np.random.default_rng(0), W, B, T, c.model.vocab_size)
  loop, _ = throughput.step_loops(exp, batch_np)
  a = exp.abstract_state
  hlo = (
    exp.inner_step.lower(a.params, a.inner_opt, throughput._abstract_batch(exp, W, B, T))  # pylint: disable=protected-access
    .compile()
    .as_text()
  )
  loop.run(3)
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    with profiler.trace(trace_dir):
      loop.run(args.steps)
    wall = (time.perf_counter() - start) / args.steps
    ops = op_times(trace_dir)
  if not ops:
    raise SystemExit("the trace holds no XLA:CPU op events: is this jax's CPU backend?")
  per = 1e6 * args.steps * W  # ns -> ms per step per device.
  total = sum(ops.values())
  kinds = sorted(by_kind(ops).items(), key=lambda kv: -kv[1])
  defs = {
    m.group(1): line.strip() for line in hlo.splitlines() if (m := re.match(r"\s*%(\S+) = ", line))
  }
  top = sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]
  print(f"{args.preset}, {W} paths on {W} devices; {wall * 1e3:.1f} ms a step under the profiler")
  print(f"{'op kind':32s} {'ms/step/device':>15s} {'of op time':>11s}")
  for name, ns in kinds:
    if ns / total >= 0.005:
      print(f"{name:32s} {ns / per:15.2f} {ns / total:11.3f}")
  print("top ops:")
  for name, ns in top:
    print(f"  {ns / per:8.2f} ms  {defs.get(name, name)[:160]}")
  return {
    "command": " ".join(["python", "benchmarks/op_profile.py", *sys.argv[1:]]),
    "jax": jax.__version__,
    "preset": args.preset,
    "set": args.set,
    "paths": W,
    "steps_traced": args.steps,
    "wall_ms_per_step_profiled": wall * 1e3,
    "op_ms_per_step_per_device": total / per,
    "kinds": {k: {"ms_per_step_per_device": ns / per, "fraction": ns / total} for k, ns in kinds},
    "top_ops": [
      {"name": n, "ms_per_step_per_device": ns / per, "hlo": defs.get(n, "")} for n, ns in top
    ],
  }


if __name__ == "__main__":
  ARGS = parse_args(sys.argv[1:])
  hugepages.maybe_reexec()  # As the CLIs and throughput.py run.
  native.choose_platforms()  # Before any backend starts: the CPU alone on a CPU host.
  jax.config.update("jax_num_cpu_devices", ARGS.paths)
  REPORT = main(ARGS)
  if ARGS.out:
    write_json(ARGS.out, REPORT)
