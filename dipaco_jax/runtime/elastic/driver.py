"""The elastic driver: Ray cluster, actors, the dispatch loop and the final checkpoint.

`run(config, workdir)` is `train_and_evaluate` for `dipaco.mode="elastic"`.
The driver holds no training state: the coordinator (queue), the executors
(outer steps) and storage do; killing the command and rerunning it resumes.
The final store, momentum, worker params, AdamW states and data positions (and
early stopping's best set) are written as one orbax checkpoint in the
synchronous mode's layout, so evaluation and serving read an elastic workdir
like any other. Evaluation runs as part of the tasks on the pool (worker.py);
early stopping runs in the driver after each evaluation phase completes.
Discriminative re-shards run in the driver too (`_Resharder`): once every
module holds the re-shard's version, it fits the router on those paths (the
synchronous `ShardPlan.reshard`), writes the shards and the phase's α, and
only then lets the coordinator hand out the phase's tasks.
"""
# pylint: disable=invalid-name

import json
import os
import socket
import time

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import routing
from dipaco_jax import saved_config
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import paths as paths_lib
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.core import sharding
from dipaco_jax.io import checkpoint as ckpt_lib
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime import shard_plan
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import worker as worker_lib
from dipaco_jax.runtime.elastic.errors import FORMAT
from dipaco_jax.runtime.elastic.errors import ElasticConfigError

META = "meta.json"  # Under <workdir>/elastic (errors.META).


