"""The inner phase: one AdamW train step for ONE path, mapped over workers.

`train_step` and `eval_step` see a single path's params and batch. The
trainer maps them over the leading worker axis with `jax.vmap` and jits them
once with the worker axis sharded on the 'path' mesh axis; nothing in here
reduces across workers, so no collective crosses the path axis.
"""
# pylint: disable=invalid-name

import dataclasses

import jax
import jax.numpy as jnp
import optax

from dipaco_jax import model as model_lib
from dipaco_jax.types import PyTree



@dataclasses.dataclass(frozen=True)
class InnerConfig:
  """Inner optimizer (config.inner; defaults in config_defaults.base)."""
  lr: float
  warmup_steps: int
  total_steps: int  # Length of the cosine decay (inner steps).
  final_lr_fraction: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  clip_norm: float  # Global-norm clip per path; 0 disables.
  decay_norms: bool  # Weight-decay norm scales too (default: matrices only).


def schedule(cfg: InnerConfig) -> optax.Schedule:
  """Linear warmup then cosine decay to `final_lr_fraction * lr`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr,
      warmup_steps=min(cfg.warmup_steps, max(cfg.total_steps - 1, 0)),
      decay_steps=max(cfg.total_steps, 1),
      end_value=cfg.lr * cfg.final_lr_fraction)


def _decay_mask(params: PyTree, decay_norms: bool) -> PyTree:
  return jax.tree.map(lambda x: decay_norms or x.ndim > 1, params)


def optimizer(cfg: InnerConfig) -> optax.GradientTransformation:
  """Clip, then AdamW with the warmup-cosine schedule."""
  adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay,
                      mask=lambda p: _decay_mask(p, cfg.decay_norms))
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw


def loss_fn(params: PyTree, batch: dict, model: model_lib.Transformer):
  """Weighted mean next-token cross-entropy and the weight sum."""
  logits_BxTxV = model.apply({"params": params}, batch["inputs"],
                             batch["segment_ids"], batch["positions"])
  ce_BxT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV, batch["targets"])
  w_BxT = batch["weights"].astype(jnp.float32)
  denom = jnp.maximum(w_BxT.sum(), 1.0)
  return (ce_BxT * w_BxT).sum() / denom, w_BxT.sum()


def train_step(params: PyTree, opt_state: PyTree, batch: dict, *,
               model: model_lib.Transformer,
               tx: optax.GradientTransformation):
  """One AdamW step on one path; returns (params, opt_state, metrics)."""
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, batch, model)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
             "param_norm": group_norms(params)}
  return params, opt_state, metrics


def group_norms(params: PyTree) -> dict:
  """‖θ_g‖ per top-level group (embed, block_i, head): the divergence guard's input.

  Per group, so a block that blows up shows even beside a much larger embedding.
  """
  return {g: optax.tree.norm(sub) for g, sub in params.items()}


def eval_step(params: PyTree, batch: dict, *, model: model_lib.Transformer):
  """Summed loss and token count of one batch for one path."""
  loss, weight = loss_fn(params, batch, model)
  return {"loss_sum": loss * weight, "weight": weight}


def init_opt_state(tx: optax.GradientTransformation, params_W: PyTree) -> PyTree:
  """One independent AdamW state per worker (DiLoCo never syncs them)."""
  return jax.vmap(tx.init)(params_W)


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
    raise ValueError("the inner optimizer state holds no schedule count to restart; set "
                     "config.routing.restart_schedule=False.")
  return out
