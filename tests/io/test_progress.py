"""progress: bars are whole lines when stderr is not a TTY, quiet for short steps, and ETAs."""

import re
import time

import jax
import numpy as np
import pytest

from dipaco_jax.config import sections
from dipaco_jax.io import progress
from dipaco_jax.routing import rerouting

import helpers


def _err_lines(capsys) -> list[str]:
  return [l for l in capsys.readouterr().err.split("\n") if l]


def test_a_log_gets_whole_lines_without_redraws(capsys, monkeypatch):
  monkeypatch.delenv("DIPACO_PROGRESS", raising=False)
  for _ in progress.bar(range(3), desc="steps", mininterval=0, delay=0, miniters=1):
    pass
  err = capsys.readouterr().err
  assert "\r" not in err and "\x1b" not in err
  lines = [l for l in err.split("\n") if l]
  # 0/3 at the start, one line per step, and the closing line (3/3 again).
  assert [re.search(r"\d+/3", l).group(0) for l in lines] == ["0/3", "1/3", "2/3", "3/3", "3/3"]
  assert all(l.startswith("steps: ") for l in lines), lines


def test_a_short_step_prints_nothing(capsys, monkeypatch):
  monkeypatch.delenv("DIPACO_PROGRESS", raising=False)
  for _ in progress.bar(range(1000), desc="quick"):  # Well under LOG_INTERVAL_S.
    pass
  assert _err_lines(capsys) == []


def test_dipaco_progress_0_turns_bars_off(capsys, monkeypatch):
  monkeypatch.setenv("DIPACO_PROGRESS", "0")
  for _ in progress.bar(range(3), desc="off", mininterval=0, delay=0):
    pass
  assert _err_lines(capsys) == []


def test_eta_reads_in_seconds_minutes_or_hours():
  assert progress.eta(42.4) == "42 s"
  assert progress.eta(210) == "3.5 min"  # 210 / 60.
  assert progress.eta(9000) == "2.5 h"  # 9000 / 3600.


def test_timer_skips_the_compile_and_averages_the_next_steps(monkeypatch):
  clock = iter([100.0, 106.0])  # Read after step 1 (compiled) and after step 4.
  monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
  t = progress.Timer(skip=1, n=3)
  assert [t.tick() for _ in range(5)] == [None, None, None, 2.0, None]  # (106 - 100) / 3.


@pytest.mark.slow  # Compiles a fine-tuning step: 3-25 s with the machine's load.
def test_the_transformer_rerouter_says_how_long_it_will_take(capsys):
  cfg = helpers.micro_config()
  from dipaco_jax.core import model as model_lib  # pylint: disable=g-import-not-at-top

  model_cfg = sections.ModelConfig.of(cfg)
  base = model_lib.init_params(model_cfg, jax.random.key(0))
  tokens = np.arange(4 * 8, dtype=np.int32).reshape(4, 8) % model_cfg.vocab_size
  labels, mask = np.zeros((4, 8), np.int32), np.ones((4, 8), bool)
  rerouting.TransformerRerouter(model_cfg, 2).fit(
    base, tokens, labels, mask, steps=5, lr=1e-3, batch_size=2
  )
  lines = [l for l in _err_lines(capsys) if "%|" not in l]  # Bars print on a slow machine.
  assert len(lines) == 2, lines
  assert lines[0].startswith("transformer re-router: fine-tuning θ̄ for 5 steps of 2 sequences")
  assert lines[1].startswith("transformer re-router: ") and lines[1].endswith(
    "s/step, about 0 s for the other 1 steps."
  ), lines
