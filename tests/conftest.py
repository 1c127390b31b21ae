"""Test setup: 4 fake CPU devices so meshes with a 'path' axis exist.

tests/ mirrors the package (core/, io/, runtime/, routing/, data/, ...); the shared
helpers beside this file (helpers.py, routing_testlib.py, outer_oracle.py,
failure_rows.py) import as top-level modules from every subfolder, and so does every
test file (its name is unique across the folders): a file may use another's cases.
"""

import atexit
import os
import shutil
import sys
import tempfile

# The shared helpers and the test files, whichever folder a test sits in (and under any
# --import-mode): docs/failures.md's table reads every file's cases, and a file may reuse
# another's (test_failures.message_lines, test_damaged_files's damage).
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(
  d
  for d, _, files in os.walk(_TESTS)
  if d != _TESTS and any(f.startswith("test_") and f.endswith(".py") for f in files)
)

# Must happen before jax is imported anywhere in the test process.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Tests run on CPU devices. With libtpu installed (the test extra, for
# test_aot.py) jax would otherwise try to start a TPU backend in every process;
# compiling for a described TPU topology works without it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, this process's and its children's (the CLI
# runs): the tests compile the same tiny programs many times over (2.4x faster on
# tests/runtime/test_workdir.py). Cold at each session start, so no entry outlives its code.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JAX_CACHE = tempfile.mkdtemp(prefix="dipaco_tests_jax_cache_")
  atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import pytest

from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import model as model_lib
from dipaco_jax.routing import features

import helpers


@pytest.fixture(autouse=True)
def _own_shard_cache(tmp_path_factory, monkeypatch):
  """Each test (and its subprocesses) gets an empty shard cache: no test reuses another's shards."""
  monkeypatch.setenv("DIPACO_CACHE_DIR", str(tmp_path_factory.mktemp("dipaco_cache")))


@pytest.fixture(scope="session")
def micro_extractor():
  """θ̄'s 5-token prefix features on micro_config's model, built once for every test file."""
  cfg = helpers.micro_config()
  params = model_lib.init_params(sections.ModelConfig.of(cfg), jax.random.key(0))
  return features.FeatureExtractor(sections.ModelConfig.of(cfg), params, prefix_len=5, batch_size=4)


@pytest.fixture
def micro(micro_extractor):
  """A fresh micro_config (tests may change it) and the shared prefix extractor."""
  return helpers.micro_config(), micro_extractor


@pytest.fixture(scope="session")
def independent():
  """A micro run whose modules each have their own random init, so paths differ: (exp, state)."""
  exp = experiment.Experiment(helpers.micro_config(**{"dipaco.init": "independent"}))
  return exp, exp.init_state(0)
