"""WorkerBatcher: packing without cross-document attention, seeded order, exact resume."""

import json

import numpy as np
import pytest

from dipaco_jax import data

SEQ, BATCH = 16, 3


@pytest.fixture(name="shard_set", scope="module")
def _shard_set(tmp_path_factory):
  """Two paths; every token of document i is 3 + i (EOS excepted), so a token names its doc."""
  rng = np.random.default_rng(0)
  docs = [
    data.Document(i, np.append(np.full(int(rng.integers(1, 40)), 3 + i), 1).astype(np.int32), "d")
    for i in range(60)
  ]
  shard_dir = str(tmp_path_factory.mktemp("shards"))
  data.write_shards(shard_dir, "train", docs, data.random_assignment(2, seed=3), 2)
  return data.ShardSet(shard_dir)


def batches(batcher, n):
  return [batcher.next_batch() for _ in range(n)]


def test_shapes_dtypes_and_keys(shard_set):
  batch = data.WorkerBatcher(
    shard_set, "train", [0, 1], seq_len=SEQ, batch_size=BATCH, seed=0
  ).next_batch()
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"}
  for key, value in batch.items():
    assert value.shape == (2, BATCH, SEQ)
    assert value.dtype == (np.float32 if key == "weights" else np.int32)


def test_packing_never_crosses_documents(shard_set):
  batcher = data.WorkerBatcher(shard_set, "train", [0, 1], seq_len=SEQ, batch_size=BATCH, seed=0)
  for batch in batches(batcher, 20):
    for p in range(2):
      for r in range(BATCH):
        seg, tgt, inp, pos = (
          batch[k][p, r] for k in ("segment_ids", "targets", "inputs", "positions")
        )
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
        for s in np.unique(seg[seg > 0]):
          idx = np.flatnonzero(seg == s)
          piece = tgt[idx]
          assert len(set(piece[piece != 1].tolist())) <= 1  # one document per segment
          assert not np.any(piece[:-1] == 1)  # EOS can only close a segment
          np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart
          np.testing.assert_array_equal(inp[idx], np.concatenate([[0], piece[:-1]]))
          # Attention inside a segment sees only this document: inputs hold no other doc's ids.
          assert set(inp[idx][1:].tolist()) <= set(piece.tolist())
        assert np.all(batch["weights"][p, r] == 1.0)  # repeat=True: rows are always full


def test_one_epoch_yields_each_document_exactly_once_then_stops(shard_set):
  batcher = data.WorkerBatcher(
    shard_set, "train", [1], seq_len=SEQ, batch_size=BATCH, seed=5, repeat=False
  )
  seen = [b for b in batcher]
  targets = np.concatenate([b["targets"][0].reshape(-1) for b in seen])
  weights = np.concatenate([b["weights"][0].reshape(-1) for b in seen])
  docs = shard_set.documents(1, "train")
  assert weights.sum() == shard_set.sizes("train")[1]
  assert np.all(targets[weights == 0] == 0) and np.all(weights[: int(weights.sum())] == 1)
  stream = targets[weights == 1]
  order = [int(t) - 3 for t in stream[np.r_[0, np.flatnonzero(stream == 1)[:-1] + 1]]]
  assert sorted(order) == sorted(d.doc_id for d in docs)  # every document once
  assert order != sorted(order)  # shuffled
  with pytest.raises(StopIteration):
    batcher.next_batch()


def test_order_is_seeded_per_path_and_reshuffled_per_epoch(shard_set):
  def run(workers, seed, n=30):
    b = data.WorkerBatcher(shard_set, "train", workers, seq_len=SEQ, batch_size=BATCH, seed=seed)
    return np.stack([x["targets"] for x in batches(b, n)])

  both = run([0, 1], seed=0)
  np.testing.assert_array_equal(both, run([0, 1], seed=0))
  np.testing.assert_array_equal(both[:, 0], run([0], seed=0)[:, 0])  # paths are independent
  np.testing.assert_array_equal(both[:, 1], run([1], seed=0)[:, 0])
  assert not np.array_equal(both, run([0, 1], seed=1))
  # Epoch 2 is a different permutation: compare the first document of each epoch's stream.
  batcher = data.WorkerBatcher(shard_set, "train", [0], seq_len=SEQ, batch_size=BATCH, seed=0)
  firsts = []
  for _ in range(3):
    firsts.append(batcher._streams[0]._order_of_epoch().tolist())  # pylint: disable=protected-access
    batcher._streams[0].epoch += 1  # pylint: disable=protected-access
  assert firsts[0] != firsts[1] != firsts[2]


def test_resume_gives_identical_batches_across_epochs(shard_set):
  kwargs = dict(seq_len=SEQ, batch_size=BATCH, seed=11)
  first = data.WorkerBatcher(shard_set, "train", [0, 1], **kwargs)
  batches(first, 23)
  state = json.loads(json.dumps(first.get_state()))  # survives a JSON checkpoint
  expected = batches(first, 40)  # crosses several epoch boundaries (~330 tokens per path)
  assert first.get_state()["workers_position"][0][0] >= 2
  resumed = data.WorkerBatcher(shard_set, "train", [0, 1], **kwargs)
  resumed.set_state(state)
  for want, have in zip(expected, batches(resumed, 40)):
    for key in want:
      np.testing.assert_array_equal(want[key], have[key])
  other = data.WorkerBatcher(shard_set, "train", [0, 1], seq_len=SEQ, batch_size=BATCH, seed=12)
  with pytest.raises(ValueError, match="seed"):
    other.set_state(state)


def _docs_read(batches_, worker):
  """Ids of the documents whose tokens fill a worker's rows (a token t names document t - 3)."""
  ids = set()
  for b in batches_:
    t = b["targets"][worker][b["weights"][worker] > 0]
    ids |= {int(x) - 3 for x in t if x != 1}
  return ids


