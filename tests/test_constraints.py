"""constraints.txt pins what setup.py pulls in, at the versions installed where the tests run."""

import importlib.util
import os
import re
import subprocess
import sys

from helpers import ROOT

_spec = importlib.util.spec_from_file_location(
  "freeze_constraints", os.path.join(ROOT, "tools", "freeze_constraints.py")
)
freeze = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(freeze)


def test_constraints_match_the_installed_versions():
  # CI installs with -c constraints.txt, so there this fails only when setup.py gained a
  # dependency that constraints.txt lacks; in a dev venv also when a package was upgraded.
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "tools", "freeze_constraints.py"), "--check"],
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr


def test_closure_follows_extras_and_leaves_out_build_tools():
  plain, tpu = freeze.closure(["jax"]), freeze.closure(["jax[tpu]"])
  assert "jaxlib" in plain and "libtpu" not in plain  # libtpu comes only with the tpu extra
  assert "libtpu" in tpu and set(plain) < set(tpu)
  assert not {"pip", "setuptools", "wheel"} & set(freeze.closure(freeze.setup_requirements()))


def test_python_requires_is_the_tested_python():
  with open(freeze.CONSTRAINTS) as f:
    tested = re.search(r"on Python (3\.\d+),", f.read()).group(1)
  with open(os.path.join(ROOT, "setup.py")) as f:
    assert f'python_requires=">={tested}"' in f.read()
