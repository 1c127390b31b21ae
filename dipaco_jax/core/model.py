"""Decoder-only transformer LM whose top-level parameters are DiPaCo's groups.

The parameter tree has one top-level key per *group*: `embed`, `block_0` ...
`block_{L-1}` and `head` (final norm, plus the unembedding when untied). The
topology assigns groups to levels, so the model knows nothing of paths.
"""
# pylint: disable=invalid-name

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dipaco_jax.config import sections
from dipaco_jax.core import attention as attention_lib
from dipaco_jax.core import rope as rope_lib
from dipaco_jax.core import sharding
from dipaco_jax.types import PyTree

# Each config.model.remat choice (config/sections.py REMAT) as a policy: "none" keeps every
# activation; "full" keeps only the block's input and recomputes the rest; "save_matmuls" keeps
# the outputs of the weight matmuls (not the attention scores, whose einsums carry a batch dim)
# and recomputes the cheap rest.
# A block's weight-matmul outputs, named (jax.ad_checkpoint.checkpoint_name) for the policies
# that keep some of them: "save_matmuls_except_mlp_in" keeps all but the MLP's input projection
# (and SwiGLU's gate), its widest, which the backward recomputes from the saved rest.
MATMULS = ("query", "key", "value", "attn_out", "mlp_in", "mlp_gate", "mlp_out")
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "save_matmuls_except_mlp_in": jax.checkpoint_policies.save_only_these_names(
    *(n for n in MATMULS if n not in ("mlp_in", "mlp_gate"))
  ),
}
# model.mlp: "gelu" is up (D -> F), GELU, down (F -> D): 2 D F weights. "swiglu" is
# down(silu(gate x) * up x) with gate and up both D -> F: 3 D F weights, so a SwiGLU of width
# F costs what a GELU MLP of width 1.5 F does (Llama's 8/3 d_model matches GELU's 4 d_model).
ModelConfig = sections.ModelConfig  # config.model, declared in config/sections.py.


def _contract(x, w, n: int):
  """x's last n dims contracted with w's first n: [..., I] x [I, O] -> [..., O]."""
  return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _input_first(x, w, n: int):
  return _contract(x, w, n)


def _input_first_fwd(x, w, n):
  return _contract(x, w, n), (x, w)


def _input_first_bwd(n, res, g):
  x, w = res
  lead = tuple(range(x.ndim - n))  # The token dims, contracted for the weight gradient.
  out = tuple(range(g.ndim - (w.ndim - n), g.ndim))
  dx = jax.lax.dot_general(g, w, ((out, tuple(range(n, w.ndim))), ((), ())))
  # Autodiff's transpose computes dot(g, x) here and transposes it; with the input as the
  # left operand, XLA:CPU lays out the input (D wide) for the matmul instead of the
  # cotangent (up to V or F wide), a copy of a quarter of the bytes or less.
  dw = jax.lax.dot_general(x, g, ((lead, tuple(range(len(lead)))), ((), ())))
  return dx, dw


_input_first.defvjp(_input_first_fwd, _input_first_bwd)


def weight_grads(cfg: ModelConfig, platform: str) -> str:
  """The weight-gradient form that runs: 'autodiff' or 'input_first' (model.weight_grads)."""
  if cfg.weight_grads != "auto":
    return cfg.weight_grads
  return "input_first" if platform == "cpu" and cfg.remat != "save_matmuls" else "autodiff"


def matmul(x, w, n: int, form: str):
  """x's last n dims times w's first n (a weight matmul) with the weight gradient `form`."""
  return _input_first(x, w, n) if form == "input_first" else _contract(x, w, n)


def dot_general_of(form: str):
  """A flax Dense/DenseGeneral `dot_general` computing the weight gradient in `form`."""

  def dot_general(x, w, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type  # Flax passes None for both here.
    (contract_x, contract_w), batch = dimension_numbers
    n = len(contract_x)
    if (
      tuple(contract_x) != tuple(range(x.ndim - n, x.ndim))
      or tuple(contract_w) != tuple(range(n))
      or any(batch)
    ):
      raise ValueError(
        f"a weight matmul contracts x's last dims with w's first: {dimension_numbers}"
      )
    return matmul(x, w, n, form)

  return dot_general


class _Kernel(nn.Module):
  """One kernel param of the given shape (lecun normal: fan in = its first dim)."""

  shape: tuple[int, ...]

  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.initializers.lecun_normal(), self.shape)


