"""Checkpoints: one atomic save of state, data and best set; damaged files named in one line."""

import os
import shutil

import jax
import numpy as np
import pytest

from dipaco_jax import train
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import early_stopping

import helpers

PATH = 1  # The path serving reads (worker 1).

# Every kind of file orbax writes in a step directory. `must_fail`: truncating it must stop a
# resume with the one-line error; otherwise nothing that restores reads it (orbax's
# per-process OCDBT files are merged into the item's own b-tree), and the values must come
# back intact. The item b-tree (`<item>/d/`) and the data files are picked by size.
KINDS = [
  ("_CHECKPOINT_METADATA", "_CHECKPOINT_METADATA", True),
  ("commit_success", "commit_success.txt", False),
  ("data_json", "data/metadata", True),
  ("data_commit_success", "data/commit_success.txt", False),
  ("state_METADATA", "state/_METADATA", True),
  ("state_sharding", "state/_sharding", True),
  ("state_array_metadatas", "state/array_metadatas/process_0", True),
  ("state_manifest", "state/manifest.ocdbt", True),
  ("state_btree", ("largest", "state/d/"), True),
  ("state_data", ("largest", "state/ocdbt.process_0/d/"), True),
  ("state_process_btree", ("smallest", "state/ocdbt.process_0/d/"), False),
  ("state_process_manifest", "state/ocdbt.process_0/manifest.ocdbt", False),
  ("state_commit_success", "state/commit_success.txt", False),
  ("best_METADATA", "best/_METADATA", True),
  ("best_manifest", "best/manifest.ocdbt", True),
  ("best_btree", ("largest", "best/d/"), True),
  ("best_data", ("largest", "best/ocdbt.process_0/d/"), True),
  ("best_sharding", "best/_sharding", True),
  ("best_array_metadatas", "best/array_metadatas/process_0", True),
  ("best_process_btree", ("smallest", "best/ocdbt.process_0/d/"), False),
  ("best_process_manifest", "best/ocdbt.process_0/manifest.ocdbt", False),
  ("best_commit_success", "best/commit_success.txt", False),
  ("checksums_json", "checksums/metadata", True),
  ("checksums_commit_success", "checksums/commit_success.txt", False),
]


def _files(step_dir: str) -> list[str]:
  return sorted(helpers.tree_bytes(step_dir))


def _pick(step_dir: str, selector) -> str:
  if isinstance(selector, str):
    return selector
  how, prefix = selector
  found = [f for f in _files(step_dir) if f.startswith(prefix)]
  sizes = [os.path.getsize(os.path.join(step_dir, f)) for f in found]
  return found[int(np.argmax(sizes) if how == "largest" else np.argmin(sizes))]


def test_one_save_holds_state_data_and_the_best_set(saved):
  cfg, exp, workdir, want = saved
  assert checkpoint.steps(workdir) == [2, 4] and checkpoint.latest_step(workdir) == 4
  assert sorted(os.listdir(workdir)) == ["checkpoints"]  # No second checkpoint directory.
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  state, data = ck.restore(exp.abstract_state)
  params, records = ck.restore_best(exp.abstract_state.params)
  old_params, old_records = ck.restore_best(exp.abstract_state.params, step=2)
  ck.close()
  assert data == want["data"] and records == want["records"]
  assert old_records["step"] == [2] * 4 and records["step"] == [4] * 4
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want["state"])):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(
    jax.tree.leaves((params, old_params)), jax.tree.leaves((want["best"], want["best_2"]))
  ):
    np.testing.assert_array_equal(a, b)
  assert not _same(want["best"], want["best_2"])
  assert checkpoint.routing_phase(checkpoint.read_data_state(workdir, 4)) == 0
  assert early_stopping.read_meta(workdir, step=2)["checkpoint_step"] == 2
  del cfg


def test_the_kinds_cover_every_file_orbax_writes(saved):
  _, _, workdir, _ = saved
  step_dir = os.path.join(workdir, "checkpoints", "4")
  covered = {_pick(step_dir, sel) for _, sel, _ in KINDS}
  left = [f for f in _files(step_dir) if f not in covered]
  # Left: only more of the per-process OCDBT nodes, which restore does not read.
  assert all("/ocdbt.process_0/d/" in f for f in left), left


