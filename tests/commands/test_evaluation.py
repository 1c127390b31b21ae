"""Routed evaluation: prefix excluded exactly, re-routing windows, oracles, bad inputs."""

import types

import jax
import numpy as np
import optax
import pytest

from dipaco_jax import data as data_lib
from dipaco_jax import errors
from dipaco_jax import evaluate
from dipaco_jax import routing
from dipaco_jax.core import experiment
from dipaco_jax.core import model as model_lib
from dipaco_jax.routing import rerouting

import helpers
import routing_testlib

L, T = 4, 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run whose 4 paths differ (independent inits), 40 validation docs on random shards."""
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = helpers.micro_config(
    **{
      "dipaco.init": "independent",
      "routing.prefix_len": L,
      "eval.seq_len": T,
      "eval.rerouters": ("linear",),
    }
  )
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  W = exp.topo.num_workers
  docs = routing_testlib.fake_documents(40, seed=5, min_len=2, max_len=30)
  shard_dir = str(tmp_path_factory.mktemp("shards"))
  data_lib.write_shards(
    shard_dir, "validation", docs, data_lib.random_assignment(W, seed=cfg.data.seed), W
  )
  r = evaluate.Run(cfg, workdir, exp, state, 0, 0, data_lib.ShardSet(shard_dir))
  # A saved linear re-router (fitted on random features: only its plumbing matters here).
  rng = np.random.default_rng(0)
  lens = np.full(30, T)
  fake = rerouting.fit_linear(
    rng.normal(size=(30, T + 1, 32)).astype(np.float32),
    rng.integers(0, 4, size=(30, T)),
    lens,
    prefix_len=L,
    stride=2,
    grid=routing.router_grid(exp.topo),
  )
  fake.save(evaluate.rerouter_dir(workdir, 0) + "/linear")
  return r, docs


def _by_hand(r, docs, path=None):
  """Once-per-sequence NLL over targets L.. of each doc's first T tokens, and the count.

  path: every doc scored by this path (default: the one its prefix routes it to).
  """
  apply = jax.jit(model_lib.Transformer(r.exp.model_cfg).apply)
  pr = routing.PathRouter(r.exp.topo, None, seed=r.config.data.seed)
  first = pr.paths([d.doc_id for d in docs], None)[:, 0]
  if path is not None:
    first = np.full_like(first, path)
  nll, count = 0.0, 0
  for d, p in zip(docs, first):
    t = d.tokens[:T]
    padded = np.zeros(T, np.int32)  # One shape, one compile; causal, so padding is unseen.
    padded[: len(t)] = t
    pp = helpers.path_params(r.state.store, r.exp.topo, int(p))
    logits = apply({"params": pp}, np.concatenate([[0], padded[:-1]])[None].astype(np.int32))
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits[0], padded))
    nll += ce[L : len(t)].sum()
    count += max(len(t) - L, 0)
  return nll, count


@pytest.mark.slow  # routed evaluation at 4 windows, re-routing and oracles: ~25 s
def test_routed_eval_excludes_exactly_the_prefix_and_long_windows_equal_once(run):
  r, docs = run
  rep = evaluate.evaluate(r, windows=(4, T - L, T, 1000))
  nll, count = _by_hand(r, docs)
  assert rep["scored_tokens"] == count == sum(max(min(len(d.tokens), T) - L, 0) for d in docs)
  assert rep["num_sequences"] == 40
  np.testing.assert_allclose(rep["loss"]["once"], nll / count, rtol=1e-5)
  np.testing.assert_allclose(rep["ppl"]["once"], np.exp(nll / count), rtol=1e-5)
  # W >= the scored length: one chunk, the prefix's path, exactly once-per-sequence routing.
  for w in (T - L, T, 1000):
    assert rep["ppl"][f"linear/W={w}"] == rep["ppl"]["once"]
    assert rep["switches_per_sequence"][f"linear/W={w}"] == 0
  assert rep["switches_per_sequence"]["linear/W=4"] > 0
  # Oracles bound every routing; a finer oracle is at least as good.
  for k, v in rep["loss"].items():
    assert rep["loss"]["oracle/W=4"] <= v + 1e-6, k
  assert rep["loss"]["oracle/once"] <= rep["loss"]["once"] + 1e-6
  # A random path, in expectation: every path scores every doc, the NLL averaged over paths.
  each = [_by_hand(r, docs, path=p)[0] for p in range(r.exp.topo.num_paths)]
  np.testing.assert_allclose(rep["loss"]["random/once"], np.mean(each) / count, rtol=1e-5)
  assert rep["loss"]["oracle/once"] < rep["loss"]["random/once"]  # The paths differ.
  # Random router, one worker per path: routed = each path's own shard.
  assert rep["route_agreement_with_shards"] == 1.0
  np.testing.assert_allclose(rep["per_path"]["loss"], rep["own_shard"]["loss"])
  assert sum(rep["per_path"]["tokens"]) == count
  assert "| once |" in evaluate.to_markdown(rep)


def test_rerouters_to_fit_are_those_not_saved_for_the_step(run, tmp_path):
  r, _ = run  # Its linear re-router is saved for step 0.
  assert evaluate.rerouters_to_fit(r, ("linear", "transformer")) == ["transformer"]
  other = evaluate.Run(r.config, str(tmp_path), r.exp, r.state, 0, 0, r.shard_set)
  assert evaluate.rerouters_to_fit(other, ("linear",)) == ["linear"]
  later = evaluate.Run(r.config, r.workdir, r.exp, r.state, 7, 0, r.shard_set)
  assert evaluate.rerouters_to_fit(later, ("linear",)) == ["linear"]  # Saved per step.
  with pytest.raises(ValueError, match="unknown re-router 'lin'"):
    evaluate.rerouters_to_fit(r, ("lin",))


def test_evaluation_bad_inputs(run):
  r, _ = run
  with pytest.raises(ValueError, match="W must be an integer > 0"):
    evaluate.evaluate(r, windows=(0,))
  with pytest.raises(ValueError, match="params='final'"):
    evaluate.evaluate(r, params="final", windows=())
  with pytest.raises(FileNotFoundError, match="early-stopping"):
    evaluate.evaluate(r, params="best", windows=())
  cfg = helpers.micro_config()
  cfg.routing.prefix_len = 0  # After load, whose config check refuses it first.
  with pytest.raises(ValueError, match="prefix length"):
    evaluate.evaluate(evaluate.Run(cfg, r.workdir, r.exp, r.state, 0, 0, r.shard_set), windows=())


@pytest.mark.slow  # evaluation with both re-routers (linear, transformer): ~20 s
def test_dense_model_has_a_trivial_router_and_the_same_report_keys(tmp_path):
  cfg = helpers.micro_config(
    **{
      "dipaco.level_groups": ("embed,block_0,block_1,head",),
      "dipaco.modules_per_level": (1,),
      "outer.enabled": False,
      "data.batch_size": 4,  # One path: 4 devices on 'data'.
      "routing.prefix_len": L,
      "eval.seq_len": T,
      "eval.rerouters": ("linear", "transformer"),
    }
  )
  exp = experiment.Experiment(cfg)
  docs = routing_testlib.fake_documents(12, seed=6, min_len=8)
  data_lib.write_shards(str(tmp_path / "s"), "validation", docs, lambda d: [0], 1)
  r = evaluate.Run(
    cfg, str(tmp_path), exp, exp.init_state(0), 0, 0, data_lib.ShardSet(str(tmp_path / "s"))
  )
  rep = evaluate.evaluate(r, windows=(4, 8))
  assert set(rep["ppl"]) == {
    "once",
    "linear/W=4",
    "linear/W=8",
    "transformer/W=4",
    "transformer/W=8",
    "oracle/once",
    "random/once",
    "oracle/W=4",
    "oracle/W=8",
  }
  assert len(set(rep["ppl"].values())) == 1  # One path: every routing is the same.


def test_specialisation_is_every_path_on_every_shard_as_evaluate_scores_it(run, monkeypatch):
  r, docs = run
  rep = evaluate.evaluate(r, windows=(), per_sequence=True)
  spec = evaluate.specialisation(r, rep)
  for name, key in [("routed", "once"), ("random", "random/once"), ("oracle", "oracle/once")]:
    assert spec.loss[name] == pytest.approx(rep["loss"][key], rel=1e-5), name
  # One worker per path: the diagonal is each worker's own-shard loss.
  np.testing.assert_allclose(np.diag(spec.loss_matrix), rep["own_shard"]["loss"], rtol=1e-5)
  assert spec.shard_tokens.sum() == rep["scored_tokens"]
  assert spec.routed_best_share == spec.shard_best_share  # The random router's path = shard's.
  # M[p, q] by hand: path p on the documents of worker q's validation shard.
  seqs = evaluate.validation_sequences(r)
  worker = dict(zip(seqs["doc_ids"].tolist(), seqs["workers"].tolist()))
  q_N = np.array([worker[d.doc_id] for d in docs])
  n_N = np.array([min(len(d.tokens), T) for d in docs])
  t_NxT = np.zeros((len(docs), T), np.int32)  # Causal: the padding is unseen.
  for i, d in enumerate(docs):
    t_NxT[i, : n_N[i]] = d.tokens[:T]
  inputs = np.concatenate([np.zeros((len(docs), 1), np.int32), t_NxT[:, :-1]], 1)
  scored = (np.arange(T)[None] >= L) & (np.arange(T)[None] < n_N[:, None])
  apply = jax.jit(model_lib.Transformer(r.exp.model_cfg).apply)
  P = r.exp.topo.num_paths
  nll_QxP, tok_Q = np.zeros((P, P)), np.bincount(q_N, weights=scored.sum(1), minlength=P)
  for p in range(P):
    logits = apply({"params": helpers.path_params(r.state.store, r.exp.topo, p)}, inputs)
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, t_NxT))
    nll_QxP[:, p] = np.bincount(q_N, weights=(ce * scored).sum(1), minlength=P)
  np.testing.assert_allclose(spec.loss_matrix, (nll_QxP / tok_Q[:, None]).T, rtol=1e-5)
  # Without a report it runs evaluate as above (every path scores, no re-routing).
  calls = []
  monkeypatch.setattr(evaluate, "evaluate", lambda run, **kw: calls.append(kw) or rep)
  evaluate.specialisation(r, max_docs=7)
  assert calls == [dict(params="store", windows=(), oracle=True, max_docs=7, per_sequence=True)]
  with pytest.raises(ValueError, match="evaluate it with per_sequence=True"):
    evaluate.specialisation(r, {k: v for k, v in rep.items() if k != "per_sequence"})
  monkeypatch.undo()
  with pytest.raises(ValueError, match="needs oracle=True"):
    evaluate.evaluate(r, windows=(), oracle=False, per_sequence=True)


def test_specialisation_refuses_one_path_or_no_held_out_documents(tmp_path):
  def run_of(cfg, split):
    exp = experiment.Experiment(cfg)
    W = exp.topo.num_workers
    docs = routing_testlib.fake_documents(16, seed=1, min_len=L + 1, max_len=T)
    data_lib.write_shards(
      str(tmp_path / split), split, docs, data_lib.random_assignment(W, seed=0), W
    )
    store = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), exp.abstract_state.store)
    shards = data_lib.ShardSet(str(tmp_path / split))
    return evaluate.Run(cfg, "RUN", exp, types.SimpleNamespace(store=store), 0, 0, shards)

  one_path = helpers.micro_config(**{"dipaco.modules_per_level": (1, 1, 1), "data.batch_size": 4})
  with pytest.raises(errors.ArgumentError, match=r"RUN has one path .* needs a DiPaCo run"):
    evaluate.specialisation(run_of(one_path, "validation"))
  no_held_out = run_of(helpers.micro_config(), "train")  # Shards with a train split only.
  with pytest.raises(errors.ArgumentError, match="hold no held-out .* with a validation split"):
    evaluate.specialisation(no_held_out)


def test_with_replicas_a_paths_shard_is_its_workers_shards(tmp_path):
  cfg = helpers.micro_config(
    **{
      "dipaco.modules_per_level": (1, 2, 1),  # 2 paths x 2 replicas.
      "dipaco.replicas": 2,
      "routing.prefix_len": L,
      "eval.seq_len": T,
    }
  )
  exp = experiment.Experiment(cfg)
  docs = routing_testlib.fake_documents(12, seed=7, min_len=L + 1, max_len=T)
  data_lib.write_shards(str(tmp_path), "validation", docs, data_lib.random_assignment(4, seed=3), 4)
  shards = data_lib.ShardSet(str(tmp_path))
  # Zero params (no init_state to compile): only which documents each path's shard holds matters.
  store = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), exp.abstract_state.store)
  r = evaluate.Run(cfg, str(tmp_path), exp, types.SimpleNamespace(store=store), 0, 0, shards)
  rep = evaluate.evaluate(r, windows=(), per_sequence=True)
  n_W = shards.num_docs("validation")
  spec = evaluate.specialisation(r, rep)
  assert spec.shard_docs.tolist() == [n_W[0] + n_W[1], n_W[2] + n_W[3]]
