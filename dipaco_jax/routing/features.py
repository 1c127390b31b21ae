"""Router features: the base model's last-block hidden state, averaged over a prefix.

A document's feature is the mean of θ̄'s last-block hidden states at the
positions that read its first `prefix_len` tokens (paper §7.2.1). The model
reads `[BOS, t_0, ..., t_{L-1}]` as in training, so input position j reads
t_{j-1}; the feature averages positions 1..L. The same running mean at any
later position b (`running_means`) is the re-router's view of the text so far
(t_0..t_{b-1}); at b = L it equals the prefix feature.

Batches run on this process's devices (a local 'data' mesh), so shard writing
on process 0 of a multi-host run needs no other process.
"""
# pylint: disable=invalid-name

import functools
import hashlib
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax.config import sections
from dipaco_jax.core import model as model_lib
from dipaco_jax.io import progress
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.types import PyTree


def check_prefix_len(prefix_len: int) -> int:
  """Raises ValueError for an empty routing prefix."""
  if not isinstance(prefix_len, (int, np.integer)) or prefix_len < 1:
    raise ValueError(
      f"routing prefix length must be an integer >= 1; got {prefix_len!r}. Set "
      "config.routing.prefix_len (the paper routes on the first 32 tokens)."
    )
  return int(prefix_len)


def base_params(config) -> tuple[PyTree, str]:
  """θ̄ (config.dipaco.init_from's params, else the run's initial params) and its identity."""
  src = config.dipaco.init_from
  cfg = sections.ModelConfig.of(config)
  if src:
    shapes = jax.eval_shape(functools.partial(model_lib.init_params, cfg), jax.random.key(0))
    return theta_lib.restore(src, shapes), f"init_from:{src}"
  # The run's initial θ̄: Experiment._init draws it from jax.random.key(config.seed).
  init = jax.jit(functools.partial(model_lib.init_params, cfg))  # One compile, not one per op.
  return init(jax.random.key(config.seed)), f"init_seed:{config.seed}"


def pad_rows(seqs: Sequence[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Truncates/pads token arrays to [N, length] with 0; returns (tokens, lengths)."""
  out = np.zeros((len(seqs), length), np.int32)
  lens = np.zeros(len(seqs), np.int32)
  for i, s in enumerate(seqs):
    s = np.asarray(s[:length], np.int32)
    out[i, : len(s)] = s
    lens[i] = len(s)
  return out, lens


class FeatureExtractor:
  """Jitted θ̄ hidden-state means on this process's devices, batch sharded over 'data'."""

  def __init__(
    self,
    model_cfg: model_lib.ModelConfig,
    params: PyTree,
    *,
    prefix_len: int = 32,
    batch_size: int = 64,
    identity: str = "",
  ):
    self.prefix_len = check_prefix_len(prefix_len)
    devices = np.asarray(jax.local_devices())
    self.mesh = Mesh(devices, ("data",))
    n = devices.size
    self.batch_size = max(n, -(-int(batch_size) // n) * n)  # A multiple of the devices.
    self.model = model_lib.Transformer(model_cfg)
    replicated = NamedSharding(self.mesh, P())
    self.params = jax.device_put(params, replicated)
    self.dim = model_cfg.d_model
    self.identity = identity
    self._rows = NamedSharding(self.mesh, P("data"))
    self._running = jax.jit(
      self._running_fn, in_shardings=(replicated, self._rows), out_shardings=self._rows
    )

  def _running_fn(self, params, inputs_BxT):
    """Mean of hidden states over input positions 1..j, for every j (j=0: position 0)."""
    _, h_BxTxD = self.model.apply({"params": params}, inputs_BxT, return_hidden=True)
    h_BxTxD = h_BxTxD.astype(jnp.float32)
    T = inputs_BxT.shape[1]
    csum_BxTxD = jnp.cumsum(h_BxTxD.at[:, 0].set(0.0), axis=1)
    count_T = jnp.maximum(jnp.arange(T, dtype=jnp.float32), 1.0)
    return csum_BxTxD / count_T[None, :, None]

  @functools.cached_property
  def fingerprint(self) -> str:
    """Short hash naming θ̄ and the prefix length (recorded in shard metadata)."""
    h = hashlib.sha256(f"{self.identity}|prefix={self.prefix_len}".encode())
    for x in jax.tree.leaves(jax.device_get(self.params)):
      h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]

  def running_means(self, tokens_NxT: np.ndarray, desc: str | None = None) -> np.ndarray:
    """[N, T+1, D]: entry b is the mean hidden state over targets t_0..t_{b-1} (b >= 1).

    With `desc`, a progress bar of that name counts the sequences.
    """
    tokens_NxT = np.asarray(tokens_NxT, np.int32)
    n, t = tokens_NxT.shape
    # Inputs [BOS, t_0..t_{T-1}]: position b reads t_{b-1}, so T+1 positions cover all targets.
    inputs = np.concatenate([np.zeros((n, 1), np.int32), tokens_NxT], 1)
    outs = []
    with progress.bar(total=n, desc=desc, unit="seq", disable=desc is None) as pbar:
      for start in range(0, n, self.batch_size):
        rows = inputs[start : start + self.batch_size]
        m = rows.shape[0]
        if m < self.batch_size:  # Pad the last batch: one compile per length.
          rows = np.concatenate([rows, np.zeros((self.batch_size - m, t + 1), np.int32)])
        outs.append(np.asarray(self._running(self.params, jax.device_put(rows, self._rows)))[:m])
        pbar.update(m)
    return np.concatenate(outs) if outs else np.zeros((0, t + 1, self.dim), np.float32)

  def prefix_features(self, token_seqs: Sequence[np.ndarray]) -> np.ndarray:
    """[N, D] routing features: mean hidden state over each sequence's first prefix_len tokens."""
    tokens_NxL, lens_N = pad_rows(token_seqs, self.prefix_len)
    if len(lens_N) and lens_N.min() < 1:
      raise ValueError(
        f"sequence {int(np.argmin(lens_N))} has no tokens: an empty prefix cannot "
        "be routed. Drop empty documents or texts before routing."
      )
    means = self.running_means(tokens_NxL)
    # Shorter sequences average over the tokens they have (all causal, so padding is unseen).
    return means[np.arange(len(lens_N)), lens_N]

  def stream(
    self, documents: Iterable, batch_size: int | None = None, desc: str | None = None
  ) -> Iterator[tuple[list, np.ndarray]]:
    """(documents, features [n, D]) batch by batch: a corpus never sits in memory.

    With `desc`, a progress bar of that name counts the documents read.
    """
    bs = batch_size or self.batch_size * 8
    batch = []
    if desc is not None:
      documents = progress.bar(documents, desc=desc, unit="doc")
    for doc in documents:
      batch.append(doc)
      if len(batch) == bs:
        yield batch, self.prefix_features([d.tokens for d in batch])
        batch = []
    if batch:
      yield batch, self.prefix_features([d.tokens for d in batch])


def extractor_from_config(config, params: PyTree | None = None) -> FeatureExtractor:
  """The run's FeatureExtractor: θ̄ of the config unless a param tree is given."""
  if params is None:
    params, identity = base_params(config)
  else:
    identity = "given"
  r = config.routing
  return FeatureExtractor(
    sections.ModelConfig.of(config),
    params,
    prefix_len=r.prefix_len,
    batch_size=r.feature_batch_size,
    identity=identity,
  )
