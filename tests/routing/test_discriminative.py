"""Tests for the discriminative router (dipaco_jax/routing/discriminative.py)."""

import numpy as np
import pytest

from dipaco_jax.routing import discriminative as dm

_P = 8


def _skewed(seed=0, n=2000, d=8):
  """Scores with a weak feature signal and +4.5 on path 0: ~90% of labels go to path 0."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  s = 0.5 * x @ rng.normal(size=(d, _P)) + rng.normal(size=(n, _P))
  s[:, 0] += 4.5
  return x, s


@pytest.fixture(scope="module")
def skewed_logits():
  x, s = _skewed()
  labels = dm.labels_from_scores(s)
  params = dm.fit_logistic(x, labels, _P)
  return x, s, labels, params, dm.linear_logits(x, params)


def test_labels_are_argmax_score_path():
  s = np.array([[0.0, -1.0, -2.0], [-5.0, -1.0, -3.0], [-2.0, -2.0, -1.0]])
  np.testing.assert_array_equal(dm.labels_from_scores(s), [0, 1, 2])


def test_target_distribution_floors_unused_paths():
  # Labels [0, 0, 1] over 3 paths: shares (2/3, 1/3, 0); path 2 is floored to 1/N = 1/3,
  # and renormalising (2/3, 1/3, 1/3) by 4/3 gives (1/2, 1/4, 1/4).
  np.testing.assert_allclose(dm.target_distribution("labels", [0, 0, 1], 3), [0.5, 0.25, 0.25])
  np.testing.assert_allclose(dm.target_distribution("uniform", [0, 0, 1], 3), [1 / 3] * 3)
  np.testing.assert_allclose(
    dm.target_distribution([1, 3, 0], [0, 0, 1, 2], 3), [0.2, 0.6, 0.2]
  )  # (1/4, 3/4, 0) -> floor 1/4 -> / 5/4.
  with pytest.raises(ValueError, match="target"):
    dm.target_distribution("sizes", [0], 3)


def test_logistic_learns_separable_problem_deterministically():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(600, 4)).astype(np.float32) * 3 + 5  # Off-centre: tests standardising.
  labels = np.argmax(x @ rng.normal(size=(4, 3)), axis=1)
  a = dm.fit_logistic(x, labels, 3)
  # Labels are a linear argmax of x, so a linear classifier can fit nearly all of them.
  assert np.mean(dm.predict_top_k(x, a)[:, 0] == labels) > 0.95
  b = dm.fit_logistic(x, labels, 3)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  mini = dm.fit_logistic(x, labels, 3, batch_size=64, steps=300)
  assert np.mean(dm.predict_top_k(x, mini)[:, 0] == labels) > 0.9


def test_skewed_labels_leave_raw_classifier_with_empty_paths(skewed_logits):
  _, _, labels, _, logits = skewed_logits
  assert np.mean(labels == 0) > 0.85
  # The problem the paper's bias fix addresses: small paths vanish from the argmax.
  assert (np.bincount(logits.argmax(1), minlength=_P) == 0).any()


@pytest.mark.parametrize("target", ["labels", "uniform", [1, 1, 1, 1, 2, 2, 2, 2]])
def test_calibrated_bias_matches_target_and_fills_every_path(skewed_logits, target):
  _, _, labels, _, logits = skewed_logits
  t = dm.target_distribution(target, labels, _P)
  b, info = dm.calibrate_bias(logits, t, tol=0.1)
  c = np.bincount((logits + b).argmax(1), minlength=_P)
  assert (c > 0).all() and info["empty"] == 0
  # tol=0.1: each shard within a factor 1.1 of its target size (both +1 document).
  ratio = (c + 1) / (len(labels) * t + 1)
  assert ratio.max() <= 1.1 + 1e-9 and ratio.min() >= 1 / 1.1 - 1e-9
  assert info["tv"] < 0.05


def test_guarantee_step_fills_empty_paths_without_iterating(skewed_logits):
  _, _, labels, _, logits = skewed_logits
  t = dm.target_distribution("labels", labels, _P)
  # tol=100 (log 101 = 4.6, above every raw shard's |log (c+1)/(target+1)| <= log 12 here)
  # accepts the zero bias at once, so only the guarantee step runs: it moves exactly one
  # document into each empty path.
  raw = np.bincount(logits.argmax(1), minlength=_P)
  b, info = dm.calibrate_bias(logits, t, tol=100.0)
  c = np.bincount((logits + b).argmax(1), minlength=_P)
  assert info["iters"] == 1 and (c > 0).all()
  np.testing.assert_array_equal(c[raw == 0], 1)
  assert c.sum() == raw.sum()


def test_fit_discriminative_end_to_end(skewed_logits):
  x, s, labels, _, _ = skewed_logits
  params, info = dm.fit_discriminative(x, s)
  pred = dm.predict_top_k(x, params, top_k=3)
  assert pred.shape == (len(x), 3)
  c = np.bincount(pred[:, 0], minlength=_P)
  assert (c > 0).all() and info["empty"] == 0
  assert info["max_ratio_err"] <= np.log(1.1) + 1e-9
  # Top-k is ordered: the first column is the argmax of the logits.
  np.testing.assert_array_equal(pred[:, 0], dm.linear_logits(x, params).argmax(1))


def test_bad_inputs():
  with pytest.raises(ValueError, match="cannot fill"):
    dm.calibrate_bias(np.zeros((2, 3)), np.full(3, 1 / 3))
  with pytest.raises(ValueError, match="positive fractions"):
    dm.calibrate_bias(np.zeros((4, 3)), np.array([1.0, 0.0, 0.0]))
  with pytest.raises(ValueError, match="NaN"):
    dm.labels_from_scores(np.array([[0.0, np.nan]]))
  with pytest.raises(ValueError, match="labels must be"):
    dm.fit_logistic(np.zeros((3, 2)), [0, 1, 5], 3)
  with pytest.raises(ValueError, match="rows but scores"):
    dm.fit_discriminative(np.zeros((3, 2)), np.zeros((4, 3)))


def test_min_share_floors_every_target_at_a_fraction_of_the_uniform_share():
  # Label shares [0.7, 0.2, 0.1, 0] (0 floored at 1/N = 0.1 first: [0.7, 0.2, 0.1, 0.1] / 1.1).
  labels = [0] * 7 + [1] * 2 + [2]
  base = dm.target_distribution("labels", labels, 4)
  np.testing.assert_allclose(base, np.array([0.7, 0.2, 0.1, 0.1]) / 1.1)
  # min_share 0.5 -> floor 0.5 / 4 = 0.125 for paths 2 and 3 (0.0909 each); the other two
  # share 1 - 0.25 = 0.75 in proportion 7 : 2 -> 0.58333, 0.16667 (both above the floor).
  t = dm.target_distribution("labels", labels, 4, min_share=0.5)
  np.testing.assert_allclose(t, [0.75 * 7 / 9, 0.75 * 2 / 9, 0.125, 0.125], rtol=1e-12)
  # Scaling the rest down can push another share under the floor: [0.9, 0.06, 0.02, 0.02]
  # with min_share 1 (uniform floor 0.25) ends uniform.
  np.testing.assert_allclose(
    dm.target_distribution([90, 6, 2, 2], [0], 4, min_share=1.0), [0.25] * 4
  )
  np.testing.assert_allclose(dm.target_distribution("labels", labels, 4, min_share=0.0), base)
  with pytest.raises(ValueError, match="min_share must lie in"):
    dm.target_distribution("labels", labels, 4, min_share=1.5)


def test_min_share_calibrated_router_feeds_the_starved_path():
  x, s = _skewed()  # Label counts [1806, 48, 49, 11, 58, 18, 7, 3]: path 7 starves.
  _, plain = dm.fit_discriminative(x, s)
  _, floored = dm.fit_discriminative(x, s, min_share=0.8)
  n, p = s.shape
  # Calibrated to within tol = 0.1 (+1 doc each side) of a target >= 0.8 / P of the documents.
  assert floored["docs_min"] + 1 >= (0.8 * n / p + 1) / 1.1
  assert plain["docs_min"] < 0.05 * n / p and floored["docs_min"] >= 0.7 * n / p
  assert 0.0 <= floored["moved_off_label"] <= 1.0 and floored["docs_max"] <= n


def test_min_share_gives_paths_that_won_no_label_documents_of_their_own():
  # Paths 2 and 3 never win a label (-3 on their scores): trained on best-path labels alone
  # their classifier columns are equal, so any bias hands a document to one of the two only.
  rng = np.random.default_rng(1)
  x = rng.normal(size=(400, 4)).astype(np.float32)
  s = x @ rng.normal(size=(4, 4)) + 0.3 * rng.normal(size=(400, 4))
  s[:, 2:] = -3.0 - np.abs(s[:, 2:])
  assert set(dm.labels_from_scores(s).tolist()) == {0, 1}
  # Balanced labels: bias on the scores floors paths 2 and 3 at 0.5 / 4 = 12.5% (50 documents),
  # within the calibration's tolerance (+1 each side, a factor 1.1); 0 and 1 keep their best.
  t = dm.target_distribution("labels", dm.labels_from_scores(s), 4, min_share=0.5)
  counts = np.bincount(dm.balanced_labels(s, t), minlength=4)
  assert ((counts[2:] + 1) / 51 >= 1 / 1.1).all() and ((counts[2:] + 1) / 51 <= 1.1).all()
  _, info = dm.fit_discriminative(x, s, min_share=0.5)
  assert info["docs_min"] >= 0.5 * 100 / 1.1 - 1 and info["argmin_docs_min"] == 0


def test_token_weighted_calibration_balances_tokens_not_documents():
  # Four documents, margins (path 1 - path 0) -3, -1, 1, 3; tokens 6, 2, 2, 2 (12 in all).
  # A uniform target in tokens is 6 per path: document 0 alone on path 0. By document
  # count it is 2 + 2 (8 tokens against 4).
  logits = np.array([[0.0, -3.0], [0.0, -1.0], [0.0, 1.0], [0.0, 3.0]])
  w = np.array([6.0, 2.0, 2.0, 2.0])
  t = np.array([0.5, 0.5])
  b, info = dm.calibrate_bias(logits, t, tol=0.01, weights_N=w)
  np.testing.assert_array_equal(np.argmax(logits + b, axis=1), [0, 1, 1, 1])
  assert info["max_ratio_err"] == 0.0 and info["tv"] == 0.0
  b, _ = dm.calibrate_bias(logits, t, tol=0.01)
  np.testing.assert_array_equal(np.argmax(logits + b, axis=1), [0, 0, 1, 1])
  # Weighted label frequencies: labels [0, 0, 0, 1] with tokens [1, 1, 2, 4] -> [4, 4] / 8
  # (by count: [0.75, 0.25]).
  np.testing.assert_allclose(
    dm.target_distribution("labels", [0, 0, 0, 1], 2, weights_N=[1, 1, 2, 4]), [0.5, 0.5]
  )
  with pytest.raises(ValueError, match="positive finite"):
    dm.calibrate_bias(logits, t, weights_N=[1.0, 0.0, 1.0, 1.0])


def test_discriminative_bias_calibrates_on_the_given_sample():
  # The router split is skewed, the calibration sample is what the shards are cut from:
  # its token shares meet the floor, whatever the scored documents' counts do.
  x, s = _skewed()
  rng = np.random.default_rng(1)
  cx = rng.normal(size=(3000, x.shape[1])).astype(np.float32)
  cw = rng.integers(10, 2000, size=3000).astype(np.float64)
  params, info = dm.fit_discriminative(x, s, min_share=0.8, calibration=(cx, cw))
  got_P = np.bincount(dm.predict_top_k(cx, params)[:, 0], weights=cw, minlength=_P)
  # Each path's token share >= min_share / P within the calibration tolerance (factor 1.1).
  assert got_P.min() / got_P.sum() >= 0.8 / _P / 1.1
  assert info["calib_min_over_mean"] == pytest.approx(got_P.min() / got_P.mean())
