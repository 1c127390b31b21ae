r"""The outer exchange over a slow link: exposed communication, none vs fp4, on this CPU.

  python benchmarks/link.py [--gbps 1 0.1] [--kinds none fp4] [--inner_steps 20] \
      [--outer_steps 2] [--out benchmarks/results/link_cpu_2core.json]

A real elastic run of a tiny model (one path, one module holding every group: DiLoCo
with one worker, so every outer step is a full exchange), its pieces run in this
process without Ray (the driver's preparation, the worker's tasks, the outer executor:
the code a pool runs). Each task's fault plan (runtime/faults.py) carries a link of B
bits a second: the worker sleeps bytes x scale x 8 / B after writing its deltas (the
uplink: the delta files' real bytes, codes and scales with fp4) and after reading its
modules' new versions (the downlink: the executor's update files u<t> with fp4, the
float32 versions v<t> with none). `scale` makes one path of this model weigh what a
path of the paper's configs does (571.5 MiB of float32 parameters), so the delays are
the paper path's transfer times at B, with the compression ratio this run measured.

Exposed communication: the seconds of a phase in which no inner step runs because the
exchange has not finished, here the whole transfer (no streaming fragments: the next
phase's first step needs the new module). Reported per training phase t >= 1 (its
download and its upload): the seconds, the inner steps' own seconds, and the bytes.
"""
# pylint: disable=invalid-name

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PAPER_PATH_BYTES = 571.5 * 2**20  # One path of dipaco_2x4 / 16x16, float32 (docs/communication.md).


def _config(kind: str, H: int, T: int, shard_dir: str, F: int = 1, tau: int = 0):
  from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top

  over = {
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.head_dim": 16,
    "model.max_len": 64,
    "dipaco.level_groups": ("embed,head,block_0,block_1",),
    "dipaco.modules_per_level": (1,),
    "dipaco.replicas": 1,
    "dipaco.inner_steps": H,
    "dipaco.outer_steps": T,
    "inner.warmup_steps": 2,
    "data.seq_len": 64,
    "data.batch_size": 4,
    "ckpt.every_steps": H,
    "eval.every_steps": H * T,
    "eval.batches": 1,
    "ckpt.async_save": False,
    "early_stopping.enabled": False,
    "mesh.cpu_devices": 0,
    "data.shard_dir": shard_dir,
    "dipaco.mode": "elastic",
    "outer.compression": kind,
    "outer.fragments": F,
    "outer.overlap": tau,
  }
  return config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)


