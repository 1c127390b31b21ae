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

import contextlib
import ipaddress
import json
import math
import os
import pathlib
import secrets
import socket
import stat
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
from dipaco_jax.runtime.elastic import reaper
from dipaco_jax.runtime.elastic import repair
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
  for path, tree in _version0(config, exp, grid, workdir, theta).items():
    storage.save_tree(path, tree)
  storage.save_json(
    storage.root(workdir) / META,
    {
      "mode": "elastic",
      "format": FORMAT,
      "workers": grid.W,
      "alpha_W": [float(a) for a in alpha_W],
    },
  )


def _version0(config, exp, grid: grid_lib.Grid, workdir: str, theta) -> dict:
  """{file: tree} of every module's version 0 and its momentum."""
  state = exp.init_state(config.seed, theta)
  store, outer_opt = jax.device_get((state.store, state.outer_opt))
  out = {}
  for s in grid.groups:
    for e in range(s.num_modules):
      out[storage.module_file(workdir, s.name, e, 0)] = _module_rows(
        store, grid.module_template(s.name), s.name, e
      )
      out[storage.module_file(workdir, s.name, e, 0, "opt")] = _module_rows(
        outer_opt, grid.module_opt_template(s.name), s.name, e
      )
  return out


def _initial_modules(config, workdir: str, exp, grid: grid_lib.Grid) -> dict:
  """_version0 of a started run (θ̄ read again): repair.rebuild_modules's version 0."""
  theta = theta_lib.initial(config.dipaco.init_from, exp.recipe.abstract_params())
  return _version0(config, exp, grid, workdir, theta)


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
    alpha = storage.alpha_file(self.workdir, self._k(step))
    if not alpha.exists():  # Moved aside (a damage line): written again, the same bytes.
      self._write_alpha(self._k(step))

  def _write_alpha(self, k: int) -> None:
    alpha = np.asarray(jax.device_get(self.plan.alpha_W), np.float32)
    storage.save_json(storage.alpha_file(self.workdir, k), [float(a) for a in alpha])

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
    self._write_alpha(k)
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
  if grid.recipe.feedback:  # Each worker's error-feedback residual after the last phase.
    efs = [
      {
        g: storage.load_tree(storage.ef_file(workdir, w, grid.T, g), grid.ef_template(g))[g]
        for g, _ in grid.modules_of_worker(w)
      }
      for w in range(grid.W)
    ]
    state = grid.recipe.with_ef(state, jax.tree.map(lambda *xs: np.concatenate(xs), *efs))
  state = jax.device_put(state, exp.state_sharding)
  return state, data


# The local cluster's Ray settings. A call on an actor whose process died fails once Ray has
# the death's cause or after this wait (default 1 s): with 0.1 s a killed worker's task is back
# on the queue about 1 s sooner (measured: kill -> error 1.42 s -> 0.42 s, docs/elastic.md).
LOCAL_RAY_SYSTEM_CONFIG = {"timeout_ms_task_wait_for_death_info": 100}
LOOPBACK = "127.0.0.1"  # Every service of the command's own cluster listens here, and only here.


def is_loopback(host: str) -> bool:
  """True for a loopback address: 127.0.0.0/8, ::1, or IPv4 loopback mapped into IPv6."""
  try:
    ip = ipaddress.ip_address(host.split("%")[0])
  except ValueError:
    return False
  return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def token_file() -> pathlib.Path | None:
  """The file Ray reads the cluster's token from, where token authentication is on; else None.

  Ray 2.60 turns token authentication on for a local cluster unless $RAY_AUTH_MODE
  says otherwise, and takes the token from $RAY_AUTH_TOKEN (no file), else the
  file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, which it writes if missing.
  """
  if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
    return None
  if os.environ.get("RAY_AUTH_TOKEN"):
    return None
  path = os.environ.get("RAY_AUTH_TOKEN_PATH")
  return pathlib.Path(path) if path else pathlib.Path.home() / ".ray" / "auth_token"


