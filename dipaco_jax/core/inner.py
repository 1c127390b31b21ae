"""The inner phase: one AdamW (or Muon + AdamW) train step for ONE path.

`train_step` and `eval_step` see a single path's params and batch; the recipe
(recipe.py) binds the model, the optimizer and the microbatches, and each
runtime maps or jits the result. Nothing in here reduces across workers, so no
collective crosses the path axis.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import contrib

from dipaco_jax.config import sections
from dipaco_jax.core import model as model_lib
from dipaco_jax.types import PyTree

InnerConfig = sections.InnerConfig  # config.inner, declared in config/sections.py.


def schedule(cfg: InnerConfig, peak: float | None = None) -> optax.Schedule:
  """Linear warmup then cosine decay to `final_lr_fraction * peak` (peak: `cfg.lr` unless given)."""
  peak = cfg.lr if peak is None else peak
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak,
    warmup_steps=min(cfg.warmup_steps, max(cfg.total_steps - 1, 0)),
    decay_steps=max(cfg.total_steps, 1),
    end_value=peak * cfg.final_lr_fraction,
  )


def _decay_mask(params: PyTree, decay_norms: bool) -> PyTree:
  return jax.tree.map(lambda x: decay_norms or x.ndim > 1, params)


def _muon_dims_of(path, x) -> contrib.MuonDimensionNumbers | None:
  """The matrix Muon sees in leaf `x` at `path`, or None: the leaf is AdamW's.

  Muon's: every kernel of a block, as the matrix (inputs x outputs) it multiplies by: the
  attention's query, key and value [D, H, K] as D x (H K), its out [H, K, D] as (H K) x D, the
  MLP's [D, F] and [F, D] as they are. AdamW's: the embedding and the head (the final norm, an
  untied unembedding), though 2-D: they map tokens, not hidden features; and every norm scale
  and vector.
  """
  names = [getattr(k, "key", None) for k in path]
  if not str(names[0]).startswith("block_") or x.ndim < 2:
    return None
  if names[-3:] == ["attn", "out", "kernel"]:
    return contrib.MuonDimensionNumbers(tuple(range(x.ndim - 1)), x.ndim - 1)
  return contrib.MuonDimensionNumbers(0, tuple(range(1, x.ndim)))


def muon_dims(params: PyTree) -> PyTree:
  """Each leaf's `MuonDimensionNumbers` where Muon steps it, None where AdamW does."""
  return jax.tree_util.tree_map_with_path(_muon_dims_of, params)


def _labels(params: PyTree) -> PyTree:
  return jax.tree_util.tree_map_with_path(
    lambda p, x: "adamw" if _muon_dims_of(p, x) is None else "muon", params
  )


def optimizer(cfg: InnerConfig) -> optax.GradientTransformation:
  """Clip, then AdamW with the warmup-cosine schedule, or Muon + AdamW (inner.optimizer="muon").

  Muon (MuLoCo's inner optimizer) is optax's `contrib.muon`: Nesterov momentum `muon_beta`,
  5 Newton-Schulz steps (optax's coefficients), the update scaled by sqrt(max(1, out / in)),
  decoupled weight decay and the schedule's shape at peak `muon_lr` (lr-scaled: θ -= η_muon(t)
  (u + λ θ)). optax.partition hands it only the leaves `muon_dims` names, so the AdamW part of
  its own holds no leaf (only its counts): not that one, which is Nesterov when Muon is and
  decays every leaf, but the same AdamW as optimizer="adamw" (lr, b1, b2, eps, weight_decay,
  decay_norms) steps the rest.
  """
  tx = optax.adamw(
    schedule(cfg),
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    mask=lambda p: _decay_mask(p, cfg.decay_norms),
  )
  if cfg.optimizer == "muon":
    muon = contrib.muon(
      schedule(cfg, cfg.muon_lr),
      beta=cfg.muon_beta,
      weight_decay=cfg.weight_decay,
      muon_weight_dimension_numbers=muon_dims,
    )
    tx = optax.partition({"adamw": tx, "muon": muon}, _labels)
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
  return tx


