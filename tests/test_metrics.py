"""The divergence guard's three rules, on numbers chosen by hand; metrics.nan_mean."""

import math

import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax import metrics

import helpers

LABELS = ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]
LN_V = math.log(8192)


def _guard(last_saved=None, **kw):
  cfg = helpers.micro_config(**{"model.vocab_size": 8192, "inner.warmup_steps": 2, **kw})
  # The embedding's norm dwarfs a block's, as in the real model (1024 vs ~10).
  norms0 = {"embed": np.full(4, 1000.0), "block_0": np.full(4, 10.0)}
  return metrics.DivergenceGuard(cfg, LABELS, norms0, last_saved=last_saved)


def _norms(block_0=10.0, embed=1000.0):
  return {"embed": np.full(4, embed), "block_0": np.asarray(np.broadcast_to(block_0, 4), float)}


def _one_line(err: Exception) -> str:
  msg = str(err)
  assert "\n" not in msg and isinstance(err, errors.UserError), msg
  return msg


def test_nan_mean_skips_nan():
  assert metrics.nan_mean([1.0, np.nan, 3.0]) == 2.0
  assert math.isnan(metrics.nan_mean([np.nan, np.nan]))


def test_a_non_finite_loss_stops_naming_step_and_path():
  guard = _guard(last_saved=6)
  guard.check(7, np.full(4, 5.0), _norms())
  with pytest.raises(metrics.NonFiniteLossError) as e:
    guard.check(8, np.array([5.0, np.inf, 5.0, np.nan]), _norms())
  assert _one_line(e.value) == (
    "non-finite training loss at step 8 on paths ['0-0-1', '0-1-1']: the run diverged; the "
    "last checkpoint, step 6, is kept and nothing later was saved. Lower config.inner.lr, "
    "raise config.inner.warmup_steps or set config.inner.clip_norm, then rerun the same "
    "command to resume."
  )


def test_one_groups_norm_exploding_stops_though_the_global_norm_barely_moves():
  guard = _guard(last_saved=None)
  guard.check(1, np.full(4, 9.5), _norms(block_0=[10.0, 10.0, 1000.0, 10.0]))  # 100x: allowed.
  # Block 0 of worker 2 grows 101x; the global norm grows only sqrt(1000² + 1010²) / 1000 ≈ 1.4x.
  with pytest.raises(metrics.DivergenceError) as e:
    guard.check(2, np.full(4, 9.5), _norms(block_0=[10.0, 10.0, 1010.0, 10.0]))
  assert _one_line(e.value).startswith(
    "parameter norm of block_0 grew 101x since step 0 (to 1.01e+03) on paths ['0-1-0'] at "
    "step 2, over config.guard.max_param_norm_ratio=100: the run diverged; no checkpoint was "
    "saved. Lower config.inner.lr"
  )
  with pytest.raises(metrics.DivergenceError, match="norm of embed grew nan"):
    _guard().check(1, np.full(4, 9.5), _norms(embed=np.nan))
  _guard(**{"guard.max_param_norm_ratio": 0.0}).check(1, np.full(4, 9.5), _norms(block_0=1e9))


def test_a_loss_stuck_at_ln_v_after_warmup_stops():
  # warmup 2, window 3: the first window wholly after warmup is steps 3-5.
  guard = _guard(last_saved=4, **{"guard.stuck_steps": 3})
  for step in range(1, 5):
    guard.check(step, np.full(4, LN_V + 1.0), _norms())
  with pytest.raises(metrics.DivergenceError) as e:
    guard.check(5, np.array([LN_V - 3.0, LN_V, LN_V + 1.0, LN_V - 3.0]), _norms())
  # Means over steps 3-5: ln V - 1/3, ln V + 2/3, ln V + 1, ln V - 1/3.
  assert _one_line(e.value) == (
    f"training loss stayed at or above ln V = {LN_V:.3f} (uniform prediction; mean "
    f"{LN_V + 1.0:.3f}) over steps 3-5 on paths ['0-0-1', '0-1-0'], after warmup: the run "
    "diverged; the last checkpoint, step 4, is kept and nothing later was saved. Check "
    "config.inner.lr (too high blows the model up, too low never leaves ln V) and start "
    "again in a new --workdir, or raise config.guard.stuck_steps."
  )
  # What inner.lr=1e6 gave: a uniform prediction, ln V rounded to float32 (just below ln V).
  guard = _guard(**{"guard.stuck_steps": 3})
  for step in range(1, 5):
    guard.check(step, np.full(4, np.float32(LN_V)), _norms())
  with pytest.raises(metrics.DivergenceError, match="over steps 3-5 on paths"):
    guard.check(5, np.full(4, np.float32(LN_V)), _norms())
  # Below ln V by more than the margin on average: learning, however slowly.
  guard = _guard(**{"guard.stuck_steps": 3})
  for step in range(1, 20):
    guard.check(step, np.full(4, LN_V - 2 * metrics.STUCK_MARGIN) + (step % 2) * 0.01, _norms())
  guard = _guard(**{"guard.stuck_steps": 0})  # Off.
  for step in range(1, 20):
    guard.check(step, np.full(4, LN_V + 1.0), _norms())
