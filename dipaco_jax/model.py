"""Decoder-only transformer LM whose top-level parameters are DiPaCo's groups.

The parameter tree has one top-level key per *group*: `embed`, `block_0` ...
`block_{L-1}` and `head` (final norm, plus the unembedding when untied). The
topology assigns groups to levels, so the model knows nothing of paths.
"""
# pylint: disable=invalid-name

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax.types import PyTree

POSITIONS = ("rope", "learned")
DTYPES = ("float32", "bfloat16")
# model.remat: what a block keeps for its backward pass. "none" keeps every
# activation; "full" keeps only the block's input and recomputes the rest;
# "save_matmuls" keeps the outputs of the weight matmuls (not the attention
# scores, whose einsums carry a batch dim) and recomputes the cheap rest.
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ATTENTION = ("xla", "dot_product_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one path model (config.model; defaults in config_defaults.base)."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int  # The paper's "key/value size".
  mlp_ratio: float
  max_len: int  # Only bounds learned positions; RoPE has no limit.
  positions: str  # One of POSITIONS.
  tie_embeddings: bool
  dtype: str  # Compute dtype (one of DTYPES); parameters stay float32.
  remat: str  # Block activations kept for the backward pass: REMAT_POLICIES.
  attention: str  # "xla" (einsums here) | "dot_product_attention" (jax.nn's).
  loss_chunk: int  # Sequence positions per cross-entropy chunk (inner.loss_sums); 0 = all.

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}: use one of {tuple(REMAT_POLICIES)}.")
    if self.attention not in ATTENTION:
      raise ValueError(f"model.attention={self.attention!r}: use one of {ATTENTION}.")

  @property
  def mlp_dim(self) -> int:
    return int(self.d_model * self.mlp_ratio)


def _rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  """Rotary position embedding on the last axis (pairs of halves)."""
  half = x_BxTxHxK.shape[-1] // 2
  freq_K2 = 1.0 / (10_000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle_BxTxK2 = positions_BxT[..., None].astype(jnp.float32) * freq_K2
  sin = jnp.sin(angle_BxTxK2)[:, :, None, :]
  cos = jnp.cos(angle_BxTxK2)[:, :, None, :]
  x1, x2 = x_BxTxHxK[..., :half], x_BxTxHxK[..., half:]
  x1f, x2f = x1.astype(jnp.float32), x2.astype(jnp.float32)
  out = jnp.concatenate([x1f * cos - x2f * sin, x2f * cos + x1f * sin], -1)
  return out.astype(x_BxTxHxK.dtype)


class Attention(nn.Module):
  """Causal multi-head attention that never crosses packed segments."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, positions_BxT):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    dense = lambda name, features, axis=-1: nn.DenseGeneral(
      features, axis=axis, use_bias=False, dtype=dtype, name=name
    )
    shape = (cfg.num_heads, cfg.head_dim)
    q_BxTxHxK = dense("query", shape)(x_BxTxD)
    k_BxTxHxK = dense("key", shape)(x_BxTxD)
    v_BxTxHxK = dense("value", shape)(x_BxTxD)
    if cfg.positions == "rope":
      q_BxTxHxK = _rope(q_BxTxHxK, positions_BxT)
      k_BxTxHxK = _rope(k_BxTxHxK, positions_BxT)
    T = x_BxTxD.shape[1]
    same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    scale = cfg.head_dim**-0.5
    if cfg.attention == "dot_product_attention":
      # jax.nn picks the implementation (cuDNN flash on GPU where it applies).
      out_BxTxHxK = jax.nn.dot_product_attention(
        q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask=same_BxTxT[:, None], scale=scale, is_causal=True
      )
      return dense("out", cfg.d_model, axis=(-2, -1))(out_BxTxHxK)
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    mask_Bx1xTxT = (causal_TxT[None] & same_BxTxT)[:, None]
    att_BxHxTxT = jnp.einsum("bqhk,bshk->bhqs", q_BxTxHxK * scale, k_BxTxHxK)
    att_BxHxTxT = jnp.where(
      mask_Bx1xTxT, att_BxHxTxT.astype(jnp.float32), jnp.finfo(jnp.float32).min
    )
    att_BxHxTxT = jax.nn.softmax(att_BxHxTxT, axis=-1).astype(dtype)
    out_BxTxHxK = jnp.einsum("bhqs,bshk->bqhk", att_BxHxTxT, v_BxTxHxK)
    return dense("out", cfg.d_model, axis=(-2, -1))(out_BxTxHxK)


class Block(nn.Module):
  """Pre-norm transformer block: attention then a GELU MLP."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, positions_BxT):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    h_BxTxD = nn.RMSNorm(dtype=dtype, name="attn_norm")(x_BxTxD)
    x_BxTxD = x_BxTxD + Attention(cfg, name="attn")(h_BxTxD, segment_ids_BxT, positions_BxT)
    h_BxTxD = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x_BxTxD)
    h_BxTxF = nn.Dense(cfg.mlp_dim, use_bias=False, dtype=dtype, name="mlp_in")(h_BxTxD)
    h_BxTxD = nn.Dense(cfg.d_model, use_bias=False, dtype=dtype, name="mlp_out")(nn.gelu(h_BxTxF))
    return x_BxTxD + h_BxTxD


