r"""How the trainer scales: inner step with paths, outer step with modules.

  python benchmarks/scale.py --out benchmarks/results/scale_cpu_2core.json
  python benchmarks/scale.py --quick --out /tmp/scale.json  # seconds

Model: configs/tiny.py (vocab 8192, d_model 128, 4 blocks, B=8, T=128) as
`throughput.bench_config` sets it up; --quick: vocab 512, d 32, 2 blocks,
B=2, T=32.

Paths (one row per P in --paths): a 1 x a x b grid with a*b = P paths
(levels "embed,head" | first half of the blocks | second half), on
N = min(P, --max_devices) fake CPU devices; the mesh's 'path' axis is the
trainer's default, gcd(P, N). Each row runs in its own child process (its
own device count, and its own peak RSS). Per row:
* step_s: median wall time of --steps calls of the Experiment's jitted
  inner step (`exp.inner_step`, compiled ahead of time from the same
  arguments), each blocked on, after one untimed warm-up call.
* peak_bytes_per_device: XLA's memory_analysis() of that compiled sharded
  program, which describes ONE device's partition: argument + output + temp
  - alias bytes (alias: outputs written into donated argument buffers, here
  params and AdamW state). It excludes generated code and anything outside
  the step (the store, outer momentum, other processes' buffers).
* params_bytes_per_device / inner_opt_bytes_per_device: one device's shard.
* rss_peak_bytes: the child process's peak resident set (getrusage) - the
  whole host process: every fake device, the store, XLA's compiler, Python.

Modules (one row per K in --modules): the outer step (`exp.outer_step`) on
a 1 x K x K grid with the number of WORKERS held fixed (--outer_workers W,
on min(W, --max_devices) fake devices): min(W, K*K) distinct paths chosen so every
module is on some path, each with W / #paths replicas; same model, so the
per-path work of assembling W worker params is fixed and what grows is the
store (K modules in levels 1 and 2). outer_step_s: median of --outer_calls
blocked calls after one warm-up. A store group sits on the 'path' axis
when W divides K, else it is replicated on every device.

Host CPUs: pinned to --cpus cores (default 1, as throughput.py) because the
2-core host is shared; every fake device shares them. *_cpu_s: the median
process CPU seconds (all threads, user + system) per call; with one pinned
core, wall well above CPU means other work (or page faults) took the core.
Load averages count this benchmark's own threads too (one+ per fake device).
"""
# pylint: disable=invalid-name

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import jax
import numpy as np

from dipaco_jax import data as data_lib
from dipaco_jax.core import experiment
from dipaco_jax.core import sharding

from throughput import bench_config, module_bytes, pin_cpus  # Beside us.
from timing import Loop, write_json  # Beside us.

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--paths", default=None, help="comma list of P (default 1,4,16,64; quick: 1,4)")
  p.add_argument(
    "--modules",
    default=None,
    help="comma list of K for the outer rows (default 1,2,4,8,16; quick: 1,2,4)",
  )
  p.add_argument(
    "--outer_workers",
    type=int,
    default=None,
    help="W workers of the outer rows (default 16; quick: 4)",
  )
  p.add_argument(
    "--max_devices", type=int, default=None, help="fake CPU devices at most (default 16; quick: 2)"
  )
  p.add_argument("--steps", type=int, default=3, help="timed inner steps")
  p.add_argument("--outer_calls", type=int, default=5, help="timed outer steps per K")
  p.add_argument("--cpus", type=int, default=1, help="pin to this many host CPUs (0: no pinning)")
  p.add_argument(
    "--quick", action="store_true", help="seconds-long setting (vocab 512, d 32, T=32, B=2)"
  )
  p.add_argument(
    "--out", default="benchmarks/results/scale_cpu_2core.json", help="JSON file to write"
  )
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  a.paths = _ints(a.paths or ("1,4" if a.quick else "1,4,16,64"))
  a.modules = _ints(a.modules or ("1,2,4" if a.quick else "1,2,4,8,16"))
  a.outer_workers = a.outer_workers or (4 if a.quick else 16)
  a.max_devices = a.max_devices or (2 if a.quick else 16)
  a.d_model = 32 if a.quick else 128
  if (
    min(a.paths + a.modules) < 1
    or a.max_devices < 1
    or a.steps < 1
    or a.outer_calls < 1
    or a.cpus < 0
  ):
    p.error(
      "--paths, --modules, --max_devices, --steps, --outer_calls must be >= 1 and --cpus >= 0"
    )
  return a


def _shard_bytes(tree) -> int:
  """Bytes of one device's shard of every leaf (even-sized shards)."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
  )


def _memory(compiled) -> dict[str, int]:
  """XLA's per-device byte counts of a compiled (partitioned) program."""
  m = compiled.memory_analysis()
  out = {
    k: int(getattr(m, f"{k}_size_in_bytes"))
    for k in ("argument", "output", "temp", "alias", "generated_code")
  }
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def _timed(loop: Loop, calls: int) -> tuple[float, list[float], float]:
  """Wall s (median, each) of single blocked calls after a warm-up; median CPU s."""
  loop.run(1)
  secs, cpu = [], []
  for _ in range(calls):
    secs.append(loop.run(1))
    cpu.append(loop.cpu_s)
  return statistics.median(secs), secs, statistics.median(cpu)


