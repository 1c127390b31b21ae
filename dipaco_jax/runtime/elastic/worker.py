"""Worker actors: run tasks (phase, worker) — H inner steps of one path — from and to storage.

Task (t, w) also evaluates the path on its own validation shard at step t*H
when the spmd loop would (after outer step t: every eval.every_steps, and at the
end); tasks (T, w) only evaluate.

A worker jits the recipe's single-path steps once (recipe.py: the train step
with its microbatches, remat and chunked loss, the eval and scoring steps, each
mapped over a leading axis of 1: the per-device block of the synchronous
program) and reuses them for every task of every path; each step's metrics pass
the recipe's divergence guard, as in the spmd loop. A task reads only versioned
inputs (the path's modules at version `phase`, the worker's AdamW state and data
position at `phase`) and writes versioned outputs for `phase + 1`: its deltas
Δ = θ_module − θ_worker (what the executors average), AdamW state and data
position, so running a task twice (a retry after a kill or a timeout) writes
the same bytes.

Discriminative re-shards: task t reads routing phase k's shards (k = the
re-shards at or before t; the coordinator runs no such task before the driver
wrote them). The first task of a phase (t = its re-shard step) starts its data
position fresh on the new shards, as the synchronous loop's new feed, and
restarts the schedule of the AdamW state it loads (routing.restart_schedule,
as the spmd loop); the inputs in storage stay as written, so a retry is the same.

Streamed (outer.fragments, outer.overlap), `phase` counts the schedule's units
(fragments.py): a task trains one unit's inner steps from the params streamed.py
assembles, keeps its params for the next unit, and sends the deltas of the groups
its unit's end syncs.

The task's files are task_io.py's (TaskStorage), its evaluations and guard
task_checks.py's (TaskChecks): PathWorker mixes both in.
"""
# pylint: disable=invalid-name

import functools
import os
import time

import jax
import numpy as np

from dipaco_jax import routing
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import profiling
from dipaco_jax.routing import scoring
from dipaco_jax.runtime import dispatch
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import downlink
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import jit_cache
from dipaco_jax.runtime.elastic import pacing
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import streamed
from dipaco_jax.runtime.elastic import task_checks
from dipaco_jax.runtime.elastic import task_io


def _pin_cpus(node: str, cpus) -> None:
  """Every thread of this process onto `cpus`, if it runs on Ray node `node` (Linux)."""
  import ray  # pylint: disable=g-import-not-at-top

  if ray.get_runtime_context().get_node_id() != node or not hasattr(os, "sched_setaffinity"):
    return
  for tid in os.listdir("/proc/self/task"):  # Threads Ray started already; later ones inherit.
    try:
      os.sched_setaffinity(int(tid), cpus)
    except ProcessLookupError:  # The thread ended meanwhile.
      pass


def programs(recipe) -> dict:
  """The worker's jitted programs, each the recipe's single-path function over a leading 1."""
  return {
    "step": jax.jit(jax.vmap(recipe.train_step), donate_argnums=(0, 1)),
    "init_opt": jax.jit(jax.vmap(recipe.init_opt)),
    "eval": jax.jit(jax.vmap(recipe.eval_step)),
    "norms": jax.jit(jax.vmap(recipe.group_norms)),
    "deltas": jax.jit(recipe.worker_deltas),
    "encode": jax.jit(recipe.encode_deltas),  # outer.compression: the deltas' wire form.
    "rebuild": jax.jit(recipe.apply_update),  # outer.compression: v<t> from v<t-1> and u<t>.
    "finite": jax.jit(guard_lib.all_finite),
    # Re-shard scoring tasks: per-token log p of one path, the batch layout [1, B, T].
    "logp": jax.jit(jax.vmap(recipe.token_logprobs)),
  }


