"""model.attention: XLA against the splash kernel (Pallas interpreter), the choice, bad input.

The splash kernel runs here on CPU in Pallas's interpret mode (its own code, not a
re-implementation), so its causal and packed-segment masking and its custom backward are
checked against jax.nn's XLA attention, alone, under shard_map over a (path, data) mesh as
the spmd inner step maps it, and inside the model.
"""
# pylint: disable=invalid-name

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from dipaco_jax import config_check
from dipaco_jax.core import attention
from dipaco_jax.core import inner
from dipaco_jax.core import model
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.errors import ConfigError

import helpers

B, H, T, K = 2, 2, 256, 32
BLOCKS = (128, 128)


def _qkv_seg(seed=0, lead=()):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(*lead, B, H, T, K)), jnp.float32) for _ in range(3))
  seg = np.ones((*lead, B, T), np.int32)
  seg[..., 0, 90:] = 2  # Row 0 packs three documents, one crossing a block boundary.
  seg[..., 0, 200:] = 3
  return q, k, v, jnp.asarray(seg)


def _xla(q, k, v, seg):
  """jax.nn's XLA attention on [B, H, T, K] (scale 1: splash takes q pre-scaled)."""
  mask = seg[:, :, None] == seg[:, None, :]
  out = attention.xla_attention(
    *(x.swapaxes(1, 2) for x in (q, k, v)), mask, causal=True, scale=1.0, implementation="xla"
  )
  return out.swapaxes(1, 2)


def _value_and_grads(f, q, k, v, seg):
  w = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
  loss = lambda q, k, v: (f(q, k, v, seg) * w).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _close(a, b):
  (la, ga), (lb, gb) = a, b
  np.testing.assert_allclose(la, lb, rtol=1e-5)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_splash_kernel_equals_xla_with_causal_packed_segments_and_gradients():
  q, k, v, seg = _qkv_seg()
  splash = lambda q, k, v, s: attention.splash_attention(q, k, v, s, blocks=BLOCKS)
  np.testing.assert_allclose(
    jax.jit(splash)(q, k, v, seg), _xla(q, k, v, seg), rtol=1e-5, atol=1e-5
  )
  _close(_value_and_grads(splash, q, k, v, seg), _value_and_grads(_xla, q, k, v, seg))


