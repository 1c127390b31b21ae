"""The path model: causality, segment isolation, RoPE, parameter layout, remat and dtypes."""
# pylint: disable=invalid-name

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax.core import flops
from dipaco_jax.core import inner
from dipaco_jax.core import model as model_lib
from dipaco_jax.io import theta as theta_lib

import helpers

V, D, H, K, T = 13, 8, 2, 4, 12  # vocab, d_model, heads, head_dim, sequence length


def _cfg(**overrides):
  base = dict(
    vocab_size=V, d_model=D, num_layers=2, num_heads=H, head_dim=K, mlp_ratio=2.0, max_len=64
  )
  base.update(overrides)
  return helpers.model_config(**base)


@functools.lru_cache(maxsize=None)
def _apply(cfg):
  """One jitted apply per config, so compared runs share a compiled program."""
  return jax.jit(model_lib.Transformer(cfg).apply, static_argnames="return_hidden")


def _logits(cfg, params, tokens, segment_ids=None, positions=None, return_hidden=False):
  """The model's output, segment ids and positions always explicit (one program per shape)."""
  B, T_ = tokens.shape
  if segment_ids is None:
    segment_ids = jnp.ones((B, T_), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T_, dtype=jnp.int32), (B, T_))
  return _apply(cfg)(
    {"params": params}, tokens, segment_ids, positions, return_hidden=return_hidden
  )


def _shapes(cfg):
  """init_params' output as shapes and dtypes, traced without running (no compile)."""
  return jax.eval_shape(functools.partial(model_lib.init_params, cfg), jax.random.key(0))


def _params(cfg, seed=0):
  """Random parameters in init_params' layout, drawn in numpy so no init program compiles.

  Norm scales are 1 as at init (the hand-derived checks use that); the rest are N(0, 1/2).
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    if path[-1].key == "scale":
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(0.5 * rng.normal(size=leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, _shapes(cfg))


def _tokens(seed, shape=(2, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(1, V, size=shape), jnp.int32)


def _rms_norm(x):
  """flax's RMSNorm at init (scale 1, epsilon 1e-6), in numpy."""
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_causal_future_tokens_never_change_past_logits(positions):
  cfg = _cfg(positions=positions)
  params = _params(cfg)
  tokens = _tokens(0)
  logits = _logits(cfg, params, tokens)
  for t in (0, 5, T - 2):
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 1 + t) % V)
    logits_changed = _logits(cfg, params, changed)
    # Masked scores become exactly 0 after the softmax and 0 * v adds exactly 0: bit-equal.
    np.testing.assert_array_equal(logits[:, : t + 1], logits_changed[:, : t + 1])
    # The test can fail: the changed future does move the logits right after t.
    assert np.abs(logits[:, t + 1] - logits_changed[:, t + 1]).max() > 1e-3


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_segment_sees_only_itself(positions):
  # One row packed as PathBatcher packs it: segment 1 at 0..4, segment 2 at 5..11, positions
  # restarting at each segment start.
  cfg = _cfg(positions=positions)
  params = _params(cfg)
  n1 = 5
  segment_ids = jnp.asarray([[1] * n1 + [2] * (T - n1)], jnp.int32)
  positions_1xT = jnp.asarray([list(range(n1)) + list(range(T - n1))], jnp.int32)
  tokens = _tokens(1, (1, T))
  other_first = tokens.at[:, :n1].set((tokens[:, :n1] + 3) % V)
  logits = _logits(cfg, params, tokens, segment_ids, positions_1xT)
  logits_other = _logits(cfg, params, other_first, segment_ids, positions_1xT)
  # Same program, segment 1's keys masked to exact zeros: segment 2's logits are bit-equal.
  np.testing.assert_array_equal(logits[:, n1:], logits_other[:, n1:])
  assert np.abs(logits[:, :n1] - logits_other[:, :n1]).max() > 1e-3  # segment 1 itself moved

  # Segment 2 run alone (length 7, positions 0..6) gives the same logits. Only close, not equal:
  # a length-7 program reduces its softmax and matmuls in another order (float32, ~1e-7 per op;
  # measured 4e-7 on logits of size ~1.5).
  alone = _logits(cfg, params, tokens[:, n1:])
  np.testing.assert_allclose(logits[:, n1:], alone, rtol=1e-5, atol=1e-6)

  # Without segment ids the same tokens do leak across the boundary: the mask is what isolates.
  unpacked = _logits(cfg, params, tokens, None, positions_1xT)
  unpacked_other = _logits(cfg, params, other_first, None, positions_1xT)
  assert np.abs(unpacked[:, n1:] - unpacked_other[:, n1:]).max() > 1e-3