def _private_token() -> None:
  """Ray's token file, readable by its owner only (0600); written so from the start if missing.

  Ray writes ~/.ray/auth_token with the process umask (0644: every local user
  could read the token); this writes the token first, owner-only, as Ray would
  (32 random bytes in hex), or takes the group's and others' bits off an existing file.
  """
  path = token_file()
  if path is None:
    return
  if not path.exists():
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # Another command wrote it meanwhile: tightened below.
      pass
    else:
      with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
  mode = stat.S_IMODE(path.stat().st_mode)
  if mode & 0o077:
    try:
      path.chmod(0o600)
    except PermissionError:
      raise ElasticConfigError(
        f"Ray's token file {path} is readable by other users (mode {mode:04o}) and this user "
        "cannot change it: run `chmod 600` on it as its owner, or point RAY_AUTH_TOKEN_PATH at "
        "a file of your own."
      ) from None
    logging.info("elastic: Ray's token file %s made owner-only (mode %04o -> 0600)", path, mode)


@contextlib.contextmanager
def _loopback_node(ray):
  """Ray's node IP stays 127.0.0.1 for a cluster started here.

  On Linux, ray.init turns `_node_ip_address="127.0.0.1"` into the host's
  external address (`services.resolve_ip_for_localhost`), and every service then
  listens on all interfaces. Ray keeps loopback where it runs without clusters
  (`ray_constants.ENABLE_RAY_CLUSTER` false, Windows and macOS); with that flag
  off while the node starts, GCS, raylet, object manager, the agents and every
  worker bind 127.0.0.1 (`start_local_ray` checks it).
  """
  from ray._private import ray_constants  # pylint: disable=g-import-not-at-top

  old = ray_constants.ENABLE_RAY_CLUSTER
  ray_constants.ENABLE_RAY_CLUSTER = False
  try:
    yield
  finally:
    ray_constants.ENABLE_RAY_CLUSTER = old


def start_local_ray(num_cpus: int, **kwargs) -> None:
  """A one-node Ray cluster in this process, every service on 127.0.0.1, token owner-only.

  `kwargs` go to ray.init (the tests' and benchmarks' extra settings). Raises
  RuntimeError if Ray did not keep the node on loopback (a Ray version whose
  settings changed: nothing is left running).
  """
  import psutil  # pylint: disable=g-import-not-at-top
  import ray  # pylint: disable=g-import-not-at-top

  _private_token()
  # Its session files (sockets, logs) in a folder of this command's, owner-only, removed with
  # the cluster; the watcher (reaper.py) ends the cluster's processes when this one ends.
  temp = reaper.temp_dir()
  before = {p.pid for p in psutil.Process().children()}
  with _loopback_node(ray):
    ray.init(
      address="local",
      num_cpus=num_cpus,
      include_dashboard=False,
      _node_ip_address=LOOPBACK,
      log_to_driver=False,
      _system_config=LOCAL_RAY_SYSTEM_CONFIG,
      _temp_dir=temp,
      **kwargs,
    )
  reaper.start(temp, before)
  node, gcs = ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address
  if not (is_loopback(node) and is_loopback(gcs.rsplit(":", 1)[0])):
    stop_local_ray()
    raise RuntimeError(
      f"Ray {ray.__version__} started the local cluster on {node} (GCS {gcs}), not on "
      f"{LOOPBACK}: its services would listen beyond this machine. driver._loopback_node "
      "needs the Ray version's own setting for this."
    )
  _private_token()  # Ray may have written it (a token file it found missing after all).


def stop_local_ray() -> None:
  """Ends the cluster start_local_ray started: Ray's shutdown, then its watcher's sweep."""
  import ray  # pylint: disable=g-import-not-at-top

  try:
    ray.shutdown()
  finally:
    reaper.stop()


def _worker_cpus(worker_resources: str) -> float:
  """CPUs of one worker actor (elastic.worker_resources' "CPU", else 1)."""
  return float(_worker_options(worker_resources)["num_cpus"])


def _local_cpus(config) -> int:
  """CPUs of the command's own cluster: every worker actor's, plus one; refuses more than exist.

  Each worker actor asks for worker_resources' CPUs (1 by default); the coordinator
  and executors ask for none. A worker asking for more cores than this machine
  has could never be placed.
  """
  e = config.elastic
  per = _worker_cpus(e.worker_resources)
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if per > cores:
    raise ElasticConfigError(
      f"config.elastic.worker_resources={e.worker_resources!r} asks {per:g} CPUs per worker "
      f"actor, but this machine, where the command's own Ray cluster runs "
      f"(config.elastic.address=''), has {cores} cores: ask for at most {cores}, or join a "
      "larger cluster with --config.elastic.address=HOST:PORT."
    )
  return math.ceil(e.num_workers * per) + 1


