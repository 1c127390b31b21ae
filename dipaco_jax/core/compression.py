"""Compression of the outer exchange: each worker's Δ_w as bf16, int8, fp4 or top-k 2-bit codes.

`config.outer.compression` (docs/communication.md, "Compression"):

  none   Δ_w crosses in float32 (unchanged).
  bf16   Δ_w rounded to bfloat16 (round to nearest even), no scales: 16 bits a value.
  int8   per block of `b` values, scale = absmax / 127 and codes round(x · 127 / absmax)
         in [-127, 127] (round half to even): 8 bits a value + 32 per block.
  fp4    per block, scale = absmax / 6 and codes x · 6 / absmax rounded (to nearest even) to
         float4 e2m1 {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, packed two to a byte: 4 bits a
         value + 32 per block.
  auto   of none, bf16, int8 and fp4, the one whose codec time (CODEC_BYTES over
         `outer.hbm_gbs`) plus wire time (over `outer.link_gbps`) a value is least,
         chosen from the fields when the run is built (`resolved`).
  topk2  per block, the k = `outer.compression_keep` values of largest |x| (top-k
         sparsification; 1 of 64 keeps 1.56%, as SparseLoCo), each as 2 bits: its sign and
         whether |x| >= 3/4 of the block's absmax (decoded as absmax or absmax / 2), with
         their positions in the block (uint8 up to 256 values a block, else uint16) and
         the absmax (float32); the other values decode to 0. With error feedback what a
         phase leaves out is sent later. k · (8 + 2) + 32 bits per block of 64: 0.66 bits
         a value (k = 1; the codes padded to whole bytes per block: 0.75).

Blocks run along a leaf's last axis: b = min(outer.compression_block, that axis' length),
and a row whose length b does not divide is padded with zeros to a multiple of b (the
padding codes 0 and is dropped on decoding), so every block size fits every leaf. A block
of zeros has scale 0 and decodes to zeros. Leading axes (workers, modules) never share a
block.

Error feedback (`outer.error_feedback`): a worker sends C(Δ_w + e_w), where C is decode ∘
encode, and keeps e_w ← Δ_w + e_w − C(Δ_w + e_w) for its next phase (`with_feedback`); so
over phases Σ_t C(·) = Σ_t Δ_t + e_0 − e_T: nothing the codes drop is lost for good.

Everything here is pure JAX (jit, vmap and shard_map alike): the wire form (`encode`) is
what the spmd program's collectives over 'path' carry and what an elastic worker's delta
file holds, as integer arrays (int8, or uint8 / uint16 bit patterns), so every backend
moves exactly these bytes.
"""
# pylint: disable=invalid-name

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.config import sections

