r"""Elastic mode against spmd on this CPU: overhead, outer latency, goodput under SIGKILLs.

  python benchmarks/elastic.py --out /tmp/elastic.json [--inner_steps 50]

One Ray cluster (local, loopback) serves every elastic run. Figures:
  overhead: elastic / spmd tokens/s at 1 worker (one path, DiLoCo with 1 replica), steady
    phases only (phase >= 1: compilation excluded from both);
  outer latency: per phase, last task report of the phase -> its last module updated;
  goodput: useful inner steps x clean step time / (worker actors x wall), elastic with one
    SIGKILL per ~10 tasks vs clean, and spmd-with-restart SIMULATED from measured parts:
    each preemption costs the spmd run a restart (its measured start-up + compile time) plus
    half a checkpoint interval of lost steps (checkpoints every H steps);
  identical: the faulty run's final checkpoint equals the clean run's, byte for byte.
"""
# pylint: disable=invalid-name

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dipaco_jax import checkpoint  # noqa: E402
from dipaco_jax import config_defaults  # noqa: E402
from dipaco_jax import metrics  # noqa: E402
from dipaco_jax import train  # noqa: E402
from dipaco_jax.elastic import storage  # noqa: E402


def _config(args, shard_dir, **kw):
  over = {
    "model.d_model": 32,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.head_dim": 16,
    "model.max_len": 64,
    "dipaco.level_groups": ("embed,head", "block_0", "block_1"),
    "dipaco.modules_per_level": (1, 2, 2),
    "dipaco.inner_steps": args.inner_steps,
    "dipaco.outer_steps": args.outer_steps,
    "inner.warmup_steps": 2,
    "data.seq_len": 64,
    "data.batch_size": 4,
    "ckpt.every_steps": args.inner_steps,
    "eval.every_steps": args.inner_steps,
    "eval.batches": 1,
    "ckpt.async_save": False,
    "early_stopping.enabled": False,
    "mesh.cpu_devices": 0,
    "data.shard_dir": shard_dir,
  }
  over.update(kw)
  return config_defaults.load(os.path.join(ROOT, "configs", "tiny.py"), **over)


def _events(workdir):
  return storage.read_lines(storage.root(workdir) / "tasks.jsonl")


def _phase_walls(events, T):
  """Seconds between the last outer update of phase t-1 and of phase t, t >= 1."""
  last = {}
  for e in events:
    if e["event"] == "outer":
      last[e["phase"]] = max(last.get(e["phase"], 0.0), e["t"])
  return [last[t] - last[t - 1] for t in range(1, T) if t in last and t - 1 in last]


def _outer_latency(events, T):
  """Per phase: last accepted task of the phase -> last module update of the phase."""
  done, outer = {}, {}
  for e in events:
    if e["event"] == "done" and e["phase"] < T:
      done[e["phase"]] = max(done.get(e["phase"], 0.0), e["t"])
    if e["event"] == "outer":
      outer[e["phase"]] = max(outer.get(e["phase"], 0.0), e["t"])
  return [outer[t] - done[t] for t in sorted(outer) if t in done]


def _spmd_tokens_per_s(workdir, H):
  recs = metrics.read_records(workdir)
  return statistics.median(r["tokens_per_s"] for r in recs if r["step"] > H and "tokens_per_s" in r)


