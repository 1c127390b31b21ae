r"""Inner-step throughput against a plain one-model loop; outer cost; bytes.

  python benchmarks/throughput.py --out /tmp/throughput.json
  python benchmarks/throughput.py --quick --out /tmp/q.json  # seconds

Per d_model, on configs/tiny.py (4 blocks, vocab 8192, B=8, T=128; head_dim =
d_model / num_heads) with a 1 x a x b grid of P = a*b paths:

* dipaco_vs_plain_tokens_ratio: tokens/s of the Experiment's P-path inner
  step over a plain jitted Flax/optax step of ONE path model (same
  ModelConfig, same `inner.optimizer`, same B x T batch), per unit of
  hardware. The P-path step runs in the trainer's layout, one path per
  device on P devices. On a CPU host those are fake devices sharing the
  same (pinned) cores as the plain loop: the same hardware, compared as is;
  on accelerators they are P devices against one, so tokens/s are divided
  by P. `..._one_device` puts all P paths (vmapped) on the plain loop's one
  device instead; `cpu_time_ratio*` compare tokens per CPU-second.
* inner_flops_fraction_of_gemm_peak: model FLOP/s of the P-path step on one
  device over the FLOP/s of a large fp32 matmul there (2 n^3 / t), with
  model FLOPs per token = 6 N + 12 L T H K (N: matmul parameters, i.e. the
  blocks' q/k/v/out and MLP plus the unembedding; attention scores over the
  full T x T, no causal saving; embedding lookup and norms not counted).
* outer_step_fraction_of_inner_phase: one outer step over H inner steps, both
  on the trainer's P-device layout.
* cross_path_bytes_{inner,outer}_step: bytes per device of the collectives
  in the compiled HLO whose groups span the 'path' axis (dipaco_jax.hlo).
* module_bytes: one module of each level, one path, and the whole store.

Host CPUs: by default the process is pinned to ONE core (--cpus 1, the same
core for every loop). On a 2-core host shared with other work, unpinned runs
gave per-repetition ratios from 0.45 to 1.8 (other processes preempt one of
XLA's worker threads and the other waits at every parallel op); pinned, they
agree within a few percent. --cpus 0 uses every core.

Presets: `tiny` (default) is configs/tiny.py at each --d_model. `llama_toy`
is the Llama-shaped toy path of the CPU-speed work (docs/performance.md):
d_model 128, 4 heads, 4 blocks, SwiGLU of width 512 (the FLOPs of a GELU MLP
of 768), vocab 8192 untied, T=128, B=8 per path, H=50, 4 paths: 13.37 MFLOP
per token by the formula below.

--cpus takes a comma list (e.g. 1,2): each count runs in its own child
process (a thread pool is sized and pinned when JAX starts), with its own
GEMM peak on the same cores; the report gathers them under `by_cpus`.
--layouts lists the device counts the P-path step is timed on (fake CPU
devices; each divides P): `dipaco_<n>dev`, P devices also as `dipaco`.

Repetitions are interleaved (A, B, C, C, B, A, ...): a ratio is the median
over repetitions of the paired ratio of back-to-back runs, other numbers are
medians; each segment gives every step loop the same number of tokens.
"""
# pylint: disable=invalid-name,g-import-not-at-top,wrong-import-position

