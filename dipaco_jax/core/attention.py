"""The attention kernel behind config.model.attention: XLA, Pallas splash (TPU), cuDNN (GPU).

  auto    splash on TPU where the sequence allows it, cuDNN on GPU where the shape and dtype
          allow it, XLA otherwise (and always for decoding and short prefixes)
  xla     einsums and a masked float32 softmax, as XLA fuses them: [B, H, T, S] scores in HBM
  splash  jax.experimental.pallas.ops.tpu.splash_attention: scores stay in VMEM, blocks of
          (model.attention_block_q x model.attention_block_kv), masked blocks skipped; run
          under shard_map over the model's mesh (batch on 'data', heads on 'model'), so the
          kernel sees one device's share and no collective is added
  cudnn   jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's fused flash attention

Every implementation computes causal attention that never crosses packed segments
(segment ids), softmax in float32. `check` refuses what a backend cannot run, one line each.
"""
# pylint: disable=invalid-name

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dipaco_jax.errors import ConfigError

LANES = 128  # The TPU vector width: splash's key blocks are a multiple of it.
# cuDNN's flash attention (jax's fused_attention_stablehlo.check_is_flash_attention):
# head_dim a multiple of 8, at most 128 before Hopper and 256 from Hopper on; fp16/bf16 only.
CUDNN_MAX_HEAD_DIM = 256
CUDNN_HEAD_MULTIPLE = 8


def platform_of(mesh) -> str:
  """The platform a program runs on: its mesh's devices', else the default backend's."""
  if mesh is not None:
    return np.asarray(mesh.devices).flat[0].platform
  return jax.default_backend()


def splash_blocks(cfg, seq_len: int) -> tuple[int, int] | None:
  """The (q, kv) block sizes splash uses at `seq_len`, or None when it cannot run there.

  A block longer than the sequence is cut to it; both must then divide the sequence and
  the key block must be a multiple of the 128 lanes (short prefixes go to XLA).
  """
  bq, bkv = min(cfg.attention_block_q, seq_len), min(cfg.attention_block_kv, seq_len)
  if seq_len % bq or seq_len % bkv or bkv % LANES or bq % 8:
    return None
  return bq, bkv


def cudnn_shape_ok(cfg) -> bool:
  return cfg.head_dim % CUDNN_HEAD_MULTIPLE == 0 and cfg.head_dim <= CUDNN_MAX_HEAD_DIM


def resolve(cfg, platform: str, seq_len: int, decode: bool = False) -> str:
  """The implementation that runs: 'xla', 'splash' or 'cudnn'."""
  choice = cfg.attention
  if decode:  # The KV cache's mask is by slot position: XLA's masked softmax.
    return "xla"
  if choice == "auto":
    if platform == "tpu" and splash_blocks(cfg, seq_len):
      return "splash"
    if platform == "gpu" and cfg.dtype == "bfloat16" and cudnn_shape_ok(cfg):
      return "cudnn"
    return "xla"
  if choice == "splash" and splash_blocks(cfg, seq_len) is None:
    return "xla"  # A routing prefix or an eval length `check` did not cover.
  return choice


def check(cfg, seq_lens: tuple[int, ...] = (), platform: str | None = None) -> None:
  """ConfigError for an attention the config or the backend cannot run (one line each).

  `cfg` is config.model; `seq_lens` the training and evaluation lengths; `platform` the
  backend the run compiles for (None: check the config alone).
  """
  a = cfg.attention
  seq_lens = tuple(t for t in seq_lens if t)  # 0: "the training length".
  if a == "splash":
    if platform is not None and platform != "tpu":
      raise ConfigError(
        f"config.model.attention='splash' needs a TPU (Pallas splash attention), but this run "
        f"compiles for {platform}: set model.attention=auto (cuDNN on GPU where it applies, "
        "XLA otherwise) or model.attention=xla."
      )
    for t in seq_lens:
      if splash_blocks(cfg, t) is None:
        raise ConfigError(
          f"config.model.attention_block_q={cfg.attention_block_q} / attention_block_kv="
          f"{cfg.attention_block_kv} do not divide the sequence length {t} (the kv block "
          f"also a multiple of {LANES}): choose blocks that divide it (e.g. "
          f"{_dividing_block(t)}), or set model.attention=xla."
        )
  if a == "cudnn":
    if platform is not None and platform != "gpu":
      raise ConfigError(
        f"config.model.attention='cudnn' needs an NVIDIA GPU, but this run compiles for "
        f"{platform}: set model.attention=auto (splash on TPU, XLA elsewhere) or "
        "model.attention=xla."
      )
    if not cudnn_shape_ok(cfg):
      raise ConfigError(
        f"config.model.head_dim={cfg.head_dim} is not one cuDNN's flash attention runs (a "
        f"multiple of {CUDNN_HEAD_MULTIPLE}, at most 128, or {CUDNN_MAX_HEAD_DIM} from "
        "Hopper on): set model.attention=xla, or change head_dim."
      )
    if cfg.dtype != "bfloat16":
      raise ConfigError(
        f"config.model.attention='cudnn' runs in bfloat16 only, but model.dtype="
        f"{cfg.dtype!r}: set model.dtype=bfloat16, or model.attention=xla."
      )


