"""setup.py: a shim whose setup() takes every piece of metadata from pyproject.toml."""

import os
import subprocess
import sys
import tomllib

from helpers import ROOT


def _project() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def test_setup_py_reads_the_name_version_and_requirements_of_pyproject(tmp_path):
  run = lambda *a: subprocess.run(
    [sys.executable, "setup.py", *a], cwd=ROOT, capture_output=True, text=True, check=True
  )
  project = _project()
  assert run("--name", "--version").stdout.split() == [project["name"], project["version"]]
  run("-q", "egg_info", f"--egg-base={tmp_path}")  # Written under tmp_path, not the checkout.
  (info,) = [p for p in tmp_path.iterdir() if p.name.endswith(".egg-info")]
  requires = (info / "requires.txt").read_text().split("\n\n")[0].split()
  # The core requirements, as pyproject lists them (comments and spaces aside).
  assert requires == [r.replace(" ", "") for r in project["dependencies"]]
  extras = {
    line[1:-1] for line in (info / "requires.txt").read_text().splitlines() if line[:1] == "["
  }
  assert extras == set(project["optional-dependencies"])
