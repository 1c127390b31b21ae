"""Outer executors: each owns some store groups and steps a module once its workers reported.

`report(phase, worker)` records that task (phase, worker) is complete and
loads that worker's deltas for the executor's groups (online gathering). When
every worker through a module has reported, the module takes the recipe's outer
step (`Recipe.module_outer_step`: α, √P, Nesterov, the spmd program's pieces)
on the workers' deltas in WORKER order, so the result does not depend on the
order reports arrive in. With elastic.token_weights, a delta's α is scaled by the
share of H its task trained (core/contribution.py).
Version t+1 of a module is a pure function of version t and the phase's task
outputs, written once to its own file: a delta can never be applied twice.
Streamed (outer.fragments, outer.overlap; fragments.py), t counts units: unit t
steps the modules of the fragment its end syncs, from the version the schedule
names (`stored`), and the other modules count as stepped without a new file.

Quorum (config.elastic.quorum < 1, beyond the paper; docs/elastic.md): a module
may step once the workers that reported hold that fraction of its α-weight and
`grace_s` has passed since that moment (`poll` checks the clock). The workers
it stepped with are recorded; a delta that missed the step (late) either joins
the module's next step (`late_deltas="next"`: its own Δ, against its own
starting version; "discount": the same, its weight × late_discount) or is
dropped ("drop"). Staleness is bounded to one phase:
step t+1 waits until every phase-t report through the module is in. In "next"
and "discount" modes the last step (phase T-1) waits for every report: there is no later step
to carry a late delta to.

α: phase t's step weighs its workers with the α of t's routing phase (phase 0:
the constructor's; after a discriminative re-shard: the file the driver wrote
before any task of that phase ran, storage.alpha_file). A late delta carried
across a re-shard takes the new phase's α.

The executor's own state (reports received, modules stepped and with whom,
when quorums were reached) is snapshotted before each call returns, so an
executor killed mid-phase comes back (Ray restarts it without state) and
carries on from the snapshot. It holds only the phases a step may still need:
once phases t and t+1 are complete (every report in, every module of its
groups stepped), phase t is *settled* and forgotten (`settled` counts them), so
the snapshot stays the same size over a run of any length; a report of a
settled phase (a driver's re-report after its restart) answers that every
module stepped, and steps nothing.
"""
# pylint: disable=invalid-name

import os
import threading
import time

import jax
import numpy as np

from dipaco_jax.core import contribution
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import jit_cache
from dipaco_jax.runtime.elastic import storage


def snapshot_file(workdir: str, index: int):
  return storage.root(workdir) / "executors" / f"x{index}.json"


def settled_file(workdir: str, index: int, phase: int):
  """Quorum only: a settled phase's record (workers each module stepped with, deltas carried)."""
  return storage.root(workdir) / "executors" / f"x{index}" / f"phase{phase:05d}.json"


def quorum_steps(workdir: str, index: int) -> dict[int, dict]:
  """Executor `index`'s steps without every worker: {phase: {module: the workers it used}}.

  Settled phases from their files, the others from the snapshot.
  """
  folder = settled_file(workdir, index, 0).parent
  out = {t: storage.load_json(f)["used"] for t, f in storage.numbered(folder, "phase").items()}
  snap = snapshot_file(workdir, index)
  if snap.exists():
    out.update({int(t): u for t, u in storage.load_json(snap).get("used", {}).items()})
  return {t: u for t, u in sorted(out.items()) if u}


def assign_groups(group_names, num_executors: int) -> list[list[str]]:
  """Store groups dealt round-robin to the executors (each gets at least one or none)."""
  out = [[] for _ in range(num_executors)]
  for i, g in enumerate(group_names):
    out[i % num_executors].append(g)
  return out


