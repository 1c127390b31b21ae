"""The synchronous SPMD trainer: H inner steps on every path, then one outer step.

Every worker (a path, or one replica of it) trains on its own shard; every H
inner steps the outer step averages module deltas over the workers that share
each module and applies Nesterov to the store. Auto-resumes from the workdir.
"""

import json
import math
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import config_check
from dipaco_jax import config_defaults
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import inner as inner_lib
from dipaco_jax.core import sharding
from dipaco_jax.data import feed as feed_lib
from dipaco_jax.io import checkpoint as ckpt_lib
from dipaco_jax.io import files
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.io import progress
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime import elastic
from dipaco_jax.runtime import shard_plan

# Sections of the config that must not change when a run resumes.
_FROZEN_SECTIONS = ("model", "dipaco", "data")


def check_config_matches(workdir: epath.Path, config) -> None:
  """Refuses to resume a workdir written by a different grid, model or data."""
  path = workdir / files.CONFIG_FILE
  if path.exists():
    old, new = files.read_json(path), json.loads(config.to_json_best_effort())
    # A field added since the run started (model.mlp, ...) had its default then.
    default = json.loads(config_defaults.base().to_json_best_effort())
    changed = [
      s for s in _FROZEN_SECTIONS if {**default.get(s, {}), **old.get(s, {})} != new.get(s)
    ]
    if changed:
      raise config_defaults.ConfigError(
        f"{workdir} holds a run with different config sections {changed}; "
        "its checkpoints would not fit. Use a new --workdir (nothing was "
        "changed in the old one)."
      )


def write_config(workdir: epath.Path, config) -> None:
  """config.json, once the config is valid and the run's shards are ready."""
  path = workdir / files.CONFIG_FILE
  if jax.process_index() == 0 and not path.exists():
    files.write_json(path, json.loads(config.to_json_best_effort()))


# config.dispatch_ahead: "auto" (on for TPU and GPU, off on CPU), "on", "off".
DISPATCH_AHEAD = ("auto", "on", "off")


def dispatch_ahead(config, backend: str | None = None) -> bool:
  """Whether the loop reads step t's metrics after dispatching step t+1 (docs/performance.md).

  On an accelerator that keeps the device busy while the host reads, logs and guards. On CPU
  the host is the device, so "auto" leaves it off; "on" still waits on every step, one late.
  """
  if config.dispatch_ahead == "auto":
    return (backend or jax.default_backend()) in ("tpu", "gpu")
  return config.dispatch_ahead == "on"