def test_rope_logits_invariant_to_a_shift_of_all_positions_learned_not():
  tokens = _tokens(3)
  base_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  cfg = _cfg(positions="rope")
  params = _params(cfg)
  logits = _logits(cfg, params, tokens, None, base_BxT)
  shifted = _logits(cfg, params, tokens, None, base_BxT + 1000)
  # In exact arithmetic the scores see only p - s. In float32 the angles p * freq round to a
  # relative 6e-8, i.e. at most ~1011 * 6e-8 = 6e-5 rad at these positions, so 1e-4 bounds the
  # change (measured: ~5e-7, as the frequency-1 angles are exact integers).
  np.testing.assert_allclose(shifted, logits, rtol=1e-4, atol=1e-4)

  cfg = _cfg(positions="learned")
  params = _params(cfg)
  logits = _logits(cfg, params, tokens, None, base_BxT)
  shifted = _logits(cfg, params, tokens, None, base_BxT + 40)  # 51 < max_len 64
  # Learned positions are absolute: other rows of the position table give other logits.
  assert np.abs(shifted - logits).max() > 1e-3


def _shape_tree(cfg):
  return jax.tree.map(lambda x: tuple(x.shape), _shapes(cfg))


def _block_shapes(F):
  return {
    "attn_norm": {"scale": (D,)},
    "mlp_norm": {"scale": (D,)},
    "attn": {
      "query": {"kernel": (D, H, K)},
      "key": {"kernel": (D, H, K)},
      "value": {"kernel": (D, H, K)},
      "out": {"kernel": (H, K, D)},
    },
    "mlp_in": {"kernel": (D, F)},
    "mlp_out": {"kernel": (F, D)},
  }


def test_param_groups_and_shapes_tied_untied_learned():
  F = 16  # d_model 8 * mlp_ratio 2
  tied = _shape_tree(_cfg(num_layers=1))
  assert tied == {
    "embed": {"token": (V, D)},
    "block_0": _block_shapes(F),
    "head": {"norm": {"scale": (D,)}},
  }
  untied = _shape_tree(_cfg(num_layers=1, tie_embeddings=False))
  assert untied == {
    "embed": {"token": (V, D)},
    "block_0": _block_shapes(F),
    "head": {"norm": {"scale": (D,)}, "unembed": {"kernel": (D, V)}},
  }
  learned = _shape_tree(_cfg(num_layers=1, positions="learned"))
  assert learned["embed"] == {"token": (V, D), "position": (64, D)}
  assert set(_shapes(_cfg(num_layers=3))) == {"embed", "block_0", "block_1", "block_2", "head"}
  # Count by hand: token 13*8 = 104; block 4 attention kernels 4*8*2*4 = 256, two norms 16,
  # MLP 2*8*16 = 256, so 528; head norm 8. Untied adds 8*13 = 104.
  count = lambda p: sum(x.size for x in jax.tree.leaves(p))
  assert count(_shapes(_cfg(num_layers=1))) == 104 + 528 + 8
  assert count(_shapes(_cfg(num_layers=1, tie_embeddings=False))) == 104 + 528 + 8 + 104


