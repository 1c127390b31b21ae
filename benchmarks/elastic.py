r"""Elastic mode against spmd on this CPU: overhead, outer latency, goodput, kills, heterogeneity.

  python benchmarks/elastic.py --out /tmp/elastic.json [--inner_steps 50]

Every training run is a child process (`elastic.py --_train`: the same command
each time, its own local Ray cluster for elastic), so walls are whole-command
walls and a run can be SIGKILLed whole (its process group) and run again. All
runs share a persistent JAX compilation cache (--compile_cache, default on),
so a restarted spmd program or worker actor loads its executables instead of
compiling them again. Figures (docs/elastic.md "Figures"):
  overhead: one path, one replica, 1 worker actor: spmd vs elastic per-phase walls
    (steady phases: phase >= 1, eval, outer step and spmd's checkpoint included), plus
    the task's fixed-cost breakdown from the task log;
  outer latency: per phase, last task report of the phase -> its last module updated;
  pin (not in the default --only): the clean grid run with elastic.pin_cpus on and off, in
    pairs (which goes first alternates): command walls and median step seconds;
  heterogeneous: a grid whose paths share only some modules, worker actor 0 slowed
    (runtime/faults.Faults' step_delay_s) to ~3x the others' step time: how many phases ahead the
    other actors started tasks while the slow one still trained;
  chaos (item 7): >= 20 worker SIGKILLs (half timed at random moments, half mid-write),
    executor SIGKILLs and one SIGKILL of the whole driver command, then the same
    command again; kills counted from the task log; final checkpoint vs the clean run's;
  goodput (item 8): useful inner steps x clean step time / (worker actors x command
    wall) under one preemption per ~--tasks_per_kill tasks, elastic vs spmd with a real
    restart from its last checkpoint (SIGKILL of the spmd command, rerun); where each
    run's actor seconds went (start-up, steps, task overheads, waits, failed tasks);
  --grid: the goodput/chaos/pin runs' 2x2 grid: `shared_embed` (one embedding+head
    module read by all 4 paths, so each phase ends at a barrier) or `path_specific`
    (private embedding and head, as the paper's 16x16: a path's next phase waits only
    for the 3 paths it shares a module with).
"""
# pylint: disable=invalid-name

import argparse
import ast
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

B, L = 4, 64  # Batch size and sequence length of every run.
GRID = {"dipaco.level_groups": ("embed,head", "block_0", "block_1")}  # 2x2 paths, shared embed.
GRID["dipaco.modules_per_level"] = (1, 2, 2)
# The paper's 16x16 layout in small (§4.2): embedding and head private to each path, so no
# module is shared by all paths; path i-j shares block_0 module i and block_1 module j.
PATH_SPECIFIC = {"dipaco.level_groups": ("block_0", "block_1"), "dipaco.modules_per_level": (2, 2)}
PATH_SPECIFIC["dipaco.path_specific"] = "embed,head"
GRIDS = {"shared_embed": GRID, "path_specific": PATH_SPECIFIC}
HETERO = {"dipaco.level_groups": ("embed,block_0", "block_1,head")}  # Path i-j shares i or j.
HETERO["dipaco.modules_per_level"] = (2, 2)
ONE = {"dipaco.level_groups": ("embed,block_0-1,head",), "dipaco.modules_per_level": (1,)}


def _config(H, T, shard_dir, **kw):
  """config/micro.py's model at batch B, length L, H x T steps (`kw` on top)."""
  from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top
  from dipaco_jax.config import micro  # pylint: disable=g-import-not-at-top

  over = micro.overrides(
    **{
      "model.max_len": L,
      **GRID,
      "dipaco.inner_steps": H,
      "dipaco.outer_steps": T,
      "data.seq_len": L,
      "data.batch_size": B,
      "ckpt.every_steps": H,
      "eval.every_steps": H,
      "ckpt.async_save": False,
      "early_stopping.enabled": False,
      "mesh.cpu_devices": 0,
      "data.shard_dir": shard_dir,
    }
  )
  over.update(kw)
  return config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)


