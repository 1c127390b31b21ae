"""End to end on the embedded corpus: loss falls, resume is bit-exact, guards."""

import itertools
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from dipaco_jax import saved_config
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.core import flops
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.io import metrics
from dipaco_jax.io import theta as theta_lib
from dipaco_jax.runtime import spmd

import helpers

# Training runs on the embedded corpus, whose shards are tokenized first: minutes, outside the
# fast suite (-m "not slow").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
  """Shards for 4 workers, written once for every test here."""
  return str(tmp_path_factory.mktemp("shards"))


def _config(shard_dir, **kw):
  over = {"model.vocab_size": 8192, "data.shard_dir": shard_dir}
  over.update(kw)
  return helpers.micro_config(**over)


def _params(workdir, cfg):
  exp = experiment.Experiment(cfg)
  state, data_state = checkpoint.Checkpointer(workdir).restore(exp.abstract_state)
  return jax.tree.map(np.asarray, state), data_state


def test_short_run_loss_falls(tmp_path, shard_dir, monkeypatch):
  write = metrics.MetricsLogger.write

  def slow_write(self, step, record):  # Each record's write takes >= 0.2 s.
    time.sleep(0.2)
    write(self, step, record)

  monkeypatch.setattr(metrics.MetricsLogger, "write", slow_write)
  # A CPU has no entry in the peak table (no perf/mfu); a pretend one of 2 TFLOP/s gives it.
  assert flops.peak_tflops(jax.devices()[0].device_kind, "float32") is None
  monkeypatch.setattr(spmd.flops_lib, "peak_tflops", lambda kind, dtype: 2.0)
  cfg = _config(
    shard_dir,
    **{
      "dipaco.inner_steps": 10,
      "dipaco.outer_steps": 3,
      "inner.lr": 1e-2,
      "inner.warmup_steps": 5,
      "ckpt.every_steps": 10,
      "eval.every_steps": 10,
      "log_every_steps": 5,
    },
  )
  out = train.train_and_evaluate(cfg, str(tmp_path))
  lines = metrics.read_records(tmp_path)
  vals = [l["val_loss_mean"] for l in lines if "val_loss_mean" in l]
  assert len(vals) == 3 and vals[-1] < vals[0] - 0.3, vals
  assert out["step"] == 30
  outer = [l for l in lines if "outer_delta_norm" in l]
  assert len(outer) == 3
  assert len(outer[0]["outer_delta_norm"]["level_1"]) == 2
  assert len(lines[0]["train_loss"]) == 4
  # The first record gives the shards' sizes; early stopping reads its held-out slices.
  assert lines[0]["shards/phase"] == 0 and lines[0]["shards/tokens_min"] > 0
  assert all(len(l["heldout_loss"]) == 4 for l in lines if "val_loss" in l)
  # Routed, all tokens: each path's tokens scored by that path; equal token counts per path here.
  # Named apart from evaluate's routed perplexity (prefix excluded): no record has the bare name.
  for l in lines:
    assert "val_perplexity_routed" not in l and "val_loss_routed" not in l
    if "val_loss" in l:
      assert l["val_loss_routed_all_tokens"] == pytest.approx(np.mean(l["val_loss"]), rel=1e-5)
      assert l["val_perplexity_routed_all_tokens"] == pytest.approx(
        math.exp(l["val_loss_routed_all_tokens"])
      )
  assert out["val_perplexity_routed_all_tokens"] == lines[-1]["val_perplexity_routed_all_tokens"]
  # tokens_per_s counts the previous record's write (>= 0.2 s); step_s leaves it out.
  timed = [l for l in lines if "tokens_per_s" in l]
  assert [l["step"] for l in timed] == [5, 10, 15, 20, 25, 30]
  for prev, l in zip(timed, timed[1:]):
    steps = l["step"] - prev["step"]
    wall = 4 * 2 * 16 * steps / l["tokens_per_s"]  # W x batch x seq_len tokens per step.
    assert wall - l["step_s"] * steps >= 0.2, (prev, l)
  assert all(l["mfu"] == pytest.approx(l["tflops_per_device"] / 2.0) for l in timed)
  # TensorBoard: a scalar per path and per module.
  tags = {v.tag for e in helpers.events(tmp_path) for v in e.summary.value}
  assert {
    "train/loss/path_0-1-0",
    "val/loss/path_0-1-1",
    "val/perplexity_routed_all_tokens",
  } <= tags
  assert {
    "train/learning_rate",
    "perf/per_device_tflops_per_sec",
    "perf/mfu",
    "train/param_norm/embed/mean",
  } <= tags
  assert {"outer/delta_norm/level_0/module_0", "outer/delta_norm/level_2/module_1"} <= tags


