r"""What elastic.quorum does to goodput and loss with one worker actor 3x slower (this CPU).

  python benchmarks/elastic_quorum.py --out /tmp/quorum.json [--workers 4 --inner_steps 10]

configs/tiny.py, short (T outer steps of H), on one local Ray cluster. First a run with no
delay measures a task's inner step time s; then actor 1 sleeps 2 s per inner step (3x
slower) in runs with quorum 1.0 (off), and 0.5 with late deltas "next" and "drop".
Per run, from the task log (first task start -> last task end): wall, and
  goodput = inner steps x s / (worker actors x wall);
late_module_deltas counts the (module, worker) deltas that missed their step (joined the
next one with "next", lost with "drop"); and the final mean validation loss (own shards,
after the last outer step).
"""
# pylint: disable=invalid-name

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dipaco_jax import config_check  # noqa: E402
from dipaco_jax import train  # noqa: E402
from dipaco_jax.runtime import faults  # noqa: E402
from dipaco_jax.runtime.elastic import driver  # noqa: E402
from dipaco_jax.runtime.elastic import executor as exec_lib  # noqa: E402
from dipaco_jax.runtime.elastic import grid as grid_lib  # noqa: E402
from dipaco_jax.runtime.elastic import storage  # noqa: E402


def _run(args, tmp, name, **kw):
  over = {
    "dipaco.mode": "elastic",
    "dipaco.inner_steps": args.inner_steps,
    "dipaco.outer_steps": args.outer_steps,
    "inner.warmup_steps": 2,
    "eval.every_steps": args.inner_steps,
    "ckpt.every_steps": args.inner_steps,
    "mesh.cpu_devices": 0,
    "elastic.num_workers": args.workers,
    "data.shard_dir": os.path.join(tmp, "shards"),
    **kw,
  }
  over, injected = faults.from_overrides(over)  # "faults.X": runtime/faults.Faults.
  cfg = config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)
  wd = os.path.join(tmp, name)
  out = train.train_and_evaluate(cfg, wd, injected)
  events = storage.read_task_log(wd)
  starts = [e["t"] for e in events if e["event"] == "start"]
  done = [e for e in events if e["event"] == "done"]
  wall = max(e["t"] for e in done) - min(starts)
  trained = [e for e in done if e["phase"] < args.outer_steps]
  step_s = statistics.median(e["seconds"] / args.inner_steps for e in trained if e["actor"] != 1)
  late = _late_deltas(cfg, wd)
  return {
    "wall_s": wall,
    "step_s": step_s,
    "tasks": len(trained),
    "partial_steps": late[0],
    "late_module_deltas": late[1],
    "val_loss_mean": out["val_loss_mean"],
    "train_loss_mean": out["train_loss_mean"],
  }


def _late_deltas(cfg, wd) -> tuple[int, int]:
  """Module outer steps taken without every worker through the module, and the deltas missed."""
  grid = grid_lib.Grid(cfg)
  steps = [(k, u) for ph in exec_lib.quorum_steps(wd, 0).values() for k, u in ph.items()]
  missed = sum(
    len(grid.workers_through(k.split("/")[0], int(k.split("/")[1]))) - len(u) for k, u in steps
  )
  return len(steps), missed


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--workers", type=int, default=4)
  p.add_argument("--inner_steps", type=int, default=10)
  p.add_argument("--outer_steps", type=int, default=4)
  args = p.parse_args()
  import ray  # pylint: disable=g-import-not-at-top

  driver.start_local_ray(num_cpus=args.workers + 1)  # The command's own cluster's settings.
  res = {"args": vars(args)}
  with tempfile.TemporaryDirectory() as tmp:
    res["no_delay"] = _run(args, tmp, "clean")
    s = res["no_delay"]["step_s"]
    slow = {"faults.step_delay_s": (0.0, 2 * s)}  # Actor 1: s + 2s per step.
    res["slow_quorum_1.0"] = _run(args, tmp, "q1", **slow)
    for late in ("next", "drop"):
      res[f"slow_quorum_0.5_{late}"] = _run(
        args, tmp, f"q05{late}", **slow, **{"elastic.quorum": 0.5, "elastic.late_deltas": late}
      )
  H, W = args.inner_steps, args.workers
  for k, r in res.items():
    if k != "args":
      r["goodput"] = r["tasks"] * H * s / (W * r["wall_s"])
  ray.shutdown()
  text = json.dumps(res, indent=1)
  print(text)
  with open(args.out, "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  main()