def _connect(config) -> bool:
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
    start_local_ray(_local_cpus(config))
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


def _need(worker_resources: str) -> dict:
  """What one worker actor asks Ray for: {"CPU": n, other resources...}, amounts > 0."""
  opts = _worker_options(worker_resources)
  need = {"CPU": opts["num_cpus"], **(opts["resources"] or {})}
  return {k: float(v) for k, v in need.items() if v > 0}


def _shown(resources: dict) -> str:
  """Resources as JSON, without Ray's bookkeeping (memory, node:..., accelerator_type:...)."""
  keep = {
    k: int(v) if float(v).is_integer() else round(float(v), 4)
    for k, v in sorted(resources.items())
    if ":" not in k and k not in ("memory", "object_store_memory")
  }
  return json.dumps(keep)


def _room(nodes: list, need: dict) -> float:
  """How many worker actors asking `need` fit on `nodes` (ray.nodes() entries) by their totals."""
  if not need:
    return math.inf
  return sum(
    min(math.floor(n["Resources"].get(k, 0.0) / v + 1e-9) for k, v in need.items()) for n in nodes
  )


def check_resources(config, nodes: list, fixed: bool) -> str | None:
  """elastic.worker_resources against the cluster's live nodes (`nodes`: ray.nodes()).

  `fixed`: the cluster cannot grow (the local one, config.elastic.address=""):
  if it has no room for config.elastic.num_workers worker actors this raises
  ElasticConfigError, before any actor is requested. A joined cluster may grow
  (spot VMs re-created, a pool still joining, an autoscaler), so there a
  shortfall is a warning, returned as one line: the actors wait for nodes.
  None when every worker actor fits.
  """
  e = config.elastic
  nodes = [n for n in nodes if n.get("Alive", True)]
  need = _need(e.worker_resources)
  room = _room(nodes, need)
  if room >= e.num_workers:
    return None
  total = {}
  for n in nodes:
    for k, v in n["Resources"].items():
      total[k] = total.get(k, 0.0) + v
  missing = [k for k in need if not total.get(k)]
  field = f"config.elastic.worker_resources={e.worker_resources!r}"
  asks = f"{field} asks each worker actor for {_shown(need)}"
  if fixed:
    where = "the local Ray cluster (config.elastic.address='', this machine)"
    if missing:
      fix = (
        "ask for resources this machine has (worker_resources='' = 1 CPU each), or join a "
        f"cluster whose nodes advertise {missing[0]} with --config.elastic.address=HOST:PORT."
      )
      raise ElasticConfigError(
        f"{asks}, but {where} has no {missing[0]}: it offers {_shown(total)}; {fix}"
      )
    if room == 0:
      raise ElasticConfigError(
        f"{asks}, but no node of {where} has that much: it offers {_shown(total)}; ask for "
        "less per worker, or join a larger cluster with --config.elastic.address=HOST:PORT."
      )
    raise ElasticConfigError(
      f"{asks}: {where} offers {_shown(total)}, room for {room} of the "
      f"config.elastic.num_workers={e.num_workers} worker actors; set "
      f"--config.elastic.num_workers={room}, or ask for less per worker."
    )
  lack = f" (no node has {missing[0]})" if missing else ""
  return (
    f"elastic: {asks}; the cluster's {len(nodes)} live nodes offer {_shown(total)}: room for "
    f"{room} of the config.elastic.num_workers={e.num_workers} worker actors{lack}. The others "
    "wait until nodes with room join; if none will, stop the command and fix "
    "config.elastic.worker_resources or config.elastic.num_workers."
  )


class _StartWatch:
  """Worker actors that have not answered since they were requested: one line a minute.

  A joined cluster may have no room for them yet (check_resources); the line
  names them, config.elastic.worker_resources and what the live nodes offer.
  Leasing does not wait for them (a task leased to an actor Ray has not placed
  waits in its queue; its lease may expire: see _Timeouts).
  """

  def __init__(self, ray, config, workers, every_s: float = 60.0):
    self.ray, self.config, self.every_s = ray, config, every_s
    self.waiting = {w.pid.remote(): i for i, w in enumerate(workers)}
    self.t0 = time.time()
    self.next = self.t0 + every_s

  def tick(self) -> None:
    if not self.waiting:
      return
    ready, _ = self.ray.wait(list(self.waiting), num_returns=len(self.waiting), timeout=0)
    for f in ready:
      del self.waiting[f]
    if self.waiting and time.time() >= self.next:
      self.next = time.time() + self.every_s
      logging.warning("%s", self.line())

  def line(self) -> str:
    actors = sorted(self.waiting.values())
    head = (
      f"elastic: worker actors {', '.join(map(str, actors))} ({len(actors)} of "
      f"{self.config.elastic.num_workers}) have not started after {time.time() - self.t0:.0f} s"
    )
    short = check_resources(self.config, self.ray.nodes(), fixed=False)
    if short:
      return f"{head}: {short.removeprefix('elastic: ')}"
    return f"{head}; the cluster has room for them (busy nodes, or their processes still start)."


