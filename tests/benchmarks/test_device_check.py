"""benchmarks/device_check.py's dry run and refusals; device_bundle.py's pins and size cap."""

import json
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import device_bundle  # pylint: disable=g-import-not-at-top,wrong-import-position


def device_check(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=660,
    check=False,
  )


# ~80 CPU-seconds (two child processes compile and run): slow, but the done-when names it.
@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.cli
def test_dry_run_measures_the_path_and_trains_the_tiny_run(tmp_path):
  out = tmp_path / "out"
  # No prepared cache: the tiny run writes its shards itself, as a host without the bundle would.
  # A budget for a busy CPU: ~80 CPU-seconds took 5.5 minutes on 2 shared cores.
  args = ("--dry_run", f"--out={out}", "--batch=2", "--steps=2", "--reps=1", "--budget_s=600")
  proc = device_check(*args, f"--cache_dir={tmp_path / 'none'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.listdir(out) == ["device_check.json"]  # One JSON, nothing else.
  r = json.loads((out / "device_check.json").read_text())
  assert r["dry_run"] and r["ok"] and r["host"]["platform"] == "cpu"
  assert r["phases"]["mfu_cudnn"] == {"ok": True, "skipped": "cuDNN needs a GPU (dry run)"}
  x = r["phases"]["mfu_xla"]["result"]
  assert x["attention_runs"] == "xla" and x["microbatches"] == 1 and x["loss_chunk"] == 64
  # Measured: model FLOPs per token x tokens/s over the pretend 1 TFLOP/s peak.
  assert x["mfu"] == pytest.approx(x["model_flops_per_token"] * x["tokens_per_s"] / 1e12)
  f = x["roofline"]
  # The estimate from XLA's counts at 1 TFLOP/s and 50 GB/s: ceiling max, floor the sum.
  assert f["flops"] >= x["model_flops_per_token"] * 2 * 64 and f["bytes"] > 0
  assert f["compute_s"] == pytest.approx(f["flops"] / 1e12)
  assert f["memory_s"] == pytest.approx(f["bytes"] / 50e9)
  assert f["mfu_floor"] < f["mfu_ceiling"] <= 1.0
  assert x["xla_cost"]["counted"] == "XLA's cost analysis of the compiled step: every op once"
  assert x["memory"]["compiled"]["arguments"] > 0
  t = r["phases"]["trainer"]["result"]
  # 2 outer steps of H = 2: the last record at step 4, evaluated and checkpointed.
  assert t["step"] == 4 and t["checkpoint"] and t["val_loss_mean"] > 0
  assert not t["shards_from_cache"]  # Written by the run: no prepared cache was given.
  assert "measured MFU" in proc.stdout and "roofline estimate ceiling" in proc.stdout


@pytest.mark.cli
def test_a_gpu_check_on_a_cpu_host_is_one_line(tmp_path):
  proc = device_check("--device=gpu", f"--out={tmp_path}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  assert "--device=gpu" in line and "no gpu" in line and "--dry_run" in line
  assert not os.listdir(tmp_path)  # Nothing written.


def test_the_bundle_over_its_cap_is_one_line(tmp_path):
  # Sparse files: 1.5 MiB of wheels and 0.25 MiB of cache, 1.75 MiB in all, over a 1 MiB cap.
  (tmp_path / "wheels").mkdir()
  (tmp_path / "cache").mkdir()
  for path, size in ((tmp_path / "wheels" / "a.whl", 3 * 2**19), (tmp_path / "cache" / "x", 2**18)):
    with open(path, "wb") as f:
      f.truncate(size)
  assert device_bundle.check_size(str(tmp_path), cap_mib=2) == 7 * 2**18
  with pytest.raises(device_bundle.BundleError) as e:
    device_bundle.check_size(str(tmp_path), cap_mib=1)
  (line,) = str(e.value).splitlines()
  assert "is 1.8 MiB, over the 1 MiB" in line
  assert "largest: wheels 1.5 MiB, cache 0.2 MiB" in line


def test_the_bundle_pins_constraints_versions(tmp_path):
  constraints = tmp_path / "constraints.txt"
  constraints.write_text("# pins\nml-collections==1.1.0\nDm_Tree==0.1.10 ; sys_platform\n")
  got = device_bundle.pins(("ml_collections", "dm-tree"), str(constraints))
  assert got == ["ml_collections==1.1.0", "dm-tree==0.1.10"]
  with pytest.raises(device_bundle.BundleError, match=r"pins no version of \['toml'\]"):
    device_bundle.pins(("toml",), str(constraints))
  # Every package the bundle carries is pinned by the repo's constraints.txt.
  assert len(device_bundle.pins()) == len(device_bundle.PACKAGES)


def test_the_docs_give_the_bundle_and_check_commands():
  text = open(os.path.join(ROOT, "docs", "tpu.md")).read()
  assert device_bundle.install_command() in text
  assert "python benchmarks/device_bundle.py" in text
  assert "python benchmarks/device_check.py --device=gpu --out=" in text
  ignored = subprocess.run(
    ["git", "check-ignore", "-q", f"{device_bundle.DEFAULT_DIR}/{device_bundle.WHEELS}/a.whl"],
    cwd=ROOT,
    check=False,
  )
  assert ignored.returncode == 0  # A device run carries it as an ignored path.
