"""Per-token log-likelihoods under chosen paths (dipaco_jax/routing/scoring.py)."""

import jax
import numpy as np
import optax

from dipaco_jax.core import model as model_lib
from dipaco_jax.routing import phases
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import scoring

import helpers
import routing_testlib


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
