"""What a worker actor asks Ray for, whether the cluster has room for the pool, and its cores."""

import json
import math
import time

from absl import logging

from dipaco_jax.runtime.elastic.errors import ElasticConfigError


def worker_options(worker_resources: str) -> dict:
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


def worker_cpus(worker_resources: str) -> float:
  """CPUs of one worker actor (elastic.worker_resources' "CPU", else 1)."""
  return float(worker_options(worker_resources)["num_cpus"])


def _need(worker_resources: str) -> dict:
  """What one worker actor asks Ray for: {"CPU": n, other resources...}, amounts > 0."""
  opts = worker_options(worker_resources)
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


class StartWatch:
  """Worker actors that have not answered since they were requested: one line a minute.

  A joined cluster may have no room for them yet (check_resources); the line
  names them, config.elastic.worker_resources and what the live nodes offer.
  Leasing does not wait for them (a task leased to an actor Ray has not placed
  waits in its queue; its lease may expire: see leases.Timeouts).
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
