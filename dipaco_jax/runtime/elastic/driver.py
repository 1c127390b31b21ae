"""The elastic driver: the command that starts the pool, prepares the store and runs the loop.

`run(config, workdir)` is `train_and_evaluate` for `dipaco.mode="elastic"`.
The driver holds no training state: the coordinator (queue), the executors
(outer steps) and storage do; killing the command and rerunning it resumes.
Its parts, one concern each: the Ray cluster (cluster.py) and what the worker
actors ask of it (resources.py); version 0 and the final checkpoint from
storage (versions.py); the event loop (loop.py), with lease timeouts
(leases.py), discriminative re-shards (resharder.py), and the metrics and
early stopping of completed phases (records.py). Evaluation runs as part of
the tasks on the pool (worker.py).
"""
# pylint: disable=invalid-name

import os
import time

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import saved_config
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import sharding
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime import shard_plan
from dipaco_jax.runtime.elastic import cluster
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import leases
from dipaco_jax.runtime.elastic import loop as loop_lib
from dipaco_jax.runtime.elastic import repair
from dipaco_jax.runtime.elastic import resharder
from dipaco_jax.runtime.elastic import resources
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import versions
from dipaco_jax.runtime.elastic import worker as worker_lib
from dipaco_jax.runtime.elastic.errors import ElasticConfigError

# Names tests and benchmarks reach through the driver, where they were defined before the split.
start_local_ray = cluster.start_local_ray
stop_local_ray = cluster.stop_local_ray
is_loopback = cluster.is_loopback
token_file = cluster.token_file
_private_token = cluster.private_token
_control_options = cluster.control_options
check_resources = resources.check_resources
cpu_sets = resources.cpu_sets
_worker_options = resources.worker_options
stepping = leases.stepping
_Timeouts = leases.Timeouts
_Resharder = resharder.Resharder
_paths_at = versions.paths_at
_final_state = versions.final_state


def run(config, workdir: str, faults: faults_lib.Faults | None = None) -> dict:
  """Trains (or resumes) `workdir` on a Ray pool; returns a summary.

  faults: what to inject (tests, benchmarks: runtime/faults.py); None for none.
  """
  faults = faults or faults_lib.NO_FAULTS
  try:
    import ray  # pylint: disable=g-import-not-at-top
    from ray import exceptions as ray_errors  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ElasticConfigError(
      "config.dipaco.mode='elastic' needs Ray: pip install 'dipaco_jax[elastic]'."
    ) from None
  workdir = str(workdir)
  e = config.elastic
  t0, actors, task_log = time.time(), [], None
  grid = grid_lib.Grid(config)
  # Damaged files of the queue's and the executors' records stop the command here, in one line,
  # not inside an actor; what the user moved aside is redone (repair.py).
  repair.check_records(workdir, grid)
  # A bad address, or worker resources the local cluster lacks, fail before anything is written.
  started = cluster.connect(config)
  try:
    short = resources.check_resources(config, ray.nodes(), fixed=not e.address)
    if short:  # A joined cluster may grow: the actors wait for nodes (a line a minute).
      logging.warning("%s", short)
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    repair.forget_lost_outputs(workdir, grid)  # Before the queue reads its results.
    task_log = storage.TaskLog(workdir)
    t_ray = time.time()
    # The queue and the worker actors first: while their processes import JAX (seconds), the
    # driver prepares θ̄, the shards and the store; no task is leased before that is done.
    worker_opts = resources.worker_options(e.worker_resources)
    control = cluster.control_options(ray)
    # The command's own cluster is this machine: each worker actor on its own cores.
    pins = [None] * e.num_workers
    if e.pin_cpus and not e.address and hasattr(os, "sched_getaffinity"):
      node = ray.get_runtime_context().get_node_id()
      pins = [(node, c) for c in resources.cpu_sets(os.sched_getaffinity(0), e.num_workers)]
    coord = (
      ray.remote(coord_lib.Coordinator)
      .options(max_restarts=-1, num_cpus=0, **control)
      .remote(grid.queue_plan(), workdir)
    )
    actors.append(coord)
    workers = [
      ray.remote(worker_lib.PathWorker)
      .options(**worker_opts)
      .remote(config, workdir, i, e.compile_cache, pins[i], faults)
      for i in range(e.num_workers)
    ]
    actors += workers
    # A line a minute while any worker actor has not started.
    starting = resources.StartWatch(ray, config, workers)
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
    try:
      pool = loop_lib.Pool(ray, ray_errors, coord, workers, executors, owned)
      return loop_lib.EventLoop(
        config, workdir, grid, pool, task_log, exp, plan, starting, faults
      ).run()
    except ray_errors.RayTaskError as err:  # A task's or an executor's own error: stop.
      raise repair.task_error(err) from None
  finally:
    if task_log is not None:
      task_log.close()
    try:
      for a in actors:
        ray.kill(a, no_restart=True)
    except Exception:  # pylint: disable=broad-except  # Ctrl-C reached the cluster too.
      if not started:
        raise
    if started:
      cluster.stop_local_ray()


def _prepare(config, workdir: str, grid: grid_lib.Grid):
  """The driver's Experiment, phase-0 shards and α, and version 0 of the store."""
  # The driver's Experiment on one device: it builds θ̄, the shards, α and the final state.
  exp = exp_lib.Experiment(
    config,
    mesh=sharding.make_mesh(
      {"path": 1, "data": 1, "model": 1, "num_slices": 1}, 1, devices=jax.devices()[:1]
    ),
  )
  started = (storage.root(workdir) / versions.META).exists()
  # θ̄ read and checked before anything is written (as the spmd loop).
  theta = (
    None if started else theta_lib.initial(config.dipaco.init_from, exp.recipe.abstract_params())
  )
  plan = shard_plan.ShardPlan(config, workdir, exp)  # Phase-0 shards and α, as the SPMD loop.
  saved_config.write(epath.Path(workdir), config)
  alpha_W = np.asarray(jax.device_get(plan.alpha_W), np.float32)
  if not started:
    versions.init_storage(config, workdir, exp, grid, alpha_W, theta)
  else:  # Module files moved aside as a damage line said: rebuilt before any task reads them.
    initial = lambda: versions.initial_modules(config, workdir, exp, grid)
    repair.rebuild_modules(config, workdir, grid, alpha_W, initial)
  return exp, plan, alpha_W
