"""Values each field's rule accepts that do not fit what other fields derive: one line each.

tools/config_sweep.py takes every declared field to its edge values (alone, and size
fields in pairs) through validation, the recipe on the mesh and the inner step's
shapes; every traceback it found is a case here, refused by config_check.validate in
one line before anything runs. The validation stage of the sweep runs here too, over
every field's edge values: a ConfigError or nothing, never another exception.
"""

import importlib.util
import os

import numpy as np
import pytest

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax.config import schema
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.core import recipe as recipe_lib

import helpers
from failure_rows import Row


def _sweep():
  path = os.path.join(helpers.ROOT, "tools", "config_sweep.py")
  spec = importlib.util.spec_from_file_location("config_sweep", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# (fields over the sweep's base config, the one line's start): what reached a traceback.
DERIVED = [
  (
    {"dipaco.paths": ("a-b",)},
    "TopologyError: config.dipaco.paths has path 'a-b': write each path as its module ids, one "
    "per level, joined by '-' (e.g. '0-1').",
  ),
  (
    {"mesh.num_slices": 2},
    "MeshError: config.mesh.num_slices=2 but the 4 cpu devices form 1 slice(s): set "
    "num_slices=1, or 0 to take it from the devices.",
  ),
  (
    {"model.mlp_ratio": 1e-9},
    "ConfigError: config.model.mlp_ratio=1e-09 gives an MLP of width int(d_model x mlp_ratio) = "
    "0 at model.d_model=32: raise mlp_ratio to at least 0.0312.",
  ),
]


@pytest.mark.parametrize("over,line", DERIVED, ids=[str(o) for o, _ in DERIVED])
def test_a_derived_size_that_cannot_work_is_one_line(over, line):
  """Refused by validation, or where the mesh is built (before anything is written)."""
  assert _sweep().run({**over, "model.vocab_size": 8192}) == ("refused", line)


def test_muon_diverging_names_muon_lr_in_its_fix():
  cfg = helpers.micro_config(**{"inner.optimizer": "muon", "inner.muon_lr": 1e9})
  guard = recipe_lib.Recipe.from_config(cfg).guard(["path 0"])
  with pytest.raises(guard_lib.NonFiniteLossError) as e:
    guard.check(1, np.array([np.nan]), {})
  assert "Lower config.inner.lr (AdamW's leaves) or config.inner.muon_lr (Muon's), raise " in str(
    e.value
  )
  adamw = recipe_lib.Recipe.from_config(helpers.micro_config()).guard(["path 0"])
  with pytest.raises(guard_lib.NonFiniteLossError, match="Lower config.inner.lr, raise"):
    adamw.check(1, np.array([np.nan]), {})


def test_every_edge_value_of_every_field_validates_or_is_refused_in_one_line():
  sweep = _sweep()
  fields = {k: f for k, f in schema.declared().items() if k not in sweep.SKIP}
  tried = 0
  for key, f in fields.items():
    for value in sweep.candidates(key, f):
      try:
        config = sweep._config({key: value, "model.vocab_size": 8192})  # pylint: disable=protected-access
        config_check.validate(config, for_run=False)
      except Exception as e:  # pylint: disable=broad-except
        assert errors.is_user_error(e), (key, value, e)
        assert "\n" not in str(e), (key, value, e)
      tried += 1
  assert tried > 300


# The rows this file adds to docs/failures.md (tests/project/test_failure_table.py).
TABLE = [
  Row(
    f"--config.{k}={v!r} (the sweep: a traceback before)",
    "every command",
    line,
    1,
    "nothing written: refused by validation",
    "tests/config/test_config_derived.py",
  )
  for over, line in DERIVED
  for k, v in over.items()
] + [
  Row(
    "--config.inner.optimizer=muon --config.inner.muon_lr=1e9 (diverges)",
    "main",
    "NonFiniteLossError: non-finite training loss at step 1 on paths […]: the run diverged; … "
    "Lower config.inner.lr (AdamW's leaves) or config.inner.muon_lr (Muon's), raise "
    "config.inner.warmup_steps or set config.inner.clip_norm, then rerun the same command to "
    "resume.",
    1,
    "the last checkpoint; nothing later is saved",
    "tests/config/test_config_derived.py",
  ),
]
