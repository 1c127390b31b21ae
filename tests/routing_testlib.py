"""Helpers of the routing tests: a small slice of the embedded corpus, fake documents."""

import itertools

import numpy as np

from dipaco_jax.data import Document

import helpers


def small_corpus(monkeypatch, docs_per_split: int = 200) -> None:
  """Every reader of the embedded corpus (shards, routers) sees its first N docs per split."""
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  orig = tasks.iter_documents
  monkeypatch.setattr(
    tasks,
    "iter_documents",
    lambda task, split, **kw: itertools.islice(orig(task, split, **kw), docs_per_split),
  )


def routed_config(**overrides):
  """micro_config on the shipped 8k vocab, short sequences, an 8-token routing prefix."""
  base = {
    "model.vocab_size": 8192,
    "routing.prefix_len": 8,
    "eval.seq_len": 32,
    "eval.rerouting_windows": (4, 8),
    "eval.reroute_steps": 10,
    "routing.kmeans_restarts": 2,
    "routing.kmeans_iters": 20,
  }
  base.update(overrides)
  return helpers.micro_config(**base)


def fake_documents(
  n: int, *, vocab: int = 256, seed: int = 0, min_len: int = 4, max_len: int = 40, first_id: int = 0
) -> list[Document]:
  """Random documents ending with EOS, two alternating 'domains'."""
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    t = rng.integers(3, vocab, size=int(rng.integers(min_len, max_len))).astype(np.int32)
    docs.append(
      Document(
        first_id + i, np.concatenate([t, [1]]).astype(np.int32), "even" if i % 2 == 0 else "odd"
      )
    )
  return docs