def _train_child(spec: str, workdir: str, result: str) -> None:
  """The child process: one training command (train_and_evaluate) with `spec`'s config."""
  from dipaco_jax import train  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime import faults  # pylint: disable=g-import-not-at-top

  s = ast.literal_eval(spec)
  over, injected = faults.from_overrides(s["over"])  # "faults.X": runtime/faults.Faults.
  out = train.train_and_evaluate(_config(s["H"], s["T"], s["shards"], **over), workdir, injected)
  with open(result, "w") as f:
    json.dump(out, f, default=float)


class _Command:
  """A child training command, run whole; `kill()` SIGKILLs its process group (Ray included)."""

  def __init__(self, tmp, name, H, T, shards, **over):
    self.workdir = os.path.join(tmp, name)
    self.result = self.workdir + ".result.json"
    spec = repr({"H": H, "T": T, "shards": shards, "over": over})
    self.argv = [sys.executable, os.path.abspath(__file__), "--_train", spec, self.workdir]
    self.argv += [self.result]
    self.log = open(self.workdir + ".log", "ab")  # pylint: disable=consider-using-with
    self.proc, self.launches = None, []

  def start(self):
    self.launches.append(time.time())
    self.proc = subprocess.Popen(
      self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
    )

  def kill(self) -> int:
    """SIGKILL of the whole command (a host going down): every process it started, Ray's too.

    Ray's worker processes sit in their own process groups, so each descendant is
    killed by id. Returns how many of them were still alive a second later.
    """
    tree, parents = (
      {self.proc.pid},
      subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split(),
    )
    pairs = [(int(a), int(b)) for a, b in zip(parents[::2], parents[1::2])]
    while True:
      more = {c for c, pp in pairs if pp in tree} - tree
      if not more:
        break
      tree |= more
    for pid in tree:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.proc.wait()
    time.sleep(1.0)
    alive = 0
    for pid in tree - {self.proc.pid}:
      try:
        os.kill(pid, 0)
        alive += not open(f"/proc/{pid}/stat").read().split()[2] == "Z"
      except (ProcessLookupError, FileNotFoundError):
        pass
    return alive

  def wait(self) -> dict:
    if self.proc.wait() != 0:
      raise RuntimeError(f"{self.argv[3]} failed; see {self.workdir}.log")
    with open(self.result) as f:
      return json.load(f)

  def run(self) -> tuple[dict, float]:
    t0 = time.time()
    self.start()
    return self.wait(), time.time() - t0


def _events(workdir):
  from dipaco_jax.runtime.elastic import storage  # pylint: disable=g-import-not-at-top

  return storage.read_task_log(workdir)


def _startup(workdir) -> dict:
  """The driver's start-up event (driver.run): seconds of Ray's start and of its preparation."""
  e = next(e for e in _events(workdir) if e["event"] == "startup")
  return {"ray_s": e["ray_s"], "prepare_s": e["prepare_s"]}


def _results(workdir) -> dict:
  from dipaco_jax.runtime.elastic import coordinator  # pylint: disable=g-import-not-at-top

  return coordinator.read_results(workdir)


def _records(workdir) -> list:
  from dipaco_jax.io import metrics  # pylint: disable=g-import-not-at-top

  return metrics.read_records(workdir)


def _last_outer(events) -> dict:
  last = {}
  for e in events:
    if e["event"] == "outer":
      last[e["phase"]] = max(last.get(e["phase"], 0.0), e["t"])
  return last


def _elastic_phase_walls(events, T):
  """Seconds between the last outer update of phase t-1 and of phase t, 1 <= t < T."""
  last = _last_outer(events)
  return [last[t] - last[t - 1] for t in range(1, T)]