import argparse
import json
import os
import sys


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--d_model", default=None, help="comma list of widths (default 128,256; quick: 32)"
  )
  p.add_argument("--paths", type=int, default=4, help="P paths (workers)")
  p.add_argument(
    "--steps", type=int, default=None, help="P-path steps per repetition (default 2; quick: 1)"
  )
  p.add_argument(
    "--reps", type=int, default=None, help="interleaved repetitions (default 9; quick: 2)"
  )
  p.add_argument(
    "--cpus",
    default="1",
    help="pin to this many host CPUs (0: no pinning); a comma list runs one child per count",
  )
  p.add_argument(
    "--hugepages",
    default="on",
    choices=("on", "off"),
    help="huge-page malloc as the CLIs run (dipaco_jax/io/hugepages.py), or glibc's default",
  )
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shapes")
  p.add_argument(
    "--layouts", default="", help="device counts for the P-path step (default: P,1; e.g. 4,2,1)"
  )
  p.add_argument("--out", default="", help="JSON file to write")
  p.add_argument("--quick", action="store_true", help="seconds-long setting (vocab 512, T=32, B=2)")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    help="field=value on top of the preset, e.g. model.loss_chunk=128 (repeatable)",
  )
  a = p.parse_args(argv)
  if any("=" not in kv for kv in a.set):
    p.error(f"--set {a.set}: each is field=value, e.g. --set model.loss_chunk=128")
  widths = a.d_model or ("32" if a.quick else PRESETS[a.preset]["d_model"])
  a.d_model = [int(x) for x in widths.split(",")]
  a.steps = a.steps or (1 if a.quick else 2)
  a.reps = a.reps or (2 if a.quick else 9)
  try:
    a.cpu_list = [int(x) for x in a.cpus.split(",")]
    a.layouts = sorted({int(x) for x in (a.layouts or f"{a.paths},1").split(",")} | {1, a.paths})
  except ValueError:
    p.error(f"--cpus {a.cpus!r} / --layouts {a.layouts!r}: comma lists of integers, e.g. 1,2")
  a.cpus = a.cpu_list[0]
  if a.paths < 1 or a.steps < 1 or a.reps < 1 or min(a.cpu_list) < 0:
    p.error("--paths, --steps and --reps must be >= 1, --cpus >= 0")
  if any(n < 1 or a.paths % n for n in a.layouts):
    p.error(f"--layouts {a.layouts}: each device count must divide --paths {a.paths}")
  return a


# Shapes on top of configs/tiny.py; d_model: the default --d_model list.
PRESETS = {
  "tiny": {"d_model": "128,256", "model": {}},
  "llama_toy": {
    "d_model": "128",
    "model": {"mlp": "swiglu", "mlp_ratio": 4.0, "tie_embeddings": False},
  },
}


def _fake_cpu_devices(n: int) -> None:
  """At least n host devices; must run before jax is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count={n}").strip()


def pin_cpus(n: int) -> None:
  """Runs every thread XLA will start on the last n CPUs we may use."""
  if n == 0:
    return
  if not hasattr(os, "sched_setaffinity"):
    raise ValueError("--cpus needs Linux CPU affinity: pass --cpus 0.")
  cpus = sorted(os.sched_getaffinity(0))
  if n > len(cpus):
    raise ValueError(f"--cpus {n} but this process may use {len(cpus)} CPUs.")
  os.sched_setaffinity(0, cpus[-n:])


if __name__ == "__main__":
  ARGS = parse_args(sys.argv[1:])
  from dipaco_jax.io import hugepages

  if ARGS.hugepages == "on":
    hugepages.maybe_reexec()
  elif hugepages.TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
    sys.exit(f"--hugepages=off but GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}: unset it.")
  if len(ARGS.cpu_list) == 1:
    _fake_cpu_devices(ARGS.paths)
    pin_cpus(ARGS.cpus)

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax import config_check
from dipaco_jax import data as data_lib
from dipaco_jax import hlo
from dipaco_jax.core import experiment
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import sharding

from timing import (
  Loop,
  field_overrides,
  gemm_loop,
  interleave,
  paired_ratio,
  write_json,
)  # Beside us.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_config(d_model: int, paths: int, quick: bool, preset: str = "tiny", sets=()):
  """configs/tiny.py at width d_model, a 1 x a x b grid of P paths.

  With the preset's shapes, and `sets` ("field=value", --set) over both.
  """
  over = field_overrides(sets)
  c = config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)
  for k, v in PRESETS[preset]["model"].items():
    if f"model.{k}" not in over:
      c.model[k] = v
  if d_model % c.model.num_heads:
    raise ValueError(f"--d_model {d_model} is not a multiple of num_heads={c.model.num_heads}.")
  c.model.d_model = d_model
  c.model.head_dim = d_model // c.model.num_heads
  a = max(k for k in range(1, math.isqrt(paths) + 1) if paths % k == 0)
  c.dipaco.modules_per_level = (1, a, paths // a)
  if quick:  # Two blocks, small vocab and batch: compiles in seconds.
    c.model.vocab_size, c.data.seq_len, c.data.batch_size = 512, 32, 2
    c.model.num_layers = 2
    c.dipaco.level_groups = ("embed,head", "block_0", "block_1")
  return c


def flops_per_token(cfg: model_lib.ModelConfig, seq_len: int) -> tuple[int, int]:
  """(6 N + 12 L T H K, N): training FLOPs per token and matmul params."""
  hk = cfg.num_heads * cfg.head_dim
  n = cfg.num_layers * (4 * cfg.d_model * hk + cfg.mlp_params) + cfg.vocab_size * cfg.d_model
  return 6 * n + 12 * cfg.num_layers * seq_len * hk, n


def module_bytes(exp: experiment.Experiment) -> dict[str, int]:
  """Bytes of one module per level (and 'private' copy), one path, the store."""
  out: dict[str, int] = {}
  store = 0
  for s in exp.topo.store_groups():
    b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(exp.abstract_state.store[s.name]))
    store += b
    out[s.level] = out.get(s.level, 0) + b // s.num_modules
  out["path"] = sum(out.values())
  out["store"] = store
  return out


def step_loops(exp, batch_np) -> tuple[Loop, Loop]:
  """The Experiment's inner and outer steps, from one initial state."""
  st = exp.init_state(0)
  batch = exp.put_batch(batch_np)
  alpha_W = exp.recipe.alpha(np.ones(exp.topo.num_workers))

  def inner(s):
    return exp.inner_step(s[0], s[1], batch)[:2]

  def outer(s):
    return exp.outer_step(*s, alpha_W)[:3]

  # Both steps donate their inputs: the outer loop gets its own params.
  outer_params = jax.tree.map(jnp.copy, st.params)
  return (
    Loop(inner, (st.params, st.inner_opt), batch_np["inputs"].size),
    Loop(outer, (st.store, st.outer_opt, outer_params), 0),
  )


