"""Smoke tests: the benchmarks/ scripts run (throughput, serving, shard_writing, mfu, ...)."""

import json
import math
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
KEYS = (
  "dipaco_vs_plain_tokens_ratio",
  "inner_flops_fraction_of_gemm_peak",
  "outer_step_fraction_of_inner_phase",
  "cross_path_bytes_inner_step",
  "cross_path_bytes_outer_step",
  "module_bytes",
)

# A child process runs the benchmark end to end: outside the fast suite (-m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.cli]


def run_benchmark(script: str, out, *args: str, timeout: int = 240) -> tuple[str, dict]:
  """benchmarks/SCRIPT ARGS --out OUT in a child process: (its stdout, the JSON it wrote).

  A child process, as users run them: a benchmark sets its own fake-device count before jax.
  """
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", script), *args, f"--out={out}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(out.read_text())


def run_failing(script: str, *args: str) -> subprocess.CompletedProcess:
  """benchmarks/SCRIPT ARGS expected to exit 1 with a one-line error (no traceback)."""
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc


def test_throughput_quick(tmp_path):
  stdout, report = run_benchmark(
    "throughput.py", tmp_path / "throughput.json", "--quick", "--paths", "4"
  )
  assert "dipaco_vs_plain_tokens_ratio" in stdout
  (r,) = report["results"]
  for k in KEYS:
    assert k in r, k
  for k in KEYS[:3]:
    assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
  # No collective of the inner step spans paths; the outer step's does.
  assert r["cross_path_bytes_inner_step"] == 0
  assert r["cross_path_bytes_outer_step"] > 0
  mb = r["module_bytes"]
  assert mb["store"] == sum(
    mb[lvl] * k for lvl, k in zip(("level_0", "level_1", "level_2"), r["grid"])
  )


def test_op_profile_quick(tmp_path):
  stdout, r = run_benchmark("op_profile.py", tmp_path / "ops.json", "--quick", "--steps", "1")
  assert "top ops:" in stdout
  kinds = r["kinds"]
  assert "ynn_fusion" in kinds or "dot" in kinds, sorted(kinds)  # The matmuls are traced.
  assert math.isclose(sum(k["fraction"] for k in kinds.values()), 1.0, rel_tol=1e-9)
  total = sum(k["ms_per_step_per_device"] for k in kinds.values())
  assert math.isclose(total, r["op_ms_per_step_per_device"], rel_tol=1e-9) and total > 0
  assert all(op["hlo"].startswith(f"%{op['name']} = ") for op in r["top_ops"]), r["top_ops"]


def test_serving_quick(tmp_path):
  _, r = run_benchmark("serving.py", tmp_path / "serving.json", "--quick")
  assert r["greedy_tokens_agree"] is True
  assert [x["batch"] for x in r["results"]] == [1, 8]
  for x in r["results"]:
    assert x["cached_tokens_per_s"] > 0 and x["uncached_tokens_per_s"] > 0
    # A timed figure, not a test: the ratio is reported (benchmarks/), the test checks it exists.
    assert math.isfinite(x["speedup"]) and x["speedup"] > 0


def test_shard_writing_two_os_processes(tmp_path):
  """The documented offline job as 2 OS processes (route --num_processes=2 --process_id=i)."""
  _, r = run_benchmark(
    "shard_writing.py",
    tmp_path / "shard_writing.json",
    "--processes",
    "2",
    "--subsample",
    "50",
    timeout=600,
  )
  (run,) = r["runs"]
  assert [p["process"] for p in run["per_process"]] == [0, 1]
  # Subsample 50 of 20,315 train + 606 validation documents: about 418, split between the two.
  docs = [p["docs"] for p in run["per_process"]]
  assert 300 < sum(docs) < 550 and min(docs) > 50, docs
  assert all(p["tokens_per_s"] > 0 for p in run["per_process"])
  rate = r["c4_estimate"]["tokens_per_s_per_process"]
  for pool in r["c4_estimate"]["pools"]:
    assert pool["hours"] == round(156e9 / (rate * pool["processes"]) / 3600, 2)