def _spmd_phase_walls(workdir, H, T, tokens_per_step, first=1):
  """Seconds of phase t, first <= t < T, from the records' tokens/s (they add up to the wall)."""
  recs = [r for r in _records(workdir) if "tokens_per_s" in r]
  walls, prev = [0.0] * T, 0
  for r in recs:
    t = (r["step"] - 1) // H
    walls[t] += (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]
    prev = r["step"]
  return walls[first:]


def _outer_latency(events, T):
  """Per phase: last accepted task of the phase -> last module update of the phase."""
  done, outer = {}, _last_outer(events)
  for e in events:
    if e["event"] == "done" and e["phase"] < T:
      done[e["phase"]] = max(done.get(e["phase"], 0.0), e["t"])
  return [outer[t] - done[t] for t in sorted(outer) if t in done]


def _task_breakdown(workdir, events, T) -> dict:
  """Median seconds of each part of a steady task's cycle at 1 worker (phases 1..T-1)."""
  res, starts, dones, outer = _results(workdir), {}, {}, _last_outer(events)
  for e in events:
    if e["event"] in ("start", "done"):
      (starts if e["event"] == "start" else dones)[e["phase"]] = e["t"]
  parts = {k: [] for k in ("dispatch", "load_eval", "steps", "save", "return", "outer", "next")}
  for t in range(1, T):
    r = res[f"{t}/0"]
    parts["dispatch"].append(r["start"] - starts[t])
    for k, name in (("load", "load_eval"), ("steps", "steps"), ("save", "save")):
      parts[name].append(r["clock"][k])
    parts["return"].append(dones[t] - r["end"])
    parts["outer"].append(outer[t] - dones[t])
    parts["next"].append(starts[t + 1] - outer[t])
  return {k: statistics.median(v) for k, v in parts.items()}


def _actor_seconds(events, results, launch: float, wall: float, A: int, T: int) -> dict:
  """Where a run's worker actor seconds (A x command wall) went, from its task log.

  Each actor's time is cut into: before its first task (`startup`); inside
  accepted tasks, as inner steps (`task_steps`), evaluation-only tasks of phase
  T (`task_eval_only`) and the rest of a task (load, evaluation, saves, the
  call's round trip: `task_other`); tasks that died (`task_failed`) and re-shard
  scoring (`scoring`); idle after a failed task until its next one (`restart`),
  idle between tasks otherwise (`wait`: no task ready, the phase barrier); and
  after its last task (`tail`: the last phase's outer step, the final state).
  """
  parts = ("startup", "task_steps", "task_eval_only", "task_other", "task_failed", "scoring")
  out = dict.fromkeys(parts + ("restart", "wait", "tail"), 0.0)
  spans = {a: [] for a in range(A)}  # actor -> [(start, end, kind, key)] in time order.
  open_ = {}
  for e in events:
    kind = e["event"]
    if kind in ("start", "start_score"):
      open_[e["actor"]] = (e["t"], e.get("phase"), e.get("worker"))
    elif kind in ("done", "failed", "scored", "failed_score") and e.get("actor") in open_:
      t, phase, worker = open_.pop(e["actor"])
      spans[e["actor"]].append((t, e["t"], kind, (phase, worker)))
  end = launch + wall
  for sp in spans.values():
    if not sp:
      out["startup"] += wall
      continue
    out["startup"] += sp[0][0] - launch
    out["tail"] += end - sp[-1][1]
    for i, (t, u, kind, (phase, worker)) in enumerate(sp):
      if i:
        out["restart" if sp[i - 1][2] in ("failed", "failed_score") else "wait"] += t - sp[i - 1][1]
      if kind == "done" and phase == T:
        out["task_eval_only"] += u - t
      elif kind == "done":
        steps = results[f"{phase}/{worker}"]["clock"]["steps"]
        out["task_steps"] += steps
        out["task_other"] += u - t - steps
      elif kind == "scored":
        out["scoring"] += u - t
      else:
        out["task_failed"] += u - t
  total = A * wall
  return {
    "seconds": out,
    "fraction": {k: v / total for k, v in out.items()},
    "actor_seconds": total,
  }