def plain_loop(exp, batch_np, device) -> Loop:
  """The textbook loop on one path model, written independently of inner.py."""
  model, tx = exp.model, exp.recipe.inner_tx

  def train_step(params, opt_state, batch):
    def loss_fn(p):
      logits = model.apply({"params": p}, batch["inputs"], batch["segment_ids"], batch["positions"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  jitted = jax.jit(train_step, donate_argnums=(0, 1))
  params = jax.device_put(model_lib.init_params(exp.model_cfg, jax.random.key(0)), device)
  opt_state = jax.device_put(tx.init(params), device)
  batch = jax.device_put({k: v[0] for k, v in batch_np.items()}, device)

  def step(s):
    return jitted(s[0], s[1], batch)[:2]

  B, T = batch_np["inputs"].shape[1:]
  return Loop(step, (params, opt_state), B * T)


def _abstract_batch(exp, W: int, B: int, T: int) -> dict:
  return {
    k: jax.ShapeDtypeStruct(
      (W, B, T), jnp.float32 if k == "weights" else jnp.int32, sharding=exp.batch_sharding
    )
    for k in ("inputs", "targets", "segment_ids", "positions", "weights")
  }


def cross_path_bytes(exp, W: int, B: int, T: int) -> dict[str, int]:
  """Bytes and count of collectives in the compiled inner and outer steps."""
  a = exp.abstract_state
  alpha = jax.ShapeDtypeStruct((W,), jnp.float32, sharding=NamedSharding(exp.mesh, P()))
  out = {}
  for name, lowered in (
    ("inner", exp.inner_step.lower(a.params, a.inner_opt, _abstract_batch(exp, W, B, T))),
    ("outer", exp.outer_step.lower(a.store, a.outer_opt, a.params, alpha)),
  ):
    text = lowered.compile().as_text()
    out[f"cross_path_bytes_{name}_step"] = hlo.cross_axis_bytes(text, exp.mesh, "path")
    out[f"collectives_{name}_step"] = len(hlo.collectives(text))
  return out


def xla_flops(exp, W: int, B: int, T: int) -> float:
  """XLA's own FLOP count of one inner step (a cross-check of the formula)."""
  a = exp.abstract_state
  cost = (
    exp.inner_step.lower(a.params, a.inner_opt, _abstract_batch(exp, W, B, T))
    .compile()
    .cost_analysis()
  )
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float((cost or {}).get("flops", float("nan")))


def measure(d_model: int, args) -> dict:
  """Every number of one width; loops interleaved repetition by repetition."""
  c = bench_config(d_model, args.paths, args.quick, args.preset, args.set)
  devices = jax.devices()
  W, B, T = args.paths, c.data.batch_size, c.data.seq_len
  exp1 = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, W, devices=devices[:1]))
  # The trainer's layout, one path per device, needs P devices. Fake CPU
  # devices share the host's (pinned) cores: the same hardware as the plain
  # loop. Real accelerators are P times the hardware: compare per device.
  # With fewer than P real ones, fake CPU devices give the HLO only.
  timed = len(devices) >= W
  hardware = 1 if jax.default_backend() == "cpu" else W
  hlo_devices = devices if timed else jax.devices("cpu")
  if len(hlo_devices) < W:
    raise ValueError(
      f"{len(hlo_devices)} devices for --paths {W}: set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={W}."
    )
  expP = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, W, devices=hlo_devices[:W]))
  batch_np = data_lib.synthetic_batch(np.random.default_rng(0), W, B, T, c.model.vocab_size)
  # name: (loop, calls per repetition); equal tokens for the step loops.
  inner1, outer1 = step_loops(exp1, batch_np)
  loops = {
    "dipaco_1dev": (inner1, args.steps),
    "plain": (plain_loop(exp1, batch_np, devices[0]), args.steps * W),
    "outer_1dev": (outer1, 2),
  }
  if timed:
    innerP, outerP = step_loops(expP, batch_np)
    loops["dipaco"] = (innerP, args.steps)
    loops["outer"] = (outerP, 2)
    for n in args.layouts:  # The P-path step on n devices (P/n paths vmapped on each).
      if 1 < n < W:
        expN = experiment.Experiment(c, mesh=sharding.make_mesh(c.mesh, W, devices=devices[:n]))
        loops[f"dipaco_{n}dev"] = (step_loops(expN, batch_np)[0], args.steps)
  n = 256 if args.quick else 2048
  peak_gemm, peak_flops = gemm_loop(n, n, n, devices[0])
  loops["gemm_peak"] = (peak_gemm, 2 if args.quick else 3)
  shape_gemm, shape_flops = gemm_loop(B * T, d_model, exp1.model_cfg.mlp_dim, devices[0])
  loops["gemm_model_shape"] = (shape_gemm, 20)
  first_call_s = {k: loop.run(2) for k, (loop, _) in loops.items()}
  layouts = {n: ("dipaco" if n == W else f"dipaco_{n}dev") for n in args.layouts}
  compared = ["plain", *(v for v in layouts.values() if v in loops)]
  system_s: dict = {}
  secs, cpu = interleave(loops, args.reps, compared, system_s)
  med = {k: statistics.median(v) for k, v in secs.items()}
  tok_s = {k: loops[k][0].tokens / med[k] for k in loops if loops[k][0].tokens}
  ratio, ratio_reps, ratio_best = paired_ratio(loops, secs, "dipaco", hardware)
  ratio1, ratio1_reps, ratio1_best = paired_ratio(loops, secs, "dipaco_1dev")
  fpt, n_params = flops_per_token(exp1.model_cfg, T)
  peak = peak_flops / med["gemm_peak"]
  H = c.dipaco.inner_steps
  # Per layout of the P-path step: model FLOP/s, its fraction of the GEMM peak
  # (same run, same cores) and CPU seconds per step, user and system apart.
  by_layout = {}
  for n, k in layouts.items():
    if k in loops:
      sys_s = statistics.median(system_s[k])
      by_layout[str(n)] = {
        "loop": k,
        "tokens_per_s": tok_s[k],
        "model_flops_per_s": fpt * tok_s[k],
        "fraction_of_gemm_peak": fpt * tok_s[k] / peak,
        "user_cpu_s_per_step": statistics.median(cpu[k]) - sys_s,
        "system_cpu_s_per_step": sys_s,
      }
  best = max(by_layout, key=lambda n: by_layout[n]["tokens_per_s"])
  return {
    "d_model": d_model,
    "preset": args.preset,
    "by_layout": by_layout,
    "best_layout_devices": int(best),
    "best_fraction_of_gemm_peak": by_layout[best]["fraction_of_gemm_peak"],
    "dipaco_vs_plain_tokens_ratio": ratio,
    "dipaco_vs_plain_tokens_ratio_one_device": ratio1,
    "ratio_per_repetition": ratio_reps,
    "ratio_per_repetition_one_device": ratio1_reps,
    "ratio_of_best_times": ratio_best,
    "ratio_of_best_times_one_device": ratio1_best,
    # Tokens per CPU-second (all threads): the work per token, which other
    # users of a shared host disturb far less than wall time.
    "cpu_time_ratio": paired_ratio(loops, cpu, "dipaco", hardware)[0],
    "cpu_time_ratio_one_device": paired_ratio(loops, cpu, "dipaco_1dev")[0],
    "hardware_factor": hardware,
    "inner_flops_fraction_of_gemm_peak": fpt * tok_s["dipaco_1dev"] / peak,
    "plain_flops_fraction_of_gemm_peak": fpt * tok_s["plain"] / peak,
    "outer_step_fraction_of_inner_phase": (med["outer"] / (H * med["dipaco"]) if timed else None),
    "outer_step_fraction_of_inner_phase_one_device": (med["outer_1dev"] / (H * med["dipaco_1dev"])),
    "H": H,
    **cross_path_bytes(expP, W, B, T),
    "module_bytes": module_bytes(exp1),
    "tokens_per_s": tok_s,
    "seconds_per_call": med,
    "seconds_per_call_per_repetition": secs,
    "cpu_seconds_per_call_per_repetition": cpu,
    "first_two_calls_s": first_call_s,
    "model_flops_per_token": fpt,
    "matmul_params": n_params,
    "params_per_path": sum(x.size for x in jax.tree.leaves(exp1.abstract_state.params)) // W,
    "xla_flops_per_token": xla_flops(exp1, W, B, T) / (W * B * T),
    "gemm_peak_flops_per_s": peak,
    "gemm_peak_n": n,
    "gemm_model_shape": [B * T, d_model, exp1.model_cfg.mlp_dim],
    "gemm_model_shape_fraction_of_peak": shape_flops / med["gemm_model_shape"] / peak,
    "grid": list(c.dipaco.modules_per_level),
  }