KINDS = tuple(k for k in sections.COMPRESSIONS if k != "auto")  # The wire forms.
# What "auto" picks among (topk2 is left out: its quality, docs/communication.md).
AUTO_KINDS = ("none", "bf16", "int8", "fp4")
# HBM bytes a value that encode then decode read and write, as XLA counts the programs it
# compiles for a TPU (v5e: libtpu, on any host; a [896, 3584] float32 leaf, blocks of 64):
# `python -m dipaco_jax.aot.codec` prints them, tests/commands/test_aot.py checks them.
CODEC_BYTES = {"none": 0.0, "bf16": 12.0, "int8": 50.5, "fp4": 63.0}
BLOCKED = ("int8", "fp4", "topk2")  # The kinds that code blocks along a leaf's last axis.
_QMAX = {"int8": 127.0, "fp4": 6.0}  # The largest code: absmax maps onto it.
# float4 e2m1's magnitudes, in the order of their 3-bit patterns.
E2M1 = np.float32([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def block_size(n: int, block: int) -> int:
  """The block of a row of n values: `block`, or the whole row when it is shorter."""
  return max(1, min(int(block), int(n)))


def padded(n: int, block: int) -> int:
  """A row of n values padded to whole blocks."""
  b = block_size(n, block)
  return -(-n // b) * b


def _absmax(x_NxB: jax.Array) -> jax.Array:
  """Each block's max |x|, as max(max x, −max −x): XLA on TPU writes |x| out whole otherwise."""
  # abs: a block of zeros gives −0.0 here, and its scale must be +0.0 (NaN stays NaN).
  return jnp.abs(jnp.maximum(jnp.max(x_NxB, axis=-1), -jnp.min(x_NxB, axis=-1)))


def _scaled_codes(x_R: jax.Array, kind: str, b: int):
  """Per block of b values along the last axis: (codes, scales).

  int8: the codes as float32 values; fp4: the e2m1 bit patterns (uint8, one a value: the
  sign, then the magnitude's index in E2M1), computed from the float4 cast's value, not
  compared against the grid: one pass over the values and no int32 or float32 copy.
  """
  *lead, n = x_R.shape
  x_NxB = x_R.reshape(*lead, n // b, b)
  absmax = _absmax(x_NxB)
  qmax = _QMAX[kind]
  inv = jnp.where(absmax > 0, qmax / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  y = x_NxB * inv[..., None]
  if kind == "int8":
    c = jnp.clip(jnp.round(y), -qmax, qmax)
  else:  # fp4: the nearest e2m1 value (|y| <= 6 by construction), rounded to nearest even.
    v = y.astype(jnp.float4_e2m1fn).astype(jnp.float32)
    a = jnp.abs(v)  # Its index in E2M1: 2 a below 2, a + 2 up to 4, 7 for 6.
    i = jnp.where(a < 2, 2 * a, jnp.where(a < 6, a + 2, 7.0)).astype(jnp.uint8)
    c = i | jnp.where(jnp.signbit(v), jnp.uint8(8), jnp.uint8(0))
  return c.reshape(*lead, n), absmax / qmax


def _fp4_values(q: jax.Array) -> jax.Array:
  """float32 [..., 2 p] of fp4 codes packed two to a byte [..., p] (`encode`'s order).

  Each byte widened to 16 bits with its upper code moved to the upper byte, read back as two
  bytes (little-endian: the lower code first), each code's value computed from its bits: no
  table look-up (a gather) and no [..., 2] array, which XLA on TPU would lay out anew. (A
  uint4 -> float4 bitcast would be shorter, but XLA:CPU fails to compile it inside a scan.)
  """
  v = q.astype(jnp.uint16)
  v = (v & 15) | ((v & 0xF0) << 4)
  nib = jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(*q.shape[:-1], -1)
  i = (nib & 7).astype(jnp.float32)  # E2M1[i]: i / 2 below 4, i − 2 up to 6, 6 for 7.
  mag = jnp.where(i < 4, 0.5 * i, jnp.where(i < 7, i - 2, 6.0))
  return jnp.where(nib >= 8, -mag, mag)


def kept(n: int, block: int, keep: int) -> int:
  """topk2: the values a block of a row of n values keeps (at most the block)."""
  return max(1, min(int(keep), block_size(n, block)))


def _index_dtype(b: int):
  return jnp.uint8 if b <= 256 else jnp.uint16


def _encode_topk(x: jax.Array, b: int, k: int) -> dict[str, jax.Array]:
  """topk2's wire form of padded rows [..., m]: positions "i", 2-bit codes "q", absmax "s"."""
  *lead, m = x.shape
  x_NxB = x.reshape(*lead, m // b, b)
  _, i_NxK = jax.lax.top_k(jnp.abs(x_NxB), k)  # Ties: the lower position first.
  v_NxK = jnp.take_along_axis(x_NxB, i_NxK, axis=-1)
  s_N = jnp.max(jnp.abs(v_NxK), axis=-1)
  big = jnp.abs(v_NxK) >= 0.75 * s_N[..., None]
  code = big.astype(jnp.uint8) | jnp.where(jnp.signbit(v_NxK), jnp.uint8(2), jnp.uint8(0))
  code = jnp.pad(code, [(0, 0)] * len(lead) + [(0, 0), (0, -k % 4)])
  c = code.reshape(*code.shape[:-1], -1, 4)
  q = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
  flat = lambda a: a.reshape(*lead, -1)
  return {"i": flat(i_NxK.astype(_index_dtype(b))), "q": flat(q), "s": s_N}


def _decode_topk(enc: dict, b: int, k: int, m: int) -> jax.Array:
  """Padded rows [..., m] from `_encode_topk`'s wire form."""
  s_N = enc["s"]
  i_NxK = enc["i"].reshape(*s_N.shape, k).astype(jnp.int32)
  q = enc["q"].reshape(*s_N.shape, -1)
  code = jnp.stack([(q >> sh) & 3 for sh in (0, 2, 4, 6)], axis=-1).reshape(*s_N.shape, -1)
  code = code[..., :k]
  mag = jnp.where((code & 1) > 0, 1.0, 0.5) * s_N[..., None]
  v_NxK = jnp.where((code & 2) > 0, -mag, mag)
  # Scattered into zero rows (the positions of a block are distinct): memory of the row only.
  *lead, nb = s_N.shape
  rows = int(np.prod(lead))
  at = (i_NxK + (jnp.arange(nb, dtype=jnp.int32) * b)[:, None]).reshape(rows, nb * k)
  x = jnp.zeros((rows, nb * b), jnp.float32)
  x = x.at[jnp.arange(rows)[:, None], at].set(v_NxK.reshape(rows, nb * k))
  return x.reshape(*lead, m)


def encode(x: jax.Array, kind: str, block: int, keep: int = 1) -> dict[str, jax.Array]:
  """The wire form of float32 `x` [..., n]: {"q": codes} (+ {"s": scales [..., blocks]}).

  q: bf16 bit patterns (uint16) [..., n]; int8 codes [..., n padded]; fp4 codes packed
  two to a uint8, the lower 4 bits first [..., n padded / 2, rounded up]; topk2 (`keep`
  values a block) codes packed four to a uint8 [..., blocks * ceil(k / 4)] and their
  positions "i" [..., blocks * k]. kind "none": x.
  """
  x = jnp.asarray(x, jnp.float32)
  if kind == "none":
    return {"q": x}
  if kind == "bf16":
    return {"q": jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)}
  n = x.shape[-1]
  b, m = block_size(n, block), padded(n, block)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, m - n)])
  if kind == "topk2":
    return _encode_topk(x, b, kept(n, block, keep))
  c, s = _scaled_codes(x, kind, b)
  if kind == "int8":
    return {"q": c.astype(jnp.int8), "s": s}
  if m % 2:
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, 1)])
  # Two codes a byte, the even position's in the lower 4 bits: strided slices, which XLA fuses
  # into the pass that makes the codes (a [..., 2] view is a relayout on TPU).
  return {"q": c[..., 0::2] | (c[..., 1::2] << 4), "s": s}