def loss_sums(params: PyTree, batch: dict, model: model_lib.Transformer):
  """Summed weighted next-token cross-entropy and the weight sum of a batch.

  With model.cfg.loss_chunk = C > 0 the logits are built C sequence positions
  at a time ([B, C, V], recomputed in the backward pass), never all [B, T, V].
  """
  w_BxT = batch["weights"].astype(jnp.float32)
  chunk = model.cfg.loss_chunk
  if not chunk:
    logits_BxTxV = model.apply(
      {"params": params}, batch["inputs"], batch["segment_ids"], batch["positions"]
    )
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
    return (ce_BxT * w_BxT).sum(), w_BxT.sum()
  feats_BxTxD, unembed_DxV = model.apply(
    {"params": params}, batch["inputs"], batch["segment_ids"], batch["positions"], unembed=False
  )
  B, T, D = feats_BxTxD.shape
  if T % chunk:
    raise ValueError(
      f"model.loss_chunk={chunk} does not divide the sequence "
      f"length {T}: choose a divisor of it (0 = no chunking)."
    )
  n = T // chunk
  # Chunks along T (not B), so each keeps the batch's 'data' sharding.
  split = lambda x: x.reshape((B, n, chunk) + x.shape[2:]).swapaxes(0, 1)

  def body(total, xs):
    feats_BxCxD, targets_BxC, w_BxC = xs
    return total + chunk_loss(feats_BxCxD, unembed_DxV, targets_BxC, w_BxC), None

  total, _ = jax.lax.scan(
    body, jnp.zeros((), jnp.float32), (split(feats_BxTxD), split(batch["targets"]), split(w_BxT))
  )
  return total, w_BxT.sum()


def _chunk_logits(feats_BxCxD, unembed_DxV):
  """One chunk's logits in the compute dtype (the matmul's own output type)."""
  return jnp.einsum("btd,dv->btv", feats_BxCxD, unembed_DxV)


def _hits(targets_BxC, shape) -> jax.Array:
  """[B, C, V] bool: True at each position's target (a one-hot, fused into its reader)."""
  return targets_BxC[..., None] == jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def _chunk_ce(logits_BxCxV, targets_BxC):
  """(cross-entropy, log-sum-exp) per position, float32 math on the logits as they are.

  optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), targets), up to the
  order of the sums: the target's logit is picked by a one-hot select (exact: one term), not a
  gather, so that it reads the logits in the same pass as the sum of exponentials.
  """
  lf_BxCxV = logits_BxCxV.astype(jnp.float32)
  max_BxC = jax.lax.stop_gradient(lf_BxCxV.max(-1))
  lse_BxC = jnp.log(jnp.exp(lf_BxCxV - max_BxC[..., None]).sum(-1)) + max_BxC
  target_BxC = jnp.where(_hits(targets_BxC, lf_BxCxV.shape), lf_BxCxV, 0.0).sum(-1)
  return lse_BxC - target_BxC, lse_BxC


@jax.custom_vjp
def chunk_loss(feats_BxCxD, unembed_DxV, targets_BxC, w_BxC):
  """Σ w · cross-entropy of one chunk of positions: logits = feats @ unembed, never kept.

  The value and gradient of `(optax CE of (feats @ unembed).astype(float32)) * w` summed, as
  autodiff gives them, from a forward that keeps only the per-position log-sum-exp and
  cross-entropy (float32 [B, C]), and a backward that rebuilds the logits once (compute dtype,
  as the forward made them) and writes their gradient (softmax - onehot) * w * g in the compute
  dtype from one fused pass: never a float32 [B, C, V] in HBM, nor a second log-sum-exp.
  """
  return _chunk_loss_fwd(feats_BxCxD, unembed_DxV, targets_BxC, w_BxC)[0]


def _chunk_loss_fwd(feats_BxCxD, unembed_DxV, targets_BxC, w_BxC):
  ce_BxC, lse_BxC = _chunk_ce(_chunk_logits(feats_BxCxD, unembed_DxV), targets_BxC)
  res = (feats_BxCxD, unembed_DxV, targets_BxC, w_BxC, ce_BxC, lse_BxC)
  return (ce_BxC * w_BxC).sum(), res


