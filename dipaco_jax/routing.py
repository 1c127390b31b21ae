"""Routing a run's documents to paths: the configured router, its shard assignment, its report.

Phase 0 shards come from `config.routing.router`: "random" (i.i.d., today's
default), "kmeans" or "product_kmeans" fitted on the router split's features
(see features.py). Discriminative phases (reshard.py) save "linear" routers.
Routers live in `<workdir>/router/phase_<k>/` (router.npz + router.json).

Path ids follow `topology.Topology.paths` (row-major over the levels). A
router's grid is the run's K_l of the levels with K_l > 1 (levels shared by
every path do not route), or (P,) for an explicit path subset. With replicas,
a path's documents are spread over its workers by a hash of the doc id, or,
with `routing.replica_shards="router"` (DiLoCo's non-i.i.d. shards), the
phase-0 router has one cluster per worker: grid (W,).
"""

import dataclasses
import hashlib
import os
from typing import Callable, Iterator

import jax
import numpy as np

from dipaco_jax import features as features_lib
from dipaco_jax import router as router_lib
from dipaco_jax import router_report
from dipaco_jax import topology as topo_lib
from dipaco_jax import data as data_lib
from dipaco_jax.data import corpus

PHASE0_ROUTERS = ("random", "kmeans", "product_kmeans")
REPLICA_SHARDS = ("hash", "router")
ROUTER_DIR = "router"


def router_grid(topo: topo_lib.Topology, by_worker: bool = False) -> tuple[int, ...]:
  """The grid a router of this topology must have (see module doc)."""
  if by_worker:
    return (topo.num_workers,)
  full = int(np.prod(topo.modules_per_level))
  if topo.num_paths == full:
    return tuple(k for k in topo.modules_per_level if k > 1) or (1,)
  return (topo.num_paths,)


def router_dir(workdir: str, phase: int) -> str:
  return os.path.join(str(workdir), ROUTER_DIR, f"phase_{phase}")


def shard_dir(config, workdir: str, phase: int) -> str:
  """Phase 0: config.data.shard_dir or <workdir>/shards; phase k: <workdir>/shards_phase_<k>."""
  if phase == 0:
    return config.data.get("shard_dir") or os.path.join(str(workdir), "shards")
  return os.path.join(str(workdir), f"shards_phase_{phase}")