class PathWorker(task_io.TaskStorage, task_checks.TaskChecks):
  """One worker actor: any (phase, worker) task, one at a time."""

  def __init__(
    self,
    config,
    workdir: str,
    index: int,
    compile_cache: str | None = None,
    pin=None,
    faults: faults_lib.Faults = faults_lib.NO_FAULTS,
  ):
    """`compile_cache`: config.elastic.compile_cache for this process (None: leave JAX's).

    `pin`: (node id, CPU cores) from the driver (elastic.pin_cpus): on that Ray node this
    process runs on those cores only, from here on, so XLA's CPU thread pool (sized from
    the affinity when the backend starts, on the first compile) spans them alone.
    `faults`: what to inject into its tasks (tests, benchmarks: runtime/faults.py).
    """
    if pin is not None:
      _pin_cpus(*pin)
    if compile_cache is not None:
      jit_cache.use(compile_cache)
    self.config, self.workdir, self.index = config, str(workdir), int(index)
    self.faults = faults
    self.grid = grid_lib.Grid(config)
    self.recipe = self.grid.recipe
    fns = programs(self.recipe)
    self._step, self._init_opt, self._eval = fns["step"], fns["init_opt"], fns["eval"]
    self._norms, self._deltas, self._finite = fns["norms"], fns["deltas"], fns["finite"]
    self._logp, self._encode, self._rebuild = fns["logp"], fns["encode"], fns["rebuild"]
    # The last task's modules: with compression, the next reads their updates' codes instead
    # of the new versions (downlink.py).
    self._link = downlink.Downlink(self.grid, self.workdir, self._rebuild)
    self._ref = {}  # Streamed: worker -> (phase, the guard's reference norms) from its first unit.
    # (split, routing phase, worker) -> its evaluation batches (the same at every evaluation).
    self._val = {}
    # Early stopping on held-out training documents (shard_plan's): trained on the rest only.
    self._rest, self._heldout = early_stopping.holdouts(config)
    self._shard_sets = {}  # Routing phase -> its shards, opened on first use.
    self._ahead = dispatch.dispatch_ahead(config)  # As the spmd loop: on TPU/GPU, off on CPU.
    self._progress = None  # The running task's: see progress().
    # (phase, worker) -> seconds of steps its task may run (elastic.pace_steps: stop_after).
    self._stops = {}

  def pid(self) -> int:
    return os.getpid()

  def stop_after(self, phase: int, worker: int, seconds: float) -> None:
    """Task (phase, worker) stops at its first step `seconds` after the end of its first.

    The driver's wall deadline for an actor with no measured step time yet
    (elastic.pace_steps: pacing.Pacer.stop_after_s), sent once while the task runs
    (max_concurrency=2), or with the lease. Durations only: no two clocks compared.
    """
    self._stops[(int(phase), int(worker))] = float(seconds)

  def progress(self) -> dict | None:
    """The running training task's progress, or None (the driver asks when its lease expires).

    Durations measured here, so no two hosts' clocks are compared: {"phase",
    "worker", "steps" (inner steps done by this attempt), "of" (the steps it had
    to do: H, less a progress save's), "elapsed_s" (since the attempt began),
    "since_step_s" (since its last step, None before the first)}. Answers while
    a task runs: the actor runs two calls at a time (max_concurrency=2).
    """
    p = self._progress
    if p is None:
      return None
    now = time.time()
    return {
      "phase": p["phase"],
      "worker": p["worker"],
      "steps": p["steps"],
      "of": p["of"],
      "elapsed_s": now - p["start"],
      "since_step_s": None if p["last"] is None else now - p["last"],
    }

  def score(self, step: int, path: int, faults: dict | None = None) -> dict:
    """Re-shard scoring task: path `path` at module version `step` scores the router split.

    The expensive half of a discriminative re-shard (every path's log-likelihood
    of up to routing.router_max_docs documents) runs on the pool, one task per
    path; the driver fits the router on the gathered columns. Writes
    `storage.scores_file` (whole, or not at all), so a retry writes the same
    bytes. `faults`: the driver's fault spec for this task (runtime/faults.py).
    """
    start = time.time()
    worker = int(np.flatnonzero(self.grid.topo.path_of_worker == path)[0])
    params = self._load_params(int(step), worker)
    T, B = routing.score_len(self.config), self.config.data.batch_size

    def units(tokens):  # scoring.PathScorer.score's contract, for this one path.
      out = []
      for i in range(0, len(tokens), B):
        rows = tokens[i : i + B]
        inputs, targets = scoring.unit_batch([rows], B, T)
        logp = np.asarray(jax.device_get(self._logp(params, inputs, targets)))
        out += [logp[0, b, : len(t)] for b, t in enumerate(rows)]
      return out

    s_N = routing.score_router_split(self.config, units, self.config.routing.prefix_len)
    faults_lib.task_plan(self.faults, self.index, faults).at(
      "wrote", kind="score", n=1, of=1
    )  # Before the write: it is whole or absent.
    k = self.grid.reshard_steps.index(int(step)) + 1
    storage.save_array(storage.scores_file(self.workdir, k, int(path)), s_N)
    return {"path": int(path), "docs": len(s_N), "seconds": time.time() - start}

  def run(
    self,
    phase: int,
    worker: int,
    faults: dict | None = None,
    steps: int | None = None,
    stop_after_s: float | None = None,
  ) -> dict:
    """Task (phase, worker): validation at step phase*H if due, then H inner steps (none at T).

    `steps`: fewer inner steps than H (elastic.pace_steps: the driver's pacing.Pacer);
    a retry that finds a save past them keeps the save's steps. `stop_after_s`: the
    deadline of `stop_after`, given with the lease (an actor not measured yet).

    With elastic.progress_every_steps = n > 0 the task saves its progress every n
    inner steps, and an attempt that finds a save resumes there (the same bytes
    as one attempt from the start: the state saved is all the steps read).
    `faults`: the driver's fault spec for this task (runtime/faults.py).
    """
    start = time.time()
    self._progress = {"phase": int(phase), "worker": int(worker), "start": start}
    span = self.grid.sched.span(int(phase))
    self._progress.update(steps=0, of=span[1] - span[0], last=None)
    if stop_after_s is not None:
      self.stop_after(phase, worker, stop_after_s)
    try:
      return self._run(start, phase, worker, faults, steps)
    finally:
      self._progress = None
      self._stops.clear()  # Its deadline, and any that came after its own task ended.

  def _run(self, start: float, phase: int, worker: int, faults: dict | None, steps=None) -> dict:
    """run's body; `start`: when the attempt began."""
    wd, phase, worker = self.workdir, int(phase), int(worker)
    plan = faults_lib.task_plan(self.faults, self.index, faults)
    result = {"phase": phase, "worker": worker, "actor": self.index, "pid": os.getpid()}
    if hasattr(os, "sched_getaffinity"):  # The cores it ran on (elastic.pin_cpus).
      result["cpus"] = sorted(os.sched_getaffinity(0))
    H, every = self.grid.H, int(self.config.elastic.progress_every_steps)
    # Streamed: `phase` is a unit (fragments.py) of `outer` phase; it runs steps s0+1..s1.
    sched, unit = self.grid.sched, phase
    (s0, s1), outer = sched.span(unit), sched.phase(unit)
    first = unit == sched.first_unit(outer)  # Streamed: the phase's first unit evaluates.
    # This task's inner steps: the unit's, or fewer where elastic.pace_steps asks (not streamed).
    n_steps = s1 - s0 if steps is None else min(s1 - s0, int(steps))
    k = self.grid.routing_phase(phase)  # After a re-shard at `phase`: its new shards already.
    saved = self._saved_progress(phase, worker) if phase < self.grid.U else None
    batcher = self._batcher(worker, k) if phase < self.grid.U else None
    losses = []
    if sched.streamed:  # Its modules and own params, Δ's reference, the guard's (streamed.py).
      kept = self._ref.get(worker)
      start_params, against, ref, down = streamed.inputs(
        self.grid, wd, worker, unit, self._link, need_ref=kept is None or kept[0] != outer
      )
    else:
      start_params, down = self._receive(phase, worker)  # The path's modules: what Δ is against.
      against = start_params
    link_down = 0.0
    if phase > 0:  # The outer exchange's downlink (phase 0 reads the initial θ̄).
      result["bytes_down"] = down
      t_link = time.time()
      plan.at("received", bytes=down)
      link_down = time.time() - t_link
    if saved is not None:  # A retry: the evaluation and the first steps are in the save.
      rec, folder = saved
      params = self._load_groups(worker, lambda g, _: folder / f"{g}.npz")
      opt = storage.load_tree(folder / "opt.npz", self.grid.inner_opt_template())
      batcher.set_state(storage.load_json(folder / "data.json"))
      losses = list(rec["loss"])
      result.update({key: rec[key] for key in ("val_loss", "stop_loss") if key in rec})
      result["resumed_at_step"] = rec["step"]
      self._progress["of"] = max(n_steps - len(losses), 0)
    else:
      params = start_params
      step0 = outer * H
      eval_every = self.config.eval.every_steps
      if first and outer > 0 and (step0 % eval_every == 0 or outer == self.grid.T):
        # After outer step `phase` (and its re-shard), as the spmd loop.
        result["val_loss"] = self._evaluate(params, worker, k)
        if self._heldout is not None:  # Early stopping's loss (shard_plan's stop_batches).
          result["stop_loss"] = self._evaluate(params, worker, k, "heldout")
      if phase == self.grid.U:  # The last evaluation: nothing left to train.
        return {**result, "start": start, "end": time.time(), "loss": [], "grad_norm": None}
      if phase == 0:
        opt = self._init_opt(params)
      else:
        opt = storage.load_tree(
          storage.worker_opt_file(wd, worker, phase), self.grid.inner_opt_template()
        )
        if phase in self.grid.reshard_steps:  # A new routing phase: a fresh feed of its shards.
          if self.config.routing.restart_schedule:  # Paper Fig. 10: the cosine starts over.
            # Back on the host, as every other task's loaded state (the step's jit cache key).
            opt = jax.device_get(self.recipe.restart_schedule(jax.device_put(opt)))
        else:
          batcher.set_state(storage.load_json(storage.worker_data_file(wd, worker, phase)))
    if not sched.streamed:
      guard = self._guard(phase, worker, jax.device_get(self._norms(start_params)), losses)
    else:  # The phase's reference norms: its first unit's start (kept for its later units).
      if ref is not None:
        self._ref[worker] = (outer, jax.device_get(self._norms(ref)))
      guard = self._guard(outer, worker, self._ref[worker][1], losses, unit=unit)
    # "link": time in the fault plan's link hooks (a benchmark's injected transfer delay).
    clock = {"load": time.time() - start - link_down, "progress_save": 0.0, "link": link_down}
    t0 = time.time()
    pending, m = None, None  # pending: a dispatched step's metrics, unread.

    resumed = len(losses)
    floor = int(self.config.elastic.min_inner_steps)  # A deadline stops no task below it.
    read_at = []  # When each step's metrics were read: the step time without the compilation.
    # config.profile: the window's steps this task runs, traced into profile/w<worker>.
    window = profiling.Window(self.config, os.path.join(wd, "profile", f"w{worker}"))

    def read(m):  # Blocks on a step's metrics and passes them through the guard.
      m = jax.device_get(m)
      guard.check(s0 + len(losses) + 1, m["loss"], m["param_norm"])
      losses.append(float(m["loss"][0]))
      read_at.append(time.time())
      self._progress.update(steps=len(losses) - resumed, last=time.time())
      return m

    try:
      if n_steps < s1 - s0:
        self._progress["of"] = max(n_steps - len(losses), 0)
      for i in range(len(losses), n_steps):
        limit = self._stops.get((phase, worker))
        if pacing.past_deadline(limit, read_at[:1], len(losses), floor, time.time()):
          result["deadline_s"] = limit  # Stopped by it: fewer steps.
          break
        # config.dispatch_ahead (docs/performance.md): step i+1 is dispatched before step i's
        # metrics are read, so the host's batch and bookkeeping overlap step i+1 on the device.
        window.before(s0 + i + 1)
        params, opt, m_next = self._step(params, opt, batcher.next_batch())
        if pending is not None:
          m = read(pending)
        pending = m_next
        save = every and (i + 1) % every == 0 and i + 1 < n_steps
        if save or not self._ahead:
          m, pending = read(pending), None
        if save:
          saved_at = time.time()
          if not bool(self._finite(params)):
            guard.not_finite(s0 + i + 1)
          rec = {"H": H, "step": i + 1, "loss": losses, "grad_norm": float(m["grad_norm"][0])}
          rec.update({key: result[key] for key in ("val_loss", "stop_loss") if key in result})
          self._save_progress(phase, worker, rec, params, opt, batcher, plan)
          clock["progress_save"] += time.time() - saved_at
        window.after(s0 + i + 1, params)
        plan.at("step")
    finally:  # A task stopped inside the window (a guard, a fault) ends its trace.
      window.close()
    if pending is not None:
      m = read(pending)
    if not bool(self._finite(params)):  # Nothing non-finite leaves the task (as spmd's saves).
      guard.not_finite(s1)
    sent = sched.synced(unit)  # Every group, unless streamed: the fragment its end syncs.
    mine = lambda tree: {g: tree[g] for g in tree if g in sent}
    deltas = self._deltas(against, mine(params))
    residual = None
    if self.recipe.compressed:  # Codes and scales cross; what they dropped stays here (ef).
      residual = self._residual(phase, worker) if self.recipe.feedback else None
      deltas, new = self._encode(deltas, None if residual is None else mine(residual))
      residual = None if residual is None else {**residual, **(new or {})}
    deltas, residual, opt = jax.device_get((deltas, residual, opt))
    clock["steps"] = time.time() - t0 - clock["progress_save"]
    t0 = time.time()
    out = storage.worker_out_dir(wd, worker, phase + 1)
    writes = self._group_writes(
      lambda g: storage.delta_file(wd, worker, phase + 1, g), deltas, worker, sent
    )
    if sched.streamed:  # The next unit trains on from these (streamed.own).
      params = jax.device_get(params)
      writes += self._group_writes(
        lambda g: streamed.params_file(wd, worker, phase + 1, g), params, worker
      )
    if residual is not None:
      writes += self._group_writes(
        lambda g: storage.ef_file(wd, worker, phase + 1, g), residual, worker
      )
    writes.append(
      functools.partial(storage.save_tree, storage.worker_opt_file(wd, worker, phase + 1), opt)
    )
    writes.append(
      functools.partial(
        storage.save_json, storage.worker_data_file(wd, worker, phase + 1), batcher.get_state()
      )
    )
    task_io.write_all(writes, plan, "output")  # The last one: everything but done.json.
    clock["save"] = time.time() - t0
    # The outer exchange's uplink: the delta files' bytes (codes and scales with compression).
    groups = self.grid.modules_of_worker(worker)
    result["bytes_up"] = sum(
      storage.size(storage.delta_file(wd, worker, phase + 1, g)) for g, _ in groups if g in sent
    )
    t0 = time.time()
    plan.at("sent", bytes=result["bytes_up"])
    clock["link"] += time.time() - t0
    if len(read_at) > 1:  # Seconds per step after the first (elastic.pace_steps reads it).
      result["step_s"] = (read_at[-1] - read_at[0]) / (len(read_at) - 1)
    result.update(
      start=start,
      end=time.time(),
      clock=clock,
      loss=losses,
      # None of this attempt's steps ran (a save already past `steps`): the save's own.
      grad_norm=float(np.asarray(m["grad_norm"])[0]) if m is not None else saved[0]["grad_norm"],
    )
    storage.save_json(out / "done.json", result)
    storage.progress_dir(wd, worker, phase).rmtree(missing_ok=True)  # Done: saves not needed.
    return result