ROWS = [  # (label, key path, format[, scale])
  ("best layout: devices for P paths", ("best_layout_devices",), "{}"),
  ("best layout: model FLOP/s / GEMM peak", ("best_fraction_of_gemm_peak",), "{:.3f}"),
  ("tokens/s P-path step, P devices", ("tokens_per_s", "dipaco"), "{:,.0f}"),
  ("tokens/s P-path step, 1 device", ("tokens_per_s", "dipaco_1dev"), "{:,.0f}"),
  ("tokens/s plain loop, 1 device", ("tokens_per_s", "plain"), "{:,.0f}"),
  ("dipaco_vs_plain_tokens_ratio", ("dipaco_vs_plain_tokens_ratio",), "{:.3f}"),
  ("  same, all paths on 1 device", ("dipaco_vs_plain_tokens_ratio_one_device",), "{:.3f}"),
  ("  per CPU-second, P devices", ("cpu_time_ratio",), "{:.3f}"),
  ("  per CPU-second, 1 device", ("cpu_time_ratio_one_device",), "{:.3f}"),
  ("GEMM peak GFLOP/s (fp32 n^3)", ("gemm_peak_flops_per_s",), "{:.1f}", 1e-9),
  ("model MFLOP/token (6N+12LTHK)", ("model_flops_per_token",), "{:.2f}", 1e-6),
  ("inner_flops_fraction_of_gemm_peak", ("inner_flops_fraction_of_gemm_peak",), "{:.3f}"),
  ("  plain loop fraction", ("plain_flops_fraction_of_gemm_peak",), "{:.3f}"),
  ("  [BT,d]x[d,4d] GEMM / peak GEMM", ("gemm_model_shape_fraction_of_peak",), "{:.3f}"),
  ("outer step s, P devices", ("seconds_per_call", "outer"), "{:.4f}"),
  ("outer_step_fraction_of_inner_phase", ("outer_step_fraction_of_inner_phase",), "{:.4f}"),
  ("cross_path_bytes_inner_step", ("cross_path_bytes_inner_step",), "{:,}"),
  ("cross_path_bytes_outer_step", ("cross_path_bytes_outer_step",), "{:,}"),
  ("module bytes: level_0", ("module_bytes", "level_0"), "{:,}"),
  ("module bytes: level_1", ("module_bytes", "level_1"), "{:,}"),
  ("module bytes: level_2", ("module_bytes", "level_2"), "{:,}"),
  ("module bytes: store", ("module_bytes", "store"), "{:,}"),
]