def paths_row(P: int, args) -> dict:
  """Inner step of a P-path grid on this process's devices."""
  c = bench_config(args.d_model, P, args.quick)
  devices = jax.devices()
  exp = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, P, devices=devices))
  st = exp.init_state(0)
  batch = exp.put_batch(
    data_lib.synthetic_batch(np.random.default_rng(0), *exp.batch_shape, c.model.vocab_size)
  )
  t0 = time.perf_counter()
  compiled = exp.inner_step.lower(st.params, st.inner_opt, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = _memory(compiled)
  params_b, opt_b = _shard_bytes(st.params), _shard_bytes(st.inner_opt)
  batch_b = _shard_bytes(batch)
  if mem["argument"] != params_b + opt_b + batch_b:
    raise RuntimeError(  # memory_analysis would not be per device.
      f"XLA argument bytes {mem['argument']} != one device's shards "
      f"{params_b + opt_b + batch_b}: memory numbers are not per device."
    )
  loop = Loop(
    lambda s: compiled(s[0], s[1], batch)[:2], (st.params, st.inner_opt), batch["inputs"].size
  )
  step_s, secs, cpu_s = _timed(loop, args.steps)
  return {
    "paths": P,
    "grid": list(c.dipaco.modules_per_level),
    "devices": len(devices),
    "mesh": dict(exp.mesh.shape),
    "paths_per_device": P // exp.mesh.shape["path"],
    "step_s": step_s,
    "step_s_each": secs,
    "step_cpu_s": cpu_s,
    "tokens_per_s": loop.tokens / step_s,
    "compile_s": compile_s,
    "peak_bytes_per_device": mem["peak"],
    "memory_analysis": mem,
    "params_bytes_per_device": params_b,
    "inner_opt_bytes_per_device": opt_b,
    "batch_bytes_per_device": batch_b,
    "path_bytes": module_bytes(exp)["path"],
    "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }


def modules_config(K: int, W: int, args):
  """A 1 x K x K grid with W workers: every module on a path, equal replicas."""
  if K > W:
    raise ValueError(
      f"--modules {K} > --outer_workers {W}: some modules "
      "would have no path; raise --outer_workers."
    )
  n = min(W, K * K)
  if W % n:
    raise ValueError(
      f"--outer_workers {W} is not a multiple of the {n} paths "
      f"of K={K}: use a W divisible by min(W, K*K)."
    )
  c = bench_config(args.d_model, W, args.quick)
  c.dipaco.modules_per_level = (1, K, K)
  # Path i = (0, r, (r + q) mod K) for i = q K + r: distinct, covers all K.
  c.dipaco.paths = tuple(f"0-{i % K}-{(i % K + i // K) % K}" for i in range(n))
  c.dipaco.replicas = W // n
  return c


def modules_rows(args) -> list[dict]:
  """Outer step per K, W workers on this process's devices."""
  rows = []
  W = args.outer_workers
  for K in args.modules:
    c = modules_config(K, W, args)
    exp = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, W, devices=jax.devices()))
    st = exp.init_state(0)
    alpha_W = exp.recipe.alpha(np.ones(W))
    t0 = time.perf_counter()
    compiled = exp.outer_step.lower(st.store, st.outer_opt, st.params, alpha_W).compile()
    compile_s = time.perf_counter() - t0
    loop = Loop(
      lambda s, f=compiled, a=alpha_W: f(*s, a)[:3], (st.store, st.outer_opt, st.params), 0
    )
    outer_s, secs, cpu_s = _timed(loop, args.outer_calls)
    rows.append(
      {
        "modules": K,
        "grid": list(c.dipaco.modules_per_level),
        "store_modules": sum(c.dipaco.modules_per_level),
        "workers": W,
        "distinct_paths": exp.topo.num_paths,
        "replicas": exp.topo.replicas,
        "devices": len(jax.devices()),
        "mesh": dict(exp.mesh.shape),
        "store_bytes": module_bytes(exp)["store"],
        "store_bytes_per_device": _shard_bytes(st.store),
        "outer_step_s": outer_s,
        "outer_step_s_each": secs,
        "outer_step_cpu_s": cpu_s,
        "compile_s": compile_s,
        "peak_bytes_per_device": _memory(compiled)["peak"],
      }
    )
  return rows