def test_mfu_on_the_cpu(tmp_path):
  _, r = run_benchmark(
    "mfu.py",
    tmp_path / "mfu.json",
    "--config=configs/tiny.py",
    "--batch=2",
    "--steps=2",
    "--reps=1",
    "--set",
    "model.num_layers=2",
    "--peak_tflops=1.0",
    "--hbm_gbps=50",
  )
  # One dense path of the tiny shapes with 2 blocks; MFU is model FLOP/s over the given 1 TFLOP/s.
  assert r["seq_len"] == 128 and r["batch"] == 2
  assert r["tokens_per_s"] == pytest.approx(2 * 128 / r["step_s"])
  assert r["mfu"] == pytest.approx(r["model_flops_per_token"] * r["tokens_per_s"] / 1e12)
  assert 0 < r["mfu"] < 1
  # Beside it, the roofline estimate of the compiled step at 1 TFLOP/s and 50 GB/s. tiny.py's
  # loss is not chunked and M = 1: XLA counts every op once, never fewer FLOPs than the model's.
  f = r["roofline"]
  assert r["xla_cost"]["counted"] == "XLA's cost analysis of the compiled step: every op once"
  assert f["flops"] == r["xla_cost"]["flops"] >= r["model_flops_per_token"] * 2 * 128
  assert f["step_s_overlap"] == pytest.approx(max(f["flops"] / 1e12, f["bytes"] / 50e9))
  assert f["mfu_floor"] < f["mfu_ceiling"] <= 1


def test_mfu_refuses_a_device_missing_from_the_peak_table():
  proc = run_failing("mfu.py", "--config=configs/tiny.py", "--batch=2")
  (line,) = proc.stderr.strip().splitlines()
  assert "PEAK_TFLOPS" in line and "--peak_tflops" in line and "'cpu'" in line


def test_specialisation_on_a_trained_run(tmp_path):
  workdir = tmp_path / "run"
  # Prefix below SMALL_RUN's 16-token sequences.
  helpers.train_small_run(workdir, "--config.routing.prefix_len=4")
  stdout, rep = run_benchmark(
    "specialisation.py", tmp_path / "spec.json", f"--workdir={workdir}", "--max_docs=40"
  )
  assert rep["step"] == 6 and rep["path_labels"] == ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]
  assert len(rep["loss_matrix"]) == 4 and all(len(row) == 4 for row in rep["loss_matrix"])
  assert 0 < sum(rep["shard_docs"]) + rep["left_out"] <= 40  # All validation docs, or 40.
  assert rep["loss"]["oracle"] <= rep["loss"]["routed"] and 0 <= rep["routed_best_share"] <= 1
  assert "| own - other paths |" in stdout and "wrote: " in stdout
  # Bad input, one line each, nothing of the run touched: its held-out shards gone...
  (workdir / "shards").rename(tmp_path / "moved")
  proc = run_failing("specialisation.py", f"--workdir={workdir}")
  assert proc.stderr.startswith("FileNotFoundError: ") and proc.stderr.count("\n") == 1
  assert "held-out (validation) shards of routing phase 0 from " in proc.stderr
  # ... and a run with one path (refused from its config, before any checkpoint is read).
  one_path = tmp_path / "one_path"
  one_path.mkdir()
  config = json.loads((workdir / "config.json").read_text())
  config["dipaco"]["modules_per_level"] = [1, 1, 1]
  (one_path / "config.json").write_text(json.dumps(config))
  proc = run_failing("specialisation.py", f"--workdir={one_path}")
  assert proc.stderr.startswith("ArgumentError: ") and proc.stderr.count("\n") == 1
  assert "has one path (grid 1x1x1: 1 paths" in proc.stderr