class OuterExecutor:
  """Owns `groups`; applies each module's outer step when its phase is complete (or has quorum)."""

  def __init__(self, config, workdir: str, index: int, groups, alpha_W, compile_cache=None):
    """`compile_cache`: config.elastic.compile_cache for this process (None: leave JAX's)."""
    if compile_cache is not None:
      jit_cache.use(compile_cache)
    self.grid = grid_lib.Grid(config)
    self.workdir, self.index, self.groups = str(workdir), int(index), list(groups)
    self.alpha_W = np.asarray(alpha_W, np.float32)
    self._alphas = {0: self.alpha_W}  # Routing phase -> its α (phases >= 1 read lazily).
    self.outer_enabled = config.outer.enabled
    e = config.elastic
    self.quorum, self.grace_s, self.late = float(e.quorum), float(e.grace_s), e.late_deltas
    self.discount, self.token_weights = float(e.late_discount), bool(e.token_weights)
    self._snap = snapshot_file(self.workdir, self.index)
    state = storage.load_json(self._snap) if self._snap.exists() else {}
    self.received = {int(k): set(v) for k, v in state.get("received", {}).items()}
    self.applied = {int(k): set(v) for k, v in state.get("applied", {}).items()}
    # Quorum only: phase -> module -> the workers it stepped with (when not all); quorum times.
    self.used = {int(k): dict(v) for k, v in state.get("used", {}).items()}
    self.quorum_at = {int(k): dict(v) for k, v in state.get("quorum_at", {}).items()}
    self.carried = {int(k): dict(v) for k, v in state.get("carried", {}).items()}  # Late, joined.
    self.settled = int(state.get("settled", 0))  # Phases < settled: complete and forgotten.
    mine = [(g, e) for g, e in self.grid.used_modules() if g in self.groups]
    self._mine = sorted(grid_lib.module_key(g, e) for g, e in mine)
    self._cache = {}  # (phase, group, worker) -> that worker's delta of the group.
    self._step = None
    self._decode = {}  # Group -> its jitted decoding (outer.compression).
    # outer.compression: a new version from the old and the update's codes (a worker's program).
    self._rebuild = jax.jit(self.grid.recipe.apply_update)
    self._lock = threading.Lock()  # report/poll vs each other (max_concurrency=2 for pid()).

  def pid(self) -> int:
    return os.getpid()

  def _snapshot(self) -> None:
    state = {
      "groups": self.groups,
      "settled": self.settled,
      "received": {str(k): sorted(v) for k, v in self.received.items()},
      "applied": {str(k): sorted(v) for k, v in self.applied.items()},
    }
    if self.quorum < 1.0:
      state.update(
        used={str(k): v for k, v in self.used.items()},
        quorum_at={str(k): v for k, v in self.quorum_at.items()},
        carried={str(k): v for k, v in self.carried.items()},
      )
    storage.save_json(self._snap, state)

  def _alpha(self, phase: int) -> np.ndarray:
    """α of the routing phase outer phase `phase` trains in."""
    k = self.grid.routing_phase(phase)
    if k not in self._alphas:
      alpha = storage.load_json(storage.alpha_file(self.workdir, k))
      self._alphas[k] = np.asarray(alpha, np.float32)
    return self._alphas[k]

  def _step_fn(self):
    if self._step is None:
      self._step = jax.jit(self.grid.recipe.module_outer_step)
    return self._step

  def _decode_fn(self, group: str):
    """The jitted decoding of a worker's delta file of `group` (outer.compression)."""
    if group not in self._decode:
      template = self.grid.module_template(group)
      self._decode[group] = jax.jit(lambda wire: self.grid.recipe.decode_deltas(wire, template))
    return self._decode[group]

  def _worker_delta(self, phase: int, group: str, worker: int):
    key = (phase, group, worker)
    if key not in self._cache:
      path = storage.delta_file(self.workdir, worker, phase + 1, group)
      delta = storage.load_tree(path, self.grid.delta_template(group))
      if self.grid.recipe.compressed:  # Codes and scales: decoded here, summed in float32.
        delta = jax.device_get(self._decode_fn(group)(delta))
      self._cache[key] = delta
    return self._cache[key]

  def _module(self, group: str, module: int, version: int, kind: str = "v"):
    template = self.grid.module_template(group)
    if kind == "opt":
      template = self.grid.module_opt_template(group)
    return storage.load_tree(
      storage.module_file(self.workdir, group, module, version, kind), template
    )

  def _apply(self, phase: int, group: str, module: int, workers: list[int], late=()) -> None:
    """Module (group, module): version phase -> phase + 1 from the workers, in worker order.

    `late`: workers whose phase-1 deltas missed that step (quorum, "next"); each
    joins with its own Δ, taken against the version it started from.
    """
    wd = self.workdir
    was = self.grid.sched.stored(phase, group)  # phase, unless streamed (fragments.py).
    theta = self._module(group, module, was)
    opt = self._module(group, module, was, "opt")
    parts = [self._worker_delta(phase, group, w) for w in workers]
    parts += [self._worker_delta(phase - 1, group, w) for w in late]
    deltas_N = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
    alpha_N = self._weights(phase, workers, late)
    if self.outer_enabled:
      old = theta
      theta, opt, m = jax.device_get(self._step_fn()(theta, opt, deltas_N, alpha_N))
      if self.grid.recipe.compressed:  # The update crosses as codes; v<t+1> is what they rebuild.
        storage.save_tree(storage.module_file(wd, group, module, phase + 1, "u"), m["update"])
        theta = jax.device_get(self._rebuild(old, m["update"]))
    else:  # No outer step: the module becomes its first worker's params (spmd's sync_store).
      theta = jax.tree.map(
        lambda t, d: (t.astype(np.float32) - d[:1]).astype(t.dtype), theta, parts[0]
      )
    storage.save_tree(storage.module_file(wd, group, module, phase + 1, "opt"), opt)
    storage.save_tree(storage.module_file(wd, group, module, phase + 1), theta)

  def _steps(self, phase: int, worker: int) -> int:
    """The inner steps task (phase, worker) trained (its done.json's losses)."""
    done = storage.worker_out_dir(self.workdir, worker, phase + 1) / "done.json"
    return len(storage.load_json(done)["loss"])

  def _weights(self, phase: int, workers: list[int], late) -> np.ndarray:
    """The step's weights (core/contribution.py): α, with tokens trained and staleness if on."""
    alpha_N = self._alpha(phase)[list(workers) + list(late)]
    steps = None
    if self.token_weights:
      steps = [self._steps(phase, w) for w in workers] + [self._steps(phase - 1, w) for w in late]
    late_N = [0] * len(workers) + [1] * len(late) if self.late == "discount" else None
    return contribution.weights(alpha_N, steps, self.grid.H, late_N, self.discount)

  def _late(self, phase: int, key: str, workers: list[int]) -> list[int]:
    """Workers through module `key` whose phase-`phase` deltas missed its step (reported since)."""
    used = self.used.get(phase, {}).get(key)
    if used is None:  # Stepped with all of them (or not yet stepped).
      return []
    return [w for w in workers if w not in used and w in self.received.get(phase, ())]

  def _try_step(self, phase: int, group: str, module: int, now: float) -> bool:
    """Steps module (group, module) in `phase` if it may now; True if it did."""
    key = grid_lib.module_key(group, module)
    applied = self.applied.setdefault(phase, set())
    if key in applied or phase >= self.grid.U:
      return False
    if (
      self.grid.sched.streamed
      and phase > self.settled
      and key not in self.applied.get(phase - 1, ())
    ):
      return False  # Streamed: a module's units step in order (a later unit may report first).
    if group not in self.grid.sched.synced(phase):  # Streamed: not this unit's fragment.
      if not all(
        w in self.received.get(phase, ()) for w in self.grid.workers_through(group, module)
      ):
        return False
      applied.add(key)
      self._snapshot()
      return True
    workers = self.grid.workers_through(group, module)
    got = [w for w in workers if w in self.received.get(phase, ())]
    if not got:
      return False
    late = []
    if phase > 0 and self.used.get(phase - 1, {}).get(key) is not None:
      # Bounded staleness: every phase-(t-1) report through the module is in first.
      if not all(w in self.received.get(phase - 1, ()) for w in workers):
        return False
      late = self._late(phase - 1, key, workers) if self.late != "drop" else []
    if len(got) < len(workers):
      last = phase == self.grid.U - 1 and self.late != "drop"
      if self.quorum >= 1.0 or last:
        return False
      a = np.asarray(self._alpha(phase), np.float64)
      if a[got].sum() < self.quorum * a[workers].sum():
        return False
      reached = self.quorum_at.setdefault(phase, {})
      if key not in reached:  # The grace window starts when the quorum is reached.
        reached[key] = now
        self._snapshot()
      since = reached[key]
      if now < since + self.grace_s:
        return False
      self.used.setdefault(phase, {})[key] = got
    self._apply(phase, group, module, got, late)
    applied.add(key)
    if late:
      self.carried.setdefault(phase, {})[key] = late
    self._snapshot()
    for w in got:
      self._cache.pop((phase, group, w), None)
    for w in late:
      self._cache.pop((phase - 1, group, w), None)
    return True

  def _stepped(self, phases) -> dict[int, list[str]]:
    """The modules of this executor's groups stepped in each of `phases`."""
    return {
      t: list(self._mine)
      if t < self.settled
      else sorted(k for k in self.applied.get(t, ()) if k.split("/")[0] in self.groups)
      for t in phases
    }

  def _complete(self, phase: int) -> bool:
    """Every worker reported phase `phase` and every module of this executor stepped in it."""
    applied = self.applied.get(phase, set())
    return len(self.received.get(phase, ())) == self.grid.W and all(
      k in applied for k in self._mine
    )

  def _settle(self) -> bool:
    """Forgets the phases no step can need again (t, once t and t+1 are complete)."""
    before = self.settled
    while self._complete(self.settled) and self._complete(self.settled + 1):
      t = self.settled
      if self.quorum < 1.0:  # Which deltas went where stays on record (docs/elastic.md).
        record = {"used": self.used.get(t, {}), "carried": self.carried.get(t, {})}
        storage.save_json(settled_file(self.workdir, self.index, t), record)
      for state in (self.received, self.applied, self.used, self.quorum_at, self.carried):
        state.pop(t, None)
      self.settled += 1
    return self.settled != before

  def report(self, phase: int, worker: int) -> dict[int, list[str]]:
    """Task (phase, worker) is done; returns {phase: modules stepped} for phase and phase + 1.

    Phase + 1 is there because a late report can unblock the next step (quorum); streamed,
    the units after it that waited for its step too.
    """
    phase, worker = int(phase), int(worker)
    with self._lock:
      if phase < self.settled:  # Stepped everywhere, long ago: a re-report after a restart.
        return self._stepped((phase, phase + 1))
      received = self.received.setdefault(phase, set())
      if worker not in received:
        received.add(worker)
        self._snapshot()
      now, last = time.time(), phase + 1
      for group in self.groups:
        module = int(self.grid.group[group].module_of_worker[worker])
        key = grid_lib.module_key(group, module)
        if key not in self.applied.get(phase, ()) and group in self.grid.sched.synced(phase):
          self._worker_delta(phase, group, worker)  # Gathered as it arrives.
        self._try_step(phase, group, module, now)
        self._try_step(phase + 1, group, module, now)
        t = phase + 1  # Streamed: later units that waited for this one's step (in order).
        while self.grid.sched.streamed and self._try_step(t + 1, group, module, now):
          t += 1
        last = max(last, t)
      out = self._stepped(range(phase, last + 1))
      if self._settle():
        self._snapshot()
      return out

  def poll(self) -> tuple[dict[int, list[str]], bool]:
    """Steps the modules whose grace window has passed: ({phase: modules stepped}, waiting).

    waiting: some module has its quorum but still waits (its window, or a late
    report of the phase before).
    """
    with self._lock:
      now, out = time.time(), {}
      for phase, keys in sorted(self.quorum_at.items()):
        for key in list(keys):
          group, module = key.split("/")
          if group in self.groups and self._try_step(phase, group, int(module), now):
            out.setdefault(phase, []).append(key)
      waiting = any(
        k not in self.applied.get(t, ()) for t, keys in self.quorum_at.items() for k in keys
      )
      return {t: sorted(k) for t, k in out.items()}, waiting


def rebuild(config, workdir: str, index: int, group: str, module: int, phase: int, alpha_W):
  """Writes module (group, module)'s version phase + 1 (and momentum, update) again.

  As executor `index` stepped it: the workers it used (quorum: its records) and the
  late deltas it carried. For repair.py: the files a damage line had moved aside.
  """
  ex = OuterExecutor(config, workdir, index, [group], alpha_W)  # Reads its records only.
  key = grid_lib.module_key(group, module)
  workers = quorum_steps(workdir, index).get(phase, {}).get(key)
  record = settled_file(workdir, index, phase)
  carried = storage.load_json(record).get("carried", {}) if record.exists() else {}
  late = carried.get(key) or ex.carried.get(phase, {}).get(key) or []
  ex._apply(phase, group, module, workers or ex.grid.workers_through(group, module), late)  # pylint: disable=protected-access