def _same(a, b) -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from dipaco_jax.io import checkpoint  # pylint: disable=g-import-not-at-top

  x, y = checkpoint.restore_numpy(a), checkpoint.restore_numpy(b)
  return all(
    np.array_equal(np.asarray(p), np.asarray(q))
    for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
  )


def _step_s(workdir, H, T) -> float:
  """Median seconds per inner step of one path in a run's steady tasks (resumed ones left out)."""
  res = _results(workdir)
  return statistics.median(
    r["clock"]["steps"] / H
    for k, r in res.items()
    if 0 < int(k.split("/")[0]) < T and "resumed_at_step" not in r
  )


def _spmd_step_s(workdir, H) -> float:
  """Median seconds per lock-step step of an spmd run's records after its first phase."""
  return statistics.median(
    r["step_s"] for r in _records(workdir) if r["step"] > H and "step_s" in r
  )


def _task_log_audit(events, results, W, T) -> dict:
  """What the task log says: tasks accepted once each, none lost, kills that landed."""
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  want = {(t, w) for t in range(T + 1) for w in range(W)}
  kills = [e for e in events if e["event"] == "kill"]
  back, failed_at = [], {}  # A failed task's actor: seconds until it starts its next task.
  noticed, killed_at = [], {}  # A timed kill: seconds until its task's call fails.
  for e in events:
    if e["event"] == "kill" and e["target"] == "worker" and e["how"] == "timed":
      killed_at[e["actor"]] = e["t"]
    if e["event"] == "failed":
      failed_at[e["actor"]] = e["t"]
      if e["actor"] in killed_at:
        noticed.append(e["t"] - killed_at.pop(e["actor"]))
    elif e["event"] == "start" and e["actor"] in failed_at:
      back.append(e["t"] - failed_at.pop(e["actor"]))
  return {
    "tasks": len(want),
    "done_events": len(done),
    "accepted_twice": len(done) - len(set(done)),
    "missing_from_log": len(want - set(done)),
    "missing_from_coordinator": len(want - {tuple(map(int, k.split("/"))) for k in results}),
    "duplicates_refused": sum(e["event"] == "duplicate" for e in events),
    "starts": sum(e["event"] == "start" for e in events),
    "tasks_failed": sum(e["event"] == "failed" for e in events),
    "worker_kills_timed": sum(k["target"] == "worker" and k["how"] == "timed" for k in kills),
    "worker_kills_mid_write": sum(k["target"] == "worker" and k["how"] == "write" for k in kills),
    "worker_kills_mid_progress_save": sum(
      k["target"] == "worker" and k["how"] == "progress" for k in kills
    ),
    # Retries that resumed from a mid-task save (elastic.progress_every_steps), and the steps
    # they did not redo.
    "tasks_resumed": sum("resumed_at_step" in e for e in events if e["event"] == "done"),
    "steps_not_redone": sum(e.get("resumed_at_step", 0) for e in events if e["event"] == "done"),
    "executor_kills": sum(k["target"] == "executor" for k in kills),
    "executor_calls_failed": sum(e["event"] == "executor_failed" for e in events),
    "worker_back_after_failure_s": statistics.median(back) if back else None,
    "failure_noticed_after_kill_s": statistics.median(noticed) if noticed else None,
  }


def _done_count(workdir) -> int:
  try:
    return sum(e["event"] == "done" for e in _events(workdir))
  except (OSError, ValueError):
    return 0


