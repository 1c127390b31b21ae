r"""The elastic task queue at the paper's scale: per-task seconds, snapshot bytes, tasks done.

  python benchmarks/elastic_coordinator.py --out /tmp/coordinator.json [--grid 16,16]
      [--inner_steps 150] [--phases 40] [--budget_s 120]

In process, no Ray: the coordinator's methods (elastic/coordinator.py) called as
the driver calls them, for a 16x16 grid (256 paths) with the paper's tau = 150
inner steps (the DiPaCo paper, §3.4; its headline run is about
427 outer steps, ~110k tasks). Each phase: every path's task leased and
completed with a result shaped as a worker returns it (H per-step losses,
evaluation, clocks), then every module's outer step (modules_updated), as the
executors report it. Per phase it prints and writes the seconds its W
lease+complete pairs took, the bytes of the snapshot files, and the tasks done
so far; it stops after --phases phases or once --budget_s seconds have passed.
"""
# pylint: disable=invalid-name

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _config(grid, H, T):
  from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top

  return config_check.load(
    os.path.join(ROOT, "configs", "tiny.py"),
    **{
      "dipaco.mode": "elastic",
      "dipaco.level_groups": ("embed,block_0", "block_1,head"),
      "dipaco.modules_per_level": grid,
      "dipaco.inner_steps": H,
      "dipaco.outer_steps": T,
      "model.num_layers": 2,
    },
  )


def _result(phase, worker, H):
  """A task's result as PathWorker.run returns it (the per-step losses are most of it)."""
  now = time.time()
  return {
    "phase": phase,
    "worker": worker,
    "actor": worker % 64,
    "pid": 12345,
    "cpus": [0, 1, 2, 3],
    "start": now - 60.0,
    "end": now,
    "clock": {"load": 0.5, "progress_save": 0.1, "steps": 59.0, "save": 0.4},
    "loss": [3.0 + 1e-4 * i for i in range(H)],
    "grad_norm": 0.5,
    "val_loss": 3.1,
    "stop_loss": 3.2,
  }


def _snapshot_bytes(workdir) -> dict:
  """Bytes of the queue's snapshot files: all of them, and the largest (one change rewrites it)."""
  sizes = [
    os.path.getsize(os.path.join(d, f))
    for d, _, names in os.walk(os.path.join(workdir, "elastic"))
    for f in names
    if "coordinator" in os.path.join(d, f)
  ]
  return {"snapshot_bytes": sum(sizes), "largest_file_bytes": max(sizes)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--grid", default="16,16", help="modules per level")
  p.add_argument("--inner_steps", type=int, default=150)
  p.add_argument("--phases", type=int, default=40, help="phases to run (of the paper's ~427)")
  p.add_argument("--budget_s", type=float, default=120.0)
  args = p.parse_args()
  from dipaco_jax.runtime.elastic import coordinator as coord_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import grid as grid_lib  # pylint: disable=g-import-not-at-top

  grid = tuple(int(x) for x in args.grid.split(","))
  H, T = args.inner_steps, 427
  config = _config(grid, H, T)
  rows, t_start = [], time.time()
  with tempfile.TemporaryDirectory(prefix="coordinator_bench_") as workdir:
    queue_plan = grid_lib.Grid(config).queue_plan()
    c = coord_lib.Coordinator(queue_plan, workdir)
    keys = sorted(c.versions)
    W = queue_plan.workers
    for t in range(args.phases):
      t0 = time.time()
      for _ in range(W):
        task = c.lease(0)
        assert task is not None and task[0] == t, task
        c.complete(*task, _result(*task, H))
      s = time.time() - t0
      c.modules_updated(t, keys)
      rows.append(
        {
          "phase": t,
          "tasks_done": (t + 1) * W,
          "seconds": s,
          "ms_per_task": 1e3 * s / W,
          **_snapshot_bytes(workdir),
        }
      )
      print(json.dumps(rows[-1]), flush=True)
      if time.time() - t_start > args.budget_s:
        break
    t0 = time.time()
    coord_lib.Coordinator(queue_plan, workdir)  # A restart: the snapshot read back.
    restore_s = time.time() - t0
  report = {
    "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    "grid": list(grid),
    "paths": W,
    "inner_steps": H,
    "phases_run": len(rows),
    "restore_s": restore_s,
    "phases": rows,
  }
  print(json.dumps({k: v for k, v in report.items() if k != "phases"}))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
