"""constraints.txt pins what setup.py pulls in, at the versions installed where the tests run."""

import importlib.util
import os
import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

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


def test_the_cuda_extra_is_jax_own_and_left_out_of_the_pins():
  # No test host has a GPU, so the cuda extra's packages are not installed and not pinned; what
  # keeps its install consistent is jax's own cuda12 extra, which pins the plugin (and jaxlib) to
  # exactly the jax version constraints.txt pins.
  extras = freeze.setup_kwargs()["extras_require"]
  assert extras["cuda"] == ["jax[cuda12]"] and set(freeze.UNPINNED_EXTRAS) == {"cuda"}
  assert not set(extras["cuda"]) & set(freeze.setup_requirements())
  with open(freeze.CONSTRAINTS) as f:
    text = f.read()
  assert "# Not pinned: the `cuda` extra (jax[cuda12], for CUDA GPU hosts)." in text
  jax_version = re.search(r"^jax==(\S+)$", text, re.M).group(1)
  assert jax_version == metadata.version("jax")
  pins = {}
  for r in map(Requirement, metadata.requires("jax")):
    if r.marker and r.marker.evaluate({"extra": "cuda12"}) and not r.marker.evaluate({"extra": ""}):
      pins[r.name] = {(s.operator, s.version) for s in r.specifier}
  assert pins["jax-cuda12-plugin"] == pins["jaxlib"] == {("<=", jax_version), (">=", jax_version)}
