"""Router features, routed assignments, discriminative labels, schedule restart, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import routing_testlib
from dipaco_jax import data as data_lib
from dipaco_jax import experiment
from dipaco_jax.routing import features
from dipaco_jax import model as model_lib
from dipaco_jax import inner
from dipaco_jax.routing import router as router_lib
from dipaco_jax import routing
from dipaco_jax.routing import phases
from dipaco_jax.routing import scoring
from dipaco_jax import topology


@pytest.fixture(scope="module")
def micro():
  cfg = helpers.micro_config()
  params = model_lib.init_params(experiment.model_config(cfg), jax.random.key(0))
  return cfg, features.FeatureExtractor(experiment.model_config(cfg), params, prefix_len=5,
                                        batch_size=4)


def test_prefix_feature_is_the_mean_hidden_state_over_the_prefix(micro):
  cfg, ex = micro
  long, short = np.arange(3, 13, dtype=np.int32), np.array([7, 8, 9], np.int32)
  got = ex.prefix_features([long, short])
  model = model_lib.Transformer(experiment.model_config(cfg))
  for seq, n, row in ((long, 5, 0), (short, 3, 1)):
    # [BOS, t_0..t_{n-1}]: positions 1..n read the n prefix tokens.
    inputs = np.concatenate([[0], seq[:n]])[None].astype(np.int32)
    _, h = model.apply({"params": ex.params}, inputs, return_hidden=True)
    np.testing.assert_allclose(got[row], np.asarray(h[0, 1:n + 1]).mean(0), rtol=2e-5, atol=2e-6)
  # The running mean at b = prefix_len is the prefix feature.
  np.testing.assert_allclose(ex.running_means(long[None])[0, 5], got[0], rtol=1e-5, atol=1e-6)


def test_empty_prefix_is_refused(micro):
  cfg, ex = micro
  with pytest.raises(ValueError, match="prefix length must be an integer >= 1"):
    features.FeatureExtractor(experiment.model_config(cfg), ex.params, prefix_len=0)
  with pytest.raises(ValueError, match="empty prefix"):
    ex.prefix_features([np.array([5], np.int32), np.array([], np.int32)])


def test_router_grid_is_the_routed_levels_and_refuses_another_grid():
  t = topology.build(("embed,head", "block_0", "block_1"), (1, 2, 2), 2)
  assert routing.router_grid(t) == (2, 2)
  assert routing.router_grid(topology.build(("embed,block_0,block_1,head",), (1,), 2)) == (1,)
  x = np.random.default_rng(0).normal(size=(40, 6)).astype(np.float32)
  routing.PathRouter(t, router_lib.fit_kmeans_router(x, (2, 2), restarts=1))
  with pytest.raises(ValueError, match="router from another grid"):
    routing.PathRouter(t, router_lib.fit_kmeans_router(x, (2, 3), restarts=1))


def test_replicas_split_a_paths_documents_over_its_workers():
  t = topology.build(("embed,block_0,block_1,head",), (2,), 2, replicas=3)
  x = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)
  pr = routing.PathRouter(t, router_lib.fit_kmeans_router(x, (2,), restarts=1))
  w = pr.workers(np.arange(300), x, top_k=1)[:, 0]
  np.testing.assert_array_equal(t.path_of_worker[w], pr.router.route(x)[:, 0])
  assert set(w.tolist()) == set(range(6))


def test_routed_shards_stream_in_batches_overlap_in_train_never_in_validation(
    micro, tmp_path, monkeypatch):
  cfg, ex = micro
  docs = {"train": routing_testlib.fake_documents(60, seed=1),
          "validation": routing_testlib.fake_documents(30, seed=2, first_id=1000)}
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tasks, "iter_documents", lambda task, split, **kw: iter(docs[split]))
  topo = topology.from_config(cfg)
  x = ex.prefix_features([d.tokens for d in docs["train"]])
  pr = routing.PathRouter(topo, router_lib.fit_kmeans_router(x, (2, 2), restarts=2),
                          feature_id=ex.fingerprint)
  cfg.data.top_k = 2
  assign = routing.make_assignment(cfg, pr, ex)
  assign._batch_size = 8  # pylint: disable=protected-access
  seen = []
  orig_fill = assign._fill  # pylint: disable=protected-access
  assign._fill = lambda split: (orig_fill(split), seen.append(len(assign._cache)))  # pylint: disable=protected-access
  shards = data_lib.prepare_shards(cfg.data, 4, str(tmp_path / "s"), assign=assign)
  assert max(seen) <= 8  # One lookahead batch in memory, never the split.
  want = pr.paths([d.doc_id for d in docs["train"]], x, top_k=2)
  got = {}
  for p in range(4):
    for d in shards.documents(p, "train"):
      got.setdefault(d.doc_id, set()).add(p)
  assert got == {d.doc_id: set(w.tolist()) for d, w in zip(docs["train"], want)}
  assert shards.num_docs("train").sum() == 2 * 60  # top-2 overlap in training
  assert shards.num_docs("validation").sum() == 30  # never in validation
  xv = ex.prefix_features([d.tokens for d in docs["validation"]])
  first = pr.paths([d.doc_id for d in docs["validation"]], xv)[:, 0]
  for p in range(4):
    ids = {d.doc_id for d in shards.documents(p, "validation")}
    assert ids == {d.doc_id for d, f in zip(docs["validation"], first) if f == p}


def test_replica_shards_router_gives_each_worker_its_own_cluster():
  """DiLoCo non-i.i.d.: one path, 3 replicas, the k-means clusters are the workers' shards."""
  t = topology.build(("embed,block_0,block_1,head",), (1,), 2, replicas=3)
  rng = np.random.default_rng(0)
  centres = np.array([[9, 0], [0, 9], [-9, -9]], np.float32)
  x = (centres[np.arange(90) % 3] + rng.normal(size=(90, 2))).astype(np.float32)
  cfg = helpers.micro_config(**{"routing.router": "kmeans", "routing.replica_shards": "router"})
  assert phases.replicas_by_router(cfg, t)
  router = phases.fit_phase0(cfg, t, x)
  assert router.grid == (3,)
  pr = routing.PathRouter(t, router, by_worker=True)
  w = pr.workers(np.arange(90), x)[:, 0]
  # Each well-separated blob lands on exactly one worker, and each worker holds one blob.
  blob_of_worker = {int(wk): {int(i % 3) for i in np.flatnonzero(w == wk)} for wk in range(3)}
  assert sorted(len(v) for v in blob_of_worker.values()) == [1, 1, 1]
  assert set().union(*blob_of_worker.values()) == {0, 1, 2}
  np.testing.assert_array_equal(pr.paths(np.arange(90), x)[:, 0], np.zeros(90))
  # A path-grid router is refused where workers are routed, and vice versa.
  with pytest.raises(ValueError, match="router from another grid"):
    routing.PathRouter(t, router)
  cfg.routing.replica_shards = "cluster"
  with pytest.raises(ValueError, match="replica_shards='cluster'"):
    phases.replicas_by_router(cfg, t)
  cfg.routing.replica_shards = "router"
  cfg.dipaco.outer_steps, cfg.routing.discriminative_at_outer_step = 4, 2
  with pytest.raises(ValueError, match="phase 0 only"):
    phases.replicas_by_router(cfg, t)