def run_child(what: str, devices: int, args) -> dict | list:
  """Runs one measurement in a fresh process with `devices` fake devices."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags + [f"{DEVICE_FLAG}={devices}"]))
  out = f"{args.out}.{what}.tmp"
  load = os.getloadavg()
  argv = [
    "--paths",
    ",".join(map(str, args.paths)),
    "--modules",
    ",".join(map(str, args.modules)),
    "--outer_workers",
    str(args.outer_workers),
    "--max_devices",
    str(args.max_devices),
    "--steps",
    str(args.steps),
    "--outer_calls",
    str(args.outer_calls),
    "--cpus",
    "0",
    *(["--quick"] if args.quick else []),
    "--child",
    what,
    "--out",
    out,
  ]
  proc = subprocess.run(  # The affinity of this process is inherited.
    [sys.executable, os.path.abspath(__file__), *argv],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if proc.returncode:
    raise RuntimeError(f"child '{what}' exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  with open(out) as f:
    result = json.load(f)
  os.remove(out)
  if isinstance(result, dict):
    result["loadavg_before"] = load
  return result


def child_main(args) -> None:
  if jax.default_backend() != "cpu":
    raise RuntimeError(
      "scale.py measures fake CPU devices; run it on a CPU host (JAX_PLATFORMS=cpu)."
    )
  if args.child == "modules":
    result = modules_rows(args)
  else:
    result = paths_row(int(args.child.split("=")[1]), args)
  with open(args.out, "w") as f:
    json.dump(result, f, default=float)


def table(report: dict) -> str:
  mib = 2**20
  lines = [
    "paths  grid      dev  mesh(p,d,m)  paths/dev  step_s  cpu_s  "
    "tokens/s  peak/dev MiB  params/dev MiB  RSS MiB"
  ]
  for r in report["paths_rows"]:
    m = r["mesh"]
    lines.append(
      f"{r['paths']:5d}  {'x'.join(map(str, r['grid'])):8s}"
      f"{r['devices']:4d}  {m['path']:3d},{m['data']},{m['model']}"
      f"{r['paths_per_device']:12d}{r['step_s']:8.3f}{r['step_cpu_s']:7.3f}"
      f"{r['tokens_per_s']:10,.0f}{r['peak_bytes_per_device'] / mib:14.1f}"
      f"{r['params_bytes_per_device'] / mib:16.1f}"
      f"{r['rss_peak_bytes'] / mib:9.0f}"
    )
  lines.append("")
  lines.append("K  grid      workers  paths  store MiB  store/dev MiB  outer_step_s  cpu_s")
  for r in report["modules_rows"]:
    lines.append(
      f"{r['modules']:2d} {'x'.join(map(str, r['grid'])):9s}"
      f"{r['workers']:8d}{r['distinct_paths']:7d}"
      f"{r['store_bytes'] / mib:11.1f}{r['store_bytes_per_device'] / mib:15.1f}"
      f"{r['outer_step_s']:14.4f}{r['outer_step_cpu_s']:7.3f}"
    )
  return "\n".join(lines)


def main(args) -> dict:
  if args.cpus:
    pin_cpus(args.cpus)  # Children inherit the affinity.
  load_start = os.getloadavg()
  paths_rows = []
  for P in args.paths:
    paths_rows.append(run_child(f"paths={P}", min(P, args.max_devices), args))
    print(f"P={P}: {paths_rows[-1]['step_s']:.3f} s/step", flush=True)
  modules = run_child("modules", min(args.outer_workers, args.max_devices), args)
  report = {
    "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]),
    "jax": jax.__version__,
    "host_cpus": os.cpu_count(),
    "pinned_cpus": sorted(os.sched_getaffinity(0)) if args.cpus else None,
    "loadavg_start": load_start,
    "loadavg_end": os.getloadavg(),
    "quick": args.quick,
    "d_model": args.d_model,
    "steps": args.steps,
    "outer_calls": args.outer_calls,
    "max_devices": args.max_devices,
    "memory_definition": (
      "peak_bytes_per_device = argument + output + temp - alias bytes of "
      "XLA's memory_analysis() of the compiled sharded step (one device's "
      "partition; alias = outputs written into donated inputs); excludes "
      "generated code and buffers outside the step. rss_peak_bytes: "
      "getrusage ru_maxrss of the whole child process (all fake devices)."
    ),
    "timing": (
      "median wall seconds of single calls, each blocked on, "
      "after one warm-up call; one child process per paths row"
    ),
    "modules_fixed": (
      f"{args.outer_workers} workers on as many devices "
      "(capped by --max_devices) and the model; grid 1xKxK "
      "with min(W, K*K) paths"
    ),
    "paths_rows": paths_rows,
    "modules_rows": modules,
  }
  print(
    f"jax {jax.__version__}, {os.cpu_count()} host CPUs, pinned "
    f"{report['pinned_cpus'] or 'none'}, load {load_start}"
  )
  print(table(report))
  write_json(args.out, report)
  return report


if __name__ == "__main__":
  ARGS = parse_args(sys.argv[1:])
  if ARGS.child:
    child_main(ARGS)
  else:
    main(ARGS)
