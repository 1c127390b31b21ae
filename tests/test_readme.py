"""The README's first two commands are the ones CI and newcomers run."""

import os

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
