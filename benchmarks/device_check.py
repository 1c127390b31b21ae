r"""The device check: the 150M path's step measured on a GPU, and the trainer end to end.

  python benchmarks/device_check.py --device=gpu --out=DIR   # a GPU host: <= 8 minutes
  python benchmarks/device_check.py --dry_run --out=DIR      # its own logic on a CPU, tiny

For an air-gapped GPU host whose Python has jax with CUDA, flax, optax, orbax-checkpoint,
tensorboard and sentencepiece: what else the code needs comes in the bundle that
benchmarks/device_bundle.py builds (wheels and the prepared corpus shards; its install line is
in docs/tpu.md). Three phases, each a child process under its own time limit, so that a crash
or a hang of one is recorded and the others still run:

  mfu_cudnn, mfu_xla  benchmarks/mfu.py on configs/dense_150m.py (the paper's 150M path), one
                      microbatch of --batch sequences, the loss in one chunk (so that XLA's cost
                      analysis sees every op once), model.attention=cudnn, then =xla: measured
                      tokens/s and MFU beside the roofline estimate's ceiling and floor, XLA's
                      flops and bytes, the compiled and the allocator's memory
  trainer             python -m dipaco_jax.main on configs/tiny.py (the embedded corpus, spmd),
                      a few inner and outer steps, evaluation and a checkpoint: its last record

One JSON, DIR/device_check.json, rewritten after every phase; exit status 0 when every phase
passed. --budget_s bounds the whole (default 450 s). --dry_run runs the same phases on the CPU
at a tiny size (cuDNN skipped, a pretend peak and bandwidth): what CI tests. A host without the
--device asked for, or a missing package, is a one-line error before any phase.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import device_bundle  # Beside us.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = "device_check.json"
PATH_CONFIG = "configs/dense_150m.py"  # The paper's 150M path (mfu.py runs it as one module).
# Phase time limits (s) within --budget_s; what a phase leaves is the next one's.
MFU_LIMIT_S, TRAINER_LIMIT_S = 170, 150
# The tiny sizes of --dry_run: the 150M path's config cut to a CPU's seconds.
DRY_MODEL = {
  "model.d_model": 64,
  "model.num_layers": 2,
  "model.num_heads": 2,
  "model.head_dim": 32,
  "model.vocab_size": 512,
  "data.seq_len": 64,
}
DRY_PEAK = ("--peak_tflops=1", "--hbm_gbps=50")  # A pretend CPU device: the arithmetic only.


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="folder for device_check.json")
  p.add_argument("--device", default="gpu", choices=["gpu"], help="the device to check")
  p.add_argument("--dry_run", action="store_true", help="on the CPU, tiny: the check's logic")
  p.add_argument("--budget_s", type=float, default=450.0, help="wall-clock bound of the whole")
  p.add_argument("--batch", type=int, default=32, help="sequences per measured step")
  p.add_argument("--steps", type=int, default=16, help="timed steps per repetition")
  p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
  p.add_argument(
    "--cache_dir",
    default=os.path.join(ROOT, device_bundle.DEFAULT_DIR, device_bundle.CACHE),
    help="a prepared corpus cache (the bundle's); the trainer reads a copy of it",
  )
  return p.parse_args(argv)


class CheckError(Exception):
  """The check cannot start: one line, what and the fix."""


def preflight(device: str, dry_run: bool) -> dict:
  """The host's facts; CheckError for a missing package or a host without the device."""
  for module in device_bundle.NEEDED_MODULES:
    try:
      __import__(module)
    except ImportError as e:
      raise CheckError(
        f"this Python cannot import {module} ({e}): install the device bundle first: "
        f"{device_bundle.install_command()}"
      ) from e
  import jax  # pylint: disable=g-import-not-at-top

  import mfu  # pylint: disable=g-import-not-at-top  # Beside us; imports what was checked above.

  try:
    first = mfu.check_platform("" if dry_run else device, "--device", ", or --dry_run here")
  except mfu.errors.UserError as e:
    raise CheckError(str(e)) from e
  return {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "platform": first.platform,
    "device_kind": first.device_kind,
    "devices": jax.device_count(),
  }


def mfu_command(args, attention: str, out: str, budget_s: float) -> list[str]:
  """benchmarks/mfu.py for one attention, as the check runs it."""
  model = dict(DRY_MODEL) if args.dry_run else {}
  seq_len = model.get("data.seq_len", 1024)
  sets = {
    **model,
    "model.attention": attention,
    "inner.microbatches": 1,
    "model.loss_chunk": seq_len,  # One chunk: no loop body that XLA would count once.
  }
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mfu.py"), f"--config={PATH_CONFIG}"]
  cmd += [f"--batch={args.batch}", f"--steps={args.steps}", f"--reps={args.reps}"]
  cmd += [f"--time_budget_s={budget_s:.0f}", f"--out={out}"]
  cmd += DRY_PEAK if args.dry_run else [f"--platform={args.device}"]
  for k, v in sets.items():
    cmd += ["--set", f"{k}={v}"]
  return cmd


def run_phase(cmd: list[str], env: dict, limit_s: float) -> tuple[dict, str]:
  """A child process under a time limit: its status, wall time and output's end; its stderr."""
  t0 = time.perf_counter()
  try:
    p = subprocess.run(
      cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(limit_s, 1)
    )
    rc, out, err = p.returncode, p.stdout, p.stderr
  except subprocess.TimeoutExpired as e:
    rc, out, err = None, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {limit_s:.0f} s"
  result = {"ok": rc == 0, "returncode": rc, "wall_s": round(time.perf_counter() - t0, 1)}
  result["command"] = " ".join(cmd[1:]).replace(ROOT + os.sep, "")
  if rc != 0:
    result["error_tail"] = (out[-1500:] + "\n" + err[-3000:]).strip()
  return result, err


