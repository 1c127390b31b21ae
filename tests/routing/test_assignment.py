"""A run's router over paths -> the documents' shard assignment (routing/assignment.py)."""

import numpy as np
import pytest

from dipaco_jax import data as data_lib
from dipaco_jax import routing
from dipaco_jax.core import topology
from dipaco_jax.routing import router as router_lib

import routing_testlib


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
  micro, tmp_path, monkeypatch
):
  cfg, ex = micro
  docs = {
    "train": routing_testlib.fake_documents(60, seed=1),
    "validation": routing_testlib.fake_documents(30, seed=2, first_id=1000),
  }
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tasks, "iter_documents", lambda task, split, **kw: iter(docs[split]))
  topo = topology.from_config(cfg)
  x = ex.prefix_features([d.tokens for d in docs["train"]])
  pr = routing.PathRouter(
    topo, router_lib.fit_kmeans_router(x, (2, 2), restarts=2), feature_id=ex.fingerprint
  )
  cfg.data.top_k = 2
  assign = routing.make_assignment(cfg, pr, ex)
  assign._batch_size = 8  # pylint: disable=protected-access
  seen = []
  orig_batch = assign.assign_batch
  assign.assign_batch = lambda batch: (seen.append(len(batch)), orig_batch(batch))[1]
  shards = data_lib.prepare_shards(cfg.data, 4, str(tmp_path / "s"), assign=assign)
  assert max(seen) == 8 and sum(seen) == 60 + 30  # Batches of 8, never the split.
  # Asked one document at a time (its own stream read a batch ahead), it answers the same.
  one_by_one = routing.make_assignment(cfg, pr, ex)
  batched = orig_batch(docs["train"])
  assert [one_by_one(d) for d in docs["train"]] == batched
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
