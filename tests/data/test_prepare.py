"""Shards of a data task for a run's workers (dipaco_jax/data/prepare.py)."""

import pytest

from dipaco_jax.data import prepare


def test_split_policy():
  assert prepare.split_policy("allow_validation", "train") == "error"
  assert prepare.split_policy("allow_validation", "validation") == "allow"
  assert prepare.split_policy("error", "validation") == "error"
  with pytest.raises(ValueError, match="empty_shard_policy='skip'"):
    prepare.split_policy("skip", "train")