def _spmd_with_restarts(cmd: _Command, H, T, kills, seed) -> dict:
  """Runs the spmd command, SIGKILLs it `kills` times (one per 1/kills of the run), reruns it."""
  rng = random.Random(seed)
  per = T * H / kills  # Lock-step steps between preemptions: the elastic run's tasks per kill.
  targets = [int(rng.uniform(k * per, (k + 1) * per)) for k in range(kills)]
  targets = [s for s in targets if 0 < s < T * H]
  t0, kills = time.time(), []
  cmd.start()
  for target in targets:
    while cmd.proc.poll() is None:
      recs = [r["step"] for r in _records(cmd.workdir)] if os.path.exists(cmd.workdir) else []
      if recs and recs[-1] >= target:
        break
      time.sleep(0.05)
    if cmd.proc.poll() is not None:
      break
    recs = [r["step"] for r in _records(cmd.workdir)]
    cmd.kill()
    kills.append({"at_step_at_least": recs[-1], "t": time.time() - t0})
    cmd.start()
  cmd.wait()
  wall = time.time() - t0
  # Steps past the last checkpoint (every H steps) when killed: trained again after the restart.
  redone = sum(k["at_step_at_least"] % H for k in kills)
  return {"wall_s": wall, "kills": kills, "redone_steps_at_least": redone, "restarts": len(kills)}


