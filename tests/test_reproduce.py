"""Smoke run of benchmarks/reproduce.py: every model trained, evaluated, tabled and plotted."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import reproduce  # pylint: disable=g-import-not-at-top,wrong-import-position

# A child process trains and evaluates every model of the smoke run: minutes, outside the fast
# suite (-m "not slow").
pytestmark = pytest.mark.slow


def test_smoke_run_tables_every_model_with_finite_numbers(tmp_path):
  out = tmp_path / "repro"
  # A child process: the script sets its fake CPU device count before jax starts.
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", "reproduce.py"), "--smoke", f"--out={out}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads((out / "results.json").read_text())
  models = report["models"]
  assert set(models) == {"pretrain", *reproduce.MODELS}
  table = (out / "results.md").read_text()
  s = reproduce.MODES["smoke"]
  for name, r in models.items():
    if name != "pretrain":
      assert f"| {name} | " in table, name
    steps = [x for x, _ in r["curve"]]
    ppl = [y for _, y in r["curve"]]
    assert all(math.isfinite(p) and p > 1 for p in ppl), (name, ppl)
    # Every model ends after the same number of weight-update steps (pretraining included).
    assert steps[-1] == (s.pretrain if name == "pretrain" else s.pretrain + s.steps), name
    store = r["final"]["store"]
    assert all(math.isfinite(v) for v in store["ppl"].values()), (name, store["ppl"])
    if r["params"]["paths"] > 1:  # Re-routing at every window, and the oracles bound it.
      for w in s.windows:
        assert {f"linear/W={w}", f"transformer/W={w}", f"oracle/W={w}"} <= set(store["ppl"])
      # The once-per-sequence oracle picks the best path in hindsight: never worse than routing.
      assert store["ppl"]["oracle/once"] <= store["ppl"]["once"] + 1e-6
      assert "best" in r["final"]
  # Shapes of the comparison: grids, replicas and parameter counts.
  p = {k: v["params"] for k, v in models.items()}
  assert (p["dipaco_4x4"]["paths"], p["dipaco_2x2"]["paths"], p["flat_moe"]["paths"]) == (16, 4, 4)
  assert p["diloco_iid"]["workers"] == 4 and p["diloco_iid"]["paths"] == 1
  # The fair baseline: as many DiLoCo replicas as the 4x4 grid has paths.
  assert p["diloco_iid_16"]["workers"] == p["dipaco_4x4"]["paths"] == 16
  assert p["diloco_iid_16"]["paths"] == 1
  assert p["dipaco_4x4_kmeans"]["paths"] == 16
  assert p["flat_moe"]["total"] == 4 * p["flat_moe"]["path"]
  assert p["dense_path"]["path"] < p["dipaco_2x2"]["total"] < p["flat_moe"]["total"]
  assert p["dense_4x"]["path"] > 2 * p["dense_path"]["path"]
  # DiLoCo's k-means shards: one cluster per replica (a router of 4 clusters, 1 path).
  meta = json.loads(
    (out / "runs" / "diloco_kmeans" / "router" / "phase_0" / "router.json").read_text()
  )
  assert meta["kind"] == "kmeans" and list(meta["grid"]) == [4]
  for png in ("ppl_vs_steps.png", "ppl_vs_window.png"):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
