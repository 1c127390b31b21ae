"""This process's part of the global batch, and its checkpointable position.

Each worker reads its own shard through its own `WorkerBatcher`, so a worker's
batches do not depend on which process loads it: a run gives the same batches
as one process or as many. A process loads only the workers (and batch rows)
whose shards live on its devices; the positions of all workers are gathered
into one JSON object for the checkpoint.
"""

import json
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from dipaco_jax import data as data_lib
from dipaco_jax.data import batcher


def local_block(sharding: NamedSharding, global_shape: Sequence[int]):
  """(worker ids, batch-row slice) that this process's devices hold."""
  workers, rows = set(), set()
  for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
    workers.update(range(*idx[0].indices(global_shape[0])))
    rows.update(range(*idx[1].indices(global_shape[1])))
  lo, hi = min(rows), max(rows) + 1
  if len(rows) != hi - lo:
    raise ValueError(
      "this process's batch rows are not contiguous; put the "
      "'data' axis inside a host (config.mesh)."
    )
  return sorted(workers), slice(lo, hi)


class _NoDocuments:
  """An empty validation shard's batches: all padding (weight 0), so its loss reads NaN."""

  def __init__(self, batch_size: int, seq_len: int, **unused_kw):
    self._batch = {k: v[None] for k, v in batcher.pack([], batch_size, seq_len).items()}

  def next_batch(self) -> dict[str, np.ndarray]:
    return self._batch

  def get_state(self) -> dict:
    return {"empty": True}

  def set_state(self, state: dict) -> None:
    del state


class Feed:
  """Batches [local workers, local rows, T] from one WorkerBatcher per worker.

  Validation shards may be empty (data.empty_shard_policy="allow_validation"),
  and so may a held-out slice (a shard too small to spare a document); those
  workers get padding-only batches. Training shards never may.
  """

  def __init__(self, shard_set, split: str, workers: Sequence[int], rows: slice, **batcher_kw):
    self.workers = list(workers)
    self._rows = rows
    docs = shard_set.num_docs(split)
    holdout = batcher_kw.get("holdout")
    if holdout is not None and holdout.part == "heldout":
      docs = [holdout.count(int(n)) for n in docs]
    elif split == "train":
      docs = [1] * len(docs)  # Never empty: WorkerBatcher refuses an empty training shard.
    self._its = {
      w: (
        _NoDocuments(**batcher_kw)
        if docs[w] == 0
        else data_lib.WorkerBatcher(shard_set, split, [w], **batcher_kw)
      )
      for w in self.workers
    }

  def next_batch(self) -> dict[str, np.ndarray]:
    parts = [self._its[w].next_batch() for w in self.workers]
    return {k: np.concatenate([p[k][:, self._rows] for p in parts]) for k in parts[0]}

  def local_state(self) -> dict[str, dict]:
    return {str(w): it.get_state() for w, it in self._its.items()}

  def get_state(self) -> dict[str, dict]:
    """Positions of every worker of the run (gathered across processes)."""
    state = {}
    for part in gather_json(self.local_state()):
      state.update(part)
    return state

  def set_state(self, state: dict[str, dict]) -> None:
    missing = [w for w in self.workers if str(w) not in state]
    if missing:
      raise ValueError(
        f"the checkpoint's data state has no position for "
        f"workers {missing}; it was written by another grid."
      )
    for w, it in self._its.items():
      it.set_state(state[str(w)])


def make_feed(exp, shard_set, split: str, **kw) -> Feed:
  """This process's workers and rows of `split` for an Experiment, one batcher each."""
  workers, rows = local_block(exp.batch_sharding, exp.batch_shape)
  c = exp.config.data
  if split == "train" and kw.get("shuffle", True):  # Training batches (not held-out ones).
    kw.setdefault("interleave", c.interleave)
  return Feed(
    shard_set, split, workers, rows, seq_len=c.seq_len, batch_size=c.batch_size, seed=c.seed, **kw
  )


def gather_json(obj) -> list:
  """`obj` from every process, in process order (one process: [obj])."""
  if jax.process_count() == 1:
    return [obj]
  raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  n = int(np.max(multihost_utils.process_allgather(np.array([raw.size]))))
  padded = np.zeros(n, np.uint8)
  padded[: raw.size] = raw
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, n)
  return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in every]


def host(tree):
  """Fetches (possibly non-addressable) global arrays to numpy on every host."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
