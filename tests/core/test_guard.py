"""The divergence guard's rules, on hand-chosen numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax.config import sections
from dipaco_jax.core import guard as guard_lib

LABELS = ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]
LN_V = math.log(8192)


def _guard(last_saved=None, H=100, **kw):
  cfg = sections.GuardConfig(**kw)
  guard = guard_lib.DivergenceGuard(
    cfg, vocab_size=8192, warmup_steps=2, inner_steps=H, labels=LABELS
  )
  if last_saved is not None:
    guard.saved(last_saved)
  # The embedding's norm dwarfs a block's, as in the real model (1024 vs ~10).
  guard.start_phase(0, {"embed": np.full(4, 1000.0), "block_0": np.full(4, 10.0)})
  return guard


def _norms(block_0=10.0, embed=1000.0):
  return {"embed": np.full(4, embed), "block_0": np.asarray(np.broadcast_to(block_0, 4), float)}


def _one_line(err: Exception) -> str:
  msg = str(err)
  assert "\n" not in msg and isinstance(err, errors.UserError), msg
  return msg


def test_a_non_finite_loss_stops_naming_step_and_path():
  guard = _guard(last_saved=6)
  guard.check(7, np.full(4, 5.0), _norms())
  with pytest.raises(guard_lib.NonFiniteLossError) as e:
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
  with pytest.raises(guard_lib.DivergenceError) as e:
    guard.check(2, np.full(4, 9.5), _norms(block_0=[10.0, 10.0, 1010.0, 10.0]))
  assert _one_line(e.value).startswith(
    "parameter norm of block_0 grew 101x since step 0 (to 1.01e+03) on paths ['0-1-0'] at "
    "step 2, over config.guard.max_param_norm_ratio=100: the run diverged; no checkpoint was "
    "saved. Lower config.inner.lr"
  )
  with pytest.raises(guard_lib.DivergenceError, match="norm of embed grew nan"):
    _guard().check(1, np.full(4, 9.5), _norms(embed=np.nan))
  _guard(max_param_norm_ratio=0.0).check(1, np.full(4, 9.5), _norms(block_0=1e9))


def test_a_loss_stuck_at_ln_v_after_warmup_stops():
  # warmup 2, window 3: the first window wholly after warmup is steps 3-5.
  guard = _guard(last_saved=4, stuck_steps=3)
  for step in range(1, 5):
    guard.check(step, np.full(4, LN_V + 1.0), _norms())
  with pytest.raises(guard_lib.DivergenceError) as e:
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
  guard = _guard(stuck_steps=3)
  for step in range(1, 5):
    guard.check(step, np.full(4, np.float32(LN_V)), _norms())
  with pytest.raises(guard_lib.DivergenceError, match="over steps 3-5 on paths"):
    guard.check(5, np.full(4, np.float32(LN_V)), _norms())
  # Below ln V by more than the margin on average: learning, however slowly.
  guard = _guard(stuck_steps=3)
  for step in range(1, 20):
    guard.check(step, np.full(4, LN_V - 2 * guard_lib.STUCK_MARGIN) + (step % 2) * 0.01, _norms())
  guard = _guard(stuck_steps=0)  # Off.
  for step in range(1, 20):
    guard.check(step, np.full(4, LN_V + 1.0), _norms())


def test_a_phase_is_held_against_the_norms_it_started_from():
  # H = 2. Phase 0 starts at block_0 norm 10; step 2 ends at 500 (50x: allowed). Phase 1
  # starts from 500 (the outer step's params), read lazily from device arrays: step 3 at
  # 1000 is 2x its start (though 100x step 0's); step 4 at 60,000 is 120x: it stops, naming
  # the phase's start, step 2.
  guard = _guard(H=2)
  guard.check(1, np.full(4, 9.0), _norms(block_0=20.0))
  guard.check(2, np.full(4, 9.0), _norms(block_0=500.0))
  guard.start_phase(1, {"embed": jnp.full(4, 1000.0), "block_0": jnp.full(4, 500.0)})
  guard.check(3, np.full(4, 9.0), _norms(block_0=1000.0))
  with pytest.raises(guard_lib.DivergenceError) as e:
    guard.check(4, np.full(4, 9.0), _norms(block_0=[500.0, 500.0, 500.0, 60000.0]))
  assert _one_line(e.value).startswith(
    "parameter norm of block_0 grew 120x since step 2 (to 6e+04) on paths ['0-1-1'] at step 4"
  )


def test_a_window_seeded_with_earlier_losses_fires_as_one_that_saw_them():
  # An elastic task of phase 1 (H = 2, window 3) seeds its guard with steps 1-2's losses: it
  # fires where a guard that saw them fires, at step 5 (steps 3-5: the first window wholly
  # after warmup, 2).
  a, b = _guard(H=2, stuck_steps=3), _guard(H=2, stuck_steps=3)
  stuck = np.full(4, LN_V + 1.0)
  for step in (1, 2):
    a.check(step, stuck, _norms())
  b.seed_losses([stuck, stuck])
  for guard in (a, b):
    guard.check(3, stuck, _norms())
    guard.check(4, stuck, _norms())
    with pytest.raises(guard_lib.DivergenceError, match="over steps 3-5 on paths"):
      guard.check(5, stuck, _norms())