def _nice_s(seconds: float) -> int:
  """Seconds rounded up to a multiple of 10 (at least 10)."""
  return max(10, math.ceil(seconds / 10) * 10)


def stepping(seen: dict | None) -> bool:
  """A worker's progress (PathWorker.progress) shows it was still stepping when asked.

  At least one inner step done in this attempt, the last one recent: within 30 s
  or 3x the attempt's mean time per step so far (load and compile included).
  """
  if not seen or not seen["steps"] or seen["since_step_s"] is None:
    return False
  return seen["since_step_s"] <= max(30.0, 3 * seen["elapsed_s"] / seen["steps"])


class _Timeouts:
  """config.elastic.task_timeout_s against the tasks' real durations (docs/elastic.md, Failures).

  The rule: each expired lease is one warning line (and a `timeout` event in the
  task log with the worker's progress). The run stops with ElasticConfigError,
  naming the field, the measured time and a value, when the same task expires
  `STEPPING` times while its worker was stepping (the timeout is shorter than
  the task: every retry would be cut again), or `ANSWERED` times whatever the
  worker was doing when asked (loading, compiling, hung). One expiry is what the
  timeout is for (a straggler, a hung worker: the task moves on), and a worker
  that does not answer (not placed or started yet, or gone) is not counted:
  those are the pool's normal troubles, not the timeout's.
  """

  STEPPING = 2
  ANSWERED = 3

  def __init__(self, timeout_s: float, H: int):
    self.timeout_s, self.H = float(timeout_s), int(H)
    self.counts = {}  # task -> [expiries while stepping, expiries answered]

  def _field(self) -> str:
    return f"config.elastic.task_timeout_s={self.timeout_s:g}"

  def expired(self, task, actor: int, seen: dict | None) -> str:
    """Task (phase, worker) expired on `actor`; returns the warning line, raises at the limit."""
    name = f"task (phase {task[0]}, worker {task[1]})"
    c = self.counts.setdefault(tuple(task), [0, 0])
    was_stepping = stepping(seen)
    c[0] += was_stepping
    c[1] += seen is not None
    est = None
    if seen is None:
      state = "its worker did not answer (not placed or started yet, or gone)"
    else:
      state = f"{seen['steps']} of {seen['of']} inner steps done in {seen['elapsed_s']:.1f} s"
      if was_stepping:  # This attempt's pace, its load and compile included: errs long.
        est = seen["elapsed_s"] * self.H / seen["steps"]
        state += f", about {est:.0f} s for the task's {self.H}"
      else:
        state += ", none lately (loading, compiling or hung)"
    if c[0] >= self.STEPPING:
      raise ElasticConfigError(
        f"{self._field()} is shorter than a task: {name} timed out {c[0]} times while its "
        f"worker was stepping (the last attempt: {state}); set "
        f"--config.elastic.task_timeout_s={_nice_s(3 * est)} (3x that) or more and rerun "
        "the same command (it resumes)."
      )
    if c[1] >= self.ANSWERED:
      value = _nice_s(3 * est) if est else _nice_s(10 * self.timeout_s)
      raise ElasticConfigError(
        f"{self._field()}: {name} timed out {c[1]} times (the last attempt: {state}); set "
        f"--config.elastic.task_timeout_s={value} or more (the `done` events of "
        "elastic/tasks.jsonl hold the tasks' real seconds) and rerun the same command."
      )
    return (
      f"elastic: {name} passed {self._field()} on actor {actor}: {state}; requeued, the "
      f"actor restarted (this task's timeouts: {c[0]} while stepping, {c[1]} answered; "
      f"{self.STEPPING} or {self.ANSWERED} stop the run)."
    )

  def expired_score(self, path: int, actor: int, elapsed_s: float) -> str:
    """A re-shard's scoring task on `actor` expired: a line; raises the `ANSWERED`-th time."""
    c = self.counts.setdefault(("score", path), [0, 0])
    c[1] += 1
    if c[1] >= self.ANSWERED:
      raise ElasticConfigError(
        f"{self._field()}: the scoring task of path {path} (a discriminative re-shard) timed out "
        f"{c[1]} times, the last after {elapsed_s:.1f} s; set "
        f"--config.elastic.task_timeout_s={_nice_s(10 * self.timeout_s)} or more and rerun the "
        "same command."
      )
    return (
      f"elastic: the scoring task of path {path} passed {self._field()} on actor {actor} after "
      f"{elapsed_s:.1f} s; scored again ({c[1]} of {self.ANSWERED} such timeouts stop the run)."
    )


