"""WorkerBatcher: packed, fixed-length batches per worker from shards; exact resume state.

A `Holdout` splits each worker's shard into a seeded held-out slice and the rest
(early stopping's own-shard documents, early_stopping.py): a view on the shard,
so the shard files (and the shard cache's fingerprint) do not change.

`interleave` = N > 1 reads N of a worker's documents side by side: the shard is dealt
into N lanes (document i to lane i mod N), each lane a stream of its own documents in
its own seeded order, and row r of every batch is the next `seq_len` tokens of lane
r mod N. With N = batch_size every row of a batch comes from another document, as the
rows of a shuffle buffer of packed examples would (seqio, tf.data), but the position is
a few integers per lane, so a resumed run reads exactly what the first would have.
N = 1 lays one document after the other, so a batch holds as many documents as its
tokens span (32 rows of 96 tokens of 1,265-token documents: about three).
"""

import dataclasses
from typing import Sequence

import numpy as np

from dipaco_jax.data.shards import EmptyShardError
from dipaco_jax.data.shards import ShardSet

STATE_VERSION = 2  # 2: keys name workers.
HOLDOUT_PARTS = ("rest", "heldout")
_HOLDOUT_TAG = 0x4E1D  # Keeps the held-out draw apart from the per-epoch orders' seeds.


@dataclasses.dataclass(frozen=True)
class Holdout:
  """min(docs, floor(fraction x n)) seeded documents of each n-document shard, held out.

  part "rest" reads the shard without them (training), "heldout" only them.
  """

  docs: int
  fraction: float
  part: str

  def __post_init__(self):
    if self.part not in HOLDOUT_PARTS or self.docs < 0 or not 0 <= self.fraction < 1:
      raise ValueError(
        f"Holdout needs part in {HOLDOUT_PARTS}, docs >= 0 and fraction in [0, 1); got {self}."
      )

  def count(self, num_docs: int) -> int:
    """Held-out documents of a shard of num_docs (fewer than num_docs: training keeps one)."""
    return min(self.docs, int(self.fraction * num_docs))

  def indices(self, num_docs: int, worker: int, seed: int) -> np.ndarray:
    """The documents this part reads of a worker's shard, in shard order."""
    rng = np.random.default_rng([seed, worker, _HOLDOUT_TAG])
    held = np.zeros(num_docs, bool)
    held[rng.choice(num_docs, self.count(num_docs), replace=False)] = True
    return np.flatnonzero(held if self.part == "heldout" else ~held)


class _Subset(Sequence):
  """Some documents of a shard, by index (a Holdout's part)."""

  def __init__(self, docs, indices: np.ndarray):
    self._docs, self._indices = docs, indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, i):
    return self._docs[int(self._indices[i])]


class _WorkerStream:
  """One worker's documents as an endless (or one-pass) token stream in a seeded per-epoch order."""

  def __init__(self, docs, worker: int, seed: int, shuffle: bool, repeat: bool, lane=None):
    self.docs, self.worker, self.seed, self.lane = docs, worker, seed, lane
    self.shuffle, self.repeat = shuffle, repeat
    self.epoch, self.index, self.offset = 0, 0, 0  # position: epoch, rank in its order, token
    self._order, self._order_epoch, self._doc, self._doc_key = None, None, None, None

  def _order_of_epoch(self) -> np.ndarray:
    if self._order_epoch != self.epoch:
      n = len(self.docs)
      key = [self.seed, self.worker, self.epoch] + ([] if self.lane is None else [self.lane])
      rng = np.random.default_rng(key)
      self._order = rng.permutation(n) if self.shuffle else np.arange(n)
      self._order_epoch = self.epoch
    return self._order

  def _current_doc(self) -> np.ndarray:
    key = (self.epoch, self.index)
    if self._doc_key != key:  # a document split across batches is read once
      self._doc = self.docs[int(self._order_of_epoch()[self.index])].tokens
      self._doc_key = key
    return self._doc

  def take(self, num_tokens: int) -> list[np.ndarray]:
    """The next pieces of documents, num_tokens in all unless a one-pass stream runs out."""
    pieces = []
    while num_tokens > 0:
      if self.index == len(self.docs):
        if not self.repeat:
          break
        self.epoch, self.index = self.epoch + 1, 0
      tokens = self._current_doc()
      piece = tokens[self.offset : self.offset + num_tokens]
      pieces.append(piece)
      num_tokens -= len(piece)
      self.offset += len(piece)
      if self.offset == len(tokens):
        self.index, self.offset = self.index + 1, 0
    return pieces


def pack(pieces: list[np.ndarray], batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
  """Lays pieces end to end in batch_size rows of seq_len; each piece in a row is a segment."""
  n = batch_size * seq_len
  lengths = np.array([len(p) for p in pieces], np.int64)
  used = int(lengths.sum())
  targets = np.zeros(n, np.int32)
  if pieces:
    targets[:used] = np.concatenate(pieces)
  idx = np.arange(n)
  start = np.zeros(n, bool)  # a segment starts at each piece start and at each row start
  start[np.cumsum(lengths)[:-1]] = True
  start[0::seq_len] = True
  real = idx < used
  segment_ids = np.cumsum(start.reshape(batch_size, seq_len), axis=1).reshape(n)
  positions = idx - np.maximum.accumulate(np.where(start, idx, 0))
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)
  inputs[start] = 0  # pad id doubles as BOS: nothing leaks from the previous segment
  batch = {
    "inputs": inputs,
    "targets": targets,
    "segment_ids": segment_ids.astype(np.int32),
    "positions": positions.astype(np.int32),
    "weights": real.astype(np.float32),
  }
  for key in ("inputs", "segment_ids", "positions"):
    batch[key][~real] = 0
  return {k: v.reshape(batch_size, seq_len) for k, v in batch.items()}