def table(results: list[dict]) -> str:
  """Metrics as rows, one column per d_model."""

  def cell(r, key, fmt, scale=1):
    v = r
    for k in key:
      v = v.get(k) if isinstance(v, dict) else None
    return "-" if v is None else fmt.format(v * scale)

  rows = list(ROWS)
  for n in results[0]["by_layout"]:
    at = ("by_layout", n)
    rows += [
      (f"P paths on {n} device(s): tokens/s", (*at, "tokens_per_s"), "{:,.0f}"),
      ("  model GFLOP/s", (*at, "model_flops_per_s"), "{:.1f}", 1e-9),
      ("  fraction of GEMM peak", (*at, "fraction_of_gemm_peak"), "{:.3f}"),
      ("  user CPU s per step", (*at, "user_cpu_s_per_step"), "{:.3f}"),
      ("  system CPU s per step", (*at, "system_cpu_s_per_step"), "{:.3f}"),
    ]
  lines = [f"{'d_model':38s}" + "".join(f"{r['d_model']:>14d}" for r in results)]
  for label, *spec in rows:
    lines.append(f"{label:38s}" + "".join(f"{cell(r, *spec):>14s}" for r in results))
  return "\n".join(lines)


def main_per_cpu_count(args, argv: list[str]) -> dict:
  """One child process per --cpus count; gathers their reports and the 2-core scaling."""
  import subprocess
  import tempfile

  by_cpus = {}
  with tempfile.TemporaryDirectory() as tmp:
    for n in args.cpu_list:
      out = os.path.join(tmp, f"cpus_{n}.json")
      child = [
        f"--d_model={','.join(map(str, args.d_model))}",
        f"--paths={args.paths}",
        f"--steps={args.steps}",
        f"--reps={args.reps}",
        f"--preset={args.preset}",
        f"--hugepages={args.hugepages}",
        f"--layouts={','.join(map(str, args.layouts))}",
        *(["--quick"] if args.quick else []),
        *(f"--set={kv}" for kv in args.set),
      ]
      subprocess.run(
        [sys.executable, os.path.abspath(__file__), *child, f"--cpus={n}", f"--out={out}"],
        check=True,
      )
      with open(out) as f:
        by_cpus[str(n)] = json.load(f)
  report = {"command": "python benchmarks/throughput.py " + " ".join(argv), "by_cpus": by_cpus}
  if len(by_cpus) > 1:  # Tokens/s of the best layout, each count over the first.
    first, *rest = by_cpus
    best = lambda n, i: max(
      v["tokens_per_s"] for v in by_cpus[n]["results"][i]["by_layout"].values()
    )
    report["scaling"] = {
      f"{n}_over_{first}_cpus": [best(n, i) / best(first, i) for i in range(len(args.d_model))]
      for n in rest
    }
    print("tokens/s scaling of the best layout:", report["scaling"])
  if args.out:
    write_json(args.out, report)
  return report