def _progress(ray, ray_errors, actor, task) -> dict | None:
  """The worker actor's progress on `task` (PathWorker.progress), or None if it does not answer."""
  try:
    seen = ray.get(actor.progress.remote(), timeout=2.0)
  except ray_errors.RayError:  # GetTimeoutError (busy starting, or not placed), a dead actor.
    return None
  if not seen or (seen["phase"], seen["worker"]) != tuple(task):
    return None
  return seen


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
  started = _connect(config)
  try:
    short = check_resources(config, ray.nodes(), fixed=not e.address)
    if short:  # A joined cluster may grow: the actors wait for nodes (a line a minute).
      logging.warning("%s", short)
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    repair.forget_lost_outputs(workdir, grid)  # Before the queue reads its results.
    task_log = storage.TaskLog(workdir)
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
    starting = _StartWatch(ray, config, workers)  # A line a minute while any is not started.
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
      return _loop(
        config,
        workdir,
        grid,
        coord,
        executors,
        owned,
        workers,
        task_log,
        ray,
        ray_errors,
        exp,
        plan,
        starting,
        faults,
      )
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
      stop_local_ray()


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
  else:  # Module files moved aside as a damage line said: rebuilt before any task reads them.
    initial = lambda: _initial_modules(config, workdir, exp, grid)
    repair.rebuild_modules(config, workdir, grid, alpha_W, initial)
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
  config,
  workdir,
  grid,
  coord,
  executors,
  owned,
  workers,
  task_log,
  ray,
  ray_errors,
  exp,
  plan,
  starting=None,
  faults_cfg: faults_lib.Faults = faults_lib.NO_FAULTS,
) -> dict:
  """Leases tasks to idle workers, forwards results to executors, versions to the queue.

  `starting`: the worker actors not started yet (_StartWatch), logged while they wait.
  `faults_cfg`: what to inject (runtime/faults.py).
  """
  e = config.elastic
  timeouts = _Timeouts(e.task_timeout_s, grid.H)  # Stops a run whose timeout cuts every task.
  call = lambda m, *a: _call(ray, ray_errors, m, *a)
  log = lambda **kw: task_log.append({"t": time.time(), **kw})
  running, outer = {}, {}  # future -> (actor, task, start); future -> (executor, phase, worker)
  scoring = {}  # future -> (actor, path, start): a re-shard's scoring tasks (the driver's queue).
  timed_out = set()  # Scoring futures whose actor was killed for the task timeout.
  results = call(coord.results)
  left = (grid.T + 1) * grid.W - len(results)  # Faults are drawn among this invocation's tasks.
  faults = faults_lib.driver_plan(faults_cfg, left, grid.topo.num_paths, len(executors), log)
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
      if starting is not None:
        starting.tick()
      for task, actor in call(coord.expired):
        seen = _progress(ray, ray_errors, workers[actor], task)  # Before the kill ends it.
        log(event="timeout", phase=task[0], worker=task[1], actor=actor, progress=seen)
        logging.warning("%s", timeouts.expired(task, actor, seen))  # Raises at the limit.
        ray.kill(workers[actor], no_restart=False)  # Comes back; its future raises.
      for f, (actor, path, start) in scoring.items():
        if f not in timed_out and time.time() - start > e.task_timeout_s:
          timed_out.add(f)  # Killed once; rescored when its future raises.
          log(event="timeout_score", path=path, actor=actor)
          logging.warning("%s", timeouts.expired_score(path, actor, time.time() - start))
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
