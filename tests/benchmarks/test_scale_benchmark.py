"""benchmarks/scale.py --quick: every row, positive numbers, memory per device."""

import json
import math
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT

# A child process runs the benchmark end to end: outside the fast suite (-m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.cli]


def _positive(row: dict, keys) -> None:
  for k in keys:
    assert math.isfinite(row[k]) and row[k] > 0, (k, row[k])


def test_scale_quick(tmp_path):
  out = tmp_path / "scale.json"
  # A child process: the script gives each row its own fake-device count.
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--quick", "--out", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "outer_step_s" in proc.stdout
  report = json.loads(out.read_text())
  rows = {r["paths"]: r for r in report["paths_rows"]}
  assert sorted(rows) == [1, 4]
  for r in rows.values():
    _positive(
      r,
      (
        "step_s",
        "tokens_per_s",
        "peak_bytes_per_device",
        "params_bytes_per_device",
        "rss_peak_bytes",
      ),
    )
    mem = r["memory_analysis"]
    assert mem["argument"] == (
      r["params_bytes_per_device"] + r["inner_opt_bytes_per_device"] + r["batch_bytes_per_device"]
    )
    assert r["peak_bytes_per_device"] >= mem["argument"]
    assert r["params_bytes_per_device"] == r["paths_per_device"] * r["path_bytes"]
  # --quick caps devices at 2: P=4 puts two paths on each device.
  one, four = rows[1], rows[4]
  assert (one["paths_per_device"], four["paths_per_device"]) == (1, 2)
  assert four["mesh"] == {"path": 2, "data": 1, "model": 1}
  assert four["peak_bytes_per_device"] > 1.5 * one["peak_bytes_per_device"]
  mods = report["modules_rows"]
  assert [r["modules"] for r in mods] == [1, 2, 4]
  for r in mods:
    _positive(r, ("store_bytes", "store_bytes_per_device", "outer_step_s", "peak_bytes_per_device"))
    assert r["workers"] == r["distinct_paths"] * r["replicas"] == 4
  store = [r["store_bytes"] for r in mods]
  assert store == sorted(set(store)), store  # Grows with K.
