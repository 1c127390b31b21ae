"""The README's main command after a non-editable install, run from an empty directory.

A wheel built from this checkout is installed into a folder of its own (no dependencies: the
test venv has them) and put first on PYTHONPATH; the command runs in an empty directory with
the environment a user's shell has (no JAX_PLATFORMS, XLA_FLAGS or TF_CPP_MIN_LOG_LEVEL from
the test setup), shortened to a seconds-long model and six steps. It checks what a newcomer
sees: exit 0, three lines about the run, the summary with the next commands, no error-level
native line (libtpu's E0000, TensorFlow's cuInit), a rerun that says in one line that the run
is complete, and the profiler window's trace under the workdir.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import helpers
from helpers import ROOT

# The README's quick start: the core install, then this command.
_README_COMMAND = re.compile(r"python -m dipaco_jax\.main --config=configs/tiny\.py --workdir=\S+")
# The small run's sizes, a sixteenth of the corpus, and the profiler window: step 3 traced into
# <workdir>/plugins/profile/<time>/.
_SMALL = [
  *helpers.SMALL_RUN,
  "--config.data.subsample=16",
  "--config.profile.start_step=3",
  "--config.profile.num_steps=1",
]
# Error-level lines: absl/glog E or F records (libtpu's E0000 ...), CUDA's start-up failure.
_ERROR_LINE = re.compile(r"^[EF]\d{4} |cuInit|Traceback \(most recent call last\)")
# absl's log records and progress-bar lines: what is not one of them is a message.
_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ |^inner steps:|^shards |^\S.*: *\d+%\|")
_TIMEOUT_S = 300


def _readme_command() -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    found = _README_COMMAND.search(f.read())
  assert found, "the README's quick start names no dipaco_jax.main command"
  argv = shlex.split(found.group(0))
  return [sys.executable, *argv[1:-1], "--workdir=run"]  # A relative workdir, as users type.


def _install(tmp_path) -> str:
  """The wheel of this checkout installed into its own folder (returned); no network."""
  src, dist, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
  src.mkdir()
  # Built from a copy: an in-tree build leaves build/ and *.egg-info in the clone.
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(os.path.join(ROOT, name), src)
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
  shutil.copytree(os.path.join(ROOT, "dipaco_jax"), src / "dipaco_jax", ignore=ignore)
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", "--no-input"]
  wheel = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
  subprocess.run([*wheel, str(src)], check=True, capture_output=True, timeout=_TIMEOUT_S)
  (whl,) = dist.glob("dipaco_jax-*.whl")
  install = [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(whl)]
  subprocess.run(install, check=True, capture_output=True, timeout=_TIMEOUT_S)
  return str(site)


def _messages(stderr: str) -> list[str]:
  return [l for l in stderr.splitlines() if l.strip() and not _RECORD.match(l)]


@pytest.mark.cli
@pytest.mark.slow
def test_the_readme_command_runs_from_a_wheel_in_an_empty_directory(tmp_path):
  site = _install(tmp_path)
  empty = tmp_path / "empty"
  empty.mkdir()
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")
  }
  env["PYTHONPATH"] = site  # Before the test venv's own (editable) dipaco_jax.

  def run(*argv):
    return subprocess.run(
      argv, cwd=empty, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )

  where = run(sys.executable, "-c", "import dipaco_jax; print(dipaco_jax.__file__)")
  assert where.stdout.startswith(site), where  # The wheel's package, not the checkout's.

  command = [*_readme_command(), *_SMALL]
  first = run(*command)
  assert first.returncode == 0, first.stderr[-3000:]
  errors = [l for l in first.stderr.splitlines() if _ERROR_LINE.search(l)]
  assert not errors, errors
  said = _messages(first.stderr)
  assert said[0].startswith("spmd: grid 1x2x2: 4 paths"), said
  assert "params per path" in said[1] and said[2].startswith("workdir run:"), said
  assert not any("level_groups" in l for l in said), "the config is config.json's, not stderr's"
  summary = said[said.index(next(l for l in said if l.startswith("Finished at step 6:"))) :]
  assert "routed validation perplexity" in summary[0], summary
  assert [l.split()[0] for l in summary[1:]] == [
    "checkpoints",
    "metrics",
    "TensorBoard",
    "evaluate",
    "serve",
  ], summary
  assert "tensorboard --logdir run" in summary[3]
  assert "python -m dipaco_jax.evaluate --workdir=run" in summary[4]
  workdir = empty / "run"
  assert (workdir / "config.json").is_file() and (workdir / "metrics.jsonl").is_file()
  traces = list(workdir.glob("plugins/profile/*/*.xplane.pb"))
  assert len(traces) == 1, sorted(p.relative_to(workdir) for p in workdir.rglob("*"))

  again = run(*command)
  assert again.returncode == 0, again.stderr[-3000:]
  lines = [l for l in again.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("run is complete at step 6"), lines
  assert "--config.dipaco.outer_steps" in lines[0]