class Transformer(nn.Module):
  """The path model: embed -> blocks -> head; returns logits (and hidden).

  unembed=False returns (features_BxTxD, unembedding_DxV) instead of logits:
  logits = features @ unembedding, for a loss that builds them in chunks.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(
    self,
    inputs_BxT,
    segment_ids_BxT=None,
    positions_BxT=None,
    return_hidden: bool = False,
    unembed: bool = True,
  ):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    B, T = inputs_BxT.shape
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((B, T), jnp.int32)
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embed = Embed(cfg, name="embed")
    x_BxTxD = embed(inputs_BxT, positions_BxT)
    policy = REMAT_POLICIES[cfg.remat]
    block_cls = Block if cfg.remat == "none" else nn.remat(Block, policy=policy)
    for i in range(cfg.num_layers):
      x_BxTxD = block_cls(cfg, name=f"block_{i}")(x_BxTxD, segment_ids_BxT, positions_BxT)
    hidden_BxTxD = x_BxTxD
    table_VxD = embed.variables["params"]["token"] if cfg.tie_embeddings else None
    head = Head(cfg, name="head")
    if not unembed:
      return head.features(x_BxTxD.astype(dtype), table_VxD)
    logits_BxTxV = head(x_BxTxD.astype(dtype), table_VxD)
    if return_hidden:
      return logits_BxTxV, hidden_BxTxD
    return logits_BxTxV


class Embed(nn.Module):
  """Token (and, when configured, learned position) embeddings."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, inputs_BxT, positions_BxT):
    cfg = self.cfg
    init = nn.initializers.normal(stddev=1.0)
    table_VxD = self.param("token", init, (cfg.vocab_size, cfg.d_model))
    x_BxTxD = jnp.take(table_VxD, inputs_BxT, axis=0)
    if cfg.positions == "learned":
      pos_LxD = self.param("position", nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model))
      x_BxTxD = x_BxTxD + jnp.take(pos_LxD, positions_BxT, axis=0)
    return x_BxTxD.astype(jnp.dtype(cfg.dtype))


class Unembed(nn.Module):
  """The untied unembedding kernel [D, V] (the tree of nn.Dense(name="unembed"))."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self):
    return self.param(
      "kernel", nn.initializers.lecun_normal(), (self.cfg.d_model, self.cfg.vocab_size)
    )


class Head(nn.Module):
  """Final norm and unembedding (the tied table is passed in when tied)."""

  cfg: ModelConfig

  def setup(self):
    dtype = jnp.dtype(self.cfg.dtype)
    self.norm = nn.RMSNorm(dtype=dtype)
    if not self.cfg.tie_embeddings:
      self.unembed = Unembed(self.cfg)

  def features(self, x_BxTxD, table_VxD=None):
    """(normed features, unembedding [D, V]) whose product is the logits."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    x_BxTxD = self.norm(x_BxTxD)
    if table_VxD is None:
      return x_BxTxD, self.unembed().astype(dtype)
    # Tied: scale so logits start O(1) with the unit-variance token table.
    return x_BxTxD * cfg.d_model**-0.5, table_VxD.astype(dtype).T

  def __call__(self, x_BxTxD, table_VxD=None):
    return logits(*self.features(x_BxTxD, table_VxD))


def logits(features_BxTxD: jax.Array, unembed_DxV: jax.Array) -> jax.Array:
  """Float32 logits from the head's features and unembedding (compute dtype)."""
  return jnp.einsum("btd,dv->btv", features_BxTxD, unembed_DxV).astype(jnp.float32)


def init_params(cfg: ModelConfig, rng: jax.Array) -> PyTree:
  """Initial parameters of one path model (a pure pytree keyed by group)."""
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens_1x1)["params"]
