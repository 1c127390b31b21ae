"""Serving one path: only its arrays are read from an orbax checkpoint of any grid."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dipaco_jax import serve
from dipaco_jax.core import experiment
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import early_stopping

import helpers

GRID = {"dipaco.modules_per_level": (1, 4, 4)}  # 16 paths; each routed group has 4 modules.


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One state, saved by the trainer's Checkpointer and with one-module chunks."""
  cfg = helpers.micro_config(**GRID)
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  # Module m of every group holds θ̄ + m: any wrong row shows.
  store = {
    g: jax.tree.map(
      lambda x: x + jnp.arange(x.shape[0], dtype=x.dtype).reshape((-1,) + (1,) * (x.ndim - 1)), sub
    )
    for g, sub in state.store.items()
  }
  state = state.replace(store=store)
  plain = str(tmp_path_factory.mktemp("plain"))
  ck = checkpoint.Checkpointer(plain, async_save=False)
  ck.save(7, state, {"train": {}})
  ck.close()
  chunked = str(tmp_path_factory.mktemp("chunked"))
  mgr = ocp.CheckpointManager(chunked + "/checkpoints", item_names=("state", "data"))
  mgr.save(
    7,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state, save_args=checkpoint.save_args(state)),
      data=ocp.args.JsonSave({"train": {}}),
    ),
  )
  mgr.wait_until_finished()
  mgr.close()
  return cfg, exp, jax.device_get(state), plain, chunked


@pytest.mark.parametrize("path", [0, 9, 15])
def test_serving_restores_exactly_one_paths_arrays(saved, path):
  cfg, exp, state, plain, _ = saved
  want = helpers.path_params(state.store, exp.topo, path)
  got, info = serve.load_path_params(plain, cfg, path)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert info["arrays"] == len(jax.tree.leaves(want))
  assert info["bytes"] == _nbytes(want)
  # The trainer's chunks hold whole leaves: at most the store is read, never the
  # worker params or optimizer states (3x the store here).
  total = _nbytes(state.store) + _nbytes(state.params) + _nbytes(state.inner_opt)
  assert info["bytes_read"] <= 1.1 * _nbytes(state.store) + 65536
  assert info["bytes_read"] < 0.2 * total


def test_one_module_chunks_read_one_paths_bytes(saved):
  cfg, exp, state, plain, chunked = saved
  got, info = serve.load_path_params(chunked, cfg, 9)
  want = helpers.path_params(state.store, exp.topo, 9)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  store_bytes = _nbytes(state.store)
  assert info["bytes_read"] <= 1.1 * info["bytes"] + 65536 < store_bytes
  # The chunked checkpoint is an ordinary one for the trainer.
  restored, _ = checkpoint.Checkpointer(chunked).restore(exp.abstract_state)
  for a, b in zip(jax.tree.leaves(restored.store), jax.tree.leaves(state.store)):
    np.testing.assert_array_equal(a, b)
  del plain


def _save_best(workdir, exp, state, step, best):
  ck = checkpoint.Checkpointer(workdir, async_save=False, max_to_keep=5)
  ck.save(step, state, {"train": {}}, best=best.saved())
  ck.close()


