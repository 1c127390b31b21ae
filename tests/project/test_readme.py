"""The README's first two commands are the ones CI and newcomers run; its tiny-run figures hold."""

import os
import re

import numpy as np
import pytest

from dipaco_jax.io import metrics

import helpers
from helpers import ROOT


def _readme_commands():
  with open(os.path.join(ROOT, "README.md")) as f:
    lines = f.read().splitlines()
  return [l.strip() for l in lines[:40] if l.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
  run_cmd, test_cmd = _readme_commands()[:2]
  assert "dipaco_jax.main --config=configs/tiny.py" in run_cmd
  assert "pytest" in test_cmd
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci_lines = [l.strip() for l in f if l.strip() and not l.startswith("#")]
  assert test_cmd in ci_lines


# The README's measured figures of configs/tiny.py ("Measured here"), from its latest rerun: the
# mean validation loss on each path's own shard at these inner steps, then the trainer's routed
# perplexity over all tokens at step 500.
_TINY_RERUN = re.compile(
  r"latest rerun read ((?:\d+\.\d+\s*→\s*)+\d+\.\d+) and (\d+\.\d+) over all tokens"
)
_TINY_STEPS = (50, 100, 200, 300, 400, 500)
_LOSS_TOL = 0.015  # Written to 2 decimals; the run is deterministic on one machine.
_PPL_RTOL = 0.005


def readme_tiny_figures() -> tuple[dict[int, float], float]:
  """The README's tiny-run losses by step and its routed perplexity at the last step."""
  with open(os.path.join(ROOT, "README.md")) as f:
    m = _TINY_RERUN.search(" ".join(f.read().split()))
  assert m, "the README's tiny-run figures moved: update _TINY_RERUN"
  losses = [float(x) for x in m.group(1).split("→")]
  assert len(losses) == len(_TINY_STEPS), (losses, _TINY_STEPS)
  return dict(zip(_TINY_STEPS, losses)), float(m.group(2))


def tiny_run_drift(workdir: str) -> list[str]:
  """Each README figure of the tiny run that `workdir`'s metrics.jsonl does not reproduce.

  A run stopped early (config.stop_at_step) is held to the figures of the steps it reached.
  """
  losses, ppl = readme_tiny_figures()
  evals = {r["step"]: r for r in metrics.read_records(workdir) if "val_loss" in r}
  drift = []
  for step, want in losses.items():
    if step not in evals:
      continue
    got = float(np.mean(evals[step]["val_loss"]))
    if abs(got - want) > _LOSS_TOL:
      drift.append(f"val loss at step {step}: README {want}, measured {got:.4f}")
  if _TINY_STEPS[-1] in evals:
    got = evals[_TINY_STEPS[-1]]["val_perplexity_routed_all_tokens"]
    if abs(got - ppl) > _PPL_RTOL * ppl:
      drift.append(f"routed perplexity over all tokens: README {ppl}, measured {got:.1f}")
  return drift


def test_the_readme_states_the_tiny_runs_figures():
  losses, ppl = readme_tiny_figures()
  assert list(losses) == list(_TINY_STEPS) and ppl > 1


# The README's first command as it stands, stopped after step 100 (a fifth of its 5 minutes on
# an idle 2-core CPU, for CI's budget): the run is deterministic and stopping changes no step,
# so a change to what the command runs moves its first figures too. The steps 200-500 are
# re-measured with the whole run (`tiny_run_drift` on its workdir) when the README is updated.
@pytest.mark.cli
@pytest.mark.slow
def test_the_tiny_run_measures_the_readmes_figures(tmp_path):
  workdir = str(tmp_path / "tiny")
  helpers.train_tiny(workdir, "--config.stop_at_step=100")
  evals = [r["step"] for r in metrics.read_records(workdir) if "val_loss" in r]
  assert evals == [50, 100], evals
  assert tiny_run_drift(workdir) == [], "README.md's tiny-run figures drifted: re-measure them"
