"""Tests for routing quality numbers (dipaco_jax/routing/report.py)."""

import math

import numpy as np
import pytest

from dipaco_jax.routing import report as rr

# Six documents on 4 paths (path 3 empty), two domains.
_PATHS = np.array([0, 0, 1, 1, 1, 2])
_DOMAINS = np.array([0, 1, 1, 1, 0, 0])


def test_confusion_purity_by_hand():
  c = rr.confusion(_PATHS, _DOMAINS, 4, 2)
  np.testing.assert_array_equal(c, [[1, 1], [1, 2], [1, 0], [0, 0]])
  # Majority per path: 1 (tie), 2, 1, 0 -> (1 + 2 + 1) / 6.
  assert rr.purity(c) == pytest.approx(4 / 6)


def test_nmi_by_hand():
  c = rr.confusion(_PATHS, _DOMAINS, 4, 2)
  # p(path) = (2, 3, 1)/6, p(domain) = (1/2, 1/2). Cells with p(x,y) = p(x)p(y) add 0:
  # (0,0) and (0,1). The rest: (1,0): 1/6 log((1/6)/(1/4)); (1,1): 2/6 log((2/6)/(1/4));
  # (2,0): 1/6 log((1/6)/(1/12)).
  mi = 1 / 6 * math.log(2 / 3) + 1 / 3 * math.log(4 / 3) + 1 / 6 * math.log(2)
  h_path = -(1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2) + 1 / 6 * math.log(1 / 6))
  h_dom = math.log(2)
  assert rr.nmi(c) == pytest.approx(mi / ((h_path + h_dom) / 2))
  # A bijection paths <-> domains is perfect; an independent table carries nothing.
  assert rr.nmi(np.array([[3, 0], [0, 5]])) == pytest.approx(1.0)
  assert rr.nmi(np.array([[2, 2], [1, 1]])) == pytest.approx(0.0, abs=1e-12)
  assert rr.nmi(np.array([[4]])) == 1.0  # Both constant.


def test_shard_sizes_count_top_k_overlap():
  assert rr.shard_sizes(np.array([[0, 1], [1, 2]]), 4).tolist() == [1, 2, 1, 0]
  # Confusion uses the first (best) column only.
  c = rr.confusion(np.array([[0, 1], [1, 2]]), np.array([1, 0]), 4, 2)
  np.testing.assert_array_equal(c.sum(axis=1), [1, 1, 0, 0])


def test_report_and_markdown():
  rep = rr.report(_PATHS, 4, _DOMAINS, domain_names=("bible", "austen"))
  assert rep.sizes.tolist() == [2, 3, 1, 0]
  assert rep.num_empty == 1
  assert rep.imbalance == pytest.approx(3 / 1.5)  # Largest shard 3 over mean 6/4.
  md = rr.to_markdown(rep)
  assert "purity: 0.6667" in md and "empty: 1" in md
  assert "| path | top-1 docs | bible | austen | majority |" in md
  assert "| 1 | 3 | 1 | 2 | austen |" in md
  assert "| 3 | 0 | 0 | 0 | - |" in md
  plain = rr.to_markdown(rr.report(_PATHS, 4))
  assert "purity" not in plain and "| 2 | 1 |" in plain


def test_bad_inputs():
  with pytest.raises(ValueError, match="path ids must lie in"):
    rr.shard_sizes([0, 4], 4)
  with pytest.raises(ValueError, match="one domain per document"):
    rr.confusion([0, 1], [0], 2, 2)
  with pytest.raises(ValueError, match="domain ids"):
    rr.confusion([0, 1], [0, 2], 2, 2)
  with pytest.raises(ValueError, match="non-empty"):
    rr.confusion(np.zeros((0,), int), np.zeros((0,), int), 2, 2)
  with pytest.raises(ValueError, match="non-empty"):
    rr.shard_sizes(np.zeros((0, 2), int), 2)
