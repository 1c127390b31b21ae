"""Shards cached across workdirs by fingerprint (data/shard_cache.py, shard_plan.prepare_shards)."""

import os

import pytest

from dipaco_jax.config import schema
from dipaco_jax.data import shard_cache
from dipaco_jax.data import tasks
from dipaco_jax.data import vocab
from dipaco_jax.runtime import shard_plan

import helpers
from test_tasks import data_cfg
from test_tasks import write_fake_c4


def run_config(tfds_dir: str, cache: str, **data):
  c = schema.base()
  c.data = data_cfg(tfds_dir, task="c4_en", vocab_path=vocab.DEFAULT_VOCAB_PATH, **data)
  c.data.shard_cache = cache
  return c


def test_cache_root_settings(monkeypatch, tmp_path):
  monkeypatch.setenv("DIPACO_CACHE_DIR", str(tmp_path / "c"))
  assert os.fspath(shard_cache.cache_root("auto")) == str(tmp_path / "c" / "shard_sets")
  monkeypatch.delenv("DIPACO_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
  assert os.fspath(shard_cache.cache_root("auto")) == str(
    tmp_path / "x" / "dipaco_jax" / "shard_sets"
  )
  assert shard_cache.cache_root("off") is None
  assert os.fspath(shard_cache.cache_root("gs://b/cache")) == "gs://b/cache/shard_sets"


def test_a_second_workdir_copies_the_shards_without_reading_the_data(tmp_path, monkeypatch):
  tfds_dir = str(tmp_path / "tfds")
  write_fake_c4(tfds_dir, {"train": 120, "validation": 12})
  cache = str(tmp_path / "cache")
  c = run_config(tfds_dir, cache)
  first = str(tmp_path / "a" / "shards")
  shard_plan.prepare_shards(c, 3, first)
  (entry,) = os.listdir(os.path.join(cache, "shard_sets"))
  assert entry == shard_cache.fingerprint(c.data, 3)
  assert helpers.tree_bytes(os.path.join(cache, "shard_sets", entry)) == helpers.tree_bytes(first)

  def no_reading(*args, **kwargs):
    raise AssertionError("the documents were read again")

  monkeypatch.setattr(tasks, "iter_documents", no_reading)
  second = str(tmp_path / "b" / "shards")
  shard_set = shard_plan.prepare_shards(c, 3, second)
  assert helpers.tree_bytes(second) == helpers.tree_bytes(first)  # Bit for bit.
  assert shard_set.num_docs("validation").sum() == 12
  # Another seed is another fingerprint: nothing is reused, the documents are read.
  with pytest.raises(AssertionError, match="read again"):
    shard_plan.prepare_shards(run_config(tfds_dir, cache, seed=1), 3, str(tmp_path / "c"))
  # Another worker count as well.
  assert shard_cache.fingerprint(c.data, 4) != shard_cache.fingerprint(c.data, 3)


def test_a_run_with_its_own_shards_or_the_cache_off_is_left_alone(tmp_path):
  tfds_dir = str(tmp_path / "tfds")
  write_fake_c4(tfds_dir, {"train": 60, "validation": 6})
  cache = str(tmp_path / "cache")
  c = run_config(tfds_dir, cache)
  shard_plan.prepare_shards(c, 2, str(tmp_path / "a"))
  # A shard dir that already holds files (a run's partly written shards) is not replaced.
  own = tmp_path / "b"
  own.mkdir()
  (own / "pending.json").write_text("{}")
  assert not shard_cache.fetch(cache, c.data, 2, str(own))
  assert helpers.tree_bytes(own) == {"pending.json": b"{}"}
  # "off": neither read nor written.
  off = run_config(tfds_dir, "off")
  shard_plan.prepare_shards(off, 2, str(tmp_path / "d"))
  assert len(os.listdir(os.path.join(cache, "shard_sets"))) == 1
  assert not shard_cache.fetch("off", off.data, 2, str(tmp_path / "e"))
  assert not (tmp_path / "e").exists()