def run(kind: str, gbps: float, H: int, T: int, shard_dir: str, F: int = 1, tau: int = 0) -> dict:
  """One run over a link of `gbps`: per task (a phase, or a streamed unit), clocks and bytes."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import executor as exec_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import grid as grid_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import worker as worker_lib  # pylint: disable=g-import-not-at-top

  cfg = _config(kind, H, T, shard_dir, F, tau)
  grid = grid_lib.Grid(cfg)
  fp32 = sum(
    int(np.prod(x.shape)) * 4
    for s in grid.groups
    for x in __import__("jax").tree.leaves(grid.module_template(s.name))
  )
  scale = PAPER_PATH_BYTES / fp32
  link = {"link_bps": gbps * 1e9, "link_scale": scale}
  with tempfile.TemporaryDirectory() as wd:
    _, _, alpha = driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
    worker = worker_lib.PathWorker(cfg, wd, 0)
    ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], alpha)
    phases, started = [], time.perf_counter()
    for t in range(grid.U + 1):  # Task U: the last download (and the final evaluation).
      r = worker.run(t, 0, faults=link)
      if t < grid.U:
        ex.report(t, 0)
      c = r.get("clock", {})
      phases.append(
        {
          "phase": t,
          "bytes_down": r.get("bytes_down", 0),
          "bytes_up": r.get("bytes_up", 0),
          "link_s": c.get("link", 0.0),
          "steps_s": c.get("steps", 0.0),
          "load_s": c.get("load", 0.0),
          "save_s": c.get("save", 0.0),
        }
      )
    wall = time.perf_counter() - started
  return {
    "kind": kind,
    "gbps": gbps,
    "fragments": F,
    "overlap": tau,
    "path_fp32_bytes": fp32,
    "scale": scale,
    "wall_s": wall,
    "phases": phases,
  }


def summary(r: dict, H: int) -> dict:
  """A training phase t >= 1 of run r: what waits on the link (its download and its upload)."""
  ph = [p for p in r["phases"][1:] if p["steps_s"] > 0]  # Phases 1..T-1 train and exchange.
  if not ph:  # T = 1: phase 0's upload and phase 1's download.
    ph = [{**r["phases"][0], "bytes_down": r["phases"][1]["bytes_down"]}]
    ph[0]["link_s"] += r["phases"][1]["link_s"]
  p = ph[-1]
  scaled = (p["bytes_down"] + p["bytes_up"]) * r["scale"]
  return {
    "kind": r["kind"],
    "gbps": r["gbps"],
    "bytes_up": p["bytes_up"],
    "bytes_down": p["bytes_down"],
    "scaled_mib_per_phase": scaled / 2**20,
    "link_expected_s": scaled * 8 / (r["gbps"] * 1e9),
    "exposed_s": p["link_s"],
    "steps_s": p["steps_s"],
    "step_s": p["steps_s"] / H,
    "exposed_fraction_of_this_phase": p["link_s"] / (p["link_s"] + p["steps_s"]),
  }


def streamed_summary(r: dict, T: int) -> dict:
  """A run's exchange per phase over all its tasks (T uploads, T downloads), and its steps.

  Every link second is exposed: a task reads and writes its modules itself, inside the task.
  The last task (evaluation only) keeps no clock: its download's sleep is its bytes' time.
  """
  per = (len(r["phases"]) - 1) // T  # Tasks a phase (units, streamed); the last only evaluates.
  total = lambda k, ph=r["phases"]: sum(p[k] for p in ph)
  down, up = total("bytes_down") * r["scale"], total("bytes_up") * r["scale"]
  last = r["phases"][-1]["bytes_down"] * r["scale"] * 8 / (r["gbps"] * 1e9)
  steady = r["phases"][per : T * per]  # Phases 1..T-1: no compilation.
  return {
    "kind": r["kind"],
    "gbps": r["gbps"],
    "fragments": r["fragments"],
    "overlap": r["overlap"],
    "tasks_per_phase": per,
    "scaled_mib_down_per_phase": down / T / 2**20,
    "scaled_mib_up_per_phase": up / T / 2**20,
    "link_expected_s_per_phase": (down + up) * 8 / (r["gbps"] * 1e9) / T,
    "exposed_s_per_phase": (total("link_s") + last) / T,
    "steps_s_per_phase": total("steps_s", steady) / (T - 1),
    "other_s_per_phase": (total("load_s", steady) + total("save_s", steady)) / (T - 1),
    "wall_s": r["wall_s"],
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gbps", type=float, nargs="+", default=[1.0, 0.1])
  ap.add_argument("--kinds", nargs="+", default=["none", "fp4"])
  ap.add_argument("--inner_steps", type=int, default=20)
  ap.add_argument("--outer_steps", type=int, default=2)
  ap.add_argument(
    "--fragments",
    type=int,
    default=1,
    help="> 1: each kind also streamed, F fragments with overlap H // F - 1 (whole-run rows)",
  )
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "link_cpu.json"))
  a = ap.parse_args()
  started, load_start = time.time(), os.getloadavg()
  H, T, F = a.inner_steps, a.outer_steps, a.fragments
  arms = [(1, 0)] + ([(F, H // F - 1)] if F > 1 else [])
  with tempfile.TemporaryDirectory() as shards:
    runs = [run(k, g, H, T, shards, f, tau) for g in a.gbps for k in a.kinds for f, tau in arms]
  rows = [summary(r, a.inner_steps) for r in runs if r["fragments"] == 1]
  streamed = [streamed_summary(r, T) for r in runs] if F > 1 else []
  for x in streamed:
    print(
      f"| {x['gbps'] * 1000:g} Mb/s | {x['kind']} | F={x['fragments']}, τ={x['overlap']} |"
      f" {x['tasks_per_phase']} tasks | {x['scaled_mib_down_per_phase']:.1f}"
      f" / {x['scaled_mib_up_per_phase']:.1f} MiB |"
      f" exposed {x['exposed_s_per_phase']:.2f} s ({x['link_expected_s_per_phase']:.2f}) |"
      f" steps {x['steps_s_per_phase']:.2f} s | wall {x['wall_s']:.1f} s |"
    )
  print(
    "| link | compression | bytes up / down a phase (this run) | scaled to a paper path (MiB) |"
    " exposed s a phase (expected) | inner steps s | exposed share of this phase |"
  )
  print("|---|---|---|---|---|---|---|")
  for x in rows:
    print(
      f"| {x['gbps'] * 1000:g} Mb/s | {x['kind']} | {x['bytes_up']:,} / {x['bytes_down']:,} |"
      f" {x['scaled_mib_per_phase']:.1f} | {x['exposed_s']:.2f} ({x['link_expected_s']:.2f}) |"
      f" {x['steps_s']:.2f} | {x['exposed_fraction_of_this_phase']:.1%} |"
    )
  out = {
    "command": " ".join(["python", "benchmarks/link.py", *sys.argv[1:]]),
    "args": vars(a),
    "rows": rows,
    "streamed_rows": streamed,
    "runs": runs,
    "wall_s": time.time() - started,
    "load_start": load_start,
    "load_end": os.getloadavg(),
  }
  import timing  # pylint: disable=g-import-not-at-top  # Beside this script; imports jax.

  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  timing.write_json(a.out, out)


if __name__ == "__main__":
  main()
