"""What a run checks of its workdir before it writes.

θ̄'s source is checked first, an earlier attempt that saved nothing is set aside, a
resume under another config is refused naming the fields, a longer run resumes.
"""

import json
import os

import jax
import numpy as np
import pytest
from etils import epath

from dipaco_jax import errors
from dipaco_jax import saved_config
from dipaco_jax import train
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime.elastic import storage

import helpers

# Training runs on the embedded corpus (micro model, 2-4 inner steps each): outside the fast suite.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("shards"))


def _config(shard_dir, **kw):
  return helpers.micro_config(**{"model.vocab_size": 8192, "data.shard_dir": shard_dir, **kw})


@pytest.fixture(scope="module")
def dense(shard_dir, tmp_path_factory):
  """A finished run of the micro model (its checkpoints are a θ̄ source)."""
  workdir = str(tmp_path_factory.mktemp("dense"))
  train.train_and_evaluate(_config(shard_dir), workdir)
  return workdir


def _untouched(workdir) -> bool:
  return not os.path.exists(workdir) or not os.listdir(workdir)


@pytest.mark.parametrize(
  "source,match",
  [
    ("{dense}/checkpoints/2", r"names a checkpoint folder, not a run: give the run's workdir "),
    ("{dense}/checkpoints", r"names a checkpoint folder, not a run"),
    ("{tmp}", r"holds no finished checkpoint"),
    ("{tmp}/missing", r"does not exist"),
  ],
)
def test_a_wrong_theta_source_is_refused_before_anything_is_written(
  source, match, dense, shard_dir, tmp_path
):
  src = source.format(dense=dense, tmp=tmp_path)
  workdir = str(tmp_path / "run")
  with pytest.raises(errors.ConfigError, match=f"config.dipaco.init_from=.*{match}") as e:
    train.train_and_evaluate(_config(shard_dir, **{"dipaco.init_from": src}), workdir)
  assert "\n" not in str(e.value)
  assert _untouched(workdir)


def test_theta_of_another_model_is_refused_naming_a_leaf(dense, shard_dir, tmp_path):
  workdir = str(tmp_path / "run")
  cfg = _config(shard_dir, **{"dipaco.init_from": dense, "model.d_model": 48})
  with pytest.raises(errors.ConfigError, match=r"holds params of another model: \['block_0'\]"):
    train.train_and_evaluate(cfg, workdir)
  assert _untouched(workdir)


@pytest.mark.cli
def test_an_earlier_attempt_that_saved_nothing_never_blocks_the_corrected_command(
  shard_dir, tmp_path
):
  workdir = tmp_path / "run"
  # A first attempt that diverges at step 1, before its first checkpoint (every 4 steps).
  first = _config(shard_dir, **{"inner.lr": 1e6, "ckpt.every_steps": 4})
  with pytest.raises(guard_lib.DivergenceError):
    train.train_and_evaluate(first, str(workdir))
  written = helpers.tree_bytes(workdir)
  assert "config.json" in written and not checkpoint.steps(str(workdir))
  # The corrected command, another config: it runs; the attempt's files are set aside whole.
  fixed = _config(shard_dir, **{"ckpt.every_steps": 4, "dipaco.inner_steps": 1})
  train.train_and_evaluate(fixed, str(workdir))
  assert checkpoint.steps(str(workdir)) == [2]
  assert helpers.tree_bytes(workdir / "earlier_attempt_1") == written
  assert json.loads((workdir / "config.json").read_text())["dipaco"]["inner_steps"] == 1


def test_a_resume_under_another_config_is_refused_by_field(shard_dir, tmp_path):
  cfg = _config(shard_dir)
  train.train_and_evaluate(cfg, str(tmp_path))
  before = helpers.tree_bytes(tmp_path)
  other = _config(shard_dir, **{"model.d_model": 48, "dipaco.replicas": 2})
  with pytest.raises(errors.ConfigError) as e:
    train.train_and_evaluate(other, str(tmp_path))
  msg = str(e.value)
  assert "(model.d_model: 32 -> 48, dipaco.replicas: 1 -> 2)" in msg, msg
  assert "rerun with its own values, or use a new --workdir" in msg
  assert helpers.tree_bytes(tmp_path) == before


def test_a_run_resumes_with_more_outer_steps_as_if_it_had_asked_for_them(shard_dir, tmp_path):
  # The cosine's length given (inner.total_steps), so both runs share one schedule: the
  # resumed run's state is the bytes of the run that asked for 2 outer steps from the start.
  kw = {"inner.total_steps": 4, "dipaco.outer_steps": 1}
  train.train_and_evaluate(_config(shard_dir, **kw), str(tmp_path / "grown"))
  grown = train.train_and_evaluate(
    _config(shard_dir, **{**kw, "dipaco.outer_steps": 2}), str(tmp_path / "grown")
  )
  whole = train.train_and_evaluate(
    _config(shard_dir, **{**kw, "dipaco.outer_steps": 2}), str(tmp_path / "whole")
  )
  assert grown["step"] == whole["step"] == 4
  a, b = (checkpoint.restore_numpy(str(tmp_path / d)) for d in ("grown", "whole"))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  # Fewer outer steps than the checkpoint has done: refused, with the way on.
  with pytest.raises(errors.ConfigError, match=r"dipaco.outer_steps: 2 -> 1\).* larger"):
    train.train_and_evaluate(_config(shard_dir, **kw), str(tmp_path / "whole"))


def test_the_elastic_pool_refuses_more_outer_steps(shard_dir, tmp_path):
  workdir = tmp_path / "el"
  cfg = _config(shard_dir, **{"dipaco.mode": "elastic", "dipaco.outer_steps": 1})
  saved_config.write(epath.Path(workdir), cfg)
  storage.save_json(storage.root(str(workdir)) / "meta.json", {"mode": "elastic", "format": 3})
  longer = _config(shard_dir, **{"dipaco.mode": "elastic", "dipaco.outer_steps": 2})
  with pytest.raises(errors.ConfigError, match=r"dipaco.outer_steps: 1 -> 2\)"):
    train.train_and_evaluate(longer, str(workdir))