def test_early_stopping_set_serves_one_paths_row(saved, tmp_path):
  cfg, exp, state, _, _ = saved
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  params = jax.device_put(state.params, exp.state_sharding.params)
  val = np.linspace(3.0, 4.0, exp.topo.num_workers)
  assert best.update(4, val, params, phase=0) == list(range(16))
  _save_best(str(tmp_path), exp, state, 4, best)
  better = val.copy()
  better[5] -= 1.0
  shifted = jax.tree.map(lambda x: x + 1.0, params)
  assert best.update(6, better, shifted, phase=0) == [5]  # Only worker 5 improved.
  _save_best(str(tmp_path), exp, state, 6, best)
  meta = early_stopping.read_meta(str(tmp_path))
  assert meta["step"][5] == 6 and meta["step"][4] == 4 and meta["loss"][5] == better[5]
  for p, delta in ((5, 1.0), (4, 0.0)):
    got, info = serve.load_path_params(str(tmp_path), cfg, p, source="best")
    want = jax.tree.map(lambda x, p=p, delta=delta: x[p] + delta, state.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
    assert info["bytes_read"] <= 1.1 * info["bytes"] + 65536
  # A new shard phase restarts the records: every worker's first loss is its best.
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  best.load(ck.restore_best(exp.abstract_state.params))
  ck.close()
  assert best.meta["step"][5] == 6
  assert best.update(8, val + 10, params, phase=1) == list(range(16))


def test_serve_best_reads_the_set_saved_with_the_checkpoint(saved, tmp_path):
  # The last evaluation (step 8) improved no worker: the set still holds step 4's params,
  # and serving reads it from checkpoint 8 (it once looked for a best set at step 8 and failed).
  cfg, exp, state, _, _ = saved
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  params = jax.device_put(state.params, exp.state_sharding.params)
  val = np.full(exp.topo.num_workers, 3.0)
  best.update(4, val, params, phase=0)
  _save_best(str(tmp_path), exp, state, 4, best)
  assert best.update(8, val + 1.0, jax.tree.map(lambda x: x + 1.0, params), phase=0) == []
  _save_best(str(tmp_path), exp, state, 8, best)
  server = serve.PathServer(cfg, str(tmp_path), source="best")
  assert server.step == 8
  got = server.params(3)
  assert server.load_info["step"] == 8 and server.load_info["source"] == "best"
  for a, b in zip(
    jax.tree.leaves(got), jax.tree.leaves(jax.tree.map(lambda x: x[3], state.params))
  ):
    np.testing.assert_array_equal(a, b)
  assert early_stopping.read_meta(str(tmp_path))["step"] == [4] * exp.topo.num_workers


def test_serving_bad_inputs(saved):
  cfg, _, _, plain, _ = saved
  with pytest.raises(ValueError, match="path 16 is not in this grid"):
    serve.load_path_params(plain, cfg, 16)
  other = helpers.micro_config(**{"dipaco.modules_per_level": (1, 2, 2)})
  with pytest.raises(ValueError, match="written by another grid"):
    serve.load_path_params(plain, other, 1)
  with pytest.raises(ValueError, match="source='final'"):
    serve.load_path_params(plain, cfg, 0, source="final")
  with pytest.raises(FileNotFoundError, match="holds no early-stopping set"):
    serve.load_path_params(plain, cfg, 0, source="best")
  server = serve.PathServer(cfg, plain)
  with pytest.raises(ValueError, match="empty prefix"):
    server.route("")


def test_generate_batch_groups_texts_by_their_routed_path(saved, monkeypatch):
  cfg, _, _, plain, _ = saved
  server = serve.PathServer(cfg, plain)
  tokenize = server.tokenize
  monkeypatch.setattr(server, "tokenize", lambda t: tokenize(t) % 256)  # The micro vocab.
  loads = []
  load = serve.load_path_params
  monkeypatch.setattr(
    serve, "load_path_params", lambda *a, **k: loads.append(a[2]) or load(*a, **k)
  )
  # Texts whose routed paths repeat: three on one path, one each on two others.
  by_path = {}
  for i in range(200):
    by_path.setdefault(server.route(f"Text number {i} of the batch"), []).append(i)
  shared = next(p for p, ids in by_path.items() if len(ids) >= 3)
  others = [p for p in by_path if p != shared][:2]
  picks = by_path[shared][:3] + [by_path[p][0] for p in others]
  texts = [f"Text number {i} of the batch" for i in picks]
  out = server.generate_batch(texts, max_new_tokens=5, batch_size=4)
  assert [o["path"] for o in out] == [shared] * 3 + others
  assert sorted(loads) == sorted({shared, *others})  # Each path's params read once.
  for text, got in zip(texts, out):
    # Alone, each text gives the same (tests/core/test_decoding.py: the same as the old full-forward
    # loop too).
    assert server.generate(text, max_new_tokens=5) == got
    assert got["new_tokens"] == len(got["tokens"]) == 5  # This micro model never picks EOS here.
    assert got["text"] == server.sp.decode(got["tokens"])
  assert len({tuple(o["tokens"]) for o in out}) > 1