def _dividing_block(t: int) -> int:
  return max((b for b in (1024, 512, 256, 128) if t % b == 0), default=LANES)


def xla_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, mask_BxTxS, *, causal, scale, implementation):
  """XLA's attention (implementation 'xla') or cuDNN's ('cudnn'); mask and causality combined.

  'xla' is written out: scores in the compute dtype, the masked softmax in float32. (jax.nn's
  implementation="xla" makes float32 scores: on dipaco_2x4's inner step on v5e that was 1.3x
  the HBM bytes, docs/results/tpu.md.) 'cudnn' is jax.nn.dot_product_attention's fused kernel.
  """
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(
      q_BxTxHxK,
      k_BxSxHxK,
      v_BxSxHxK,
      mask=mask_BxTxS[:, None],
      scale=scale,
      is_causal=causal,
      implementation="cudnn",
    )
  T, S = q_BxTxHxK.shape[1], k_BxSxHxK.shape[1]
  if causal:
    mask_BxTxS &= jnp.tril(jnp.ones((T, S), dtype=bool))[None]
  att_BxHxTxS = jnp.einsum("bqhk,bshk->bhqs", q_BxTxHxK * scale, k_BxSxHxK)
  att_BxHxTxS = jnp.where(
    mask_BxTxS[:, None], att_BxHxTxS.astype(jnp.float32), jnp.finfo(jnp.float32).min
  )
  att_BxHxTxS = jax.nn.softmax(att_BxHxTxS, axis=-1).astype(q_BxTxHxK.dtype)
  return jnp.einsum("bhqs,bshk->bqhk", att_BxHxTxS, v_BxSxHxK)


@functools.lru_cache(maxsize=None)
def _splash_mask(heads: int, seq_len: int):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top

  return sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len)) for _ in range(heads)])


def splash_kernel(heads: int, seq_len: int, blocks: tuple[int, int], interpret: bool = False):
  """Splash attention over [heads, seq_len, head_dim] (causal; segment ids at the call).

  The backward is the fused kernel (dq with dk and dv): a separate dq kernel re-reads q, k, v,
  the output's gradient and the log-sum-exp, and its inputs' layouts cost copies (on the
  150M path's v6e block, 9% of the bytes, docs/results/tpu.md). Its key block is the whole
  sequence, in compute blocks of `bkv`: dq is then summed in float32 inside the kernel, as the
  dq kernel sums it, not as per-key-block partials in the compute dtype summed outside.
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top

  bq, bkv = blocks
  sizes = sa.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=seq_len,
    block_kv_dkv_compute=bkv,
    use_fused_bwd_kernel=True,
  )
  return sa.make_splash_mha(
    _splash_mask(heads, seq_len),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )


def splash_attention(
  q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, seg_BxT, *, blocks, mesh=None, interpret=None, data_mapped=False
):
  """Causal splash attention within segments; q already scaled. [B, H, T, K] in and out.

  With a mesh of more than one device, under shard_map: the batch on 'data' and the heads on
  'model' where they divide (a vmap over workers with spmd_axis_name='path' adds 'path'; one
  over the batch's 'data' shards, `data_mapped`, adds 'data' itself).
  interpret (None: off TPU) runs Pallas's interpreter: the kernel's own code, on any backend,
  for tests (a run refuses splash off TPU: `check`).
  """
  if interpret is None:
    interpret = platform_of(mesh) != "tpu"
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top

  def local(q, k, v, seg):
    kernel = splash_kernel(q.shape[1], q.shape[2], blocks, interpret)
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s))
    return jax.vmap(one)(q, k, v, seg)

  if mesh is None or np.asarray(mesh.devices).size == 1:
    return local(q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, seg_BxT)
  B, H = q_BxHxTxK.shape[:2]
  data = "data" if B % mesh.shape["data"] == 0 and not data_mapped else None
  model = "model" if H % mesh.shape["model"] == 0 else None
  spec = P(data, model)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(spec, spec, spec, P(data)),
    out_specs=spec,
    check_vma=False,
  )(q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, seg_BxT)


def attention_flops(kind: str, shape_BxHxTxK, blocks: tuple[int, int] | None = None) -> float:
  """FLOPs a splash kernel call executes: its matmuls over the blocks it computes.

  Per (q block, kv block) pair each matmul is 2 bq bkv K flops; the forward does two (Q K^T,
  P V) over the causal block pairs (those on or below the diagonal of the n_q x n_kv); the
  fused backward kernel ("dkv") five (S, dP, dV, dK, dQ) over every pair of a q block and the
  whole sequence (its key block is the sequence: `splash_kernel`), masked or not.
  """
  B, H, T, K = shape_BxHxTxK
  bq, bkv = blocks or (T, T)
  matmuls, bkv = {"fwd": (2, bkv), "dkv": (5, T)}[kind]
  nq, nkv = T // bq, T // bkv
  pairs = sum(min(nkv, -(-((i + 1) * bq) // bkv)) for i in range(nq))
  return float(matmuls * 2 * B * H * pairs * bq * bkv * K)