def decode(enc: dict, kind: str, block: int, n: int, keep: int = 1) -> jax.Array:
  """float32 [..., n] from `encode`'s wire form of a row of n values."""
  q = enc["q"]
  if kind == "none":
    return q.astype(jnp.float32)
  if kind == "bf16":
    return jax.lax.bitcast_convert_type(q, jnp.bfloat16).astype(jnp.float32)
  b, m = block_size(n, block), padded(n, block)
  if kind == "topk2":
    return _decode_topk(enc, b, kept(n, block, keep), m)[..., :n]
  if kind == "int8":
    c = q.astype(jnp.float32)
  else:
    c = _fp4_values(q)[..., :m]
  s = enc["s"]
  y = c.reshape(*c.shape[:-1], m // b, b) * s[..., None]
  return y.reshape(*y.shape[:-2], m)[..., :n]


def roundtrip(x: jax.Array, kind: str, block: int, keep: int = 1) -> jax.Array:
  """decode(encode(x)): what the owner of a module reads of a worker's `x`."""
  x = jnp.asarray(x, jnp.float32)
  if kind == "none":
    return x
  return decode(encode(x, kind, block, keep), kind, block, x.shape[-1], keep)


def with_feedback(delta: jax.Array, residual, kind: str, block: int, keep: int = 1):
  """(the sent value C(Δ + e), the next residual Δ + e − C(Δ + e)); residual None: no feedback.

  Returns the wire form too: (encoded, sent, next residual or None).
  """
  c = jnp.asarray(delta, jnp.float32)
  if residual is not None:
    c = c + residual
  enc = encode(c, kind, block, keep)
  sent = decode(enc, kind, block, c.shape[-1], keep) if kind != "none" else c
  return enc, sent, (None if residual is None else c - sent)


def as_rows(x: jax.Array) -> jax.Array:
  """A leaf with a leading worker axis seen as rows: a scalar module's [W] as [W, 1]."""
  return x[:, None] if x.ndim == 1 else x


def wire_bytes(shape, kind: str, block: int, keep: int = 1) -> int:
  """Bytes of the wire form of an array [..., n] (the arithmetic of docs/communication.md)."""
  shape = tuple(shape) or (1,)
  rows, n = int(np.prod(shape[:-1])), shape[-1]
  if kind == "none":
    return rows * n * 4
  if kind == "bf16":
    return rows * n * 2
  m, b = padded(n, block), block_size(n, block)
  if kind == "topk2":
    k = kept(n, block, keep)
    per_block = k * np.dtype(_index_dtype(b)).itemsize + -(-k // 4) + 4
    return rows * (m // b) * per_block
  q = m if kind == "int8" else -(-m // 2)
  return rows * (q + 4 * (m // b))


def value_seconds(kind: str, block: int, link_gbps: float, hbm_gbs: float) -> float:
  """Seconds a value of Δ costs one way: the codec's HBM bytes plus its wire bytes on the link."""
  wire = wire_bytes((block,), kind, block) / block
  return CODEC_BYTES[kind] / (hbm_gbs * 1e9) + wire * 8 / (link_gbps * 1e9)


def choose(block: int, link_gbps: float, hbm_gbs: float) -> str:
  """compression="auto": the kind of AUTO_KINDS a value costs least (a tie: the more exact)."""
  return min(AUTO_KINDS, key=lambda k: value_seconds(k, block, link_gbps, hbm_gbs))


def break_even_gbps(kind: str, block: int, hbm_gbs: float) -> float:
  """The link Gb/s below which `kind` costs less than float32: its codec time = the time saved."""
  saved = 4.0 - wire_bytes((block,), kind, block) / block
  return saved * 8 * hbm_gbs / CODEC_BYTES[kind]


def resolved(cfg: sections.OuterConfig) -> sections.OuterConfig:
  """`cfg` with compression "auto" replaced by its choice (`choose`), from config fields alone.

  Fields only, not the device: an elastic pool's executors and workers (on whatever chips)
  and a resumed run all choose the same.
  """
  if cfg.compression != "auto":
    return cfg
  kind = choose(cfg.compression_block, cfg.link_gbps, cfg.hbm_gbs)
  return dataclasses.replace(cfg, compression=kind)
