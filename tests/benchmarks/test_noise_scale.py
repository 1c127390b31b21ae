"""benchmarks/noise_scale.py: the simple gradient noise scale, by hand and on a real run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import helpers

ROOT = helpers.ROOT
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import noise_scale  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_two_workers_by_hand():
  # Two workers of b = 3 tokens each: g1 = (3, 1), g2 = (1, 3).
  # |g_small|² = mean(10, 10) = 10; the average (2, 2) has |g_big|² = 8; B_big = 6.
  # |G|² = (6 * 8 - 3 * 10) / (6 - 3) = 6;  tr Σ = (10 - 8) / (1/3 - 1/6) = 12;  B = 12 / 6 = 2.
  g2, trace, b_small, b_big = noise_scale.from_gradients(
    np.array([[3.0, 1.0], [1.0, 3.0]]), np.array([3, 3])
  )
  assert (b_small, b_big) == (3, 6)
  np.testing.assert_allclose([g2, trace, trace / g2], [6.0, 12.0, 2.0])
  np.testing.assert_allclose(noise_scale.estimate(10.0, 8.0, 3, 6), (6.0, 12.0))


def test_recovers_a_known_noise_scale_from_sampled_gradients():
  # Per-token gradients G + ξ, ξ ~ N(0, σ² I) in D dimensions: a batch of b tokens has
  # gradient G + N(0, σ²/b I), and B_simple = tr Σ / |G|² = D σ² / |G|² = 64 * 4 / 16 = 16.
  rng = np.random.default_rng(0)
  D, sigma, b, groups = 64, 2.0, 8, 8
  G = np.zeros(D)
  G[:4] = 2.0  # |G|² = 16.
  sums = np.zeros(2)
  for _ in range(2000):
    grads = G + rng.normal(scale=sigma / np.sqrt(b), size=(groups, D))
    g2, trace, _, _ = noise_scale.from_gradients(grads, np.full(groups, b))
    sums += (g2, trace)
  np.testing.assert_allclose(sums[1] / sums[0], 16.0, rtol=0.05)
  np.testing.assert_allclose(sums / 2000, (16.0, D * sigma**2), rtol=0.05)  # Each unbiased.


def test_bad_inputs():
  with pytest.raises(ValueError, match="b_small < b_big"):
    noise_scale.estimate(1.0, 1.0, 4, 4)
  with pytest.raises(ValueError, match=r"\[N>=2, D\]"):
    noise_scale.from_gradients(np.ones((1, 3)), np.ones(1))


@pytest.mark.cli
@pytest.mark.slow  # a 2-step run, then the tool as a user runs it: ~40 s
def test_the_command_on_a_trained_run_writes_its_report(tmp_path):
  workdir = tmp_path / "run"
  helpers.train_small_run(workdir)
  out = tmp_path / "ns.json"
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "benchmarks", "noise_scale.py"),
      f"--workdir={workdir}",
      "--batch=2",
      "--groups=3",
      "--repeats=2",
      f"--out={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  rep = json.loads(out.read_text())
  assert rep["groups"] == 3 and len(rep["repeats_detail"]) == 2
  assert rep["tokens_big"] == 3 * rep["tokens_small"] > 0
  # The reported noise scale is the ratio of the repeats' averaged estimates.
  g2 = np.mean([r["g2"] for r in rep["repeats_detail"]])
  trace = np.mean([r["trace"] for r in rep["repeats_detail"]])
  np.testing.assert_allclose(rep["noise_scale_tokens"], trace / g2)
  np.testing.assert_allclose(
    rep["run_batch_over_noise_scale"], rep["run_batch_tokens"] / rep["noise_scale_tokens"]
  )
  assert "noise scale at step" in proc.stdout and f"wrote: {out}" in proc.stdout