def _chunk_loss_bwd(res, g):
  feats_BxCxD, unembed_DxV, targets_BxC, w_BxC, ce_BxC, lse_BxC = res
  logits_BxCxV = _chunk_logits(feats_BxCxD, unembed_DxV)
  lf_BxCxV = logits_BxCxV.astype(jnp.float32)
  hit_BxCxV = _hits(targets_BxC, lf_BxCxV.shape)
  scale_BxC = (g * w_BxC).astype(jnp.float32)
  # d ce / d logits = softmax - onehot; the float32 gradient rounds to the compute dtype where
  # autodiff's would (the transpose of the logits' cast), in the same fused op.
  dlogits_BxCxV = (
    (jnp.exp(lf_BxCxV - lse_BxC[..., None]) - hit_BxCxV) * scale_BxC[..., None]
  ).astype(logits_BxCxV.dtype)
  dfeats_BxCxD = jnp.einsum("btv,dv->btd", dlogits_BxCxV, unembed_DxV)
  dunembed_DxV = jnp.einsum("btd,btv->dv", feats_BxCxD, dlogits_BxCxV)
  dw_BxC = (ce_BxC * g).astype(w_BxC.dtype)
  return dfeats_BxCxD, dunembed_DxV, None, dw_BxC


chunk_loss.defvjp(_chunk_loss_fwd, _chunk_loss_bwd)


def loss_fn(params: PyTree, batch: dict, model: model_lib.Transformer):
  """Weighted mean next-token cross-entropy and the weight sum."""
  loss_sum, weight = loss_sums(params, batch, model)
  return loss_sum / jnp.maximum(weight, 1.0), weight


