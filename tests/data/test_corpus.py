"""The shipped corpus and tokenizer: domains, splits, licenses, size, round trip, bad files."""

import collections
import hashlib
import json
import os
import shutil

import pytest

from dipaco_jax.data import corpus
from dipaco_jax.data import vocab


@pytest.fixture(name="records", scope="module")
def _records():
  return list(corpus.read_records())


@pytest.fixture(name="manifest", scope="module")
def _manifest():
  with open(corpus.MANIFEST_PATH, encoding="utf-8") as f:
    return json.load(f)


def test_domains_splits_and_bounds(records, manifest):
  assert len(corpus.DOMAINS) >= 6
  by_split = collections.Counter((r["domain"], r["split"]) for r in records)
  for domain in corpus.DOMAINS:
    for split in corpus.SPLITS:
      assert by_split[domain, split] == manifest["domains"][domain]["docs"][split] > 0
  build = manifest["build"]
  assert all(build["min_chars"] <= len(r["text"]) <= build["max_chars"] for r in records)
  assert [r["doc_id"] for r in records] == list(range(len(records)))  # stable, unique ids
  total = collections.Counter(r["split"] for r in records)
  assert 0.02 < total["router"] / len(records) < 0.05  # the paper's held-out router data


def test_splits_are_deterministic_and_disjoint(records):
  again = [(r["doc_id"], r["split"]) for r in corpus.read_records()]
  assert again == [(r["doc_id"], r["split"]) for r in records]
  assert [r["doc_id"] for r in corpus.read_records("router")] == [
    r["doc_id"] for r in records if r["split"] == "router"
  ]
  texts = {s: {r["text"] for r in records if r["split"] == s} for s in corpus.SPLITS}
  assert not texts["train"] & texts["validation"] and not texts["train"] & texts["router"]
  assert not texts["validation"] & texts["router"]
  # Splits are drawn per source unit (chapter, scene, file): no unit straddles two splits.
  unit_split = {}
  for r in records:
    unit = r["title"].split(" (")[0]
    assert unit_split.setdefault((r["domain"], unit), r["split"]) == r["split"]


def test_shipped_files_match_manifest_and_carry_licenses(manifest):
  size = 0
  for domain, info in manifest["domains"].items():
    for name in (corpus.DOCS_FILE, corpus.LICENSE_FILE):
      path = corpus.domain_path(domain, name)
      with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == info["sha256"][name], path
      size += os.path.getsize(path)
    assert manifest["packages"][info["package"]]["sha256"]
  assert size < 20e6  # the budget for the shipped corpus


def test_tokenizer_round_trips_every_domain(records):
  sp = vocab.load(vocab.DEFAULT_VOCAB_PATH)
  assert sp.vocab_size() == 8192
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  seen = set()
  for r in records:
    if r["domain"] not in seen:  # the first document of each domain, and some odd text
      seen.add(r["domain"])
      assert sp.decode(sp.encode(r["text"])) == r["text"]
  odd = "  def f(x):\n\treturn x  # indent\n\n\nÜnïcødé 日本 🙂 "
  assert sp.decode(sp.encode(odd)) == odd


def test_wrong_or_missing_vocab_file_is_a_clear_error(tmp_path):
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"this is not a model")
  with pytest.raises(ValueError, match="is not a SentencePiece model"):
    vocab.load(str(bad))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    vocab.load(str(tmp_path / "missing.model"))
  with pytest.raises(ValueError, match="needs data.vocab_path"):
    vocab.resolve("c4_en", None)


def test_missing_corpus_file_is_a_clear_error(tmp_path):
  copy = tmp_path / "corpus"
  shutil.copytree(corpus.CORPUS_DIR, copy)
  os.remove(corpus.domain_path("plays", corpus_dir=str(copy)))
  with pytest.raises(FileNotFoundError, match=r"missing: .*plays.*build_corpus"):
    next(corpus.read_records(corpus_dir=str(copy)))
