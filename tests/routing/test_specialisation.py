"""The specialisation report by hand (dipaco_jax/routing/specialisation.py)."""

import json

import numpy as np
import pytest

from dipaco_jax.routing import specialisation as sp

# Specialisation: 3 paths, 6 documents. Per document: its shard's path, scored tokens n, the
# per-token loss of paths 0/1/2 (nll = loss x n), its routed path, its domain.
#   d0: shard 0, n=2, loss [1, 3, 3] -> nll [ 2,  6,  6], routed 0, "a"  (best 0)
#   d1: shard 0, n=2, loss [2, 1, 4] -> nll [ 4,  2,  8], routed 1, "a"  (best 1)
#   d2: shard 1, n=4, loss [3, 1, 2] -> nll [12,  4,  8], routed 1, "a"  (best 1)
#   d3: shard 2, n=1, loss [4, 4, 2] -> nll [ 4,  4,  2], routed 2, "b"  (best 2)
#   d4: shard 2, n=3, loss [2, 4, 3] -> nll [ 6, 12,  9], routed 2, "b"  (best 0: misrouted)
#   d5: shard 1, n=0 (no scored token: left out, and its domain "c" with it)
_NLL = np.array([[2, 6, 6], [4, 2, 8], [12, 4, 8], [4, 4, 2], [6, 12, 9], [0, 0, 0]], float)
_TOK = np.array([2, 2, 4, 1, 3, 0])
_ROUTED = np.array([0, 1, 1, 2, 2, 0])
_SHARD = np.array([0, 0, 1, 2, 2, 1])
_DOM = np.array(["a", "a", "a", "b", "b", "c"])


def test_specialisation_by_hand():
  s = sp.compute(_NLL, _TOK, _ROUTED, _SHARD, _DOM, num_paths=3)
  # Shard 0 = d0 + d1 (4 tokens): path sums 6, 8, 14. Shard 1 = d2 (4 tokens): 12, 4, 8.
  # Shard 2 = d3 + d4 (4 tokens): 10, 16, 11. M[p, q] = path p's sum on shard q / 4.
  want = [[1.5, 3.0, 2.5], [2.0, 1.0, 4.0], [3.5, 2.0, 2.75]]
  np.testing.assert_allclose(s.loss_matrix, want)
  assert s.shard_docs.tolist() == [2, 1, 2] and s.shard_tokens.tolist() == [4, 4, 4]
  assert s.left_out == 1  # d5.
  # Rows: 1.5 - (3 + 2.5)/2, 1 - (2 + 4)/2, 2.75 - (3.5 + 2)/2.
  np.testing.assert_allclose(s.own_minus_other_shards, [-1.25, -2.0, 0.0])
  # Columns: 1.5 - (2 + 3.5)/2, 1 - (3 + 2)/2, 2.75 - (2.5 + 4)/2.
  np.testing.assert_allclose(s.own_minus_other_paths, [-1.25, -1.5, -0.5])
  # Diagonal mean 5.25/3 = 1.75; off-diagonal 17/6.
  assert s.diagonal_gap == pytest.approx(1.75 - 17 / 6)
  # Centred: row means 7/3, 7/3, 8.25/3 = 2.75; column means 7/3, 2, 9.25/3; grand mean 22.25/9.
  # Entry (0, 0): 1.5 - 7/3 - 7/3 + 22.25/9 = (13.5 - 42 + 22.25)/9 = -6.25/9.
  c = s.centred_matrix
  assert c[0, 0] == pytest.approx(-6.25 / 9)
  np.testing.assert_allclose([c.sum(0), c.sum(1)], 0, atol=1e-12)
  assert np.diag(c).mean() - c[~np.eye(3, dtype=bool)].mean() == pytest.approx(s.diagonal_gap)
  # 12 tokens. Routed: 2 + 2 + 4 + 2 + 9 = 19. Shard's path: 2 + 4 + 4 + 2 + 9 = 21.
  # Random: the paths' totals 28, 28, 33 averaged = 89/3. Oracle: 2 + 2 + 4 + 2 + 6 = 16.
  assert s.loss == pytest.approx(
    {"routed": 19 / 12, "shard": 21 / 12, "random": 89 / 36, "oracle": 16 / 12}
  )
  assert s.routed_gain_share == pytest.approx((89 - 57) / (89 - 48))  # In 36ths.
  assert s.routed_best_share == pytest.approx(4 / 5)  # All but d4.
  assert s.shard_best_share == pytest.approx(3 / 5)  # d0, d2, d3 (d1's best is 1, d4's 0).
  # Domain a = d0, d1, d2 (8 tokens): routed 2 + 2 + 4 = 8, oracle 8; paths 18, 12, 22.
  # Domain b = d3, d4 (4 tokens): routed 2 + 9 = 11, oracle 2 + 6 = 8; paths 10, 16, 11.
  assert s.domain_names == ("a", "b")
  assert s.domain_docs.tolist() == [3, 2] and s.domain_tokens.tolist() == [8, 4]
  np.testing.assert_allclose(s.domain_routed_loss, [1.0, 11 / 4])
  np.testing.assert_allclose(s.domain_oracle_loss, [1.0, 2.0])
  np.testing.assert_allclose(s.domain_path_loss, [[18 / 8, 12 / 8, 22 / 8], [10 / 4, 4, 11 / 4]])
  assert s.domain_routes.tolist() == [[1, 2, 0], [0, 0, 2]]
  assert s.domain_majority_path.tolist() == [1, 2] and s.domain_best_path.tolist() == [1, 0]
  md = sp.to_markdown(s, ["x0", "x1", "x2"])
  assert "| x0 | **1.5000** | 3.0000 | 2.5000 | -1.2500 |" in md
  assert "| own - other paths | -1.2500 | -1.5000 | -0.5000 | |" in md
  assert "| b | 2 | 2.7500 | 2.0000 | x2 (100%) | x0 (2.5000) |" in md
  assert "routed path = best path for 80.0% of documents" in md
  d = s.as_dict()
  assert d["loss_matrix"] == want and d["domain_best_path"] == [1, 0]
  assert json.loads(json.dumps(d, allow_nan=False)) == d