class Attention(nn.Module):
  """Causal multi-head attention that never crosses packed segments.

  decode=True keeps keys and values in the "cache" collection ([B, S, H, K]
  each, S the longest sequence, from `init_cache`): the tokens given are
  written at the cache slots named by their positions, and each attends to
  the slots at or before its own position. One sequence per row, so no
  segment ids; rows may stand at different positions.
  """

  cfg: ModelConfig
  decode: bool = False
  mesh: Any = None  # The program's mesh: splash runs under shard_map over it.
  data_mapped: bool = False  # Under a vmap over 'data' shards (Transformer.data_mapped).

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, positions_BxT):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    D, H, K = x_BxTxD.shape[-1], cfg.num_heads, cfg.head_dim
    form = weight_grads(cfg, attention_lib.platform_of(self.mesh))
    if cfg.attention_kernels == "matrix":
      # Kernels kept as matrices, [D, H K] and [H K, D]: flax draws a DenseGeneral's kernel as
      # the same matrix, so the values and products are those of "heads". The kernels, not the
      # activations, are viewed per head (a reshape of [B, T, H K] activations is a TPU copy).
      kernel = lambda name, shape: _Kernel(shape, name=name)().astype(dtype)
      heads = lambda name: matmul(
        x_BxTxD.astype(dtype), kernel(name, (D, H * K)).reshape(D, H, K), 1, form
      )
      project_out = lambda o_BxTxHxK: matmul(
        o_BxTxHxK.astype(dtype), kernel("out", (H * K, D)).reshape(H, K, D), 2, form
      )
    else:
      dense = lambda name, features, axis=-1: nn.DenseGeneral(
        features,
        axis=axis,
        use_bias=False,
        dtype=dtype,
        dot_general=dot_general_of(form),
        name=name,
      )
      heads = lambda name: dense(name, (H, K))(x_BxTxD)
      project_out = lambda o_BxTxHxK: dense("out", D, axis=(-2, -1))(o_BxTxHxK)
    q_BxTxHxK = checkpoint_name(heads("query"), "query")
    k_BxSxHxK = checkpoint_name(heads("key"), "key")
    v_BxSxHxK = checkpoint_name(heads("value"), "value")
    if cfg.positions == "rope":
      q_BxTxHxK = rope_lib.rope(q_BxTxHxK, positions_BxT)
      k_BxSxHxK = rope_lib.rope(k_BxSxHxK, positions_BxT)
    B = x_BxTxD.shape[0]
    T = x_BxTxD.shape[1]
    causal = True  # mask_BxTxS has no causal part yet: added below, or by is_causal.
    mask_BxTxS = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    if self.decode and self.has_variable("cache", "cached_key"):
      cache_k = self.variable("cache", "cached_key", jnp.zeros, (), dtype)  # Never built here.
      cache_v = self.variable("cache", "cached_value", jnp.zeros, (), dtype)
      row_Bx1 = jnp.arange(B)[:, None]
      cache_k.value = cache_k.value.at[row_Bx1, positions_BxT].set(k_BxSxHxK)
      cache_v.value = cache_v.value.at[row_Bx1, positions_BxT].set(v_BxSxHxK)
      k_BxSxHxK, v_BxSxHxK = cache_k.value, cache_v.value
      # Slot s holds position s: a query sees its own and earlier positions. Later slots hold
      # zeros or a shorter row's padding, masked to exact zero weights.
      slots_S = jnp.arange(k_BxSxHxK.shape[1])
      mask_BxTxS = slots_S[None, None, :] <= positions_BxT[:, :, None]
      causal = False
    elif self.decode:  # init_cache: the shapes of a length-T cache.
      self.variable("cache", "cached_key", jnp.zeros, k_BxSxHxK.shape, dtype)
      self.variable("cache", "cached_value", jnp.zeros, v_BxSxHxK.shape, dtype)
    scale = cfg.head_dim**-0.5
    impl = attention_lib.resolve(cfg, attention_lib.platform_of(self.mesh), T, self.decode)
    if impl == "splash":
      # The kernel wants [B, H, T, K], q pre-scaled; segment ids and causality it masks itself.
      blocks = attention_lib.splash_blocks(cfg, T)
      to_bhtk = lambda x: jnp.swapaxes(x, 1, 2)
      out_BxHxTxK = attention_lib.splash_attention(
        to_bhtk(q_BxTxHxK * jnp.asarray(scale, q_BxTxHxK.dtype)),
        to_bhtk(k_BxSxHxK),
        to_bhtk(v_BxSxHxK),
        segment_ids_BxT,
        blocks=blocks,
        mesh=self.mesh,
        data_mapped=self.data_mapped,
      )
      out_BxTxHxK = jnp.swapaxes(out_BxHxTxK, 1, 2)
    else:
      out_BxTxHxK = attention_lib.xla_attention(
        q_BxTxHxK,
        k_BxSxHxK,
        v_BxSxHxK,
        mask_BxTxS,
        causal=causal,
        scale=scale,
        implementation=impl,
      )
    return checkpoint_name(project_out(out_BxTxHxK), "attn_out")


class Block(nn.Module):
  """Pre-norm transformer block: attention then a GELU or SwiGLU MLP."""

  cfg: ModelConfig
  decode: bool = False
  mesh: Any = None
  data_mapped: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, positions_BxT):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    h_BxTxD = nn.RMSNorm(dtype=dtype, name="attn_norm")(x_BxTxD)
    attn = Attention(
      cfg, decode=self.decode, mesh=self.mesh, data_mapped=self.data_mapped, name="attn"
    )
    x_BxTxD = x_BxTxD + attn(h_BxTxD, segment_ids_BxT, positions_BxT)
    h_BxTxD = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x_BxTxD)
    form = weight_grads(cfg, attention_lib.platform_of(self.mesh))
    dense = lambda name, features: nn.Dense(
      features, use_bias=False, dtype=dtype, dot_general=dot_general_of(form), name=name
    )
    h_BxTxF = checkpoint_name(dense("mlp_in", cfg.mlp_dim)(h_BxTxD), "mlp_in")
    if cfg.mlp == "swiglu":
      h_BxTxF = (
        nn.silu(checkpoint_name(dense("mlp_gate", cfg.mlp_dim)(h_BxTxD), "mlp_gate")) * h_BxTxF
      )
    else:
      h_BxTxF = nn.gelu(h_BxTxF)
    return x_BxTxD + checkpoint_name(dense("mlp_out", cfg.d_model)(h_BxTxF), "mlp_out")