def _zero(params, *paths):
  """A copy of params with the leaves at the given key paths set to zero."""
  params = jax.tree.map(lambda x: x, params)  # fresh dicts
  for path in paths:
    node = params
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = jnp.zeros_like(node[path[-1]])
  return params


@pytest.mark.parametrize("tied", [True, False])
def test_identity_block_gives_logits_of_the_embedding_alone(tied):
  # Zero attention out and MLP out: the block adds 0, so logits are the head on the embedding:
  # tied, logits[t, v] = rms_norm(E[x_t]) . E[v] / sqrt(D); untied, rms_norm(E[x_t]) @ W.
  cfg = _cfg(num_layers=1, tie_embeddings=tied)
  params = _zero(
    _params(cfg), ("block_0", "attn", "out", "kernel"), ("block_0", "mlp_out", "kernel")
  )
  tokens = _tokens(4)
  logits = np.asarray(_logits(cfg, params, tokens))
  table_VxD = np.asarray(params["embed"]["token"])
  h_BxTxD = _rms_norm(table_VxD[np.asarray(tokens)])
  if tied:
    expected = h_BxTxD @ table_VxD.T / np.sqrt(D)
  else:
    expected = h_BxTxD @ np.asarray(params["head"]["unembed"]["kernel"])
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_zero_query_attends_uniformly_within_segment_and_past():
  # Zero query kernel: every allowed score is 0, so attention is the plain mean of the values
  # over s <= t in t's segment. With the MLP zeroed, hidden = x + out(mean v), checked by hand.
  cfg = _cfg(num_layers=1)
  params = _zero(
    _params(cfg), ("block_0", "attn", "query", "kernel"), ("block_0", "mlp_out", "kernel")
  )
  tokens = _tokens(5, (1, T))
  segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3]], jnp.int32)
  positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]], jnp.int32)
  _, hidden = _logits(cfg, params, tokens, segment_ids, positions, return_hidden=True)
  att = params["block_0"]["attn"]
  x_TxD = np.asarray(params["embed"]["token"])[np.asarray(tokens[0])]
  v_TxHxK = np.einsum("td,dhk->thk", _rms_norm(x_TxD), np.asarray(att["value"]["kernel"]))
  seg = np.asarray(segment_ids[0])
  allowed_TxT = np.tril(np.ones((T, T), bool)) & (seg[:, None] == seg[None, :])
  mean_v_TxHxK = np.einsum("ts,shk->thk", allowed_TxT / allowed_TxT.sum(1, keepdims=True), v_TxHxK)
  expected = x_TxD + np.einsum("thk,hkd->td", mean_v_TxHxK, np.asarray(att["out"]["kernel"]))
  np.testing.assert_allclose(hidden[0], expected, rtol=1e-5, atol=1e-5)


def test_default_segments_and_positions_are_one_segment_counting_from_zero():
  cfg = _cfg()
  params = _params(cfg)
  tokens = _tokens(6)
  defaults = jax.jit(model_lib.Transformer(cfg).apply)({"params": params}, tokens)
  np.testing.assert_array_equal(defaults, _logits(cfg, params, tokens))


def _batch(tokens):
  B, T_ = tokens.shape
  return {
    "inputs": tokens,
    "targets": jnp.roll(tokens, -1, axis=1),
    "segment_ids": jnp.ones((B, T_), jnp.int32),
    "positions": jnp.broadcast_to(jnp.arange(T_, dtype=jnp.int32), (B, T_)),
    "weights": jnp.ones((B, T_), jnp.float32),
  }


def _loss_and_grads(cfg, params, batch, trace_only=False):
  fn = jax.value_and_grad(inner.loss_fn, has_aux=True)
  if trace_only:
    return jax.eval_shape(functools.partial(fn, model=model_lib.Transformer(cfg)), params, batch)
  (loss, _), grads = jax.jit(fn, static_argnums=2)(params, batch, model_lib.Transformer(cfg))
  return loss, grads


