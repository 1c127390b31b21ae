"""Per-token log-likelihoods of sequences under chosen paths, on the run's mesh.

A *unit* is (target tokens, path): the tokens are scored by that path with the
whole unit as context. Units are bucketed by path into the trainer's [W, B, T]
batch layout (a path's units spread over its replica workers), so one jitted,
path-sharded program scores every path at once and each path only sees its own
units. Discriminative labels (every path scores a document), routed evaluation
(one path per sequence) and re-routing (one path per chunk) all reduce to units.
"""
# pylint: disable=invalid-name

import functools
from typing import Sequence

import jax
import numpy as np
import optax

from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import paths as paths_lib
from dipaco_jax.data import feed as feed_lib
from dipaco_jax.io import progress
from dipaco_jax.types import PyTree


def token_logprobs(params, inputs_BxT, targets_BxT, *, model):
  """log p(target_t | inputs_<=t) for one path: [B, T] float32."""
  logits_BxTxV = model.apply({"params": params}, inputs_BxT)
  return -optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)


def unit_batch(rows_W, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Units' tokens as (inputs, targets) [W, B, T] (the unit is its own context).

  Row b of worker w holds rows_W[w][b], zero-padded; inputs are the targets
  shifted right behind BOS 0.
  """
  targets = np.zeros((len(rows_W), batch_size, seq_len), np.int32)
  for w, rows in enumerate(rows_W):
    for b, t in enumerate(rows):
      targets[w, b, : len(t)] = t
  inputs = np.concatenate([np.zeros(targets.shape[:2] + (1,), np.int32), targets[:, :, :-1]], -1)
  return inputs, targets


class PathScorer:
  """Scores units with the params of every worker ([W, ...], sharded like training)."""

  def __init__(
    self, exp: exp_lib.Experiment, params_W: PyTree, *, seq_len: int, batch_size: int | None = None
  ):
    self.exp, self.topo = exp, exp.topo
    self.seq_len = int(seq_len)
    data = exp.mesh.shape["data"]
    bs = batch_size or exp.config.data.batch_size
    self.batch_size = max(data, -(-int(bs) // data) * data)  # A multiple of the 'data' axis.
    self.params_W = params_W
    sh = exp.batch_sharding
    self._sharding = sh
    self._fn = jax.jit(
      jax.vmap(functools.partial(token_logprobs, model=exp.model)),
      in_shardings=(exp.state_sharding.params, sh, sh),
      out_shardings=sh,
    )
    self.workers_of_path = [
      np.flatnonzero(self.topo.path_of_worker == p) for p in range(self.topo.num_paths)
    ]

  @classmethod
  def from_store(cls, exp: exp_lib.Experiment, store: PyTree, **kw) -> "PathScorer":
    """Scorer for the global modules: every replica of a path holds the store's path."""
    assemble = jax.jit(
      functools.partial(paths_lib.assemble, topo=exp.topo), out_shardings=exp.state_sharding.params
    )
    return cls(exp, assemble(store), **kw)

  def _put(self, x_WxBxT: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(x_WxBxT.shape, self._sharding, lambda i: x_WxBxT[i])

  def score(
    self, tokens: Sequence[np.ndarray], paths: Sequence[int], desc: str | None = None
  ) -> list[np.ndarray]:
    """log p of each target token of unit i under path paths[i] -> list of [len_i] arrays.

    With `desc`, a progress bar of that name counts the scored units.
    """
    if len(tokens) != len(paths):
      raise ValueError(f"{len(tokens)} token arrays but {len(paths)} paths: one path per unit.")
    W, B, T = self.topo.num_workers, self.batch_size, self.seq_len
    queues: list[list[int]] = [[] for _ in range(W)]
    sent = np.zeros(self.topo.num_paths, np.int64)  # Units per path so far: round-robin replicas.
    for i, (t, p) in enumerate(zip(tokens, paths)):
      if not 0 <= int(p) < self.topo.num_paths:
        raise ValueError(
          f"unit {i} names path {p}; this grid has paths 0-{self.topo.num_paths - 1}."
        )
      if not 1 <= len(t) <= T:
        raise ValueError(f"unit {i} has {len(t)} tokens; units need 1..{T} (the scorer's seq_len).")
      ws = self.workers_of_path[int(p)]
      queues[int(ws[sent[p] % len(ws)])].append(i)
      sent[p] += 1
    out: list[np.ndarray | None] = [None] * len(tokens)
    bar = progress.bar(total=len(tokens), desc=desc, unit="unit", disable=desc is None)
    while any(queues):
      taken, rows_W = [], []
      for w in range(W):
        rows, queues[w] = queues[w][:B], queues[w][B:]
        taken += [(w, b, i) for b, i in enumerate(rows)]
        rows_W.append([tokens[i] for i in rows])
      inputs, targets = unit_batch(rows_W, B, T)
      # Blocks every batch: keeps dispatch close (CPU collectives).
      logp = np.asarray(
        feed_lib.host(self._fn(self.params_W, self._put(inputs), self._put(targets)))
      )
      for w, b, i in taken:
        out[i] = logp[w, b, : len(tokens[i])]
      bar.update(len(taken))
    bar.close()
    return out  # type: ignore[return-value]

  def score_all_paths(self, tokens: Sequence[np.ndarray], desc: str | None = None) -> np.ndarray:
    """Per-token log p under every path: [N, T, P] (zero past each sequence's end)."""
    P, T = self.topo.num_paths, self.seq_len
    units = [t for t in tokens for _ in range(P)]
    flat = self.score(units, [p for _ in tokens for p in range(P)], desc=desc)
    out = np.zeros((len(tokens), T, P), np.float32)
    for k, lp in enumerate(flat):
      out[k // P, : len(lp), k % P] = lp
    return out


def eval_seq_len(config) -> int:
  """Tokens per validation sequence (a document's start): eval.seq_len, else data.seq_len."""
  return config.eval.seq_len or config.data.seq_len