def hash_ids(doc_ids: np.ndarray) -> np.ndarray:
  """A splitmix-style hash of doc ids (replica choice; independent of the routing)."""
  x = np.asarray(doc_ids, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


@dataclasses.dataclass
class PathRouter:
  """A run's router over paths: a fitted Router on features, or random by doc id."""
  topo: topo_lib.Topology
  router: router_lib.Router | None  # None: random (hash of the doc id, as the shards).
  seed: int = 0  # config.data.seed (random only).
  feature_id: str = ""  # Which θ̄ and prefix the router reads (FeatureExtractor.fingerprint).
  by_worker: bool = False  # The router picks workers, not paths (replica_shards="router").

  def __post_init__(self):
    if self.router is not None:
      self.router.check_matches(grid=router_grid(self.topo, self.by_worker),
                                source=f"the {self.router.kind} router")

  @property
  def kind(self) -> str:
    return "random" if self.router is None else self.router.kind

  @property
  def needs_features(self) -> bool:
    return self.router is not None

  @property
  def description(self) -> str:
    """Identifies the assignment in shard metadata: kind, arrays hash, features."""
    if self.router is None:
      return f"random(seed={self.seed})"
    h = hashlib.sha256()
    for k in sorted(self.router.arrays):
      h.update(k.encode() + self.router.arrays[k].tobytes())
    return (f"{self.router.kind}(grid={self.router.grid},arrays={h.hexdigest()[:16]},"
            f"features={self.feature_id})")

  def workers(self, doc_ids, feats_NxD: np.ndarray | None, top_k: int = 1) -> np.ndarray:
    """Workers of each document's top_k paths, best first -> int [N, top_k]."""
    doc_ids = np.asarray(doc_ids, np.int64)
    R, W = self.topo.replicas, self.topo.num_workers
    if self.router is None:
      assign = data_lib.random_assignment(W, seed=self.seed, top_k=top_k)
      return np.array([assign(data_lib.Document(int(d), np.zeros(1, np.int32), ""))
                       for d in doc_ids], np.int64).reshape(len(doc_ids), top_k)
    if feats_NxD is None:
      raise ValueError(f"a {self.kind} router needs features; compute them with "
                       "FeatureExtractor.prefix_features.")
    paths_NxK = self.router.route(feats_NxD, top_k).astype(np.int64)
    if self.by_worker:
      return paths_NxK
    replica = (hash_ids(doc_ids) % np.uint64(R)).astype(np.int64)
    return paths_NxK * R + replica[:, None]

  def paths(self, doc_ids, feats_NxD: np.ndarray | None, top_k: int = 1) -> np.ndarray:
    """Top_k paths of each document -> int [N, top_k]."""
    return self.topo.path_of_worker[self.workers(doc_ids, feats_NxD, top_k)]


class Assignment:
  """`assign(doc)` for prepare_shards that routes documents in batches of a lookahead.

  write_shards asks for one document at a time, in the order of its own
  `iter_documents` stream; this object reads the same split's stream a batch
  ahead, routes the batch on device and answers from that batch, so memory
  holds one batch and never the corpus.
  """

  def __init__(self, path_router: PathRouter, extractor: features_lib.FeatureExtractor | None,
               stream: Callable[[str], Iterator], *, top_k: int = 1, batch_size: int = 512):
    self.path_router, self.extractor, self.top_k = path_router, extractor, top_k
    self._stream, self._batch_size = stream, batch_size
    self._its: dict[str, Iterator] = {}
    self._head: dict[str, object] = {}
    self._cache: dict[int, list[int]] = {}
    self.description = f"{path_router.description},top_k={top_k}"

  def _peek(self, split: str):
    if split not in self._head:
      self._its.setdefault(split, iter(self._stream(split)))
      self._head[split] = next(self._its[split], None)
    return self._head[split]

  def _fill(self, split: str) -> None:
    batch = [self._head.pop(split)]
    it = self._its[split]
    while len(batch) < self._batch_size:
      doc = next(it, None)
      if doc is None:
        self._head[split] = None
        break
      batch.append(doc)
    ids = [d.doc_id for d in batch]
    feats = (self.extractor.prefix_features([d.tokens for d in batch])
             if self.path_router.needs_features else None)
    for d, w in zip(ids, self.path_router.workers(ids, feats, self.top_k)):
      self._cache[d] = [int(x) for x in w]

  def __call__(self, doc) -> list[int]:
    if doc.doc_id not in self._cache:
      for split in corpus.SPLITS:
        head = self._peek(split)
        if head is not None and head.doc_id == doc.doc_id:
          if not np.array_equal(head.tokens, doc.tokens):
            raise ValueError(f"document {doc.doc_id} differs from the {split} stream's copy: "
                             "the assignment must read the same task, vocab and data_dir.")
          self._fill(split)
          break
      else:
        raise ValueError(f"document {doc.doc_id} is not next in any split's stream: routed "
                         "assignments serve prepare_shards' in-order pass only.")
    return self._cache.pop(doc.doc_id)


def document_stream(data_cfg) -> Callable[[str], Iterator]:
  """split -> the split's documents, read exactly as prepare_shards reads them."""
  return lambda split: data_lib.iter_documents(
      data_cfg.task, split, data_dir=data_cfg.get("tfds_data_dir"),
      vocab_path=data_cfg.get("vocab_path"), subsample=data_cfg.get("subsample", 1))


def make_assignment(config, path_router: PathRouter,
                    extractor: features_lib.FeatureExtractor | None):
  """The prepare_shards `assign=` of a router; None keeps prepare_shards' own random default."""
  if path_router.router is None:
    return None
  return Assignment(path_router, extractor, document_stream(config.data),
                    top_k=config.data.get("top_k", 1))


def collect(extractor: features_lib.FeatureExtractor | None, documents) -> dict[str, np.ndarray]:
  """Doc ids, domains and (if an extractor is given) features of a small split, in memory."""
  ids, domains, feats = [], [], []
  if extractor is None:
    for d in documents:
      ids.append(d.doc_id)
      domains.append(d.domain)
  else:
    for docs, f in extractor.stream(documents):
      ids += [d.doc_id for d in docs]
      domains += [d.domain for d in docs]
      feats.append(f)
  out = {"doc_ids": np.asarray(ids, np.int64), "domains": np.asarray(domains)}
  if feats:
    out["features"] = np.concatenate(feats)
  return out


def replicas_by_router(config, topo: topo_lib.Topology) -> bool:
  """Whether phase 0 routes documents to workers (config.routing.replica_shards="router")."""
  how = config.routing.get("replica_shards", "hash")
  if how not in REPLICA_SHARDS:
    raise ValueError(f"config.routing.replica_shards={how!r}: choose one of {REPLICA_SHARDS}.")
  if how == "hash" or topo.replicas == 1:
    return False
  if discriminative_steps(config):
    raise ValueError("config.routing.replica_shards='router' clusters documents per worker in "
                     "phase 0 only; discriminative re-shards route paths. Set "
                     "discriminative_at_outer_step=-1 or replica_shards='hash'.")
  return True


def fit_phase0(config, topo: topo_lib.Topology, feats_NxD: np.ndarray) -> router_lib.Router:
  """k-means or product k-means with one cluster per path (or worker), on router features."""
  r = config.routing
  kw = dict(restarts=r.get("kmeans_restarts", 4), iters=r.get("kmeans_iters", 100),
            seed=r.get("seed", 0))
  grid = router_grid(topo, replicas_by_router(config, topo))
  if r.router == "kmeans":
    return router_lib.fit_kmeans_router(feats_NxD, grid, **kw)
  if r.router == "product_kmeans":
    if grid == (topo.num_paths,) and len(topo.modules_per_level) > 1:
      raise ValueError("product_kmeans needs the full grid of paths; this run lists an explicit "
                       "path subset (config.dipaco.paths): use config.routing.router='kmeans'.")
    if grid == (topo.num_workers,) and topo.replicas > 1:
      raise ValueError("product_kmeans routes over the grid of paths; replica_shards='router' "
                       "clusters per worker: use config.routing.router='kmeans'.")
    return router_lib.fit_product_kmeans_router(feats_NxD, grid, **kw)
  raise ValueError(f"config.routing.router={r.router!r}: choose one of {PHASE0_ROUTERS}.")


def phase0_router(config, workdir: str, topo: topo_lib.Topology,
                  extractor: features_lib.FeatureExtractor | None) -> PathRouter:
  """The configured phase-0 router: loaded from the workdir, else fitted and saved."""
  kind = config.routing.get("router", "random")
  if kind not in PHASE0_ROUTERS:
    raise ValueError(f"config.routing.router={kind!r}: choose one of {PHASE0_ROUTERS}.")
  if kind == "random":
    return PathRouter(topo, None, seed=config.data.seed)
  by_worker = replicas_by_router(config, topo)
  directory = router_dir(workdir, 0)
  if os.path.exists(os.path.join(directory, router_lib.META_FILE)):
    router = router_lib.Router.load(directory, grid=router_grid(topo, by_worker),
                                    feature_dim=extractor.dim)
    if router.kind != kind or router.info.get("features") != extractor.fingerprint:
      raise ValueError(f"{directory} holds a {router.kind} router on features "
                       f"{router.info.get('features')}, but the config asks for {kind} on "
                       f"{extractor.fingerprint}; use a new --workdir (nothing was changed).")
  else:
    split = collect(extractor, document_stream(config.data)("router"))
    router = fit_phase0(config, topo, split["features"])
    router.info["features"] = extractor.fingerprint
    if jax.process_index() == 0:  # Every process fits the same router; one writes it.
      router.save(directory)
  return PathRouter(topo, router, seed=config.data.seed, feature_id=extractor.fingerprint,
                    by_worker=by_worker)


def load_phase_router(config, workdir: str, topo: topo_lib.Topology, phase: int,
                      extractor: features_lib.FeatureExtractor | None) -> PathRouter:
  """The router that wrote phase `phase`'s shards (0: configured; >0: discriminative)."""
  if phase == 0:
    return phase0_router(config, workdir, topo, extractor)
  router = router_lib.Router.load(router_dir(workdir, phase), grid=router_grid(topo))
  return PathRouter(topo, router, seed=config.data.seed,
                    feature_id=router.info.get("features", ""))


def quality(path_router: PathRouter, split_data: dict, *, top_k: int = 1
            ) -> router_report.RouterReport:
  """Shard sizes and the paths x domains table of a routed split (domains never train)."""
  ids, names = domain_index(split_data["domains"])
  paths = path_router.paths(split_data["doc_ids"], split_data.get("features"), top_k)
  return router_report.report(paths, path_router.topo.num_paths, ids, names)


def discriminative_steps(config) -> list[int]:
  """Outer steps after which a discriminative re-shard runs (empty: never)."""
  r = config.routing
  at, phases = r.get("discriminative_at_outer_step", -1), r.get("discriminative_phases", 1)
  if at < 0 or phases < 1:
    return []
  every = r.get("discriminative_every", 1)
  if phases > 1 and every < 1:
    raise ValueError(f"config.routing.discriminative_every={every}: successive phases need >= 1 "
                     "outer step between them.")
  steps = [at + k * every for k in range(phases)]
  T = config.dipaco.outer_steps
  if not 1 <= at or steps[-1] >= T:
    raise ValueError(f"discriminative re-shards at outer steps {steps} do not fit in 1..{T - 1}: "
                     "set config.routing.discriminative_at_outer_step (and _every) so that "
                     "training continues after each re-shard.")
  return steps



def domain_index(domains) -> tuple[np.ndarray, list[str]]:
  names = sorted(set(np.asarray(domains).tolist()))
  index = {n: i for i, n in enumerate(names)}
  return np.array([index[d] for d in domains], np.int64), names


def route_run(config, workdir: str) -> str:
  """Fits (or loads) the phase-0 router, writes the shards, returns and saves its report."""
  topo = topo_lib.from_config(config)
  kind = config.routing.get("router", "random")
  extractor = features_lib.extractor_from_config(config) if kind != "random" else None
  pr = phase0_router(config, workdir, topo, extractor)
  shard_set = data_lib.prepare_shards(config.data, topo.num_workers, shard_dir(config, workdir, 0),
                                      assign=make_assignment(config, pr, extractor))
  lines = [f"# Phase-0 routing: {pr.description}", "",
           f"train shards (tokens per worker): {shard_set.sizes('train').tolist()}",
           f"train shards (documents per worker): {shard_set.num_docs('train').tolist()}", ""]
  for split in ("router", "validation"):
    rep = quality(pr, collect(extractor if pr.needs_features else None,
                              document_stream(config.data)(split)))
    lines += [f"## {split} split (top-1 path per document vs its domain)", "",
              router_report.to_markdown(rep)]
  text = "\n".join(lines)
  os.makedirs(router_dir(workdir, 0), exist_ok=True)
  with open(os.path.join(router_dir(workdir, 0), "report.md"), "w") as f:
    f.write(text)
  return text