def test_remat_same_params_loss_and_grads():
  cfg, cfg_remat = _cfg(num_layers=1), _cfg(num_layers=1, remat="full")  # 1 block: half the compile
  # Remat wraps the block class without renaming it: init gives the same tree.
  assert _shapes(cfg_remat) == _shapes(cfg)
  params = _params(cfg)
  batch = _batch(_tokens(7))
  loss, grads = _loss_and_grads(cfg, params, batch)
  loss_remat, grads_remat = _loss_and_grads(cfg_remat, params, batch)
  # Recomputing the forward pass runs the same float32 ops (bit-equal on CPU today), but XLA may
  # fuse the recomputed graph differently elsewhere, so allow a few ulps.
  np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), grads_remat, grads
  )
  assert jax.tree.structure(grads_remat) == jax.tree.structure(params)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3  # not all zero


def test_matrix_kernels_are_the_heads_kernels_merged_same_init_logits_and_grads():
  heads, matrix = _cfg(num_layers=1), _cfg(num_layers=1, attention_kernels="matrix")
  ph, pm = (model_lib.init_params(c, jax.random.key(3)) for c in (heads, matrix))
  attn_h, attn_m = ph["block_0"]["attn"], pm["block_0"]["attn"]
  for name in ("query", "key", "value"):
    assert attn_h[name]["kernel"].shape == (D, H, K)
    assert attn_m[name]["kernel"].shape == (D, H * K)
  assert attn_h["out"]["kernel"].shape == (H, K, D)
  assert attn_m["out"]["kernel"].shape == (H * K, D)
  # The same draw in row-major order: each layout is the other's reshape, both ways.
  jax.tree.map(np.testing.assert_array_equal, theta_lib.kernels_like(ph, pm), pm)
  jax.tree.map(np.testing.assert_array_equal, theta_lib.kernels_like(pm, ph), ph)
  # A leaf of another shape is left for the caller's check to name.
  other = _shapes(_cfg(num_layers=1, num_heads=1, head_dim=2 * K))
  assert theta_lib.kernels_like(ph, other)["block_0"]["attn"]["out"]["kernel"].shape == (H, K, D)
  batch = _batch(_tokens(9))
  loss_h, grads_h = _loss_and_grads(heads, ph, batch)
  loss_m, grads_m = _loss_and_grads(matrix, pm, batch)
  np.testing.assert_allclose(loss_m, loss_h, rtol=1e-6)
  grads_m = theta_lib.kernels_like(grads_m, grads_h)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_m, grads_h
  )
  assert float(jnp.abs(grads_h["block_0"]["attn"]["query"]["kernel"]).max()) > 1e-4


def test_save_matmuls_except_mlp_in_keeps_no_mlp_width_activation(capsys):
  # Residuals the backward pass reads, as jax lists them: "save_matmuls" keeps the MLP's
  # input projection ([B, T, F], F = 2 D here), the new policy keeps only the named
  # attention matmuls and recomputes the MLP's; the loss and gradients are the same.
  cfg = _cfg(num_layers=1, remat="save_matmuls")
  params, batch = _params(cfg), _batch(_tokens(5))
  saved = {}
  for remat in ("save_matmuls", "save_matmuls_except_mlp_in"):
    model = model_lib.Transformer(_cfg(num_layers=1, remat=remat))
    f = lambda p, m=model: m.apply({"params": p}, batch["inputs"]).sum()
    jax.ad_checkpoint.print_saved_residuals(f, params)
    saved[remat] = capsys.readouterr().out.splitlines()
  mlp_width = lambda lines: [l for l in lines if f"[2,{T},{2 * D}]" in l]
  assert mlp_width(saved["save_matmuls"]) and not mlp_width(saved["save_matmuls_except_mlp_in"])
  named = {
    m.group(1)
    for l in saved["save_matmuls_except_mlp_in"]
    for m in [re.search(r"named '(\w+)'", l)]
    if m
  }
  assert named == {"query", "key", "value", "attn_out"}
  loss, grads = _loss_and_grads(cfg, params, batch)
  loss_x, grads_x = _loss_and_grads(
    _cfg(num_layers=1, remat="save_matmuls_except_mlp_in"), params, batch
  )
  np.testing.assert_allclose(loss_x, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), grads_x, grads)