def microbatch(batch: dict, microbatches: int) -> dict:
  """[B, ...] leaves to [M, B/M, ...]; microbatch m holds rows m, m+M, m+2M, ...

  Strided, not contiguous: every microbatch then spans all of the batch's
  'data' shards, so each scanned step keeps every device busy.
  """
  B = jax.tree.leaves(batch)[0].shape[0]
  if B % microbatches:
    raise ValueError(
      f"inner.microbatches={microbatches} does not divide the "
      f"batch of {B} sequences: choose a divisor of it."
    )
  return jax.tree.map(
    lambda x: x.reshape((B // microbatches, microbatches) + x.shape[1:]).swapaxes(0, 1), batch
  )


def grad_sums(
  params: PyTree, batch: dict, model: model_lib.Transformer, microbatches: int, data_shards: int = 1
):
  """(summed gradient, summed loss, summed weight) of the batch, scanned over microbatches > 1.

  The gradient sums stay float32 whatever the params' dtype; `finish_step` divides once by the
  batch's weight, as the full-batch mean would. data_shards = d > 1 (the batch split over a
  'data' mesh axis of d devices, the params not): each microbatch's gradient is taken per shard
  (a vmap over its d row blocks, spmd_axis_name='data', so each device computes its own) and
  summed in a [d, ...] float32 accumulator, one row a device; the d rows are summed after the
  scan. The data-parallel reduction is then one all-reduce a step, not one a microbatch (the
  compiler hoists most of those out of the scan, but not the tied embedding's, whose gradient
  is summed over the loss chunks' loop first). The same sums up to their order.
  """
  grad_sums_of = one_grad = jax.value_and_grad(loss_sums, has_aux=True)
  if data_shards > 1:
    shard_model = model.clone(data_mapped=True)
    per_shard = jax.vmap(
      lambda p, mb: one_grad(p, mb, shard_model), in_axes=(None, 0), spmd_axis_name="data"
    )
    # Device k holds rows [k B/d, (k+1) B/d) of the batch, so rows [k b, (k+1) b) of each
    # strided microbatch of b d rows (`microbatch`): row block k of [d, b, ...].
    split = lambda x: x.reshape((data_shards, x.shape[0] // data_shards) + x.shape[1:])
    grad_sums_of = lambda p, mb, _: per_shard(p, jax.tree.map(split, mb))
    shape = lambda p: (data_shards,) + p.shape
  else:
    shape = lambda p: p.shape

  def body(carry, mb):
    g_acc, l_acc, w_acc = carry
    (l, w), g = grad_sums_of(params, mb, model)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
    return (jax.tree.map(jnp.add, g_acc, g), l_acc + l.sum(), w_acc + w.sum()), None

  zeros = jax.tree.map(lambda p: jnp.zeros(shape(p), jnp.float32), params)
  zero = jnp.zeros((), jnp.float32)
  (g_sum, loss_sum, weight), _ = jax.lax.scan(
    body, (zeros, zero, zero), microbatch(batch, microbatches)
  )
  if data_shards > 1:
    g_sum = jax.tree.map(lambda g: g.sum(0), g_sum)  # The one reduction over 'data'.
  return g_sum, loss_sum, weight


def train_step(
  params: PyTree,
  opt_state: PyTree,
  batch: dict,
  *,
  model: model_lib.Transformer,
  tx: optax.GradientTransformation,
  microbatches: int,
  data_shards: int = 1,
):
  """One optimizer step on one path; returns (params, opt_state, metrics).

  microbatches > 1 accumulates the gradient over that many parts of the batch
  inside this one step (`grad_sums`, then `finish_step`): the same update up to
  the order of summation; `data_shards`: grad_sums'.
  """
  if microbatches > 1:
    sums = grad_sums(params, batch, model, microbatches, data_shards)
    return finish_step(params, opt_state, *sums, tx=tx)
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, model)
  return _update(params, opt_state, loss, grads, tx)


def finish_step(
  params: PyTree,
  opt_state: PyTree,
  g_sum: PyTree,
  loss_sum: jax.Array,
  weight: jax.Array,
  *,
  tx: optax.GradientTransformation,
):
  """What a step with microbatches does after its scan: the mean gradient, the update, metrics.

  Everything of the step outside the microbatch loop (the AOT tool compiles it alone to count
  it once, aot.Report._inner_cost, aot/report.py).
  """
  denom = jnp.maximum(weight, 1.0)
  grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
  return _update(params, opt_state, loss_sum / denom, grads, tx)


def _update(params, opt_state, loss, grads, tx):
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "param_norm": group_norms(params)}
  return params, opt_state, metrics


def group_norms(params: PyTree) -> dict:
  """‖θ_g‖ per top-level group (embed, block_i, head): the divergence guard's input.

  Per group, so a block that blows up shows even beside a much larger embedding.
  """
  return {g: optax.tree.norm(sub) for g, sub in params.items()}


def eval_step(params: PyTree, batch: dict, *, model: model_lib.Transformer, microbatches: int):
  """Summed loss and token count of one batch for one path (scanned in microbatches)."""
  if microbatches == 1:
    loss_sum, weight = loss_sums(params, batch, model)
  else:

    def body(carry, mb):
      l, w = loss_sums(params, mb, model)
      return (carry[0] + l, carry[1] + w), None

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, weight), _ = jax.lax.scan(body, (zero, zero), microbatch(batch, microbatches))
  return {"loss_sum": loss_sum, "weight": weight}


def schedule_step(inner_opt: PyTree) -> int:
  """The LR schedule's step in a (workers') inner optimizer state: the next step's count.

  Every worker steps together, so the first worker's count is the run's (0 when none).
  """
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  found = [x.count for x in jax.tree.leaves(inner_opt, is_leaf=is_sched) if is_sched(x)]
  if not found:
    return 0
  count = found[0]
  if isinstance(count, jax.Array):  # This process's first shard: every worker holds the same.
    count = count.addressable_shards[0].data
  return int(np.asarray(count).ravel()[0])


def restart_schedule(inner_opt: PyTree) -> PyTree:
  """Resets the LR schedule's step count (only) in every worker's optimizer state.

  Adam's moments and bias-correction count are kept; warmup and cosine start
  over with the same warmup_steps / total_steps (paper Fig. 10's restart at a
  discriminative re-shard).
  """
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  found = []

  def reset(x):
    if is_sched(x):
      found.append(True)
      return x._replace(count=jax.device_put(jnp.zeros_like(x.count), x.count.sharding))
    return x

  out = jax.tree.map(reset, inner_opt, is_leaf=is_sched)
  if not found:
    raise ValueError(
      "the inner optimizer state holds no schedule count to restart; set "
      "config.routing.restart_schedule=False."
    )
  return out
