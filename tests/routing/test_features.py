"""θ̄'s prefix features of documents (dipaco_jax/routing/features.py)."""

import numpy as np
import pytest

from dipaco_jax.config import sections
from dipaco_jax.core import model as model_lib
from dipaco_jax.routing import features


def test_prefix_feature_is_the_mean_hidden_state_over_the_prefix(micro):
  cfg, ex = micro
  long, short = np.arange(3, 13, dtype=np.int32), np.array([7, 8, 9], np.int32)
  got = ex.prefix_features([long, short])
  model = model_lib.Transformer(sections.ModelConfig.of(cfg))
  for seq, n, row in ((long, 5, 0), (short, 3, 1)):
    # [BOS, t_0..t_{n-1}]: positions 1..n read the n prefix tokens.
    inputs = np.concatenate([[0], seq[:n]])[None].astype(np.int32)
    _, h = model.apply({"params": ex.params}, inputs, return_hidden=True)
    np.testing.assert_allclose(got[row], np.asarray(h[0, 1 : n + 1]).mean(0), rtol=2e-5, atol=2e-6)
  # The running mean at b = prefix_len is the prefix feature.
  np.testing.assert_allclose(ex.running_means(long[None])[0, 5], got[0], rtol=1e-5, atol=1e-6)


def test_empty_prefix_is_refused(micro):
  cfg, ex = micro
  with pytest.raises(ValueError, match="prefix length must be an integer >= 1"):
    features.FeatureExtractor(sections.ModelConfig.of(cfg), ex.params, prefix_len=0)
  with pytest.raises(ValueError, match="empty prefix"):
    ex.prefix_features([np.array([5], np.int32), np.array([], np.int32)])
