"""The command's Ray cluster: its own on loopback with an owner-only token, or one it joins."""
# pylint: disable=invalid-name

import contextlib
import ipaddress
import math
import os
import pathlib
import secrets
import socket
import stat

from absl import logging

from dipaco_jax.runtime.elastic import reaper
from dipaco_jax.runtime.elastic import resources
from dipaco_jax.runtime.elastic.errors import ElasticConfigError

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


def private_token() -> None:
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

  private_token()
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
      f"{LOOPBACK}: its services would listen beyond this machine. cluster._loopback_node "
      "needs the Ray version's own setting for this."
    )
  private_token()  # Ray may have written it (a token file it found missing after all).


def stop_local_ray() -> None:
  """Ends the cluster start_local_ray started: Ray's shutdown, then its watcher's sweep."""
  import ray  # pylint: disable=g-import-not-at-top

  try:
    ray.shutdown()
  finally:
    reaper.stop()


def _local_cpus(config) -> int:
  """CPUs of the command's own cluster: every worker actor's, plus one; refuses more than exist.

  Each worker actor asks for worker_resources' CPUs (1 by default); the coordinator
  and executors ask for none. A worker asking for more cores than this machine
  has could never be placed.
  """
  e = config.elastic
  per = resources.worker_cpus(e.worker_resources)
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if per > cores:
    raise ElasticConfigError(
      f"config.elastic.worker_resources={e.worker_resources!r} asks {per:g} CPUs per worker "
      f"actor, but this machine, where the command's own Ray cluster runs "
      f"(config.elastic.address=''), has {cores} cores: ask for at most {cores}, or join a "
      "larger cluster with --config.elastic.address=HOST:PORT."
    )
  return math.ceil(e.num_workers * per) + 1


def connect(config) -> bool:
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


def control_options(ray) -> dict:
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