class Transformer(nn.Module):
  """The path model: embed -> blocks -> head; returns logits (and hidden).

  unembed=False returns (features_BxTxD, unembedding_DxV) instead of logits:
  logits = features @ unembedding, for a loss that builds them in chunks.
  decode=True reads and writes the KV cache (apply with a "cache" from
  `init_cache` and mutable=["cache"]); positions_BxT are then required.
  """

  cfg: ModelConfig
  # The mesh the model's program is compiled over (the spmd Experiment's), or None (one device,
  # or a jit that shards by propagation): model.attention=splash runs under shard_map over it.
  mesh: Any = None
  # True under a vmap over the batch's 'data' shards with spmd_axis_name='data' (each device's
  # own gradient, inner.grad_sums): that vmap maps 'data', so splash's shard_map must not.
  data_mapped: bool = False
  # config.mesh.fsdp on `mesh`: each group's params are gathered over 'data' where it is used
  # (sharding.gathered), inside the remat of a block so that the backward gathers them again.
  fsdp: bool = False

  def _gathered(self, cls, methods=None):
    """`cls` reading its params gathered for use (FSDP), or `cls` itself."""
    if not self.fsdp or self.mesh is None:
      return cls
    use = lambda v: sharding.gathered(v, self.mesh)
    return nn.map_variables(cls, "params", trans_in_fn=use, methods=methods)

  @nn.compact
  def __call__(
    self,
    inputs_BxT,
    segment_ids_BxT=None,
    positions_BxT=None,
    return_hidden: bool = False,
    unembed: bool = True,
    decode: bool = False,
  ):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    B, T = inputs_BxT.shape
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((B, T), jnp.int32)
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embed = self._gathered(Embed)(cfg, name="embed")
    # The table as the embedding used it (gathered, with FSDP): a tied head reads the same one,
    # so that its two uses' gradients are summed before they are reduced over 'data'.
    x_BxTxD, table_VxD = embed(inputs_BxT, positions_BxT)
    policy = REMAT_POLICIES[cfg.remat]
    # Decoding takes no gradient: nothing to rematerialise.
    block_cls = self._gathered(Block)
    block_cls = block_cls if cfg.remat == "none" or decode else nn.remat(block_cls, policy=policy)
    for i in range(cfg.num_layers):
      block = block_cls(
        cfg, decode=decode, mesh=self.mesh, data_mapped=self.data_mapped, name=f"block_{i}"
      )
      x_BxTxD = block(x_BxTxD, segment_ids_BxT, positions_BxT)
    hidden_BxTxD = x_BxTxD
    table_VxD = table_VxD if cfg.tie_embeddings else None
    head_cls = self._gathered(Head, methods=["__call__", "features"])
    head = head_cls(cfg, weight_grads(cfg, attention_lib.platform_of(self.mesh)), name="head")
    if not unembed:
      return head.features(x_BxTxD.astype(dtype), table_VxD)
    logits_BxTxV = head(x_BxTxD.astype(dtype), table_VxD)
    if return_hidden:
      return logits_BxTxV, hidden_BxTxD
    return logits_BxTxV


class Embed(nn.Module):
  """Token (and, when configured, learned position) embeddings, and the token table."""

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
    return x_BxTxD.astype(jnp.dtype(cfg.dtype)), table_VxD


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
  weight_grads: str = "autodiff"  # The unembedding's weight-gradient form (`weight_grads`).

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
    return logits(*self.features(x_BxTxD, table_VxD), self.weight_grads)


def logits(features_BxTxD: jax.Array, unembed_DxV: jax.Array, form: str = "autodiff") -> jax.Array:
  """Float32 logits from the head's features and unembedding (compute dtype).

  `form`: the unembedding's weight-gradient form (`weight_grads`).
  """
  return matmul(features_BxTxD, unembed_DxV, 1, form).astype(jnp.float32)


def init_params(cfg: ModelConfig, rng: jax.Array) -> PyTree:
  """Initial parameters of one path model (a pure pytree keyed by group)."""
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens_1x1)["params"]


def init_cache(cfg: ModelConfig, batch: int, length: int) -> PyTree:
  """A zero KV cache for `batch` rows of up to `length` positions (the "cache" collection)."""
  tokens_BxS = jnp.zeros((batch, length), jnp.int32)
  init = lambda: Transformer(cfg).init(jax.random.key(0), tokens_BxS, decode=True)
  shapes = jax.eval_shape(init)["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