# Mid-phase, and at a phase boundary with Muon's state (inner.optimizer="muon") to restore.
@pytest.mark.parametrize("stop_at,optimizer", [(3, "adamw"), (4, "muon")])
def test_resume_is_bit_exact(tmp_path, shard_dir, stop_at, optimizer):
  kw = {"dipaco.inner_steps": 2, "dipaco.outer_steps": 3, "inner.optimizer": optimizer}
  train.train_and_evaluate(_config(shard_dir, **kw), str(tmp_path / "full"))
  part = str(tmp_path / "part")
  train.train_and_evaluate(_config(shard_dir, stop_at_step=stop_at, **kw), part)
  assert checkpoint.Checkpointer(part).latest_step() == stop_at
  train.train_and_evaluate(_config(shard_dir, **kw), part)  # resumes
  a, da = _params(str(tmp_path / "full"), _config(shard_dir, **kw))
  b, db = _params(part, _config(shard_dir, **kw))
  assert int(b.step) == 6 and da == db
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  # metrics.jsonl reads as one run: no step logged twice.
  steps = [json.loads(l)["step"] for l in open(os.path.join(part, "metrics.jsonl"))]
  assert steps == sorted(set(steps))


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path, shard_dir):
  cfg = _config(
    shard_dir,
    **{
      "dipaco.inner_steps": 2,
      "dipaco.outer_steps": 3,
      "ckpt.every_steps": 2,
      "inner.lr": 1e9,
      "inner.warmup_steps": 0,
      "inner.clip_norm": 0.0,
      "guard.max_param_norm_ratio": 0.0,
    },
  )  # The NaN rule alone.
  with pytest.raises(guard_lib.NonFiniteLossError, match="non-finite"):
    train.train_and_evaluate(cfg, str(tmp_path))
  last = checkpoint.Checkpointer(str(tmp_path)).latest_step()
  if last is not None:
    state, _ = _params(str(tmp_path), cfg)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def _trace(monkeypatch, events: list, bad_step: int | None = None) -> None:
  """Logs ("dispatch", n) per inner step and ("check", n) per guard check into `events`.

  At inner step `bad_step` the step's params and losses turn NaN, on device.
  """

  class Traced(experiment.Experiment):
    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      step_fn, calls = self.inner_step, itertools.count(1)

      def inner_step(params, opt, batch):
        n = next(calls)
        events.append(("dispatch", n))
        params, opt, m = step_fn(params, opt, batch)
        if n == bad_step:
          params = jax.tree.map(lambda x: x * jnp.nan, params)
          m = {**m, "loss": m["loss"] * jnp.nan}
        return params, opt, m

      self.inner_step = inner_step

  check = guard_lib.DivergenceGuard.check

  def traced_check(self, step, *args):
    events.append(("check", step))
    return check(self, step, *args)

  monkeypatch.setattr(spmd.exp_lib, "Experiment", Traced)
  monkeypatch.setattr(guard_lib.DivergenceGuard, "check", traced_check)


# Wall-clock numbers: they differ between two runs of the same steps.
_TIMED = ("tokens_per_s", "step_s", "tflops_per_device", "mfu")


def _untimed(records):
  return [{k: v for k, v in r.items() if k not in _TIMED} for r in records]