def test_heldout_documents_never_reach_the_training_batches(shard_set):
  from dipaco_jax.data import feed as feed_lib  # pylint: disable=g-import-not-at-top

  n_W = shard_set.num_docs("train")
  kw = dict(seq_len=SEQ, batch_size=BATCH, seed=4)
  # Worker 0 of ~30 documents: min(5 docs, floor(0.25 x n)) = 5 held out.
  rest, heldout = (data.Holdout(docs=5, fraction=0.25, part=p) for p in ("rest", "heldout"))
  assert rest.count(int(n_W[0])) == 5 and rest.count(19) == 4 and rest.count(3) == 0
  train = feed_lib.Feed(shard_set, "train", [0, 1], slice(0, BATCH), holdout=rest, **kw)
  held = feed_lib.Feed(shard_set, "train", [0, 1], slice(0, BATCH), holdout=heldout, **kw)
  many = [train.next_batch() for _ in range(200)]  # Several epochs of every worker's rest.
  for w in (0, 1):
    ids = [d.doc_id for d in shard_set.documents(w, "train")]
    held_ids = {ids[i] for i in heldout.indices(len(ids), w, seed=4)}
    assert len(held_ids) == 5
    # Every other document is trained on, no held-out one ever; the held-out batches read
    # the held-out documents only.
    assert _docs_read(many, w) == set(ids) - held_ids
    assert _docs_read([held.next_batch() for _ in range(3)], w) == held_ids
  # Another seed holds out other documents; a state saved without a holdout does not resume one.
  assert not np.array_equal(heldout.indices(30, 0, seed=4), heldout.indices(30, 0, seed=5))
  plain = data.WorkerBatcher(shard_set, "train", [0], **kw)
  with pytest.raises(ValueError, match="holdout"):
    data.WorkerBatcher(shard_set, "train", [0], holdout=rest, **kw).set_state(plain.get_state())


def test_a_shard_too_small_to_spare_a_document_gets_padding_for_its_heldout_batches(shard_set):
  from dipaco_jax.data import feed as feed_lib  # pylint: disable=g-import-not-at-top

  heldout = data.Holdout(docs=5, fraction=0.01, part="heldout")  # floor(0.01 x ~30) = 0.
  held = feed_lib.Feed(
    shard_set,
    "train",
    [0, 1],
    slice(0, BATCH),
    holdout=heldout,
    seq_len=SEQ,
    batch_size=BATCH,
    seed=0,
  )
  assert not held.next_batch()["weights"].any()


def _row_docs(batch, worker):
  """Per row: the set of documents its tokens come from (a token t names document t - 3)."""
  return [
    {int(x) - 3 for x in row[w > 0] if x != 1}
    for row, w in zip(batch["targets"][worker], batch["weights"][worker])
  ]


def test_interleave_reads_each_row_from_its_own_lane_and_every_document_once(shard_set):
  docs = {d.doc_id: d for d in shard_set.documents(0, "train")}
  n = len(docs)
  kw = dict(seq_len=4, batch_size=3, seed=2, interleave=3)
  batcher = data.WorkerBatcher(shard_set, "train", [0], repeat=False, **kw)
  seen = list(batcher)
  order = sorted(docs)  # Shard order: lane j holds documents j, j + 3, ... of the shard.
  shard_ids = [d.doc_id for d in shard_set.documents(0, "train")]
  lane_of = {doc_id: i % 3 for i, doc_id in enumerate(shard_ids)}
  for b in seen:
    for r, ids in enumerate(_row_docs(b, 0)):
      assert all(lane_of[i] == r % 3 for i in ids), (r, ids)  # Row r reads lane r mod 3.
  # One pass reads every token of every document once, packed without crossing documents.
  tokens = np.concatenate([b["targets"][0][b["weights"][0] > 0] for b in seen])
  assert len(tokens) == shard_set.sizes("train")[0]
  assert sorted({int(t) - 3 for t in tokens if t != 1}) == order
  for b in seen:
    seg, tgt = b["segment_ids"][0], b["targets"][0]
    for r in range(3):
      for s in np.unique(seg[r][seg[r] > 0]):
        piece = tgt[r][seg[r] == s]
        assert len(set(piece[piece != 1].tolist())) <= 1
  # Rows of one batch come from three documents at once; without interleave the same 12 tokens
  # span the documents that follow one another.
  many = data.WorkerBatcher(shard_set, "train", [0], **kw)
  first = _row_docs(many.next_batch(), 0)
  assert len(set().union(*first)) >= 3 and n >= 3


def test_interleave_resumes_exactly_and_is_refused_by_a_plain_batchers_state(shard_set):
  kw = dict(seq_len=SEQ, batch_size=BATCH, seed=4, interleave=BATCH)
  first = data.WorkerBatcher(shard_set, "train", [0, 1], **kw)
  batches(first, 17)
  state = json.loads(json.dumps(first.get_state()))
  assert len(state["workers_position"][0]) == BATCH  # One position per lane.
  expected = batches(first, 30)
  resumed = data.WorkerBatcher(shard_set, "train", [0, 1], **kw)
  resumed.set_state(state)
  for want, have in zip(expected, batches(resumed, 30)):
    for key in want:
      np.testing.assert_array_equal(want[key], have[key])
  plain = data.WorkerBatcher(shard_set, "train", [0, 1], seq_len=SEQ, batch_size=BATCH, seed=4)
  with pytest.raises(ValueError, match="interleave"):
    plain.set_state(state)
  with pytest.raises(ValueError, match="interleave >= 1"):
    data.WorkerBatcher(shard_set, "train", [0], seq_len=SEQ, batch_size=BATCH, seed=4, interleave=0)
