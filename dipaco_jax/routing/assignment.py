"""Documents to workers: a run's router over paths and the shard assignment it makes.

`PathRouter` wraps a fitted `Router` (k-means, product k-means, linear) or the
i.i.d. default (a hash of the doc id) and answers, for a batch of documents,
the workers of each one's top-k paths. `RouterAssignment` turns it into the
`assign(doc)` callback `data.prepare_shards` calls, routing documents a batch
ahead so memory holds one batch and never the corpus.

Path ids follow `topology.Topology.paths` (row-major over the levels). A
router's grid is the run's K_l of the levels with K_l > 1 (levels shared by
every path do not route), or (P,) for an explicit path subset. With replicas,
a path's documents are spread over its workers by a hash of the doc id, or,
with `routing.replica_shards="router"` (DiLoCo's non-i.i.d. shards), the
phase-0 router has one cluster per worker: grid (W,).
"""

import dataclasses
import hashlib
from typing import Callable, Iterator

import numpy as np

from dipaco_jax import data as data_lib
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.data import corpus
from dipaco_jax.io import progress
from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import router as router_lib


def router_grid(topo: topo_lib.Topology, by_worker: bool = False) -> tuple[int, ...]:
  """The grid a router of this topology must have (see module doc)."""
  if by_worker:
    return (topo.num_workers,)
  full = int(np.prod(topo.modules_per_level))
  if topo.num_paths == full:
    return tuple(k for k in topo.modules_per_level if k > 1) or (1,)
  return (topo.num_paths,)


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
      self.router.check_matches(
        grid=router_grid(self.topo, self.by_worker), source=f"the {self.router.kind} router"
      )

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
    return (
      f"{self.router.kind}(grid={self.router.grid},arrays={h.hexdigest()[:16]},"
      f"features={self.feature_id})"
    )

  def workers(self, doc_ids, feats_NxD: np.ndarray | None, top_k: int = 1) -> np.ndarray:
    """Workers of each document's top_k paths, best first -> int [N, top_k]."""
    doc_ids = np.asarray(doc_ids, np.int64)
    R, W = self.topo.replicas, self.topo.num_workers
    if self.router is None:
      assign = data_lib.random_assignment(W, seed=self.seed, top_k=top_k)
      return np.array(
        [assign(data_lib.Document(int(d), np.zeros(1, np.int32), "")) for d in doc_ids], np.int64
      ).reshape(len(doc_ids), top_k)
    if feats_NxD is None:
      raise ValueError(
        f"a {self.kind} router needs features; compute them with FeatureExtractor.prefix_features."
      )
    paths_NxK = self.router.route(feats_NxD, top_k).astype(np.int64)
    if self.by_worker:
      return paths_NxK
    replica = (hash_ids(doc_ids) % np.uint64(R)).astype(np.int64)
    return paths_NxK * R + replica[:, None]

  def paths(self, doc_ids, feats_NxD: np.ndarray | None, top_k: int = 1) -> np.ndarray:
    """Top_k paths of each document -> int [N, top_k]."""
    return self.topo.path_of_worker[self.workers(doc_ids, feats_NxD, top_k)]


class RouterAssignment:
  """`assign(doc)` for prepare_shards that routes documents in batches of a lookahead.

  shard_writer asks `assign_batch` for a batch of documents at a time (each
  writing process its own part of the split). A caller asking for one document
  at a time gets the same answers: this object then reads the same split's
  stream a batch ahead and routes it, so memory holds one batch, never the corpus.
  """

  def __init__(
    self,
    path_router: PathRouter,
    extractor: features_lib.FeatureExtractor | None,
    stream: Callable[[str], Iterator],
    *,
    top_k: int = 1,
    batch_size: int = 512,
  ):
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
    for d, w in zip(batch, self.assign_batch(batch)):
      self._cache[d.doc_id] = w

  @property
  def batch_size(self) -> int:
    return self._batch_size

  def assign_batch(self, docs) -> list[list[int]]:
    """Workers of each document of a batch (shard_writer's batched path: no stream needed)."""
    feats = (
      self.extractor.prefix_features([d.tokens for d in docs])
      if self.path_router.needs_features
      else None
    )
    ids = [d.doc_id for d in docs]
    return [[int(x) for x in w] for w in self.path_router.workers(ids, feats, self.top_k)]

  def __call__(self, doc) -> list[int]:
    if doc.doc_id not in self._cache:
      for split in corpus.SPLITS:
        head = self._peek(split)
        if head is not None and head.doc_id == doc.doc_id:
          if not np.array_equal(head.tokens, doc.tokens):
            raise ValueError(
              f"document {doc.doc_id} differs from the {split} stream's copy: "
              "the assignment must read the same task, vocab and data_dir."
            )
          self._fill(split)
          break
      else:
        raise ValueError(
          f"document {doc.doc_id} is not next in any split's stream: routed "
          "assignments serve prepare_shards' in-order pass only."
        )
    return self._cache.pop(doc.doc_id)


def document_stream(data_cfg) -> Callable[[str], Iterator]:
  """split -> the split's documents, read exactly as prepare_shards reads them."""
  return lambda split: data_lib.config_documents(data_cfg, split)


def make_assignment(
  config, path_router: PathRouter, extractor: features_lib.FeatureExtractor | None
):
  """The prepare_shards `assign=` of a router; None keeps prepare_shards' own random default."""
  if path_router.router is None:
    return None
  return RouterAssignment(
    path_router, extractor, document_stream(config.data), top_k=config.data.top_k
  )


def collect(
  extractor: features_lib.FeatureExtractor | None, documents, desc: str | None = None
) -> dict[str, np.ndarray]:
  """Doc ids, domains, tokens per doc and (with an extractor) features of a small split.

  With `desc`, a progress bar of that name counts the documents.
  """
  ids, domains, tokens, feats = [], [], [], []
  if extractor is None:
    for d in documents if desc is None else progress.bar(documents, desc=desc, unit="doc"):
      ids.append(d.doc_id)
      domains.append(d.domain)
      tokens.append(len(d.tokens))
  else:
    for docs, f in extractor.stream(documents, desc=desc):
      ids += [d.doc_id for d in docs]
      domains += [d.domain for d in docs]
      tokens += [len(d.tokens) for d in docs]
      feats.append(f)
  out = {
    "doc_ids": np.asarray(ids, np.int64),
    "domains": np.asarray(domains),
    "tokens": np.asarray(tokens, np.int64),
  }
  if feats:
    out["features"] = np.concatenate(feats)
  return out
