"""Memory switches change how a step is computed, never what it computes.

Gradient accumulation (inner.microbatches), the chunked cross-entropy
(model.loss_chunk), remat policies (model.remat) and FSDP (mesh.fsdp) against the
plain computation (the attention kernels: tests/core/test_attention.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax.core import experiment
from dipaco_jax.core import inner
from dipaco_jax.core import model

import helpers


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _train(cfg, batches):
  exp = experiment.Experiment(cfg)
  st = exp.init_state(0)
  params, opt = st.params, st.inner_opt
  losses = []
  for b in batches:
    params, opt, m = exp.inner_step(params, opt, exp.put_batch(b))
    losses.append(np.asarray(m["loss"]))
  return _leaves(params), np.stack(losses)


@pytest.mark.slow  # three batch-8 steps, accumulated and not, on 4 workers (16 s, load 4)
@pytest.mark.parametrize(
  "mesh",
  [
    {},  # path 4 x data 1.
    # path 2 x data 2, loss chunks: each device's gradient summed over the scan, then over
    # 'data' once (inner.grad_sums' data_shards), against the full batch's.
    {"mesh.data": 2, "model.loss_chunk": 8},
  ],
  ids=["path4", "path2xdata2"],
)
def test_microbatches_give_the_full_batch_update(mesh):
  # 8 sequences per path in 4 microbatches of 2, against one batch of 8.
  over = {"data.batch_size": 8, "dipaco.inner_steps": 3, **mesh}
  rng = np.random.default_rng(0)
  # Segments and padding (weight 0) so the per-microbatch weights differ.
  batches = []
  for _ in range(3):
    b = helpers.synthetic_batch(rng, 4, 8, 16, 256)
    b["segment_ids"][:, :, 9:] = 2
    b["weights"][:, ::3, 12:] = 0.0
    batches.append(b)
  full, loss_full = _train(helpers.micro_config(**over), batches)
  acc, loss_acc = _train(helpers.micro_config(**over, **{"inner.microbatches": 4}), batches)
  # Only the order of float32 summation differs (per-token gradients summed
  # per microbatch, then across them): ~1e-7 relative in the gradient, which
  # Adam's m / (√v + ε) keeps at that size; lr 2e-3 over 3 steps leaves the
  # parameters within ~1e-8 of each other, so 1e-6 is loose but a wrong
  # normalisation (a mean of microbatch means) misses it by ~1e-4.
  np.testing.assert_allclose(loss_acc, loss_full, rtol=1e-6)
  for a, b in zip(full, acc):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_microbatches_that_do_not_split_the_batch_are_refused():
  with pytest.raises(ValueError, match="inner.microbatches=3"):
    experiment.Experiment(helpers.micro_config(**{"data.batch_size": 8, "inner.microbatches": 3}))


def _model_cfg(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, head_dim=16)
  base.update(kw)
  return helpers.model_config(**base)


def _loss_and_grads(cfg, params, batch):
  m = model.Transformer(cfg)
  return jax.jit(jax.value_and_grad(lambda p: inner.loss_fn(p, batch, m)[0]))(params)


def _packed_batch(seed=0, B=3, T=16, V=64):
  b = {k: v[0] for k, v in helpers.synthetic_batch(np.random.default_rng(seed), 1, B, T, V).items()}
  b["segment_ids"][:, T // 3 :] = 2  # Two documents per row.
  b["positions"][:, T // 3 :] -= T // 3
  b["weights"][0, T // 2 :] = 0.0
  return b


@pytest.mark.slow  # ~7-12 s of CPU: the fast suite's budget is 3 minutes.
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_equals_the_full_logits_loss(tie):
  cfg = _model_cfg(tie_embeddings=tie)
  params = model.init_params(cfg, jax.random.key(1))
  batch = _packed_batch()
  loss, grads = _loss_and_grads(cfg, params, batch)
  for chunk in (4, 8):
    loss_c, grads_c = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=chunk), params, batch)
    # float32 throughout: the chunks only reorder the sums (≈1e-7 relative).
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    for a, b in zip(_leaves(grads), _leaves(grads_c)):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunk_loss_is_autodiff_of_optax_cross_entropy(dtype):
  """inner.chunk_loss's custom backward against autodiff of the plain chunk (float32 logits)."""
  rng = np.random.default_rng(0)
  dt = jnp.dtype(dtype)
  feats = jnp.asarray(rng.normal(size=(3, 8, 16)), dt)
  unembed = jnp.asarray(2 * rng.normal(size=(16, 50)), dt)
  targets = jnp.asarray(rng.integers(0, 50, size=(3, 8)), jnp.int32)
  w = jnp.asarray(rng.integers(0, 2, size=(3, 8)), jnp.float32)

  def plain(f, u, w):
    logits = jnp.einsum("btd,dv->btv", f, u).astype(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * w).sum()

  fused = lambda f, u, w: inner.chunk_loss(f, u, targets, w)
  want, want_g = jax.value_and_grad(plain, argnums=(0, 1, 2))(feats, unembed, w)
  got, got_g = jax.value_and_grad(fused, argnums=(0, 1, 2))(feats, unembed, w)
  # The same float32 math on the same logits, the sums in another order: ~1e-7 relative.
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # float32: the gradients to ~1e-7 relative of the largest (measured 4e-6 on |g| ~ 10).
  # bfloat16: both round the same float32 gradient to bfloat16, which a 1e-7 difference can
  # move by one step (2^-8 relative) at most (measured: equal).
  tol = 1e-5 if dtype == "float32" else 2**-7
  for g, h in zip(got_g, want_g):
    assert g.dtype == h.dtype
    g, h = np.asarray(g, np.float32), np.asarray(h, np.float32)
    np.testing.assert_allclose(g, h, rtol=tol, atol=tol * np.abs(h).max())