def _by_path(tree) -> dict:
  return {jax.tree_util.keystr(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _group_of(key: str, groups) -> str | None:
  return next((g for g in groups if f"['{g}']" in key), None)


def _module_rows(full, template, group: str, module: int):
  """Module `module`'s rows of a store-shaped tree (params or momentum), shaped like `template`."""
  rows = _by_path(full)
  leaves = []
  for kp, t in jax.tree_util.tree_flatten_with_path(template)[0]:
    x = np.asarray(rows[jax.tree_util.keystr(kp)])
    leaves.append(
      x[module : module + 1] if t.shape and t.shape[0] == 1 and x.ndim == len(t.shape) else x
    )
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _init_storage(config, workdir: str, exp, grid: grid_lib.Grid, alpha_W, theta) -> None:
  """Version 0 of every module and its momentum (θ̄ as the synchronous mode builds it)."""
  state = exp.init_state(config.seed, theta)
  store, outer_opt = jax.device_get((state.store, state.outer_opt))
  for s in grid.groups:
    for e in range(s.num_modules):
      storage.save_tree(
        storage.module_file(workdir, s.name, e, 0),
        _module_rows(store, grid.module_template(s.name), s.name, e),
      )
      storage.save_tree(
        storage.module_file(workdir, s.name, e, 0, "opt"),
        _module_rows(outer_opt, grid.module_opt_template(s.name), s.name, e),
      )
  storage.save_json(
    storage.root(workdir) / META,
    {
      "mode": "elastic",
      "format": FORMAT,
      "workers": grid.W,
      "alpha_W": [float(a) for a in alpha_W],
    },
  )


def _latest(workdir: str, group: str, module: int, kind: str, upto: int):
  """The newest stored version <= `upto` of a module (an unused module stays at version 0)."""
  for v in range(upto, -1, -1):
    path = storage.module_file(workdir, group, module, v, kind)
    if path.exists():
      return path
  raise FileNotFoundError(f"no version of module {group}/{module} under {storage.root(workdir)}")


def _store_at(workdir: str, grid: grid_lib.Grid, version: int) -> dict:
  """The whole store after `version` outer steps, leaves [K, ...] (the driver only)."""
  store = {}
  for s in grid.groups:
    mods = [
      storage.load_tree(_latest(workdir, s.name, e, "v", version), grid.module_template(s.name))
      for e in range(s.num_modules)
    ]
    store[s.name] = jax.tree.map(lambda *xs: np.concatenate(xs), *[m[s.name] for m in mods])
  return store


def _update_best(best, exp, grid: grid_lib.Grid, workdir: str, results: dict, t: int) -> None:
  """Early stopping after evaluation phase t: the tasks' own-shard losses and version t's paths.

  Task (t, w) evaluated path w's params at version t (the spmd loop's evaluation
  after outer step t), so `early_stopping.BestPaths` takes the same inputs as
  in the synchronous loop.
  """
  # Held-out training documents' loss where early stopping reads it, else validation's.
  val_W = [
    results[f"{t}/{w}"].get("stop_loss", results[f"{t}/{w}"].get("val_loss")) for w in range(grid.W)
  ]
  if any(v is None for v in val_W):  # No evaluation at this step.
    return
  params = _paths_at(exp, grid, workdir, t)
  # Records restart with a routing phase (task t evaluated on its phase's shards).
  best.update(t * grid.H, np.asarray(val_W, np.float64), params, phase=grid.routing_phase(t))


def _paths_at(exp, grid: grid_lib.Grid, workdir: str, version: int):
  """Every worker's params at module version `version`, on the driver's device."""
  params = paths_lib.assemble(_store_at(workdir, grid, version), grid.topo)
  return jax.device_put(params, exp.state_sharding.params)


class _Resharder:
  """Discriminative re-shards: the synchronous loop's `ShardPlan.reshard`, once per step.

  Re-shard step t_r (an outer step) is due once every module holds version t_r
  (the coordinator's `reshard_due`; it holds tasks (t_r, ·) until `resharded`).
  `begin` lists the paths whose scores of the router split are still missing:
  the driver leases them as scoring tasks to idle workers (`PathWorker.score`,
  path p at version t_r: the expensive half of the fit, on the pool). Once all
  are in, `finish` fits the router on them (or reloads it: a rerun finds it),
  writes the phase's shards (or reopens them) and its α for the executors, and
  only then is the coordinator told. Each step is idempotent, so a driver
  killed anywhere in it redoes it to the same bytes.
  """

  def __init__(self, exp, grid: grid_lib.Grid, workdir: str, plan, log):
    self.exp, self.grid, self.workdir, self.plan, self.log = exp, grid, workdir, plan, log
    # Step -> metrics record of the active shards (the spmd loop writes them at each re-shard).
    self.records = {grid.H: plan.shard_record()}
    self.due, self.todo = None, []  # The re-shard under way; its paths still to score.

  def reopen(self, step: int) -> None:
    """A re-shard done before a restart: its router and shards are reopened, not refitted."""
    self.plan.reshard(step * self.grid.H, None)  # The router exists: params are not read.
    self.records[step * self.grid.H] = self.plan.shard_record()

  def _k(self, step: int) -> int:
    return self.grid.reshard_steps.index(step) + 1

  def begin(self, step: int) -> None:
    """Re-shard `step` is due: the paths to score (none where the router exists already)."""
    k, self.due = self._k(step), step
    self.todo = []
    if not routing.Router.exists(routing.router_dir(self.workdir, k)):
      P = self.grid.topo.num_paths
      self.todo = [p for p in range(P) if not storage.scores_file(self.workdir, k, p).exists()]
    self.log(event="reshard_due", step=step, phase=k, to_score=list(self.todo))

  def finish(self) -> int:
    """Fits (or reloads) the router on the paths' scores; shards, α. Returns the step."""
    step, k = self.due, self._k(self.due)
    directory = routing.router_dir(self.workdir, k)
    fitted = not routing.Router.exists(directory)
    scores = None
    if fitted:
      # A save cut short (arrays written, metadata not) would refuse the new save: drop it.
      part = epath.Path(directory) / router_lib.ARRAYS_FILE
      if part.exists():
        part.unlink()
      files = [storage.scores_file(self.workdir, k, p) for p in range(self.grid.topo.num_paths)]
      cols = [storage.load_array(f) for f in files]
      if len({c.shape for c in cols}) != 1:
        raise ValueError(
          f"the scoring tasks' files under {files[0].parent} hold different document counts "
          f"({[c.shape for c in cols]}): written by runs of different configs; delete that "
          "folder and rerun the same command to score again."
        )
      scores = np.stack(cols, 1)
    self.plan.reshard(step * self.grid.H, None, scores_NxP=scores)
    alpha = np.asarray(jax.device_get(self.plan.alpha_W), np.float32)
    storage.save_json(storage.alpha_file(self.workdir, k), [float(a) for a in alpha])
    self.records[step * self.grid.H] = self.plan.shard_record()
    self.log(event="reshard", step=step, phase=k, fitted=fitted)
    logging.info("elastic: re-shard after outer step %d: routing phase %d", step, k)
    self.due = None
    return step


def _final_state(config, workdir: str, exp, grid: grid_lib.Grid):
  """The synchronous mode's TrainState after T outer steps, from storage (the one full copy)."""
  store = _store_at(workdir, grid, grid.T)
  opt_parts = {
    s.name: [
      _by_path(
        storage.load_tree(
          _latest(workdir, s.name, e, "opt", grid.T), grid.module_opt_template(s.name)
        )
      )
      for e in range(s.num_modules)
    ]
    for s in grid.groups
  }
  groups = [s.name for s in grid.groups]
  full_opt = jax.eval_shape(grid.recipe.outer_tx.init, store)
  leaves = []
  for kp, t in jax.tree_util.tree_flatten_with_path(full_opt)[0]:
    key = jax.tree_util.keystr(kp)
    g = _group_of(key, groups)
    parts = [p[key] for p in opt_parts[g]] if g else [opt_parts[groups[0]][0][key]]
    leaves.append(np.concatenate(parts) if g and t.shape else np.asarray(parts[0]))
  outer_opt = jax.tree.unflatten(jax.tree.structure(full_opt), leaves)
  opts = [
    storage.load_tree(storage.worker_opt_file(workdir, w, grid.T), grid.inner_opt_template())
    for w in range(grid.W)
  ]
  inner_opt = jax.tree.map(lambda *xs: np.concatenate(xs), *opts)
  data = {
    str(w): storage.load_json(storage.worker_data_file(workdir, w, grid.T)) for w in range(grid.W)
  }
  state = recipe_lib.TrainState(
    step=np.asarray(grid.H * grid.T, np.int32),
    rng=np.asarray(jax.random.key_data(jax.random.key(config.seed))),
    store=store,
    outer_opt=outer_opt,
    params=paths_lib.assemble(store, grid.topo),
    inner_opt=inner_opt,
  )
  state = jax.device_put(state, exp.state_sharding)
  return state, data


# The local cluster's Ray settings. A call on an actor whose process died fails once Ray has
# the death's cause or after this wait (default 1 s): with 0.1 s a killed worker's task is back
# on the queue about 1 s sooner (measured: kill -> error 1.42 s -> 0.42 s, docs/elastic.md).
LOCAL_RAY_SYSTEM_CONFIG = {"timeout_ms_task_wait_for_death_info": 100}


def _connect(config, num_cpus: int) -> bool:
  """Starts a local Ray cluster on loopback, or joins config.elastic.address; True if started.

  A process already connected (a test, a notebook) keeps its connection; a given
  address is still checked first.
  """
  import ray  # pylint: disable=g-import-not-at-top

  address = config.elastic.address

  def unreachable(e):
    return ElasticConfigError(
      f"config.elastic.address={address!r} does not answer ({type(e).__name__}: {e}); start "
      "the cluster (`ray start --head`) or pass --config.elastic.address='' for a local one."
    )

  if address and address != "auto":  # Fail in seconds, not after Ray's long connect retries.
    try:
      host, port = address.rsplit(":", 1)
      socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
      raise unreachable(e) from None
  if ray.is_initialized():
    return False
  if address:
    try:
      ray.init(address=address, log_to_driver=False)
    except Exception as e:  # ConnectionError and Ray's own errors alike.
      raise unreachable(e) from None
  else:
    ray.init(
      address="local",
      num_cpus=num_cpus,
      include_dashboard=False,
      _node_ip_address="127.0.0.1",
      log_to_driver=False,
      _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )
  return True


def _worker_options(worker_resources: str) -> dict:
  """Ray options of a worker actor: config.elastic.worker_resources ("" = 1 CPU).

  A "TPU" count makes Ray give the actor that many chips of a node that
  advertises them (launch/ray_actions.sh starts TPU VM nodes with --resources='{"TPU": chips}')
  and set TPU_VISIBLE_CHIPS for it.
  """
  resources = json.loads(worker_resources) if worker_resources else {}
  return {
    "max_restarts": -1,
    "max_concurrency": 2,
    "num_cpus": resources.pop("CPU", 1),
    "resources": resources or None,
  }


def cpu_sets(cores, n: int) -> list:
  """Worker actor i's cores of `cores` (elastic.pin_cpus).

  n disjoint equal shares, the remainder left to the driver and Ray; with more
  actors than cores, one core each in turn.
  """
  cores = sorted(cores)
  if n <= len(cores):
    per = len(cores) // n
    return [cores[i * per : (i + 1) * per] for i in range(n)]
  return [[cores[i % len(cores)]] for i in range(n)]


def _control_options(ray) -> dict:
  """Ray options that keep the coordinator and executors on the driver's node.

  They ask for no resources, so Ray could place them on any node, spot TPU VMs
  included; on the driver's node (the head, launch/README.md) a preempted worker
  VM takes only worker actors with it, and a restart lands there again.
  """
  from ray.util import scheduling_strategies  # pylint: disable=g-import-not-at-top

  node = ray.get_runtime_context().get_node_id()
  return {
    "scheduling_strategy": scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False)
  }


def run(config, workdir: str) -> dict:
  """Trains (or resumes) `workdir` on a Ray pool; returns a summary."""
  try:
    import ray  # pylint: disable=g-import-not-at-top
    from ray import exceptions as ray_errors  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ElasticConfigError(
      "config.dipaco.mode='elastic' needs Ray: pip install 'dipaco_jax[elastic]'."
    ) from None
  workdir = str(workdir)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  e = config.elastic
  t0, actors, task_log = time.time(), [], storage.TaskLog(workdir)
  started = _connect(config, num_cpus=e.num_workers + 1)  # A bad address fails before any work.
  try:
    t_ray = time.time()
    # The queue and the worker actors first: while their processes import JAX (seconds), the
    # driver prepares θ̄, the shards and the store; no task is leased before that is done.
    worker_opts = _worker_options(e.worker_resources)
    control = _control_options(ray)
    # The command's own cluster is this machine: each worker actor on its own cores.
    pins = [None] * e.num_workers
    if e.pin_cpus and not e.address and hasattr(os, "sched_getaffinity"):
      node = ray.get_runtime_context().get_node_id()
      pins = [(node, c) for c in cpu_sets(os.sched_getaffinity(0), e.num_workers)]
    grid = grid_lib.Grid(config)
    coord = (
      ray.remote(coord_lib.Coordinator)
      .options(max_restarts=-1, num_cpus=0, **control)
      .remote(grid.queue_plan(), workdir)
    )
    actors.append(coord)
    workers = [
      ray.remote(worker_lib.PathWorker)
      .options(**worker_opts)
      .remote(config, workdir, i, e.compile_cache, pins[i])
      for i in range(e.num_workers)
    ]
    actors += workers
    exp, plan, alpha_W = _prepare(config, workdir, grid)
    t_prepared = time.time()
    logging.info(
      "elastic: %s; %d worker actors, %d executors",
      grid.topo.describe(),
      e.num_workers,
      e.num_executors,
    )
    owned = exec_lib.assign_groups([s.name for s in grid.groups], e.num_executors)
    executors = [
      ray.remote(exec_lib.OuterExecutor)
      .options(max_restarts=-1, max_concurrency=2, num_cpus=0, **control)
      .remote(config, workdir, j, owned[j], alpha_W.tolist(), e.compile_cache)
      for j in range(e.num_executors)
    ]
    actors += executors
    # Where the command's start-up went (docs/elastic.md); the actors' own is in their results.
    event = {"t": time.time(), "event": "startup", "ray_s": t_ray - t0}
    task_log.append({**event, "prepare_s": t_prepared - t_ray})
    return _loop(
      config, workdir, grid, coord, executors, owned, workers, task_log, ray, ray_errors, exp, plan
    )
  finally:
    task_log.close()
    for a in actors:
      ray.kill(a, no_restart=True)
    if started:
      ray.shutdown()


def _prepare(config, workdir: str, grid: grid_lib.Grid):
  """The driver's Experiment, phase-0 shards and α, and version 0 of the store."""
  # The driver's Experiment on one device: it builds θ̄, the shards, α and the final state.
  exp = exp_lib.Experiment(
    config,
    mesh=sharding.make_mesh(
      {"path": 1, "data": 1, "model": 1, "num_slices": 1}, 1, devices=jax.devices()[:1]
    ),
  )
  started = (storage.root(workdir) / META).exists()
  # θ̄ read and checked before anything is written (as the spmd loop).
  theta = (
    None if started else theta_lib.initial(config.dipaco.init_from, exp.recipe.abstract_params())
  )
  plan = shard_plan.ShardPlan(config, workdir, exp)  # Phase-0 shards and α, as the SPMD loop.
  saved_config.write(epath.Path(workdir), config)
  alpha_W = np.asarray(jax.device_get(plan.alpha_W), np.float32)
  if not started:
    _init_storage(config, workdir, exp, grid, alpha_W, theta)
  return exp, plan, alpha_W


def _call(ray, ray_errors, method, *args):
  """A coordinator call, retried once if the actor died (it restores from its snapshot)."""
  for attempt in range(3):
    try:
      return ray.get(method.remote(*args))
    except ray_errors.RayActorError:
      if attempt == 2:
        raise
      time.sleep(1.0)


def _loop(
  config, workdir, grid, coord, executors, owned, workers, task_log, ray, ray_errors, exp, plan
) -> dict:
  """Leases tasks to idle workers, forwards results to executors, versions to the queue."""
  e = config.elastic
  call = lambda m, *a: _call(ray, ray_errors, m, *a)
  log = lambda **kw: task_log.append({"t": time.time(), **kw})
  running, outer = {}, {}  # future -> (actor, task, start); future -> (executor, phase, worker)
  scoring = {}  # future -> (actor, path, start): a re-shard's scoring tasks (the driver's queue).
  timed_out = set()  # Scoring futures whose actor was killed for the task timeout.
  results = call(coord.results)
  left = (grid.T + 1) * grid.W - len(results)  # Faults are drawn among this invocation's tasks.
  faults = faults_lib.driver_plan(config.faults, left, grid.topo.num_paths, len(executors), log)
  task_time = [1.0]
  accepted_here = 0
  saves_progress = 0 < e.progress_every_steps < grid.H
  probes = {}  # future of pid() -> worker actor coming back from a failure (busy until it answers).
  ex_probes, held = {}, {}  # The same for executors; reports held for a restarting executor.
  # Record of step (t+1)*H: phase t's training losses and tasks t+1's validation (the spmd loop's).
  complete = lambda t: all(f"{t}/{w}" in results for w in range(grid.W))
  phases_logged = sum(complete(t) and complete(t + 1) for t in range(grid.T))
  mlog = metrics_lib.MetricsLogger(
    workdir,
    resume_step=phases_logged * grid.H,
    worker_labels=grid.topo.worker_labels(),
    module_labels=grid.topo.module_labels(),
  )
  if phases_logged == 0 and not results:
    mlog.write_hparams(config.to_dict())
  # Per-path early stopping on the tasks' evaluations, in phase order (replayed on a rerun).
  best = None
  if config.early_stopping.enabled:
    best = early_stopping.BestPaths(exp.state_sharding.params, grid.W)
  best_next = [1]  # The next phase whose evaluation early stopping takes.
  resharder = _Resharder(exp, grid, workdir, plan, log)
  for step in sorted(call(coord.reshard_due)[1]):  # Done before a restart: reopened.
    resharder.reopen(step)
  reshard_check = [True]  # Module versions changed: a re-shard may be due.

  def early_stop(results):
    while best is not None and best_next[0] <= grid.T and complete(best_next[0]):
      _update_best(best, exp, grid, workdir, results, best_next[0])
      best_next[0] += 1

  scoring_actors = lambda: [a for a, _, _ in scoring.values()]

  def report(phase, worker):
    if phase == grid.T:  # Evaluation only: nothing to average.
      return
    for j, ex in enumerate(executors):
      if owned[j]:
        outer[ex.report.remote(phase, worker)] = (j, phase, worker)
        faults.at("report", executor=j)

  def stepped(j, keys):
    """Executor j's {phase: modules it stepped} to the queue (and the task log)."""
    for phase, mods in sorted(keys.items()):
      call(coord.modules_updated, phase, mods)
      if mods:
        log(event="outer", phase=phase, executor=j, modules=mods)
        reshard_check[0] = True

  # Quorum with a grace window: executors step on the clock too, so the driver polls them.
  polls, waiting, next_poll = {}, {}, 0.0
  poll_s = 0.1 if e.quorum < 1.0 and e.grace_s > 0 else None

  for phase, worker in call(coord.unreported):  # After a restart: executors are idempotent.
    report(phase, worker)
  try:
    while True:
      # The barrier: tasks of the re-shard's phase wait for its scores, router and shards.
      if reshard_check[0] and resharder.due is None:
        reshard_check[0] = False
        due = call(coord.reshard_due)[0]
        if due is not None:
          resharder.begin(due)
      if resharder.due is not None and not (resharder.todo or scoring):
        call(coord.resharded, resharder.finish())
        reshard_check[0] = True
      for task, actor in call(coord.expired):
        log(event="timeout", phase=task[0], worker=task[1], actor=actor)
        ray.kill(workers[actor], no_restart=False)  # Comes back; its future raises.
      for f, (actor, path, start) in scoring.items():
        if f not in timed_out and time.time() - start > e.task_timeout_s:
          timed_out.add(f)  # Killed once; rescored when its future raises.
          log(event="timeout_score", path=path, actor=actor)
          ray.kill(workers[actor], no_restart=False)
      busy = {a for a, _, _ in running.values()} | set(probes.values())
      busy |= set(scoring_actors())
      for i in range(len(workers)):
        if i in busy:
          continue
        if resharder.todo:  # Scoring first: the re-shard's phase waits for it.
          path = resharder.todo.pop(0)
          spec = faults.at("lease_score", actor=i, est_s=task_time[0])
          future = workers[i].score.remote(resharder.due, path, faults=spec)
          faults.at("leased", future=future, actor=i, spec=spec, scoring=True)
          scoring[future] = (i, path, time.time())
          log(event="start_score", step=resharder.due, path=path, actor=i)
          continue
        task = call(coord.lease, i)
        if task is None:
          break
        spec = faults.at(
          "lease", actor=i, est_s=task_time[0], writes=task[0] < grid.T, progress=saves_progress
        )
        future = workers[i].run.remote(*task, faults=spec)
        faults.at("leased", future=future, actor=i, spec=spec)
        running[future] = (i, tuple(task), time.time())
        log(event="start", phase=task[0], worker=task[1], actor=i)
      if poll_s and time.time() >= next_poll:
        next_poll = time.time() + poll_s
        for j, ex in enumerate(executors):
          if owned[j] and j not in polls.values():
            polls[ex.poll.remote()] = j
      if not (running or outer or probes or ex_probes or scoring or resharder.due is not None):
        if call(coord.finished):
          break
        if not (polls or any(waiting.values())):  # Nothing can make a task ready any more.
          raise RuntimeError(f"elastic: no task ready and none running: {call(coord.status)}")
      faults.at(
        "tick",
        ray=ray,
        workers=workers,
        executors=executors,
        busy_workers={a for a, _, _ in running.values()} | set(scoring_actors()),
        busy_executors={j for j, _, _ in outer.values()},
      )
      ready, _ = ray.wait(
        list(running) + list(outer) + list(probes) + list(ex_probes) + list(polls) + list(scoring),
        num_returns=1,
        timeout=faults.at("wait_s") or poll_s or 1.0,
      )
      for f in ready:
        if f in ex_probes:
          j = ex_probes.pop(f)
          try:
            ray.get(f)
          except ray_errors.RayActorError:  # Still restarting: ask again shortly.
            time.sleep(0.2)
            ex_probes[executors[j].pid.remote()] = j
            continue
          for phase, worker in held.pop(j, []):
            outer[executors[j].report.remote(phase, worker)] = (j, phase, worker)
        elif f in probes:
          actor = probes.pop(f)
          try:
            ray.get(f)
          except ray_errors.RayActorError:  # Still restarting: ask again shortly.
            time.sleep(0.2)
            probes[workers[actor].pid.remote()] = actor
        elif f in scoring:
          actor, path, _ = scoring.pop(f)
          try:
            done = ray.get(f)
          except ray_errors.RayActorError as err:  # Scored again, on the next idle worker.
            faults.at("failed", future=f)
            resharder.todo.insert(0, path)
            log(event="failed_score", path=path, actor=actor, error=type(err).__name__)
            probes[workers[actor].pid.remote()] = actor
            continue
          except ray_errors.RayTaskError as err:
            raise err.as_instanceof_cause() from None
          log(event="scored", path=path, actor=actor, docs=done["docs"], seconds=done["seconds"])
        elif f in running:
          actor, task, start = running.pop(f)
          try:
            result = ray.get(f)
          except ray_errors.RayActorError as err:
            faults.at("failed", future=f)
            call(coord.failed, *task)
            log(
              event="failed", phase=task[0], worker=task[1], actor=actor, error=type(err).__name__
            )
            probes[workers[actor].pid.remote()] = actor  # No new task until it is back.
            continue
          except ray_errors.RayTaskError as err:  # The task's own error (e.g. NaN): stop.
            raise err.as_instanceof_cause() from None
          task_time[0] = time.time() - start
          if call(coord.complete, task[0], task[1], result):
            results[f"{task[0]}/{task[1]}"] = coord_lib.summary(result)  # The queue's copy, here.
            accepted_here += 1
            log(
              event="done",
              phase=task[0],
              worker=task[1],
              actor=actor,
              seconds=result["end"] - result["start"],
              pid=result["pid"],
              **{k: result[k] for k in ("resumed_at_step", "cpus") if k in result},
            )
            report(*task)
          else:
            log(event="duplicate", phase=task[0], worker=task[1], actor=actor)
        elif f in polls:
          j = polls.pop(f)
          try:
            keys, waiting[j] = ray.get(f)
          except ray_errors.RayActorError:  # Restarting: the next poll asks again.
            continue
          stepped(j, keys)
        else:
          j, phase, worker = outer.pop(f)
          try:
            keys = ray.get(f)
          except ray_errors.RayActorError:
            log(event="executor_failed", executor=j, phase=phase, worker=worker)
            # Ray restarts it (from its snapshot); the report goes again once it answers.
            held.setdefault(j, []).append((phase, worker))
            if j not in set(ex_probes.values()):
              ex_probes[executors[j].pid.remote()] = j
            continue
          stepped(j, keys)
      early_stop(results)
      while phases_logged < grid.T and complete(phases_logged) and complete(phases_logged + 1):
        t = phases_logged
        for step, rec in _step_records(workdir, grid, t, config.log_every_steps):
          mlog.write(step, rec)
        rec = _record(grid, results, t)
        mlog.write((t + 1) * grid.H, {**rec, **resharder.records.get((t + 1) * grid.H, {})})
        phases_logged += 1
      if faults.at("accepted", count=accepted_here):
        logging.info("elastic: stopping after %d accepted tasks (faults)", accepted_here)
        return {"stopped": True, "status": {**call(coord.status), **(faults.at("counts") or {})}}
  finally:
    mlog.close()
  early_stop(results)  # A rerun that finds every task done replays it here.
  out = {"step": grid.H * grid.T, **_record(grid, results, grid.T - 1)}
  ckpt = ckpt_lib.Checkpointer(workdir, max_to_keep=config.ckpt.max_to_keep, async_save=False)
  if ckpt.latest_step() != grid.H * grid.T:
    state, data = _final_state(config, workdir, exp, grid)
    assert plan.phase == grid.routing_phase(grid.T), (plan.phase, grid.reshard_steps)
    routing_state = {"phase": plan.phase, "assignment": plan.shard_set.meta.get("assignment")}
    data_state = {"train": data, "routing": routing_state}
    ckpt.save(grid.H * grid.T, state, data_state, best=best.saved() if best else None)
  ckpt.close()
  return {**out, "status": {**call(coord.status), **(faults.at("counts") or {})}}


def _step_records(workdir: str, grid, t: int, every: int) -> list[tuple[int, dict]]:
  """Records of phase t's logged steps before its last (config.log_every_steps).

  From the losses each task kept in its done.json: the steps the spmd loop logs.
  """
  steps = [s for s in range(t * grid.H + 1, (t + 1) * grid.H) if s % every == 0]
  if not steps:
    return []
  losses = [
    storage.load_json(storage.worker_out_dir(workdir, w, t + 1) / "done.json")["loss"]
    for w in range(grid.W)
  ]
  out = []
  for s in steps:
    train_W = [float(loss[s - t * grid.H - 1]) for loss in losses]
    out.append((s, {"phase": t, "train_loss": train_W, "train_loss_mean": float(np.mean(train_W))}))
  return out


def _record(grid, results, t: int) -> dict:
  """metrics.jsonl record of step (t+1)*H: phase t's train losses, tasks t+1's validation."""
  train_W = [results[f"{t}/{w}"]["last_loss"] for w in range(grid.W)]
  rec = {
    "phase": t,
    "train_loss": train_W,
    "train_loss_mean": float(np.mean(train_W)),
    "grad_norm": [results[f"{t}/{w}"]["grad_norm"] for w in range(grid.W)],
  }
  val = [results[f"{t + 1}/{w}"].get("val_loss") for w in range(grid.W)]
  if all(v is not None for v in val):
    rec.update(val_loss=val, val_loss_mean=metrics_lib.nan_mean(val))
  return rec
