"""AOT compilation for real TPU topologies on this CPU (libtpu, no TPU).

Slow (marked): the two compiles take ~1-2 CPU-minutes each.

The tiny config and the dipaco_2x4 paper config (its 8-path grid, paper batch
512 x 1024 per path and shipped memory switches, on its stated 2 x v5e-16;
only 2 blocks instead of 12 so the compile takes seconds, not minutes) are
compiled for a 2-slice topology: each step fits in 90% of HBM, and the TPU
HLO of the inner step holds no collective whose group spans 'path'.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip(
  "libtpu",
  reason="libtpu is not installed (pip install -e '.[aot]'): "
  "the TPU compiler is needed to compile for a TPU topology.",
)

from dipaco_jax import aot  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top,wrong-import-position
from dipaco_jax.core import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position

import helpers  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.slow, pytest.mark.aot]


def _check(result, steps=("inner", "outer", "eval")):
  steps_done, steps = steps, result["steps"]
  assert set(steps) == set(steps_done)
  for name, s in steps.items():
    assert "memory" in s, f"{name}: {s.get('advice')}"
    assert s["memory"]["total"] > s["memory"]["arguments"] > 0
    assert s["fits"], f"{name}: {s.get('advice')}"
  inner = steps["inner"]
  assert inner["cross_path"] == [] and inner["path_bytes"] == 0
  if "outer" in steps:
    # The outer step moves each chip's modules over 'path', at most twice (out
    # and back) plus the ‖Δ‖ metric's float32 per module; never the store.
    outer = steps["outer"]
    assert 0 < outer["path_bytes"] <= outer["path_bound"]
    assert outer["path_bound"] < 2.01 * outer["held_module_bytes"]
  for name, s in steps.items():
    # Two roofline estimates of every step: the ceiling (perfect overlap) and the floor (none).
    assert s["roofline_ceiling_s"] == max(s["compute_s"], s["memory_s"]) > 0, name
    assert s["roofline_floor_s"] == s["compute_s"] + s["memory_s"], name
  # The floor's time is at most twice the ceiling's (a + b <= 2 max(a, b)): MFU halves at worst.
  assert 0 < inner["mfu_ceiling"] / 2 <= inner["mfu_floor"] < inner["mfu_ceiling"] <= 1.0
  assert inner["tokens_per_s_ceiling"] > inner["tokens_per_s_floor"] > 0


def test_tiny_config_on_two_v5e_slices():
  cfg = config_check.load(os.path.join(helpers.ROOT, "configs", "tiny.py"))
  r = aot.Report(cfg, "v5e:2x2", slices=2).run()
  assert r["chips"] == 8 and r["config"]["mesh"]["path"] == 4
  _check(r)
  # Inside a path the data-parallel gradient reduction is there, over 'data' only.
  assert any(c["axes"] == ["data"] for c in r["steps"]["inner"]["collectives"])


def test_paper_dipaco_2x4_on_two_v5e_16_slices():
  """configs/dipaco_2x4.py as shipped, but 2 blocks (one per level) and the inner step only.

  For compile time (the tiny config covers outer and eval). model.attention=auto runs the
  splash kernels on TPU, under shard_map inside the vmap over workers: still no collective
  across 'path'; their FLOPs (0 to XLA) are added per call and per microbatch trip, and the
  causal MFU is below the full-attention one.
  """
  cfg = config_check.load(
    os.path.join(helpers.ROOT, "configs", "dipaco_2x4.py"),
    **{"model.num_layers": 2, "dipaco.level_groups": ("embed,head", "block_0", "block_1")},
  )
  assert (cfg.data.batch_size, cfg.data.seq_len) == (512, 1024)
  r = aot.Report(cfg, "v5e:4x4", slices=2).run(["inner"])
  assert r["chips"] == 32 and r["config"]["workers"] == 8
  assert r["config"]["mesh"]["path"] == 8
  assert r["config"]["attention_runs"] == "splash" and r["config"]["microbatches"] == 4
  assert r["config"]["remat"] == "save_matmuls_except_mlp_in"
  _check(r, ["inner"])
  inner = r["steps"]["inner"]
  # The rest of the step after the microbatch scan, compiled alone, counted once.
  assert "4 x (compiled step + 1 loss chunks) - 3 x (the step after its scan)" in inner["cost_from"]
  # 2 blocks x (forward, its recomputation, the fused backward) per microbatch, 4 microbatches.
  assert "+ 24 attention kernel calls" in inner["cost_from"], inner["cost_from"]
  assert inner["mfu_ceiling"] < inner["mfu_full_ceiling"]


def test_the_gradient_crosses_data_once_a_step():
  """The data-parallel gradient reduction runs once per inner step, not once per microbatch.

  The tiny config (tied embedding, 4 blocks) on 2 x v5e:2x2 (path 4 x data 2), 4 microbatches,
  loss chunks of 32: every all-reduce over 'data' in the compiled TPU HLO runs once a step,
  and they move the path's float32 gradient once: 1,836,288 params x 4 bytes = 7.0 MiB.
  Before (each microbatch's gradient reduced in the scan), the compiler hoisted the blocks'
  reduction out of the loop but not the tied embedding's, summed over the loss chunks' loop
  first: 9 all-reduces over 'data', 35.0 MiB a step (measured, libtpu 0.0.42).
  """
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  cfg = config_check.load(tiny, **{"inner.microbatches": 4, "model.loss_chunk": 32})
  r = aot.Report(cfg, "v5e:2x2", slices=2).run(["inner"])
  inner = r["steps"]["inner"]
  over_data = [c for c in inner["collectives"] if c["axes"] == ["data"]]
  assert over_data and all(c["op"] == "all-reduce" for c in over_data), over_data
  # One path's params as float32 (the gradient), plus a few scalars (loss, weight sums).
  grad_bytes = 4 * r["config"]["path_params"]
  total = sum(c["bytes"] for c in over_data)
  assert grad_bytes <= total < grad_bytes + 4096, (total, grad_bytes)
  assert sum(c["count"] for c in over_data) <= 2, over_data  # Not 4 microbatches' worth.


def test_the_step_after_the_scan_compiles_alone_with_the_steps_donation():
  """The cost-only compile of recipe.finish_step donates what the inner step donates.

  The tiny config on 2 x v5e:2x2 with 4 microbatches: its new params and optimizer state are
  written over the donated ones (aliased bytes at least their per-device size), so the compile
  needs no more HBM than the step. Undonated, dense_1b's on v6e:2x4 asked 33.2 GiB of a chip's
  31.25 (measured, libtpu 0.0.42).
  """
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  rep = aot.Report(config_check.load(tiny, **{"inner.microbatches": 4}), "v5e:2x2", slices=2)
  st = rep.exp.abstract_state
  held = aot.per_device_bytes(st.params) + aot.per_device_bytes(st.inner_opt)
  m = rep.finish_compiled().memory_analysis()
  assert held > 0 and m.alias_size_in_bytes >= held, (m.alias_size_in_bytes, held)


def test_a_cost_compile_that_does_not_fit_is_one_line_in_the_row(monkeypatch):
  """Where the step after the scan cannot compile alone, the row says what is off; no traceback.

  The tiny config with 4 microbatches, that compile made to fail as libtpu does: the step's
  flops and bytes are then 4 x the compiled step (the optimizer update counted 4 times, not
  once), named as upper bounds; the roofline and MFU are still written, as lower bounds.
  """
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  cfg = lambda: config_check.load(tiny, **{"inner.microbatches": 4})
  good = aot.Report(cfg(), "v5e:2x2", slices=2).run(["inner"])["steps"]["inner"]
  rep = aot.Report(cfg(), "v5e:2x2", slices=2)

  def oom():
    raise aot.OutOfMemory(
      "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 33.23G of 31.25G hbm. "
      "The total memory required for HLO temporaries (33.23G) exceeds available HBM (31.25G)."
    )

  monkeypatch.setattr(rep, "finish_compiled", oom)
  r = rep.run(["inner"])
  inner = r["steps"]["inner"]
  line = inner["cost_missing"]
  assert "\n" not in line and "33.2 GiB" in line and "counted 4 times" in line, line
  assert "upper bounds" in line and "lower bounds" in line
  assert inner["cost_from"].startswith("4 x (compiled step") and "- 3 x" not in inner["cost_from"]
  # The update counted 3 more times than it runs: more bytes, a lower MFU than the true count.
  assert inner["bytes"] > good["bytes"] and inner["mfu_ceiling"] < good["mfu_ceiling"]
  assert inner["fits"] and "memory" in inner
  assert f"[inner] cost estimate incomplete: {line}" in aot.format_report(r).splitlines()


def test_v4_is_one_device_a_chip_and_dcn_is_the_chips():
  # v4 as its VMs run it (megacore): one device per chip, the chip's peak and HBM each.
  assert len(aot.topology_devices("v4:2x2x1", 1)) == 4
  assert aot.devices_per_chip("v5p:2x2x1", 2, aot.topology_devices("v5p:2x2x1", 2)) == 1
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  v4 = aot.Report(config_check.load(tiny), "v4:2x2x1", slices=1)
  assert v4.devices_per_chip == 1 and v4.peak == 275e12 and v4.mesh.shape["path"] == 4
  v5p = aot.Report(config_check.load(tiny), "v5p:2x2x1", slices=2)
  assert v5p.devices_per_chip == 1 and v5p.dcn_gbps == 50.0
  assert aot.Report(config_check.load(tiny), "v5p:2x2x1", 2, dcn_gbps=10).dcn_gbps == 10


def test_advice_names_the_need_and_the_switches():
  cfg = config_check.load(os.path.join(helpers.ROOT, "configs", "tiny.py"), **{"mesh.data": 2})
  rep = aot.Report(cfg, "v5e:2x2", slices=2)
  line = rep.advice(
    "inner",
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
    "memory required for HLO temporaries (110.78G) exceeds available "
    "HBM (15.75G).",
  )
  assert "110.8 GiB" in line and "15.75 GiB" in line
  for switch in ("inner.microbatches", "model.remat=full", "model.loss_chunk", "mesh.fsdp=True"):
    assert switch in line


def test_bad_input_is_refused_with_one_clear_error():
  with pytest.raises(aot.AotError, match="unknown chip 'v9'"):
    aot.topology_devices("v9:4x4", 1)
  with pytest.raises(aot.AotError, match="libtpu cannot build it"):
    aot.topology_devices("v5e:3x5", 1)
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  with pytest.raises(sharding.MeshError, match="not divisible by the 'data' mesh axis"):
    aot.Report(config_check.load(tiny, **{"mesh.data": 3}), "v5e:2x2", 2)
  with pytest.raises(ValueError, match="inner.microbatches=3"):
    aot.Report(config_check.load(tiny, **{"inner.microbatches": 3}), "v5e:2x2", 2)


@pytest.mark.cli
def test_cli_reports_bad_topology_in_one_line():
  out = subprocess.run(
    [sys.executable, "-m", "dipaco_jax.aot", "--config=configs/tiny.py", "--topology=v5e-16"],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "PYTHONPATH": helpers.ROOT},
    check=False,
  )
  assert out.returncode == 1
  assert out.stderr.splitlines() == [
    "AotError: --topology=v5e-16: unknown chip 'v5e-16'; use one of ['v4', 'v5e', 'v5p', 'v6e'] "
    "as CHIP:AxB[xC], e.g. v5e:4x4."
  ]


def test_a_compressed_outer_step_compiles_and_sends_codes():
  """outer.compression: the outer step takes (ef, start) too, and codes cross 'path'.

  The tiny config on 2 x v5e:2x2 (path 4 x data 2), outer step only: fp4 moves under a
  quarter of float32's bytes across 'path' (4.5 bits a value against 32, both ways).
  """
  tiny = os.path.join(helpers.ROOT, "configs", "tiny.py")
  none = aot.Report(config_check.load(tiny), "v5e:2x2", slices=2).run(["outer"])
  fp4 = aot.Report(
    config_check.load(tiny, **{"outer.compression": "fp4"}), "v5e:2x2", slices=2
  ).run(["outer"])
  assert fp4["config"]["outer_compression"] == "fp4" and fp4["config"]["outer_error_feedback"]
  a, b = none["steps"]["outer"], fp4["steps"]["outer"]
  assert a["fits"] and b["fits"]
  assert 0 < b["path_bytes"] < a["path_bytes"] / 4, (b["path_bytes"], a["path_bytes"])


@pytest.mark.parametrize("compression", ["none", "fp4"])
def test_a_level_inside_one_slice_sends_nothing_over_dcn(tmp_path, compression):
  """benchmarks/outer_levels.py on the tiny grid, 2 x v5e:2x2 (path 4: 2 slices x 2).

  Level 1 (blocks 0-1): module i on paths 2i, 2i + 1, both in slice i, so its exchange
  stays on ICI (core/slices.py): across 'path' but not over the DCN, but for the ‖Δ‖
  metric's psum (K = 2 float32: two MegaScale all-reduces, 512 bytes as compiled). Level 2
  (blocks 2-3): module j on paths j and 2 + j, one in each slice: its bytes cross.
  """
  out = tmp_path / "levels.json"
  proc = subprocess.run(
    [
      sys.executable,
      "benchmarks/outer_levels.py",
      "--config=configs/tiny.py",
      "--topology=v5e:2x2",
      "--slices=2",
      f"--set=outer.compression={compression}",
      "--levels=level_1,level_2",
      f"--out={out}",
    ],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "PYTHONPATH": helpers.ROOT},
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["levels"]
  one, two = rows["level_1"], rows["level_2"]
  assert one["slice_local"] and not two["slice_local"]
  assert one["path_bytes"] > 100_000 and one["dcn_bytes"] <= 1024, one
  assert two["dcn_bytes"] > 100_000, two