def test_splash_under_shard_map_over_workers_adds_no_collective():
  """As the spmd inner step runs it: vmap over 2 workers on 'path', batch on 'data'."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("path", "data", "model"))
  q, k, v, seg = _qkv_seg(1, lead=(2,))
  splash = jax.vmap(
    lambda q, k, v, s: attention.splash_attention(q, k, v, s, blocks=BLOCKS, mesh=mesh),
    spmd_axis_name="path",
  )
  run = jax.jit(splash)
  assert "all-" not in run.lower(q, k, v, seg).compile().as_text()
  np.testing.assert_allclose(run(q, k, v, seg), jax.vmap(_xla)(q, k, v, seg), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # Two 1-block models' loss and gradients, one in the Pallas interpreter (~25 s).
def test_the_model_with_splash_equals_the_model_with_xla():
  cfg = helpers.model_config(
    vocab_size=64, d_model=32, num_layers=1, num_heads=2, head_dim=16, attention="xla"
  )
  params = model.init_params(cfg, jax.random.key(3))
  b = {k: v[0] for k, v in helpers.synthetic_batch(np.random.default_rng(0), 1, 2, 128, 64).items()}
  b["segment_ids"][:, 50:] = 2
  b["positions"][:, 50:] -= 50
  grads = lambda c: jax.jit(
    jax.value_and_grad(lambda p: inner.loss_fn(p, b, model.Transformer(c))[0])
  )(params)
  splash = dataclasses.replace(cfg, attention="splash", attention_block_kv=128)
  (la, ga), (lb, gb) = grads(cfg), grads(splash)
  np.testing.assert_allclose(lb, la, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)


def test_auto_picks_splash_on_tpu_cudnn_on_gpu_xla_otherwise():
  cfg = helpers.model_config(attention="auto", head_dim=64, dtype="bfloat16")
  assert attention.resolve(cfg, "tpu", 1024) == "splash"
  assert attention.resolve(cfg, "tpu", 32) == "xla"  # A routing prefix: no 128-wide block.
  assert attention.resolve(cfg, "tpu", 1024, decode=True) == "xla"
  assert attention.resolve(cfg, "gpu", 1024) == "cudnn"
  assert attention.resolve(dataclasses.replace(cfg, dtype="float32"), "gpu", 1024) == "xla"
  assert attention.resolve(dataclasses.replace(cfg, head_dim=60), "gpu", 1024) == "xla"
  assert attention.resolve(cfg, "cpu", 1024) == "xla"
  assert attention.splash_blocks(cfg, 1024) == (512, 512)
  assert attention.splash_blocks(cfg, 256) == (256, 256)  # Cut to the sequence.


def test_kernel_flops_count_the_causal_blocks():
  # T = 1024 in 512-blocks: 3 of the 4 block pairs are on or below the diagonal.
  one = 2 * 1 * 2 * 512 * 512 * 64  # One matmul of one block pair, B=1, H=2, K=64.
  assert attention.attention_flops("fwd", (1, 2, 1024, 64), (512, 512)) == 3 * 2 * one
  # The fused backward computes each 512-row q block against all 1024 keys (masked or not),
  # 5 matmuls: 2 q blocks x 2 key halves x 5 = 20 block-pair matmuls.
  assert attention.attention_flops("dkv", (1, 2, 1024, 64), (512, 512)) == 20 * one
  # Small blocks approach the causal half: 128-blocks compute 36 of 64 pairs.
  assert attention.attention_flops("fwd", (1, 1, 1024, 64), (128, 128)) == 36 * 2 * (
    2 * 128 * 128 * 64
  )


def _cfg(**over):
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  return config_check.load(tiny, **{"data.seq_len": 256, "eval.seq_len": 0, **over})


@pytest.mark.parametrize(
  "over, platform, message",
  [
    (
      {"model.attention": "splash"},
      "cpu",
      r"^config.model.attention='splash' needs a TPU .* but this run compiles for cpu: set "
      r"model.attention=auto .* or model.attention=xla\.$",
    ),
    (
      {"model.attention": "cudnn", "model.dtype": "bfloat16"},
      "cpu",
      r"^config.model.attention='cudnn' needs an NVIDIA GPU, .* set model.attention=auto",
    ),
  ],
)
def test_a_backend_without_the_kernel_is_refused_in_one_line(over, platform, message):
  assert attention.platform_of(None) == platform  # The tests' CPU devices.
  with pytest.raises(ConfigError, match=message):
    recipe_lib.Recipe.from_config(_cfg(**over))


@pytest.mark.parametrize(
  "over, message",
  [
    (
      {"model.attention": "splash", "model.attention_block_q": 96},
      r"attention_block_q=96 / attention_block_kv=512 do not divide the sequence length 256 .*"
      r"e\.g\. 256\), or set model.attention=xla\.$",
    ),
    (
      {"model.attention": "cudnn", "model.dtype": "bfloat16", "model.head_dim": 12},
      r"^config.model.head_dim=12 is not one cuDNN's flash attention runs .* set "
      r"model.attention=xla",
    ),
    (
      {"model.attention": "cudnn"},
      r"^config.model.attention='cudnn' runs in bfloat16 only, but model.dtype='float32': set "
      r"model.dtype=bfloat16, or model.attention=xla\.$",
    ),
  ],
)
def test_a_config_the_kernel_cannot_run_is_refused_in_one_line(over, message):
  with pytest.raises(ConfigError, match=message) as e:
    _cfg(**over)
  assert "\n" not in str(e.value)