def test_specialisation_empty_shard_ties_no_domains_and_bad_inputs():
  # Path 2's shard holds no document: its column is NaN (null in JSON) and leaves the means.
  # One token each: M = [[1, 4, nan], [3, 2, nan], [1, 5, nan]].
  nll = np.array([[1.0, 3.0, 1.0], [4.0, 2.0, 5.0]])
  s = sp.compute(nll, [1, 1], [2, 1], [0, 1])
  np.testing.assert_allclose(s.loss_matrix, [[1, 4, np.nan], [3, 2, np.nan], [1, 5, np.nan]])
  np.testing.assert_allclose(s.own_minus_other_shards, [1 - 4, 2 - 3, np.nan])
  np.testing.assert_allclose(s.own_minus_other_paths, [1 - (3 + 1) / 2, 2 - (4 + 5) / 2, np.nan])
  assert s.routed_best_share == 1.0  # d0's routed path 2 ties its best (1.0).
  assert np.isnan(s.centred_matrix[:, 2]).all() and not np.isnan(s.centred_matrix[:, :2]).any()
  assert s.domain_names == () and s.domain_routes.shape == (0, 3)
  d = s.as_dict()
  assert d["loss_matrix"][0][2] is None and d["own_minus_other_shards"][2] is None
  json.dumps(d, allow_nan=False)
  assert "| 0 | **1.0000** | 4.0000 | - | -3.0000 |" in sp.to_markdown(s)
  with pytest.raises(ValueError, match="one tokens entry per document"):
    sp.compute(nll, [1], [0, 1], [0, 1])
  with pytest.raises(ValueError, match="routed paths must lie in"):
    sp.compute(nll, [1, 1], [0, 3], [0, 1])
  with pytest.raises(ValueError, match="no document has a scored token"):
    sp.compute(nll, [0, 0], [0, 1], [0, 1])
  with pytest.raises(ValueError, match="num_paths=4"):
    sp.compute(nll, [1, 1], [0, 1], [0, 1], num_paths=4)