def test_input_first_matmul_gradients_by_hand():
  # y = x w over x's last n dims: dx = g w^T and dw = x^T g (contracting every token dim), the
  # products written out in numpy; n = 2 is attention's out projection ([B, T, H, K] x [H, K, D]).
  # Small integers: every product and sum is exact in float32.
  rng = np.random.default_rng(0)
  draw = lambda shape: rng.integers(-3, 4, size=shape).astype(np.float32)
  for n, x_shape, w_shape in ((1, (2, 3, 4), (4, 5)), (2, (2, 3, 2, 4), (2, 4, 5))):
    x, w = draw(x_shape), draw(w_shape)
    g = draw(x_shape[: x.ndim - n] + w_shape[n:])
    y, vjp = jax.vjp(
      lambda a, b, n=n: model_lib.matmul(a, b, n, "input_first"), jnp.asarray(x), jnp.asarray(w)
    )
    dx, dw = vjp(jnp.asarray(g))
    xm, wm = x.reshape(-1, int(np.prod(w_shape[:n]))), w.reshape(-1, w_shape[-1])
    gm = g.reshape(-1, w_shape[-1])
    np.testing.assert_array_equal(y, (xm @ wm).reshape(g.shape))
    np.testing.assert_array_equal(dx, (gm @ wm.T).reshape(x_shape))
    np.testing.assert_array_equal(dw, (xm.T @ gm).reshape(w_shape))