def test_dispatch_ahead_reads_each_step_after_the_next_and_changes_nothing(
  tmp_path, shard_dir, monkeypatch
):
  # H = 3, 2 outer steps; evaluation at 3 and 6, checkpoints at 4 and 6: the loop waits there.
  kw = {
    "dipaco.inner_steps": 3,
    "dipaco.outer_steps": 2,
    "eval.every_steps": 3,
    "ckpt.every_steps": 4,
    "log_every_steps": 1,
  }
  events = {"off": [], "on": []}
  for mode in events:
    with monkeypatch.context() as m, helpers.compile_cache(tmp_path / "jax_cache"):
      _trace(m, events[mode])
      train.train_and_evaluate(_config(shard_dir, dispatch_ahead=mode, **kw), str(tmp_path / mode))
  d, c = "dispatch", "check"
  assert events["off"] == [e for n in range(1, 7) for e in ((d, n), (c, n))]
  assert events["on"] == [
    (d, 1), (d, 2), (c, 1), (d, 3), (c, 2), (c, 3),  # Step 3 is read before its evaluation,
    (d, 4), (c, 4),  # step 4 before its checkpoint,
    (d, 5), (d, 6), (c, 5), (c, 6),  # and step 5 while step 6 is queued.
  ]  # fmt: skip
  a, da = _params(str(tmp_path / "off"), _config(shard_dir, **kw))
  b, db = _params(str(tmp_path / "on"), _config(shard_dir, **kw))
  assert int(b.step) == 6 and da == db
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  off, on = metrics.read_records(tmp_path / "off"), metrics.read_records(tmp_path / "on")
  assert [r["step"] for r in on] == [1, 2, 3, 4, 5, 6]
  assert "outer_delta_norm" in on[2] and "val_loss" in on[5] and "step_s" in on[4]
  assert _untimed(on) == _untimed(off)


@pytest.mark.parametrize("bad_step", [3, 4])  # mid-phase, and a checkpoint (and outer) step
def test_dispatch_ahead_never_saves_past_a_nan(tmp_path, shard_dir, monkeypatch, bad_step):
  # Evaluation only at the end: the checkpoint at step 4 alone makes the loop wait.
  kw = {
    "dipaco.inner_steps": 2,
    "dipaco.outer_steps": 3,
    "ckpt.every_steps": 2,
    "eval.every_steps": 6,
  }
  errors, events = {}, {"off": [], "on": []}
  for mode in events:
    workdir = str(tmp_path / mode)
    with monkeypatch.context() as m, helpers.compile_cache(tmp_path / "jax_cache"):
      _trace(m, events[mode], bad_step)
      with pytest.raises(guard_lib.NonFiniteLossError) as e:
        train.train_and_evaluate(_config(shard_dir, dispatch_ahead=mode, **kw), workdir)
    errors[mode] = str(e.value)
    assert checkpoint.Checkpointer(workdir).latest_step() == 2
    state, _ = _params(workdir, _config(shard_dir, **kw))
    assert int(state.step) == 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))
  assert errors["on"] == errors["off"]
  assert errors["on"].startswith(f"non-finite training loss at step {bad_step} on paths ")
  assert "the last checkpoint, step 2, is kept and nothing later was saved" in errors["on"]
  # Ahead, a mid-phase NaN shows one step late; a checkpoint step waits for its own check.
  d, c = "dispatch", "check"
  late = {3: [(d, 3), (d, 4), (c, 3)], 4: [(d, 4), (c, 3), (c, 4)]}[bad_step]
  assert events["on"][-3:] == late
  assert events["off"][-3:] == [(c, bad_step - 1), (d, bad_step), (c, bad_step)]


def test_an_exploding_run_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path, shard_dir):
  # issue #11: inner.lr=1e6 once ran to the end with params at ~1e13 and the loss at ln V.
  kw = {"dipaco.inner_steps": 2, "dipaco.outer_steps": 3}
  workdir = str(tmp_path)
  train.train_and_evaluate(_config(shard_dir, stop_at_step=2, **kw), workdir)
  ckpts = os.path.join(workdir, "checkpoints")
  before = helpers.tree_bytes(ckpts)
  with pytest.raises(guard_lib.DivergenceError) as e:
    train.train_and_evaluate(_config(shard_dir, **{"inner.lr": 1e6, **kw}), workdir)
  msg = str(e.value)
  assert "\n" not in msg, msg
  assert re.fullmatch(
    r"parameter norm of \w+ grew [0-9.e+]+x since step 2 \(to [0-9.e+]+\) on paths \[.+\] at "
    r"step 3, over config.guard.max_param_norm_ratio=100: the run diverged; the last "
    r"checkpoint, step 2, is kept and nothing later was saved. Lower config.inner.lr, .+\.",
    msg,
  ), msg
  assert helpers.tree_bytes(ckpts) == before
  assert checkpoint.Checkpointer(workdir).latest_step() == 2