def main():
  if len(sys.argv) == 5 and sys.argv[1] == "--_train":
    return _train_child(*sys.argv[2:])
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--inner_steps", type=int, default=50)
  p.add_argument("--overhead_phases", type=int, default=6, help="outer steps of the 1-worker runs")
  p.add_argument("--outer_steps", type=int, default=6, help="outer steps of the grid runs")
  p.add_argument("--workers", type=int, default=2, help="worker actors of the grid runs")
  p.add_argument(
    "--grid", default="shared_embed", choices=sorted(GRIDS), help="of the goodput/chaos/pin runs"
  )
  p.add_argument("--tasks_per_kill", type=int, default=10)
  p.add_argument(
    "--progress_every", type=int, default=0, help="elastic.progress_every_steps of elastic runs"
  )
  p.add_argument("--chaos_worker_kills", type=int, default=20, help="per invocation (2 of them)")
  p.add_argument("--chaos_executor_kills", type=int, default=2, help="per invocation")
  p.add_argument("--slowdown", type=float, default=3.0, help="of worker actor 0, hetero run")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--pairs", type=int, default=2, help="pin_cpus on/off pairs (--only pin)")
  p.add_argument("--compile_cache", default=True, action=argparse.BooleanOptionalAction)
  p.add_argument(
    "--spmd",
    default=True,
    action=argparse.BooleanOptionalAction,
    help="goodput: also the spmd runs (--no-spmd: elastic only, e.g. a repeat with another --seed)",
  )
  p.add_argument("--only", default="overhead,hetero,chaos,goodput")
  args = p.parse_args()
  H, T, A, only = args.inner_steps, args.outer_steps, args.workers, args.only.split(",")
  G = GRIDS[args.grid]
  tmp = tempfile.mkdtemp(prefix="elastic_bench_")
  if args.compile_cache:  # Inherited by every child command and its Ray workers.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, "jax_cache")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  W = 4  # Paths of every grid (GRIDS, HETERO).
  el = {"dipaco.mode": "elastic", "elastic.num_workers": A}
  el["elastic.compile_cache"] = "auto" if args.compile_cache else "off"  # "auto": the env's.
  el["elastic.progress_every_steps"] = args.progress_every  # Clean runs pay the saves too.
  report = {
    "command": " ".join(["python benchmarks/elastic.py"] + sys.argv[1:]),
    "inner_steps": H,
    "outer_steps": T,
    "worker_actors": A,
    "grid": f"{args.grid}: {G}",
    "progress_every_steps": args.progress_every,
    "compile_cache": args.compile_cache,
    "machine": f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f} at start",
  }
  t_bench = time.time()

  def save():
    report["load_at_end"] = round(os.getloadavg()[0], 1)
    report["benchmark_wall_s"] = time.time() - t_bench
    with open(args.out + ".tmp", "w") as f:
      json.dump(report, f, indent=1, default=float)
    os.replace(args.out + ".tmp", args.out)

  if "overhead" in only:  # 1. One path, one replica, 1 worker actor.
    T1, sh = args.overhead_phases, os.path.join(tmp, "shards1")
    spmd1 = _Command(tmp, "spmd1", H, T1, sh, **ONE)
    spmd1.run()
    el1 = _Command(tmp, "el1", H, T1, sh, **ONE, **{**el, "elastic.num_workers": 1})
    el1.run()
    ev = _events(el1.workdir)
    w_spmd = _spmd_phase_walls(spmd1.workdir, H, T1, B * L)
    w_el = _elastic_phase_walls(ev, T1)
    spmd_step = _spmd_step_s(spmd1.workdir, H)
    report["overhead"] = {
      "elastic_over_spmd": statistics.median(w_spmd) / statistics.median(w_el),
      "spmd_tokens_per_s": B * L * H / statistics.median(w_spmd),
      "elastic_tokens_per_s": B * L * H / statistics.median(w_el),
      "spmd_phase_walls_s": w_spmd,
      "elastic_phase_walls_s": w_el,
      "steps_only_elastic_over_spmd": spmd_step / _step_s(el1.workdir, H, T1),
      "elastic_task_cycle_median_s": _task_breakdown(el1.workdir, ev, T1),
      "outer_latency_s": _outer_latency(ev, T1),
      "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(report["overhead"]), flush=True)
    save()

  shards = os.path.join(tmp, "shards")
  tasks = W * T
  if "goodput" in only or "chaos" in only:  # 2. The clean elastic grid run: the reference.
    # Warm-ups (untimed): the grid's shards and both modes' compilation cache entries, so
    # every timed command below starts alike.
    _Command(tmp, "warm_spmd", H, T, shards, **G, **{"stop_at_step": 1}).run()
    _Command(tmp, "warm_el", H, T, shards, **G, **el, **{"faults.stop_after_tasks": A}).run()
    clean = _Command(tmp, "clean", H, T, shards, **G, **el)
    _, clean_wall = clean.run()
    step_s = _step_s(clean.workdir, H, T)
    ev = _events(clean.workdir)
    report["clean"] = {
      "wall_command_s": clean_wall,
      "step_s": step_s,
      "outer_latency_s": _outer_latency(ev, T),
      "where_actor_time_went": _actor_seconds(
        ev, _results(clean.workdir), clean.launches[0], clean_wall, A, T
      ),
      "load": round(os.getloadavg()[0], 1),
    }
    save()

  if "goodput" in only:  # 3. One preemption per ~tasks_per_kill tasks: elastic vs spmd.
    kills = max(1, round(tasks / args.tasks_per_kill))
    pre = _Command(
      tmp,
      "preempted",
      H,
      T,
      shards,
      **G,
      **el,
      **{"faults.worker_kills": kills, "faults.seed": args.seed},
    )
    _, pre_wall = pre.run()
    pre_events, pre_results = _events(pre.workdir), _results(pre.workdir)
    audit = _task_log_audit(pre_events, pre_results, W, T)
    useful_el = W * T * H * step_s / A  # Per worker actor.
    # Start-up before the first inner step (process, Ray, shards, θ̄; not the compile): paid
    # once by any run, so also shown apart. spmd: command wall minus its records' intervals.
    first = lambda events: min(e["t"] for e in events if e["event"] == "start")
    up_el = {
      "clean": first(ev) - clean.launches[0],
      "preempted": first(pre_events) - pre.launches[0],
    }
    pre_step = _step_s(pre.workdir, H, T)
    g = report["goodput"] = {
      "definition": "useful inner steps x clean step time / (worker actors x command wall)",
      "elastic_preempted": useful_el / pre_wall,
      "elastic_clean": useful_el / clean_wall,
      "after_startup": {
        "elastic_preempted": useful_el / (pre_wall - up_el["preempted"]),
        "elastic_clean": useful_el / (clean_wall - up_el["clean"]),
        "startup_s": {"elastic": up_el},
        # The clean command's driver: Ray's start, then its θ̄/shards/store (actors importing).
        "elastic_driver_startup_s": _startup(clean.workdir),
      },
      # Each run against its own step time: sequential runs on a shared machine drift (a
      # preempted run whose steps ran faster than its clean twin's could read above 1 above).
      "own_step_time": {
        "elastic_preempted": W * T * H * pre_step / A / pre_wall,
        "elastic_clean": useful_el / clean_wall,
        "step_s": {"elastic_clean": step_s, "elastic_preempted": pre_step},
      },
      "preemptions_scheduled": kills,
      "elastic_kills_landed": audit["worker_kills_timed"]
      + audit["worker_kills_mid_write"]
      + audit["worker_kills_mid_progress_save"],
      "elastic_task_log": audit,
      "elastic_identical_to_clean": _same(clean.workdir, pre.workdir),
      "elastic_preempted_actor_time": _actor_seconds(
        pre_events, pre_results, pre.launches[0], pre_wall, A, T
      ),
      "wall_command_s": {"elastic_clean": clean_wall, "elastic_preempted": pre_wall},
      "useful_s": {"elastic_per_actor": useful_el},
    }
    if args.spmd:  # The same work as one SPMD program, restarted from its checkpoint per kill.
      spmd = _Command(tmp, "spmd", H, T, shards, **G)
      _, spmd_wall = spmd.run()
      spmd_step = _spmd_step_s(spmd.workdir, H)
      restarted = _Command(tmp, "spmd_restarted", H, T, shards, **G)
      rs = _spmd_with_restarts(restarted, H, T, kills, args.seed)
      useful_spmd = T * H * spmd_step
      up_spmd = spmd_wall - sum(_spmd_phase_walls(spmd.workdir, H, T, W * B * L, first=0))
      restarted_step = _spmd_step_s(restarted.workdir, H)
      g.update(
        spmd_with_restart=useful_spmd / rs["wall_s"],
        spmd_clean=useful_spmd / spmd_wall,
        spmd_with_restart_is="measured: SIGKILL of the spmd command, rerun from its checkpoint",
        spmd_restarts=rs,
        spmd_identical_to_clean=_same(spmd.workdir, restarted.workdir),
        spmd_step_s=spmd_step,
      )
      g["after_startup"].update(
        spmd_with_restart=useful_spmd / (rs["wall_s"] - up_spmd),
        spmd_clean=useful_spmd / (spmd_wall - up_spmd),
      )
      g["after_startup"]["startup_s"]["spmd"] = up_spmd
      g["own_step_time"].update(
        spmd_with_restart=T * H * restarted_step / rs["wall_s"], spmd_clean=useful_spmd / spmd_wall
      )
      g["own_step_time"]["step_s"].update(spmd_clean=spmd_step, spmd_with_restart=restarted_step)
      g["wall_command_s"].update(spmd_clean=spmd_wall, spmd_with_restart=rs["wall_s"])
      g["useful_s"]["spmd"] = useful_spmd
    g["load"] = round(os.getloadavg()[0], 1)
    print(json.dumps(report["goodput"]), flush=True)
    save()

  if "chaos" in only:  # 4. Item 7: many kills, and the whole driver command SIGKILLed once.
    chaos = _Command(
      tmp,
      "chaos",
      H,
      T,
      shards,
      **G,
      **el,
      **{
        "faults.worker_kills": args.chaos_worker_kills,
        "faults.executor_kills": args.chaos_executor_kills,
        "faults.seed": args.seed,
      },
    )
    t0 = time.time()
    chaos.start()
    kill_at = math.ceil(0.4 * (T + 1) * W)
    while _done_count(chaos.workdir) < kill_at and chaos.proc.poll() is None:
      time.sleep(0.05)
    if chaos.proc.poll() is not None:
      raise RuntimeError(f"the chaos command ended before its kill; see {chaos.workdir}.log")
    done_at_kill = _done_count(chaos.workdir)
    survivors = chaos.kill()
    chaos.start()  # The same command again.
    out = chaos.wait()
    audit = _task_log_audit(_events(chaos.workdir), _results(chaos.workdir), W, T)
    report["chaos"] = {
      "driver_sigkills": 1,
      "driver_killed_after_done_tasks": done_at_kill,
      "processes_left_after_driver_kill": survivors,
      "worker_kills_landed": audit["worker_kills_timed"]
      + audit["worker_kills_mid_write"]
      + audit["worker_kills_mid_progress_save"],
      "executor_kills_landed": audit["executor_kills"],
      "task_log": audit,
      "identical_to_clean": _same(clean.workdir, chaos.workdir),
      "final_step": out["step"],
      "wall_command_s": time.time() - t0,
      "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(report["chaos"]), flush=True)
    save()

  if "hetero" in only:  # 5. A slow worker actor delays only the modules its paths touch.
    hs = os.path.join(tmp, "shards_hetero")
    base = _Command(tmp, "hetero_ref", H, T, hs, **HETERO, **el)
    base.run()
    fast = _step_s(base.workdir, H, T)
    delay = (args.slowdown - 1.0) * fast
    het = _Command(
      tmp,
      "hetero",
      H,
      T,
      hs,
      **HETERO,
      **el,
      **{"faults.step_delay_s": (delay,) + (0.0,) * (A - 1)},
    )
    _, het_wall = het.run()
    ev, res = _events(het.workdir), _results(het.workdir)
    running, leads, ahead = {}, [], 0  # actor -> phase of its running task.
    for e in ev:
      if e["event"] == "start":
        slow = running.get(0)
        if e["actor"] != 0 and slow is not None:
          leads.append(e["phase"] - slow)
          ahead += e["phase"] > slow
        running[e["actor"]] = e["phase"]
      elif e["event"] in ("done", "failed"):
        running.pop(e["actor"], None)
    per_actor = {}
    for r in res.values():
      if r.get("clock"):
        per_actor.setdefault(r["actor"], []).append(r["clock"]["steps"] / H)
    med = {a: statistics.median(v) for a, v in per_actor.items()}
    report["hetero"] = {
      "grid": "2x2 paths, levels (embed+block_0: 2 modules) x (block_1+head: 2 modules)",
      "step_delay_s_actor0": delay,
      "step_s_by_actor": med,
      "slowdown_measured": med[0] / statistics.median(v for a, v in med.items() if a != 0),
      "max_phase_lead": max(leads, default=0),
      "starts_of_later_phases_while_slow_trained": ahead,
      "wall_command_s": het_wall,
      "identical_to_clean_grid": _same(base.workdir, het.workdir),
      "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(report["hetero"]), flush=True)
    save()

  if "pin" in only:  # 6. elastic.pin_cpus on vs off: the clean grid run, pairs in turn.
    pin_shards = os.path.join(tmp, "shards_pin")
    _Command(tmp, "warm_pin", H, T, pin_shards, **G, **el, **{"faults.stop_after_tasks": A}).run()
    walls, steps = {True: [], False: []}, {True: [], False: []}
    for r in range(args.pairs):
      for pin in (r % 2 == 0, r % 2 == 1):  # Alternating which goes first.
        c = _Command(
          tmp, f"pin_{pin}_{r}", H, T, pin_shards, **G, **el, **{"elastic.pin_cpus": pin}
        )
        walls[pin].append(c.run()[1])
        steps[pin].append(_step_s(c.workdir, H, T))
    report["pin_cpus"] = {
      "pairs": args.pairs,
      "wall_command_s": {"on": walls[True], "off": walls[False]},
      "median_step_s": {"on": steps[True], "off": steps[False]},
      "wall_off_over_on": statistics.median(walls[False]) / statistics.median(walls[True]),
      "step_off_over_on": statistics.median(steps[False]) / statistics.median(steps[True]),
      "load": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(report["pin_cpus"]), flush=True)
    save()
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
