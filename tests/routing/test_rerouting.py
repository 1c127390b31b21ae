"""Re-routing every W tokens with a test-time router (dipaco_jax/routing/rerouting.py)."""

import numpy as np
import pytest

from dipaco_jax.routing import rerouting


def test_window_labels_by_hand():
  # Per-token log-likelihoods of 2 paths: path 1 wins token 1 by 5, path 0 the others by 1.
  s = np.array([[[0, -1], [-5, 0], [0, -1], [0, -1]]], np.float32)
  np.testing.assert_array_equal(rerouting.window_labels(s, np.array([4]), 0), [[1, 1, 0, 0]])
  np.testing.assert_array_equal(rerouting.window_labels(s, np.array([4]), 1), [[0, 1, 0, 0]])
  np.testing.assert_array_equal(rerouting.window_labels(s, np.array([4]), 2), [[1, 1, 0, 0]])
  # A shorter sequence ignores the padding after its end.
  np.testing.assert_array_equal(rerouting.window_labels(s, np.array([1]), 0)[0, 0], 0)


def test_chunk_paths_by_hand():
  # Prefix 2, W = 3: the prefix's path scores [2, 5); chunks start at 5 and 8.
  out = rerouting.chunk_paths(
    np.array([3]), np.array([10]), 2, 3, lambda rows, b: np.full(len(rows), b)
  )
  np.testing.assert_array_equal(out[0], [3, 3, 3, 3, 3, 5, 5, 5, 8, 8])


@pytest.mark.parametrize("w", [0, -16, 2.5, True])
def test_bad_window_is_refused(w):
  with pytest.raises(ValueError, match="re-routing window W must be an integer > 0"):
    rerouting.check_window(w)