def _same(a, b) -> bool:
  x, y = checkpoint.restore_numpy(a), checkpoint.restore_numpy(b)
  return all(
    np.array_equal(np.asarray(p), np.asarray(q))
    for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--inner_steps", type=int, default=50)
  p.add_argument("--outer_steps", type=int, default=3)
  p.add_argument("--workers", type=int, default=2, help="worker actors of the grid runs")
  p.add_argument("--tasks_per_kill", type=int, default=10)
  args = p.parse_args()
  import ray  # pylint: disable=g-import-not-at-top

  H, T = args.inner_steps, args.outer_steps
  tmp = tempfile.mkdtemp(prefix="elastic_bench_")
  ray.init(
    address="local",
    num_cpus=args.workers + 2,
    include_dashboard=False,
    _node_ip_address="127.0.0.1",
    log_to_driver=False,
  )
  report = {
    "inner_steps": H,
    "outer_steps": T,
    "workers": args.workers,
    "machine": f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f} at start",
  }

  # 1. Overhead at 1 worker: one path, one replica (outer step over one worker).
  one = {"dipaco.level_groups": ("embed,block_0-1,head",), "dipaco.modules_per_level": (1,)}
  shards1 = os.path.join(tmp, "shards1")
  t0 = time.time()
  train.train_and_evaluate(_config(args, shards1, **one), os.path.join(tmp, "spmd1"))
  spmd_wall = time.time() - t0
  spmd_tps = _spmd_tokens_per_s(os.path.join(tmp, "spmd1"), H)
  train.train_and_evaluate(
    _config(args, shards1, **one, **{"dipaco.mode": "elastic", "elastic.num_workers": 1}),
    os.path.join(tmp, "el1"),
  )
  walls = _phase_walls(_events(os.path.join(tmp, "el1")), T)
  tokens_per_phase = 4 * 64 * H
  el_tps = tokens_per_phase / statistics.median(walls)
  report["overhead"] = {
    "spmd_tokens_per_s": spmd_tps,
    "elastic_tokens_per_s": el_tps,
    "elastic_over_spmd": el_tps / spmd_tps,
    "elastic_phase_walls_s": walls,
  }
  print(json.dumps(report["overhead"]))

  # 2. The 2x2 grid (4 workers) on `--workers` actors: clean, then one kill per ~10 tasks.
  shards = os.path.join(tmp, "shards")
  t0 = time.time()
  train.train_and_evaluate(_config(args, shards), os.path.join(tmp, "spmd"))
  spmd_grid_wall = time.time() - t0
  spmd_grid_tps = _spmd_tokens_per_s(os.path.join(tmp, "spmd"), H)
  el = {"dipaco.mode": "elastic", "elastic.num_workers": args.workers}
  t0 = time.time()
  clean = train.train_and_evaluate(_config(args, shards, **el), os.path.join(tmp, "clean"))
  clean_wall = time.time() - t0
  ev = _events(os.path.join(tmp, "clean"))
  steady = [e["seconds"] for e in ev if e["event"] == "done" and 0 < e["phase"] < T]
  step_s = statistics.median(steady) / H
  tasks = 4 * T
  kills = max(1, math.ceil(tasks / args.tasks_per_kill))
  t0 = time.time()
  faulty = train.train_and_evaluate(
    _config(
      args, shards, **el, **{"elastic.chaos_worker_kills": kills, "elastic.chaos_executor_kills": 1}
    ),
    os.path.join(tmp, "faulty"),
  )
  faulty_wall = time.time() - t0
  fev = _events(os.path.join(tmp, "faulty"))

  def goodput(events):
    start = min(e["t"] for e in events if e["event"] == "start")
    end = max(e["t"] for e in events if e["event"] == "outer")
    return 4 * H * T * step_s / (args.workers * (end - start)), end - start

  g_clean, w_clean = goodput(ev)
  g_faulty, w_faulty = goodput(fev)
  # spmd with restart from the last checkpoint (simulated from measured parts).
  useful = 4 * 64 * 4 * H * T / spmd_grid_tps  # Steady-state seconds of the whole run.
  restart_s = max(spmd_grid_wall - useful, 0.0)  # Start-up + shards + compile + save, measured.
  lost_s = (H / 2) * (useful / (H * T))
  g_spmd = useful / (useful + kills * (restart_s + lost_s))
  report["grid"] = {
    "tasks": tasks,
    "kills_scheduled": kills,
    "kills_done": faulty["status"]["worker_kills"],
    "executor_kills_done": faulty["status"]["executor_kills"],
    "requeued": faulty["status"]["requeued"],
    "identical_to_clean": _same(os.path.join(tmp, "clean"), os.path.join(tmp, "faulty")),
    "clean_step_s": step_s,
    "outer_latency_s": _outer_latency(ev, T),
    "goodput_elastic_clean": g_clean,
    "goodput_elastic_faulty": g_faulty,
    "wall_train_s": {"clean": w_clean, "faulty": w_faulty},
    "wall_command_s": {
      "spmd": spmd_grid_wall,
      "elastic_clean": clean_wall,
      "elastic_faulty": faulty_wall,
      "spmd_1_worker": spmd_wall,
    },
    "goodput_spmd_with_restart_simulated": g_spmd,
    "spmd_restart_s_measured": restart_s,
    "spmd_lost_s_per_preemption": lost_s,
    "clean_val_loss_mean": clean.get("val_loss_mean"),
  }
  print(json.dumps(report["grid"]))
  ray.shutdown()
  tmp_out = args.out + ".tmp"
  with open(tmp_out, "w") as f:
    json.dump(report, f, indent=1, default=float)
  os.replace(tmp_out, args.out)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