@pytest.fixture(scope="module")
def independent():
  exp = experiment.Experiment(helpers.micro_config(**{"dipaco.init": "independent"}))
  return exp, exp.init_state(0)  # Every module its own random init: paths differ.


def test_discriminative_labels_are_the_argmin_loss_path(independent):
  exp, state = independent
  docs = routing_testlib.fake_documents(16, seed=3, min_len=12)
  scorer = scoring.PathScorer.from_store(exp, state.store, seq_len=16)
  scores = phases.score_documents(scorer, docs, prefix_len=4)
  apply = jax.jit(model_lib.Transformer(exp.model_cfg).apply)
  loss = np.zeros((len(docs), exp.topo.num_paths))
  for p in range(exp.topo.num_paths):
    pp = helpers.path_params(state.store, exp.topo, p)
    for i, d in enumerate(docs):
      t = d.tokens[:16]
      logits = apply({"params": pp}, np.concatenate([[0], t[:-1]])[None].astype(np.int32))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits[0], t)
      loss[i, p] = float(ce[4:].sum())  # The tokens after the 4-token prefix.
  np.testing.assert_allclose(-scores, loss, rtol=1e-4)
  labels = router_lib.discriminative.labels_from_scores(scores)
  np.testing.assert_array_equal(labels, loss.argmin(1))
  assert len(set(labels.tolist())) > 1  # The toy separates documents.


def test_restart_schedule_resets_only_the_schedule_count(independent):
  exp, state = independent
  state = jax.tree.map(jnp.copy, state)  # The inner step donates its inputs.
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 2, 16, 256))
  p, o, m = exp.inner_step(state.params, state.inner_opt, batch)
  jax.block_until_ready(m)
  out = inner.restart_schedule(o)
  is_s = lambda x: isinstance(x, (optax.ScaleByScheduleState, optax.ScaleByAdamState))
  before = [x for x in jax.tree.leaves(o, is_leaf=is_s) if is_s(x)]
  after = [x for x in jax.tree.leaves(out, is_leaf=is_s) if is_s(x)]
  for b, a in zip(before, after):
    if isinstance(b, optax.ScaleByScheduleState):
      assert np.all(np.asarray(b.count) == 1) and np.all(np.asarray(a.count) == 0)
    else:  # Adam keeps its moments and bias-correction count.
      np.testing.assert_array_equal(a.count, b.count)
      for x, y in zip(jax.tree.leaves(a.mu), jax.tree.leaves(b.mu)):
        np.testing.assert_array_equal(x, y)
  assert jnp.asarray(after[0].count).sharding == jnp.asarray(before[0].count).sharding


@pytest.mark.parametrize("at,phases,every,want", [
    (-1, 1, 1, []), (1, 1, 1, [1]), (1, 2, 2, [1, 3]), (0, 1, 1, "fit"), (2, 3, 1, "fit"),
    (1, 2, 0, "between")])
def test_discriminative_steps(at, phases, every, want):
  cfg = helpers.micro_config(**{"dipaco.outer_steps": 4,
                                "routing.discriminative_at_outer_step": at,
                                "routing.discriminative_phases": phases,
                                "routing.discriminative_every": every})
  if isinstance(want, str):
    with pytest.raises(ValueError, match=want):
      routing.discriminative_steps(cfg)
  else:
    assert routing.discriminative_steps(cfg) == want


def test_unknown_router_kind_is_refused(tmp_path):
  cfg = helpers.micro_config(**{"routing.router": "hash"})
  with pytest.raises(ValueError, match="routing.router='hash'"):
    routing.phase0_router(cfg, str(tmp_path), topology.from_config(cfg), None)


def test_a_saved_router_of_another_grid_is_refused(micro, tmp_path):
  cfg, ex = micro
  cfg = helpers.micro_config(**{"routing.router": "kmeans"})
  x = np.random.default_rng(0).normal(size=(40, ex.dim)).astype(np.float32)
  router_lib.fit_kmeans_router(x, (2, 3), restarts=1).save(routing.router_dir(str(tmp_path), 0))
  with pytest.raises(ValueError, match="router from another grid"):
    routing.phase0_router(cfg, str(tmp_path), topology.from_config(cfg), ex)
