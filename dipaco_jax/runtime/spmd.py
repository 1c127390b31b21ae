"""The synchronous SPMD runtime: H inner steps on every path, then one outer step, in lock-step.

Every worker (a path, or one replica of it) trains on its own shard; every H
inner steps the outer step averages module deltas over the workers that share
each module and applies Nesterov to the store. The programs are the recipe's,
placed on the mesh by `Experiment`. Auto-resumes from the workdir.
"""

import math
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import saved_config
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import flops as flops_lib
from dipaco_jax.core import inner as inner_lib
from dipaco_jax.core import sharding
from dipaco_jax.data import feed as feed_lib
from dipaco_jax.io import checkpoint as ckpt_lib
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.io import profiling
from dipaco_jax.io import progress
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.runtime import dispatch
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime import shard_plan


def run(config, workdir: str, link=None) -> dict[str, Any]:
  """Trains (or resumes) the run in `workdir` (a config train.py checked); the final metrics.

  The run is built before the workdir is touched; a first attempt that fails
  before its shards are ready leaves no config.json. link: a simulated slow network
  (benchmarks/stream_link.py), told when each outer exchange is dispatched
  (`sent(step, groups)`) and asked to finish it where its update must land
  (`landed(step, params)`, once the device is done with `params`); None (a run) costs
  nothing.
  """
  exp = exp_lib.Experiment(config)
  # θ̄ read and checked before anything is written (a first run; a resume reads its checkpoint).
  theta = None
  if not ckpt_lib.steps(workdir):
    theta = theta_lib.initial(config.dipaco.init_from, exp.recipe.abstract_params())
  workdir_path = epath.Path(workdir)
  workdir_path.mkdir(parents=True, exist_ok=True)
  topo = exp.topo
  W, H, T = topo.num_workers, config.dipaco.inner_steps, config.dipaco.outer_steps
  total = H * T
  logging.info("mesh %s", sharding.describe(exp.mesh))

  # Routed shards and re-shards (shard_plan.py): the plan's train_it, eval_batches
  # (same batches at every evaluation) and alpha_W.
  plan = shard_plan.ShardPlan(config, workdir, exp)
  # Per-path early stopping (paper §2.7) on each worker's own held-out (or validation)
  # documents; the set is saved with each checkpoint.
  best = (
    early_stopping.BestPaths(exp.state_sharding.params, topo.num_workers)
    if config.early_stopping.enabled
    else None
  )
  saved_config.write(workdir_path, config)  # The run's inputs are all valid and ready.

  ckpt = ckpt_lib.Checkpointer(
    workdir, max_to_keep=config.ckpt.max_to_keep, async_save=config.ckpt.async_save
  )
  try:
    restored = ckpt.restore(exp.abstract_state)
  except BaseException:  # E.g. a damaged checkpoint: stop orbax's threads before the error.
    ckpt.close()
    raise
  if restored is None:
    state = exp.init_state(config.seed, theta)
  else:
    state, data_state = restored
    plan.restore(data_state)
    if best is not None:
      best.load(ckpt.restore_best(exp.abstract_state.params))
  step = int(jax.device_get(state.step))
  labels = topo.worker_labels()
  exchange = exp.exchange(link)  # The outer step's form (core/exchange.py): once a step.
  exchange.begin(state)
  logging.info("outer exchange: %s", exchange.describe())
  log = metrics_lib.MetricsLogger(
    workdir, resume_step=step, worker_labels=labels, module_labels=topo.module_labels()
  )
  if step == 0:
    log.write_hparams(config.to_dict())
  guard = exp.recipe.guard(labels, fetch=feed_lib.host)
  if restored is not None:
    guard.saved(step)
  # The norms each phase is held against: its workers' modules in the store (the phase's start).
  guard.start_phase(step // H, exp.store_norms(state.store))
  meter = metrics_lib.Throughput(W * config.data.batch_size * config.data.seq_len, step)
  # perf/per_device_tflops_per_sec: model FLOPs of the tokens trained over all the wall time.
  flops_per_token = flops_lib.model_flops_per_token(exp.recipe.model_cfg, config.data.seq_len)

  # perf/mfu: that over the device's dense peak in the model's dtype (flops.PEAK_TFLOPS, the
  # AOT report's), where the table has one (not on a CPU).
  peak = flops_lib.peak_tflops(jax.devices()[0].device_kind, exp.recipe.model_cfg.dtype)

  def rates(at: int) -> dict[str, float]:
    r = meter.rates(at)
    r["tflops_per_device"] = flops_per_token * r["tokens_per_s"] / jax.device_count() / 1e12
    if peak:
      r["mfu"] = r["tflops_per_device"] / peak
    return r

  # The inner LR each step runs with (train/learning_rate): the schedule at its count, which
  # a re-shard's restart sets back to 0. Counted here, so no step reads the device for it.
  lr_schedule = inner_lib.schedule(exp.recipe.inner_cfg)
  lr_count = inner_lib.schedule_step(state.inner_opt)
  profile = profiling.Window(config, workdir)
  log_every = config.log_every_steps
  eval_every = config.eval.every_steps
  ckpt_every = config.ckpt.every_steps
  ahead = dispatch.dispatch_ahead(config)
  logging.info("dispatch ahead: %s (config.dispatch_ahead=%r)", ahead, config.dispatch_ahead)
  stop = total if config.stop_at_step < 0 else min(config.stop_at_step, total)
  # Its total is where this command stops (config.stop_at_step), not the run's end.
  bar = progress.bar(total=stop, initial=min(step, stop), desc="inner steps", unit="step")

  def logged(at: int) -> bool:
    return at % log_every == 0 or at % H == 0 or at == total

  # The active shards' sizes, in the first logged record (and in the record of each re-shard).
  shards_record = plan.shard_record()

  def read(dispatched) -> tuple[dict[str, Any], dict[str, Any]]:
    """A dispatched step's metrics on the host, past the guard, and its metrics record."""
    nonlocal shards_record
    at, m, outer_norm = dispatched
    m = dict(m)
    schedule_step = m.pop("schedule_step")  # A host int: the LR schedule's count at step `at`.
    # Blocking on each step's small metrics (now or one step late) keeps the CPU collectives
    # healthy and lets the divergence guard stop before a bad state is saved.
    m = feed_lib.host(m)
    guard.check(at, m["loss"], m["param_norm"])
    out: dict[str, Any] = {}
    if outer_norm is not None:
      out["outer_delta_norm"] = feed_lib.host(outer_norm)
    if logged(at):  # Its tokens_per_s and step_s join it outside meter.timed().
      out.update(
        phase=(at - 1) // H,
        lr=float(lr_schedule(schedule_step)),
        train_loss=m["loss"],
        grad_norm=m["grad_norm"],
        param_norm=m["param_norm"],
        **shards_record,
      )
      shards_record = {}
      bar.set_postfix(loss=f"{float(np.mean(m['loss'])):.3f}")
    return m, out

  # (step, metrics, outer delta norms) on device: dispatched, not yet read (dispatch ahead only).
  pending = None
  record: dict[str, Any] = {}
  result: dict[str, Any] = {}
  try:  # On any stop, the last checkpoint's save (async) still completes.
    while step < stop:
      ckpt.check()  # A failed background save stops the run here (CheckpointSaveError).
      previous = None  # (step, record) of the step read while this one was queued.
      profile.before(step + 1)
      with meter.timed():  # step_s: the steps alone (tokens_per_s counts everything).
        batch = exp.put_batch(plan.train_it.next_batch())
        params, inner_opt, m = exp.inner_step(state.params, state.inner_opt, batch)
        m = {**m, "schedule_step": lr_count}
        lr_count += 1
        state = state.replace(params=params, inner_opt=inner_opt, step=state.step + 1)
        step += 1
        state, outer_norm = exchange(state, step, plan.alpha_W)
        if step % H == 0:  # The next phase's reference norms (read when its first step is).
          guard.start_phase(step // H, exp.group_norms(state.params))
        if pending is not None:  # Ahead: the previous step's metrics while this step runs.
          previous = (pending[0], read(pending)[1])
        pending = (step, m, outer_norm)
        reshard = step % H == 0 and plan.reshards_after(step)
        # Whatever reads or saves this step's state (evaluation, re-shard, checkpoint, the end)
        # waits for its metrics first, so the guard has seen every step up to a saved state.
        if not ahead or reshard or step == stop or step % eval_every == 0 or step % ckpt_every == 0:
          m, record = read(pending)
          pending = None
      if previous is not None:
        at, rec = previous
        log.write(at, {**rec, **rates(at)} if logged(at) else rec)
      if pending is None and logged(step):
        record.update(rates(step))  # The write and save below fall in the next interval.
      if reshard:
        plan.reshard(step, state.params)
        record.update(plan.shard_record())
        if config.routing.restart_schedule:  # Paper Fig. 10: the cosine starts over.
          state = state.replace(inner_opt=exp.recipe.restart_schedule(state.inner_opt))
          lr_count = 0
      bar.update(1)
      profile.after(step, state.params)
      if step % eval_every == 0 or step == stop:
        loss_sum_W, tokens_W = exp.evaluate_sums(state.params, plan.eval_batches)
        val = exp.losses(loss_sum_W, tokens_W)
        if best is not None:  # In memory; saved with the next checkpoint (at `stop` at the latest).
          stop_W = val
          if plan.stop_batches is not plan.eval_batches:  # early_stopping.source="heldout".
            stop_W = exp.losses(*exp.evaluate_sums(state.params, plan.stop_batches))
            record.update(heldout_loss=stop_W, heldout_loss_mean=metrics_lib.nan_mean(stop_W))
          best.update(step, stop_W, state.params, plan.phase)
        # Workers whose validation shard is empty read NaN (allow_validation): skipped.
        record.update(val_loss=val, val_loss_mean=metrics_lib.nan_mean(val))
        # Routed, all tokens: every token of the packed validation batches (the routing prefix
        # included) scored by the path its document was routed to; `evaluate` excludes the prefix.
        routed = float(np.sum(loss_sum_W) / np.sum(tokens_W)) if np.sum(tokens_W) else math.nan
        routed_ppl = float(np.exp(routed))
        record.update(
          val_loss_routed_all_tokens=routed, val_perplexity_routed_all_tokens=routed_ppl
        )
        result = {
          "step": step,
          "val_loss": val.tolist(),
          "val_loss_mean": metrics_lib.nan_mean(val),
          "val_loss_routed_all_tokens": routed,
          "val_perplexity_routed_all_tokens": routed_ppl,
          "train_loss_mean": float(np.mean(m["loss"])),
        }
      if record:
        log.write(step, record)
        record = {}
      if step % ckpt_every == 0 or step == stop:
        if not bool(jax.device_get(exp.all_finite(state.params))):
          guard.not_finite(step)
        ckpt.save(step, state, plan.data_state(), best=best.saved() if best else None)
        guard.saved(step)
  except KeyboardInterrupt as e:  # Ctrl-C: train.py's one line names the step reached.
    e.step = step
    raise
  finally:
    profile.close()
    bar.close()
    ckpt.close()
    log.close()
  return result