def test_chunk_that_does_not_divide_the_sequence_is_refused():
  cfg = _model_cfg(loss_chunk=5)
  params = model.init_params(cfg, jax.random.key(1))
  with pytest.raises(ValueError, match="loss_chunk=5"):
    _loss_and_grads(cfg, params, _packed_batch())


@pytest.mark.parametrize("remat", ["full", "save_matmuls"])
def test_remat_policies_leave_loss_and_grads_unchanged(remat):
  cfg = _model_cfg()
  params = model.init_params(cfg, jax.random.key(2))
  batch = _packed_batch(1)
  loss, grads = _loss_and_grads(cfg, params, batch)
  loss_r, grads_r = _loss_and_grads(dataclasses.replace(cfg, remat=remat), params, batch)
  np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
  for a, b in zip(_leaves(grads), _leaves(grads_r)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_unknown_remat_policy_is_refused():
  with pytest.raises(ValueError, match="model.remat=True"):
    _model_cfg(remat=True)


@pytest.mark.slow  # two experiments on a 2x2 mesh, FSDP and not, compiled and run (35 s, load 13)
def test_fsdp_shards_params_over_data_and_trains_the_same():
  over = {"mesh.path": 2, "mesh.data": 2, "data.batch_size": 4}
  rng = np.random.default_rng(4)
  batches = [helpers.synthetic_batch(rng, 4, 4, 16, 256) for _ in range(2)]
  exp = experiment.Experiment(helpers.micro_config(**over, **{"mesh.fsdp": True}))
  kernel = exp.state_sharding.params["block_0"]["mlp_in"]["kernel"].spec
  assert kernel == jax.sharding.PartitionSpec("path", "data", "model")
  mu = [x for x in jax.tree.leaves(exp.state_sharding.inner_opt) if x.spec[1:2] == ("data",)]
  assert mu, "AdamW moments follow the params' FSDP sharding"
  rep, _ = _train(helpers.micro_config(**over), batches)
  fsdp, _ = _train(helpers.micro_config(**over, **{"mesh.fsdp": True}), batches)
  for a, b in zip(rep, fsdp):
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