def _initial_theta(config):
  src = config.dipaco.init_from
  return ckpt_lib.restore_worker_params(src) if src else None


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) the run in `workdir`; returns the final metrics.

  The config is validated and the run built before the workdir is touched; a
  first attempt that fails before its shards are ready leaves no config.json.
  """
  config_check.validate(config)
  if config.dipaco.mode == "elastic":  # The Ray worker pool (dipaco_jax/runtime/elastic/).
    return elastic.run(config, workdir)
  elastic.check_workdir_mode(workdir, "spmd")
  exp = exp_lib.Experiment(config)
  workdir_path = epath.Path(workdir)
  check_config_matches(workdir_path, config)
  workdir_path.mkdir(parents=True, exist_ok=True)
  topo = exp.topo
  W, H, T = topo.num_workers, config.dipaco.inner_steps, config.dipaco.outer_steps
  total = H * T
  logging.info("%s; mesh %s", topo.describe(), sharding.describe(exp.mesh))

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
  write_config(workdir_path, config)  # The run's inputs are all valid and ready.

  ckpt = ckpt_lib.Checkpointer(
    workdir, max_to_keep=config.ckpt.max_to_keep, async_save=config.ckpt.async_save
  )
  try:
    restored = ckpt.restore(exp.abstract_state)
  except BaseException:  # E.g. a damaged checkpoint: stop orbax's threads before the error.
    ckpt.close()
    raise
  if restored is None:
    state = exp.init_state(config.seed, _initial_theta(config))
  else:
    state, data_state = restored
    plan.restore(data_state)
    if best is not None:
      best.load(ckpt.restore_best(exp.abstract_state.params))
  step = int(jax.device_get(state.step))
  labels = topo.worker_labels()
  log = metrics_lib.MetricsLogger(
    workdir, resume_step=step, worker_labels=labels, module_labels=topo.module_labels()
  )
  if step == 0:
    log.write_hparams(config.to_dict())
  guard = metrics_lib.DivergenceGuard(
    config,
    labels,
    feed_lib.host(exp.group_norms(state.params)),
    last_saved=None if restored is None else step,
  )
  meter = metrics_lib.Throughput(W * config.data.batch_size * config.data.seq_len, step)
  log_every = config.log_every_steps
  eval_every = config.eval.every_steps
  ckpt_every = config.ckpt.every_steps
  ahead = dispatch_ahead(config)
  logging.info("dispatch ahead: %s (config.dispatch_ahead=%r)", ahead, config.dispatch_ahead)
  bar = progress.bar(total=total, initial=step, desc="inner steps", unit="step")

  def logged(at: int) -> bool:
    return at % log_every == 0 or at % H == 0 or at == total

  # The active shards' sizes, in the first logged record (and in the record of each re-shard).
  shards_record = plan.shard_record()

  def read(dispatched) -> tuple[dict[str, Any], dict[str, Any]]:
    """A dispatched step's metrics on the host, past the guard, and its metrics record."""
    nonlocal shards_record
    at, m, outer_norm = dispatched
    # Blocking on each step's small metrics (now or one step late) keeps the CPU collectives
    # healthy (NOTES.md) and lets the divergence guard stop before a bad state is saved.
    m = feed_lib.host(m)
    guard.check(at, m["loss"], m["param_norm"])
    out: dict[str, Any] = {}
    if outer_norm is not None:
      out["outer_delta_norm"] = feed_lib.host(outer_norm)
    if logged(at):  # Its tokens_per_s and step_s join it outside meter.timed().
      out.update(
        phase=(at - 1) // H,
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
  stop = total if config.stop_at_step < 0 else min(config.stop_at_step, total)
  try:  # On any stop, the last checkpoint's save (async) still completes.
    while step < stop:
      ckpt.check()  # A failed background save stops the run here (CheckpointSaveError).
      previous = None  # (step, record) of the step read while this one was queued.
      with meter.timed():  # step_s: the steps alone (tokens_per_s counts everything).
        batch = exp.put_batch(plan.train_it.next_batch())
        params, inner_opt, m = exp.inner_step(state.params, state.inner_opt, batch)
        state = state.replace(params=params, inner_opt=inner_opt, step=state.step + 1)
        step += 1
        outer_norm = None
        if step % H == 0 and exp.outer_enabled:
          store, outer_opt, params, om = exp.outer_step(
            state.store, state.outer_opt, state.params, plan.alpha_W
          )
          state = state.replace(store=store, outer_opt=outer_opt, params=params)
          outer_norm = om["delta_norm"]
        elif step % H == 0:
          state = state.replace(store=exp.sync_store(state.params))
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
        log.write(at, {**rec, **meter.rates(at)} if logged(at) else rec)
      if pending is None and logged(step):
        record.update(meter.rates(step))  # The write and save below fall in the next interval.
      if reshard:
        plan.reshard(step, state.params)
        record.update(plan.shard_record())
        if config.routing.restart_schedule:  # Paper Fig. 10: the cosine starts over.
          state = state.replace(inner_opt=inner_lib.restart_schedule(state.inner_opt))
      bar.update(1)
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
        # Routed: every validation token scored by the path its document was routed to.
        routed = float(np.sum(loss_sum_W) / np.sum(tokens_W)) if np.sum(tokens_W) else math.nan
        record.update(val_loss_routed=routed, val_perplexity_routed=float(np.exp(routed)))
        result = {
          "step": step,
          "val_loss": val.tolist(),
          "val_loss_mean": metrics_lib.nan_mean(val),
          "train_loss_mean": float(np.mean(m["loss"])),
        }
      if record:
        log.write(step, record)
        record = {}
      if step % ckpt_every == 0 or step == stop:
        if not bool(jax.device_get(exp.all_finite(state.params))):
          guard.not_finite(step)
        ckpt.save(step, state, plan.data_state(), best=best.saved() if best else None)
        guard.last_saved = step
  finally:
    bar.close()
    ckpt.close()
    log.close()
  return result