def test_resuming_with_another_grid_is_refused(tmp_path, shard_dir):
  cfg = _config(shard_dir, **{"dipaco.inner_steps": 1, "dipaco.outer_steps": 1})
  train.train_and_evaluate(cfg, str(tmp_path))
  other = _config(
    shard_dir,
    **{"dipaco.inner_steps": 1, "dipaco.outer_steps": 1, "dipaco.modules_per_level": (1, 4, 1)},
  )
  with pytest.raises(ValueError, match=r"\(dipaco.modules_per_level: \[1, 2, 2\] -> \[1, 4, 1\]\)"):
    train.train_and_evaluate(other, str(tmp_path))
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 1


def test_a_field_added_since_the_run_started_reads_as_its_default(tmp_path):
  # A config.json written before model.mlp existed: the run used GELU, today's default.
  cfg = helpers.micro_config()
  saved_config.write(epath.Path(tmp_path), cfg)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["model"]["mlp"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  resume = dict(started=True, may_grow=True)
  saved_config.check_matches(epath.Path(tmp_path), cfg, **resume)  # Resumes.
  with pytest.raises(
    ValueError, match=r"does not fit this config \(model.mlp: 'gelu' -> 'swiglu'\)"
  ):
    saved_config.check_matches(
      epath.Path(tmp_path), helpers.micro_config(**{"model.mlp": "swiglu"}), **resume
    )


def test_init_from_dense_checkpoint_forks_every_module(tmp_path, shard_dir):
  # A dense run (one path, no outer step), then a 2x2 grid forked from it:
  # every module of every level starts as the dense model's params (θ̄).
  dense = _config(
    shard_dir,
    **{
      "dipaco.level_groups": ("embed,block_0-1,head",),
      "dipaco.modules_per_level": (1,),
      "outer.enabled": False,
      "dipaco.inner_steps": 2,
      "dipaco.outer_steps": 1,
      "data.batch_size": 4,  # One worker: the 4 devices go to 'data'.
      "data.shard_dir": str(tmp_path / "dense_shards"),
    },
  )
  train.train_and_evaluate(dense, str(tmp_path / "dense"))
  theta = checkpoint.restore_worker_params(str(tmp_path / "dense"))
  cfg = _config(shard_dir, **{"dipaco.init_from": str(tmp_path / "dense")})
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0, theta)
  for g in ("embed", "block_0", "block_1", "head"):
    for x_W, x in zip(jax.tree.leaves(state.params[g]), jax.tree.leaves(theta[g])):
      for w in range(4):
        np.testing.assert_array_equal(np.asarray(x_W[w]), x)
  # The trainer takes that route for a new workdir.
  got = theta_lib.initial(cfg.dipaco.init_from, exp.recipe.abstract_params())
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(theta), strict=True):
    np.testing.assert_array_equal(x, y)
  # A grid whose attention kernels are matrices (model.attention_kernels) reads the same θ̄,
  # each [D, H, K] / [H, K, D] kernel reshaped to [D, H K] / [H K, D].
  matrix = _config(
    shard_dir,
    **{"dipaco.init_from": str(tmp_path / "dense"), "model.attention_kernels": "matrix"},
  )
  abstract = experiment.Experiment(matrix).recipe.abstract_params()
  got = theta_lib.initial(matrix.dipaco.init_from, abstract)
  q = theta["block_0"]["attn"]["query"]["kernel"]
  assert got["block_0"]["attn"]["query"]["kernel"].shape == (q.shape[0], q.shape[1] * q.shape[2])
  for x, y, a in zip(jax.tree.leaves(got), jax.tree.leaves(theta), jax.tree.leaves(abstract)):
    assert x.shape == a.shape
    np.testing.assert_array_equal(x, np.reshape(y, a.shape))
