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
  remat: bool  # Recompute block activations in the backward pass.

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
        features, axis=axis, use_bias=False, dtype=dtype, name=name)
    shape = (cfg.num_heads, cfg.head_dim)
    q_BxTxHxK = dense("query", shape)(x_BxTxD)
    k_BxTxHxK = dense("key", shape)(x_BxTxD)
    v_BxTxHxK = dense("value", shape)(x_BxTxD)
    if cfg.positions == "rope":
      q_BxTxHxK = _rope(q_BxTxHxK, positions_BxT)
      k_BxTxHxK = _rope(k_BxTxHxK, positions_BxT)
    T = x_BxTxD.shape[1]
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    mask_Bx1xTxT = (causal_TxT[None] & same_BxTxT)[:, None]
    scale = cfg.head_dim ** -0.5
    att_BxHxTxT = jnp.einsum("bqhk,bshk->bhqs", q_BxTxHxK * scale, k_BxTxHxK)
    att_BxHxTxT = jnp.where(mask_Bx1xTxT, att_BxHxTxT.astype(jnp.float32),
                            jnp.finfo(jnp.float32).min)
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
    x_BxTxD = x_BxTxD + Attention(cfg, name="attn")(
        h_BxTxD, segment_ids_BxT, positions_BxT)
    h_BxTxD = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x_BxTxD)
    h_BxTxF = nn.Dense(cfg.mlp_dim, use_bias=False, dtype=dtype,
                       name="mlp_in")(h_BxTxD)
    h_BxTxD = nn.Dense(cfg.d_model, use_bias=False, dtype=dtype,
                       name="mlp_out")(nn.gelu(h_BxTxF))
    return x_BxTxD + h_BxTxD


class Transformer(nn.Module):
  """The path model: embed -> blocks -> head; returns logits (and hidden)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, inputs_BxT, segment_ids_BxT=None, positions_BxT=None,
               return_hidden: bool = False):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    B, T = inputs_BxT.shape
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((B, T), jnp.int32)
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embed = Embed(cfg, name="embed")
    x_BxTxD = embed(inputs_BxT, positions_BxT)
    block_cls = nn.remat(Block) if cfg.remat else Block
    for i in range(cfg.num_layers):
      x_BxTxD = block_cls(cfg, name=f"block_{i}")(
          x_BxTxD, segment_ids_BxT, positions_BxT)
    hidden_BxTxD = x_BxTxD
    table_VxD = embed.variables["params"]["token"] if cfg.tie_embeddings else None
    logits_BxTxV = Head(cfg, name="head")(x_BxTxD.astype(dtype), table_VxD)
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
      pos_LxD = self.param("position", nn.initializers.normal(0.02),
                           (cfg.max_len, cfg.d_model))
      x_BxTxD = x_BxTxD + jnp.take(pos_LxD, positions_BxT, axis=0)
    return x_BxTxD.astype(jnp.dtype(cfg.dtype))


class Head(nn.Module):
  """Final norm and unembedding (the tied table is passed in when tied)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, table_VxD=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    x_BxTxD = nn.RMSNorm(dtype=dtype, name="norm")(x_BxTxD)
    if table_VxD is None:
      return nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype,
                      name="unembed")(x_BxTxD).astype(jnp.float32)
    # Tied: scale so logits start O(1) with the unit-variance token table.
    x_BxTxD = x_BxTxD * cfg.d_model ** -0.5
    return jnp.einsum("btd,vd->btv", x_BxTxD,
                      table_VxD.astype(dtype)).astype(jnp.float32)


def init_params(cfg: ModelConfig, rng: jax.Array) -> PyTree:
  """Initial parameters of one path model (a pure pytree keyed by group)."""
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens_1x1)["params"]