def main(args) -> dict:
  load_start = os.getloadavg()
  results = [measure(d, args) for d in args.d_model]
  report = {
    "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "num_devices": len(jax.devices()),
    "host_cpus": os.cpu_count(),
    "pinned_cpus": sorted(os.sched_getaffinity(0)) if args.cpus else None,
    "preset": args.preset,
    "set": args.set,
    "layouts": args.layouts,
    "hugepages": args.hugepages,
    "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    "loadavg_start": load_start,
    "loadavg_end": os.getloadavg(),
    "paths": args.paths,
    "steps": args.steps,
    "reps": args.reps,
    "quick": args.quick,
    "device_policy": (
      "headline ratio: the trainer's layout (one path per device, P "
      "devices) per unit of hardware vs the plain loop on one device; "
      "fake CPU devices share the pinned cores (hardware_factor 1), real "
      "accelerators count P times (hardware_factor P); '_one_device': "
      "all P paths vmapped on the plain loop's device"
    ),
    "flops_formula": (
      "6 N + 12 L T H K per token, N = L (4 d H K + 2 d F, or 3 d F for swiglu) "
      "+ V d; GEMM peak = 2 n^3 / t of an fp32 n x n dot"
    ),
    "statistic": (
      "ratios: median over repetitions of the paired ratio of "
      "back-to-back runs; other numbers: medians"
    ),
    "results": results,
  }
  print(
    f"jax {jax.__version__}, {len(jax.devices())} {jax.default_backend()} "
    f"devices, CPUs {report['pinned_cpus'] or 'all'}, P={args.paths}, "
    f"{args.reps} repetitions"
  )
  print(table(results))
  if args.out:
    write_json(args.out, report)
  return report


if __name__ == "__main__":
  if len(ARGS.cpu_list) > 1:
    main_per_cpu_count(ARGS, sys.argv[1:])
  else:
    main(ARGS)