class WorkerBatcher:
  """Batches [len(workers), batch_size, seq_len] from each worker's shard, independently."""

  def __init__(
    self,
    shard_set: ShardSet,
    split: str,
    workers: Sequence[int],
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    repeat: bool = True,
    holdout: Holdout | None = None,
    interleave: int = 1,
  ):
    if seq_len < 1 or batch_size < 1 or not len(workers) or interleave < 1:
      raise ValueError(
        f"WorkerBatcher needs seq_len >= 1, batch_size >= 1, interleave >= 1 and some worker "
        f"ids; got seq_len={seq_len}, batch_size={batch_size}, interleave={interleave}, "
        f"workers={list(workers)}."
      )
    self.workers = [int(w) for w in workers]
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
    self._config = {
      "split": split,
      "workers": self.workers,
      "seq_len": seq_len,
      "batch_size": batch_size,
      "seed": seed,
      "shuffle": shuffle,
      "repeat": repeat,
    }
    if holdout is not None:  # Only then: states saved without one still resume.
      self._config["holdout"] = [holdout.docs, holdout.fraction, holdout.part]
    if interleave > 1:  # Likewise.
      self._config["interleave"] = interleave
    self.interleave = interleave
    self._streams = []
    for worker in self.workers:
      docs = shard_set.documents(worker, split)
      if holdout is not None:
        docs = _Subset(docs, holdout.indices(len(docs), worker, seed))
      if not len(docs):
        raise EmptyShardError(
          f"Worker {worker} has an empty {split!r} shard in {shard_set.shard_dir}"
          + (" once early stopping's held-out documents are set aside" if holdout else "")
          + "; it cannot feed a batch: fewer workers, a smaller config.data.subsample, or "
          "config.data.empty_shard_policy='error' (refused when the shards are written)."
        )
      if interleave == 1:
        self._streams.append(_WorkerStream(docs, worker, seed, shuffle, repeat))
        continue
      # Lanes: document i of the shard to lane i mod N (at most one lane per document).
      lanes = min(interleave, len(docs))
      self._streams.append(
        [
          _WorkerStream(
            _Subset(docs, np.arange(j, len(docs), lanes)), worker, seed, shuffle, repeat, lane=j
          )
          for j in range(lanes)
        ]
      )

  def _rows(self, lanes) -> dict[str, np.ndarray]:
    """One worker's batch from its lanes: row r from lane r mod N."""
    rows = [
      pack(lanes[r % len(lanes)].take(self.seq_len), 1, self.seq_len)
      for r in range(self.batch_size)
    ]
    return {k: np.concatenate([row[k] for row in rows]) for k in rows[0]}

  def next_batch(self) -> dict[str, np.ndarray]:
    """The next batch of every worker; StopIteration once one-pass streams are all used up."""
    if self.interleave > 1:
      batches = [self._rows(lanes) for lanes in self._streams]
      if not any(b["weights"].any() for b in batches):
        raise StopIteration("every worker's shard has been read once (repeat=False)")
      return {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    n = self.batch_size * self.seq_len
    per_worker = [stream.take(n) for stream in self._streams]
    if not any(per_worker):
      raise StopIteration("every worker's shard has been read once (repeat=False)")
    batches = [pack(pieces, self.batch_size, self.seq_len) for pieces in per_worker]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return self.next_batch()

  def get_state(self) -> dict:
    """Small, JSON-serialisable position of every worker's stream."""
    return {
      "version": STATE_VERSION,
      **self._config,
      "workers_position": [_position(s) for s in self._streams],
    }

  def set_state(self, state: dict) -> None:
    """Continues exactly where the iterator that produced `state` stood."""
    keys = (set(self._config) | set(state)) - {"version", "workers_position"}
    mismatch = {
      k: (state.get(k), self._config.get(k)) for k in keys if state.get(k) != self._config.get(k)
    }
    if state.get("version") != STATE_VERSION or mismatch:
      raise ValueError(
        f"Batcher state does not fit this batcher (field: (state, batcher)): "
        f"{mismatch or {'version': (state.get('version'), STATE_VERSION)}}."
      )
    for stream, position in zip(self._streams, state["workers_position"]):
      _set_position(stream, position)


def _position(stream) -> list:
  """[epoch, index, offset] of a stream; a list of them for a worker's lanes."""
  if isinstance(stream, list):
    return [_position(lane) for lane in stream]
  return [stream.epoch, stream.index, stream.offset]


def _set_position(stream, position) -> None:
  if isinstance(stream, list):
    if len(position) != len(stream):
      raise ValueError(
        f"Batcher state has {len(position)} lanes for a worker that reads {len(stream)}."
      )
    for lane, p in zip(stream, position):
      _set_position(lane, p)
    return
  epoch, index, offset = position
  stream.epoch, stream.index, stream.offset = int(epoch), int(index), int(offset)


def synthetic_batch(
  rng: np.random.Generator, num_workers: int, batch_size: int, seq_len: int, vocab_size: int
) -> dict[str, np.ndarray]:
  """Random tokens in WorkerBatcher's layout, one segment per row (tests, benchmarks)."""
  shape = (num_workers, batch_size, seq_len)
  t = rng.integers(2, vocab_size, size=shape).astype(np.int32)
  inputs = np.concatenate([np.zeros(shape[:2] + (1,), np.int32), t[:, :, :-1]], -1)
  return {
    "inputs": inputs,
    "targets": t,
    "segment_ids": np.ones_like(t),
    "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy(),
    "weights": np.ones(shape, np.float32),
  }