def _expected(exp, want):
  store_path = helpers.path_params(want["state"].store, exp.topo, PATH)
  best_path = jax.tree.map(lambda x: x[PATH], want["best"])
  return {
    "resume": {k: want[k] for k in ("state", "data", "best", "records")},
    "serve_store": store_path,
    "serve_best": best_path,
    "serve_phase": {**want["data"], "early_stopping": want["records"]},
    "init_from": jax.tree.map(lambda x: x[PATH], want["state"].params),
  }


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


def _assert_one_line_naming(err: Exception, workdir: str, name: str, then: str):
  msg = str(err)
  root = os.path.join(workdir, "checkpoints")
  assert "\n" not in msg, msg
  assert msg.startswith(f"checkpoint step 4 in {root} is damaged ({name}"), msg
  aside = f"mv {root}/4 {workdir}/damaged_checkpoint_4"
  assert f"move it aside ({aside}) {then}." in msg, msg


@pytest.mark.parametrize("kind,selector,must_fail", KINDS, ids=[k[0] for k in KINDS])
def test_a_truncated_file_gives_one_line_naming_it(saved, tmp_path, kind, selector, must_fail):
  cfg, exp, src, want = saved
  workdir = str(tmp_path / "run")
  shutil.copytree(src, workdir)
  step_dir = os.path.join(workdir, "checkpoints", "4")
  rel = _pick(step_dir, selector)
  helpers.truncate(os.path.join(step_dir, rel))
  before = helpers.tree_bytes(workdir)
  expected = _expected(exp, want)
  outcomes = {}
  for op, read in helpers.checkpoint_reads(cfg, exp, workdir, PATH).items():
    try:
      got = read()
    except checkpoint.DamagedCheckpointError as e:
      # A data file is named by its item and array (TensorStore names no file).
      name = rel if "ocdbt.process_0/d/" not in rel else f"{rel.split('/')[0]} data of array "
      _assert_one_line_naming(
        e, workdir, name, "to resume from step 2, the newest intact checkpoint"
      )
      outcomes[op] = "damaged"
    else:
      assert _same(got, expected[op]) and (op != "resume" or got["data"] == want["data"]), op
      outcomes[op] = "intact"
  if must_fail:
    assert outcomes["resume"] == "damaged", (kind, outcomes)
  else:
    assert set(outcomes.values()) == {"intact"}, (kind, outcomes)
  assert helpers.tree_bytes(workdir) == before, kind  # Nothing deleted or rewritten.


def test_no_intact_older_checkpoint_says_start_over(saved, tmp_path):
  cfg, exp, src, _ = saved
  workdir = str(tmp_path / "run")
  shutil.copytree(src, workdir)
  for step in (2, 4):
    helpers.truncate(os.path.join(workdir, "checkpoints", str(step), "state", "manifest.ocdbt"))
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  with pytest.raises(checkpoint.DamagedCheckpointError) as e:
    ck.restore(exp.abstract_state)
  ck.close()
  _assert_one_line_naming(
    e.value,
    workdir,
    "state/manifest.ocdbt: ",
    "to start the run over from step 0 (no older checkpoint is intact)",
  )
  del cfg


@pytest.mark.slow  # two training runs on the embedded corpus
def test_the_trainer_stops_on_a_damaged_checkpoint_and_resumes_after_the_mv(tmp_path):
  over = {
    "model.vocab_size": 8192,
    "data.shard_dir": str(tmp_path / "shards"),
    "dipaco.outer_steps": 3,
  }
  cfg = helpers.micro_config(**over)
  workdir = str(tmp_path / "run")
  with helpers.compile_cache(tmp_path / "jax_cache"):
    train.train_and_evaluate(helpers.micro_config(stop_at_step=4, **over), workdir)
  helpers.truncate(os.path.join(workdir, "checkpoints", "4", "data", "metadata"))
  before = helpers.tree_bytes(workdir)
  with pytest.raises(checkpoint.DamagedCheckpointError) as e:
    train.train_and_evaluate(cfg, workdir)
  _assert_one_line_naming(
    e.value, workdir, "data/metadata: ", "to resume from step 2, the newest intact checkpoint"
  )
  assert helpers.tree_bytes(workdir) == before
  # The line's own command, then the same run again: it resumes from step 2 and finishes.
  os.rename(
    os.path.join(workdir, "checkpoints", "4"), os.path.join(workdir, "damaged_checkpoint_4")
  )
  with helpers.compile_cache(tmp_path / "jax_cache"):
    assert train.train_and_evaluate(cfg, workdir)["step"] == 6
  assert checkpoint.steps(workdir) == [4, 6]