def _text(b) -> str:
  return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def trainer_result(workdir: str) -> dict:
  """The run's last metrics record (means over paths), and whether it wrote a checkpoint."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {"error": f"no {path}"}
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  last = records[-1]
  keep = ("step", "tokens_per_s", "step_s", "tflops_per_device", "mfu", "val_loss_mean")
  result = {k: last[k] for k in keep if k in last}
  result["train_loss_mean"] = sum(last["train_loss"]) / len(last["train_loss"])
  result["records"] = len(records)
  result["checkpoint"] = any(d.isdigit() for d in _listdir(os.path.join(workdir, "checkpoints")))
  return result


def _listdir(path: str) -> list[str]:
  return os.listdir(path) if os.path.isdir(path) else []


def child_env(args, cache: str) -> dict:
  """The phases' environment: the repo importable, the corpus cache a copy of --cache_dir."""
  env = dict(os.environ)
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # Ours only: each child takes its own.
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env["PYTHONUNBUFFERED"] = "1"
  env["DIPACO_CACHE_DIR"] = cache
  if args.dry_run:
    env["JAX_PLATFORMS"] = "cpu"
  return env


def write(out_dir: str, report: dict) -> str:
  """The report, whole or not at all."""
  path = os.path.join(out_dir, REPORT)
  with open(path + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
  os.replace(path + ".tmp", path)
  return path


def summary_line(name: str, phase: dict) -> str:
  if "skipped" in phase:
    return f"{name}: skipped ({phase['skipped']})"
  if not phase.get("ok"):
    return f"{name}: FAILED ({phase.get('skipped') or phase.get('error_tail', '')[-300:]})"
  if name == "trainer":
    return f"trainer: {phase['result']}"
  r, f = phase["result"], phase["result"]["roofline"]
  peak = phase["result"]["memory"].get("device", {}).get("peak_bytes_in_use")
  mem = f", allocator peak {peak / 2**30:.2f} GiB" if peak else ""
  return (
    f"{name}: measured {r['tokens_per_s']:,.0f} tokens/s, measured MFU {r['mfu']:.1%} causal; "
    f"roofline estimate ceiling {f['mfu_ceiling']:.1%}, floor {f['mfu_floor']:.1%} "
    f"({f['bound']}-bound; XLA {r['xla_cost']['flops']:.3e} flops, "
    f"{r['xla_cost']['bytes']:.3e} bytes){mem}"
  )


def check(args, argv) -> dict:
  t_start = time.perf_counter()
  deadline = t_start + args.budget_s
  os.makedirs(args.out, exist_ok=True)
  host = preflight(args.device, args.dry_run)
  report = {
    "command": "python benchmarks/device_check.py " + " ".join(argv),
    "dry_run": args.dry_run,
    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "host": host,
    "budget_s": args.budget_s,
    "mfu_is": "measured (wall-clock step time); roofline = estimate from XLA's counts",
    "phases": {},
  }
  if args.dry_run:
    report["note"] = "dry run: tiny sizes on the CPU, pretend peak and bandwidth; not figures"
  with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
    cache = os.path.join(tmp, "cache")
    if os.path.isdir(args.cache_dir):
      shutil.copytree(args.cache_dir, cache)
    report["prepared_cache"] = os.path.isdir(args.cache_dir)
    env = child_env(args, cache)
    left = lambda: deadline - time.perf_counter()
    # A phase's share of what is left: its cap on the device; all of it in a dry run (a busy CPU).
    share = lambda cap, keep=0: left() - keep if args.dry_run else min(cap, left() - keep)
    for attention in ("cudnn", "xla"):
      name = f"mfu_{attention}"
      if args.dry_run and attention == "cudnn":
        report["phases"][name] = {"ok": True, "skipped": "cuDNN needs a GPU (dry run)"}
        continue
      out = os.path.join(tmp, f"{name}.json")
      limit = share(MFU_LIMIT_S, keep=30)  # 30 s kept for the trainer at least.
      phase, _ = run_phase(mfu_command(args, attention, out, limit / 4), env, limit)
      if phase["ok"]:
        with open(out) as f:
          phase["result"] = json.load(f)
      report["phases"][name] = phase
      write(args.out, report)
    workdir = os.path.join(tmp, "run")
    phase, log = run_phase(
      device_bundle.trainer_command(workdir, args.dry_run), env, share(TRAINER_LIMIT_S)
    )
    if phase["ok"]:
      phase["result"] = trainer_result(workdir)
      phase["result"]["shards_from_cache"] = "copied from the shard cache" in log
      phase["ok"] = phase["result"].get("checkpoint", False)
    report["phases"]["trainer"] = phase
  report["wall_s"] = round(time.perf_counter() - t_start, 1)
  report["ok"] = all(p["ok"] for p in report["phases"].values())
  report["summary"] = [summary_line(k, p) for k, p in report["phases"].items()]
  print("\n".join(report["summary"]))
  print("wrote", write(args.out, report))
  return report


def main(argv) -> int:
  args = parse_args(argv)
  sys.path.insert(0, ROOT)  # dipaco_jax from this checkout, as the phases (PYTHONPATH).
  if not args.dry_run:
    # This process only looks at the device: the phases take its memory.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  else:
    os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    report = check(args, argv)
  except CheckError as e:
    print(f"device_check: {e}", file=sys.stderr)
    return 1
  return 0 if report["ok"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
