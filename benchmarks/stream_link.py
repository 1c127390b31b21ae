r"""Streamed outer sync over a slow link: exposed communication, F = 1 vs F fragments, on this CPU.

  python benchmarks/stream_link.py [--gbps 1 0.1] [--kinds none fp4] [--inner_steps 40] \
      [--outer_steps 4] [--fragments 4] [--out benchmarks/results/stream_link_cpu_2core.json]

A real spmd run of a small model (one path, one module holding every group: DiLoCo with
one worker, so each outer exchange is a path's modules), with the loop's link hook
(`spmd.run(..., link=)`): each exchange the loop dispatches starts a transfer of the
exchange's bytes both ways (each group's wire form, `compression.wire_bytes`, up and the
same down) times `scale` over one link of B bits a second (transfers queue); where the
update must land, the loop waits, once the device is done with the step, for what is left
of the transfer. That wait is the exposed communication. `scale` makes one path of this
model weigh what a path of the paper's configs does (571.5 MiB of float32 parameters), so
the transfers take a paper path's times; the inner steps are this model's on this CPU.

Arms per link and compression: F = 1, τ = 0 (the plain outer step: the whole exchange
exposed) and F fragments with τ = H / F − 1 (each fragment's exchange overlaps the inner
steps until the next fragment's sync, core/streaming.py).
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


class Link:
  """One link of `bps` bits a second: transfers queue; `landed` waits for the last one."""

  def __init__(self, bps: float, group_bytes: dict[str, int], scale: float):
    self.bps, self.group_bytes, self.scale = bps, group_bytes, scale
    self.busy_until = 0.0
    self.exposed_s = 0.0
    self.events = []

  def sent(self, step: int, groups) -> None:
    nbytes = 2 * sum(self.group_bytes[g] for g in groups)  # Up, and the update down.
    now = time.perf_counter()
    self.busy_until = max(now, self.busy_until) + nbytes * self.scale * 8 / self.bps
    self.events.append({"step": step, "t": now, "sent": list(groups), "bytes": nbytes})

  def landed(self, step: int, params) -> None:
    import jax  # pylint: disable=g-import-not-at-top

    jax.block_until_ready(params)  # The compute queued so far overlaps the transfer.
    wait = max(0.0, self.busy_until - time.perf_counter())
    time.sleep(wait)
    self.exposed_s += wait
    self.events.append({"step": step, "t": time.perf_counter(), "landed_wait_s": wait})


def steady_phases(events: list, H: int, T: int) -> list[dict]:
  """Phases 1..T-2, from the dispatch after step pH to the one after (p+1)H, with their waits.

  Phase 0 compiles the programs (each fragment's first sync, the first landing) and the
  last phase ends in the flush, so neither is steady.
  """
  sent = {e["step"]: e["t"] for e in events if "sent" in e}
  out = []
  for p in range(1, T - 1):
    lo, hi = p * H, (p + 1) * H
    waits = [e["landed_wait_s"] for e in events if "landed_wait_s" in e and lo < e["step"] <= hi]
    # A wait at step hi (an update applied at once) is its exchange's, dispatched after hi.
    span = sent[hi] - sent[lo]
    out.append({"phase": p, "seconds": span, "exposed_s": sum(waits), "share": sum(waits) / span})
  return out


def _config(kind: str, H: int, T: int, F: int, tau: int, shard_dir: str):
  from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top

  over = {
    "model.d_model": 64,
    "model.num_layers": 3,
    "model.num_heads": 4,
    "model.head_dim": 16,
    "model.max_len": 64,
    "dipaco.level_groups": ("embed,head,block_0,block_1,block_2",),
    "dipaco.modules_per_level": (1,),
    "dipaco.replicas": 1,
    "dipaco.inner_steps": H,
    "dipaco.outer_steps": T,
    "inner.warmup_steps": 2,
    "data.seq_len": 64,
    "data.batch_size": 4,
    "ckpt.every_steps": H * T,
    "eval.every_steps": H * T,
    "eval.batches": 1,
    "ckpt.async_save": False,
    "early_stopping.enabled": False,
    "mesh.cpu_devices": 0,
    "data.shard_dir": shard_dir,
    "outer.compression": kind,
    "outer.fragments": F,
    "outer.overlap": tau,
  }
  return config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)


def run(kind: str, gbps: float, H: int, T: int, F: int, tau: int, shard_dir: str) -> dict:
  """One run over a link of `gbps`: the exposed seconds, the wall time, the transfers."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from dipaco_jax.core import compression  # pylint: disable=g-import-not-at-top
  from dipaco_jax.core import experiment  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime import spmd  # pylint: disable=g-import-not-at-top

  cfg = _config(kind, H, T, F, tau, shard_dir)
  exp = experiment.Experiment(cfg)
  block = cfg.outer.compression_block
  module = lambda x: x.shape[1:]  # A store leaf [K = 1, ...]: one path's module.
  group_bytes = {
    g: sum(compression.wire_bytes(module(x), kind, block) for x in jax.tree.leaves(t))
    for g, t in exp.abstract_state.store.items()
  }
  fp32 = sum(int(np.prod(module(x))) * 4 for x in jax.tree.leaves(exp.abstract_state.store))
  scale = PAPER_PATH_BYTES / fp32
  link = Link(gbps * 1e9, group_bytes, scale)
  with tempfile.TemporaryDirectory() as wd:
    started = time.perf_counter()
    spmd.run(cfg, wd, link=link)
    wall = time.perf_counter() - started
  path_bytes = 2 * sum(group_bytes.values())
  steady = steady_phases(link.events, H, T)
  return {
    "kind": kind,
    "gbps": gbps,
    "fragments": F,
    "overlap": tau,
    "inner_steps": H,
    "outer_steps": T,
    "fragment_groups": [list(f) for f in exp.fragments],
    "path_fp32_bytes": fp32,
    "scale": scale,
    "exchange_mib_both_ways_scaled": path_bytes * scale / 2**20,
    "transfer_s_per_phase": path_bytes * scale * 8 / (gbps * 1e9),
    "largest_fragment_share": max(sum(group_bytes[g] for g in f) for f in exp.fragments)
    / sum(group_bytes.values()),
    "exposed_s": link.exposed_s,
    "steady": steady,
    "exposed_s_per_phase": sum(p["exposed_s"] for p in steady) / len(steady),
    "phase_s": sum(p["seconds"] for p in steady) / len(steady),
    "exposed_share": sum(p["exposed_s"] for p in steady) / sum(p["seconds"] for p in steady),
    "wall_s": wall,
    "events": link.events,
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gbps", type=float, nargs="+", default=[1.0, 0.1])
  ap.add_argument("--kinds", nargs="+", default=["none", "fp4"])
  ap.add_argument("--inner_steps", type=int, default=40)
  ap.add_argument("--outer_steps", type=int, default=4)
  ap.add_argument("--fragments", type=int, default=4)
  ap.add_argument(
    "--out", default=os.path.join(ROOT, "benchmarks", "results", "stream_link_cpu.json")
  )
  a = ap.parse_args()
  H, T, F = a.inner_steps, a.outer_steps, a.fragments
  if F < 2 or H // F < 2 or T < 3:
    sys.exit(
      f"stream_link.py: --fragments={F}, --inner_steps={H}, --outer_steps={T}: give F >= 2 "
      "with H // F >= 2 (an overlap of H // F - 1 >= 1 steps) and T >= 3 (the steady phases "
      "are 1..T-2)."
    )
  started = time.time()
  arms = [(1, 0), (F, H // F - 1)]
  with tempfile.TemporaryDirectory() as shards:
    rows = [run(k, g, H, T, f, tau, shards) for g in a.gbps for k in a.kinds for f, tau in arms]
  print(
    "| link | compression | F, τ | transfer s a phase (paper path, both ways) |"
    " largest fragment | exposed s a phase | phase s | exposed share |"
  )
  print("|---|---|---|---:|---:|---:|---:|---:|")
  for x in rows:
    print(
      f"| {x['gbps'] * 1000:g} Mb/s | {x['kind']} | {x['fragments']}, {x['overlap']} |"
      f" {x['transfer_s_per_phase']:.2f} | {x['largest_fragment_share']:.0%} |"
      f" {x['exposed_s_per_phase']:.3f} | {x['phase_s']:.2f} | {x['exposed_share']:.1%} |"
    )
  out = {
    "command": " ".join(["python", "benchmarks/stream_link.py", *sys.argv[1:]]),
    "args": vars(a),
    "rows": rows,
    "wall_s": time.time() - started,
  }
  import timing  # pylint: disable=g-import-not-at-top  # Beside this script; imports jax.

  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  timing.write_json(a.out, out)


if __name__ == "__main__":
  main()