@pytest.mark.parametrize(
  "overrides",
  [
    {"mlp": "swiglu", "tie_embeddings": False},
    {"attention_kernels": "matrix", "remat": "save_matmuls_except_mlp_in"},
  ],
  ids=["swiglu-untied", "matrix-remat"],
)
def test_input_first_weight_grads_equal_autodiffs(overrides):
  # The same loss and gradients (every weight matmul, the head's included), another program.
  auto, input_first, autodiff = (
    _cfg(num_layers=1, weight_grads=w, **overrides) for w in ("auto", "input_first", "autodiff")
  )
  assert model_lib.weight_grads(auto, "cpu") == "input_first"
  params, batch = _params(autodiff), _batch(_tokens(6))
  loss, grads = _loss_and_grads(autodiff, params, batch)
  loss_f, grads_f = _loss_and_grads(input_first, params, batch)
  np.testing.assert_allclose(loss_f, loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads_f, grads)
  assert min(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4  # Every leaf.
  step = jax.jit(jax.grad(lambda p, m: inner.loss_fn(p, batch, m)[0]), static_argnums=1)
  text = lambda c: step.lower(params, model_lib.Transformer(c)).as_text()
  assert text(input_first) != text(autodiff)


def test_weight_grads_auto_is_input_first_on_cpu_only_and_never_under_save_matmuls():
  cfg = _cfg()
  assert model_lib.weight_grads(cfg, "cpu") == "input_first"
  assert model_lib.weight_grads(cfg, "tpu") == model_lib.weight_grads(cfg, "gpu") == "autodiff"
  assert model_lib.weight_grads(_cfg(remat="save_matmuls"), "cpu") == "autodiff"
  assert model_lib.weight_grads(_cfg(weight_grads="input_first"), "tpu") == "input_first"
  assert model_lib.weight_grads(_cfg(weight_grads="autodiff"), "cpu") == "autodiff"


def test_bfloat16_compute_keeps_float32_params_logits_and_grads():
  cfg32, cfg16 = _cfg(), _cfg(dtype="bfloat16")
  shapes16 = _shapes(cfg16)
  assert {x.dtype for x in jax.tree.leaves(shapes16)} == {jnp.dtype(jnp.float32)}
  assert shapes16 == _shapes(cfg32)
  params = _params(cfg16)
  tokens = _tokens(8)
  logits16, hidden16 = _logits(cfg16, params, tokens, return_hidden=True)
  logits32 = _logits(cfg32, params, tokens)
  assert logits16.dtype == jnp.float32 and hidden16.dtype == jnp.bfloat16
  # bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); through 2 blocks logits of size ~2
  # agree to ~0.04 (measured), and they do differ, so the bf16 path really computes in bf16.
  np.testing.assert_allclose(logits16, logits32, atol=0.1)
  assert np.abs(logits16 - logits32).max() > 1e-4
  # Gradients land on the float32 parameters: traced only, the dtypes need no compile.
  _, grads = _loss_and_grads(cfg16, params, _batch(tokens), trace_only=True)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_swiglu_params_by_hand_and_the_config_field_checked():
  F = 16  # d_model 8 * mlp_ratio 2: the width of each of gate and up.
  shapes = _shape_tree(_cfg(num_layers=1, mlp="swiglu"))["block_0"]
  assert shapes == {**_block_shapes(F), "mlp_gate": {"kernel": (D, F)}}
  # By hand: the GELU block's 528 (test above) plus the gate's 8*16 = 128, so 656; with the
  # token table 104 and head norm 8: 768. mlp_params: 3*8*16 = 384 against GELU's 2*8*16.
  count = sum(x.size for x in jax.tree.leaves(_shapes(_cfg(num_layers=1, mlp="swiglu"))))
  assert count == 104 + 656 + 8
  assert _cfg(mlp="swiglu").mlp_params == 384 and _cfg().mlp_params == 256
  with pytest.raises(ValueError, match="config.model.mlp='relu' is invalid: it must be one of"):
    _cfg(mlp="relu")


def test_swiglu_block_computes_down_of_silu_gate_times_up():
  # Attention out zeroed: hidden = x + W_out (silu(W_gate h) * W_in h), h = rms_norm(x).
  cfg = _cfg(num_layers=1, mlp="swiglu")
  params = _zero(_params(cfg), ("block_0", "attn", "out", "kernel"))
  tokens = _tokens(9, (1, T))
  _, hidden = _logits(cfg, params, tokens, return_hidden=True)
  b = jax.tree.map(np.asarray, params["block_0"])
  x_TxD = np.asarray(params["embed"]["token"])[np.asarray(tokens[0])]
  h_TxD = _rms_norm(x_TxD)
  gate_TxF = h_TxD @ b["mlp_gate"]["kernel"]
  silu_TxF = gate_TxF / (1 + np.exp(-gate_TxF))
  expected = x_TxD + (silu_TxF * (h_TxD @ b["mlp_in"]["kernel"])) @ b["mlp_out"]["kernel"]
  np.testing.assert_allclose(hidden[0], expected, rtol=1e-5, atol=1e-5)


def test_swiglu_training_lowers_the_loss():
  cfg = _cfg(num_layers=1, mlp="swiglu")
  model = model_lib.Transformer(cfg)
  params = _params(cfg)
  batch = _batch(_tokens(10, (4, T)))
  grad_fn = jax.jit(jax.value_and_grad(inner.loss_fn, has_aux=True), static_argnums=2)
  losses = []
  for _ in range(6):  # Plain gradient descent on one batch.
    (loss, _), grads = grad_fn(params, batch, model)
    losses.append(float(loss))
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  assert np.abs(grads["block_0"]["mlp_gate"]["kernel"]).max() > 1e-4  # The gate learns too.
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < losses[0] - 0.1, losses  # Measured 2.61 -> 2.26 over 5 steps.


def test_model_flops_count_swiglus_third_matrix():
  gelu = flops.model_flops_per_token(_cfg(), T)
  swiglu = flops.model_flops_per_token(_cfg(mlp="swiglu"), T)
  # The gate adds D*F = 8*16 weights per block: 6 * 2 blocks * 128 = 1536 FLOPs per token.
  assert swiglu - gelu == 1536
