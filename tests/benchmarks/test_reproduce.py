"""Smoke run of benchmarks/reproduce.py: every model trained, evaluated, tabled and plotted."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import ml_collections
import pytest

import helpers

ROOT = helpers.ROOT
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from reproduction import arms  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import command  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import modes  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import report  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import runs  # pylint: disable=g-import-not-at-top,wrong-import-position

# The smoke run's models: every kind of run the script makes once (two whose runs repeat
# another's code path at more cost, DiLoCo P=16 and the 2x2 k-means control, are checked from
# their configs below, untrained).
# dense_4x runs dense_path's code at 4x the params (its size is checked from its config below).
SMOKE_MODELS = tuple(
  m for m in arms.MODELS if m not in ("diloco_iid_16", "dipaco_2x2_kmeans", "dense_4x")
)


# A child process trains and evaluates every model of the smoke run: minutes, outside the fast
# suite (-m "not slow").
@pytest.mark.slow
@pytest.mark.cli
def test_smoke_run_tables_every_model_with_finite_numbers(tmp_path):
  out = tmp_path / "repro"
  # A child process: the script sets its fake CPU device count before jax starts.
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "benchmarks", "reproduce.py"),
      "--smoke",
      f"--out={out}",
      f"--models={','.join(SMOKE_MODELS)}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  check_smoke_output(out)


def check_smoke_output(out):
  """The smoke run's results (also runnable on a finished --smoke --out dir)."""
  results = json.loads((out / "results.json").read_text())
  models = results["models"]
  assert set(models) == {"pretrain", *SMOKE_MODELS}
  table = (out / "results.md").read_text()
  s = modes.MODES["smoke"]
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
      # The specialisation report, from the final evaluation's scores.
      spec = r["specialisation"]
      assert len(spec["loss_matrix"]) == r["params"]["paths"], name
      assert spec["loss"]["oracle"] <= spec["loss"]["routed"] + 1e-6, name
    elif name != "pretrain":
      assert r["specialisation"] is None, name
  # Shapes of the comparison: grids, replicas and parameter counts.
  p = {k: v["params"] for k, v in models.items()}
  assert (p["dipaco_4x4"]["paths"], p["dipaco_2x2"]["paths"], p["flat_moe"]["paths"]) == (16, 4, 4)
  assert p["diloco_iid"]["workers"] == 4 and p["diloco_iid"]["paths"] == 1
  # The fair baseline: as many DiLoCo replicas as the 4x4 grid has paths (from its config).
  c16 = runs.make_config("diloco_iid_16", s, str(out), "multiply")
  assert c16.dipaco.replicas == p["dipaco_4x4"]["paths"] == 16
  assert tuple(c16.dipaco.modules_per_level) == (1,) and c16.outer.enabled
  # The 2x2 k-means control: dipaco_2x2 without the re-shard, on the same phase-0 shards.
  k2, d2 = (
    runs.make_config(m, s, str(out), "multiply").to_dict()
    for m in ("dipaco_2x2_kmeans", "dipaco_2x2")
  )
  assert d2["routing"].pop("discriminative_at_outer_step") == s.disc_at
  assert k2["routing"].pop("discriminative_at_outer_step") == -1
  for c in (k2, d2):  # The re-shard's own fields.
    c["routing"].pop("discriminative_min_share"), c["routing"].pop("restart_schedule")
  assert k2 == d2
  assert p["dipaco_4x4_kmeans"]["paths"] == 16
  assert p["flat_moe"]["total"] == 4 * p["flat_moe"]["path"]
  assert p["dense_path"]["path"] < p["dipaco_2x2"]["total"] < p["flat_moe"]["total"]
  dense_4x = runs.param_counts(runs.make_config("dense_4x", s, str(out), "multiply"))
  assert dense_4x["path"] > 2 * p["dense_path"]["path"] and dense_4x["paths"] == 1
  # DiLoCo's k-means shards: one cluster per replica (a router of 4 clusters, 1 path).
  meta = json.loads(
    (out / "runs" / "diloco_kmeans" / "router" / "phase_0" / "router.json").read_text()
  )
  assert meta["kind"] == "kmeans" and list(meta["grid"]) == [4]
  # Balanced routing: every phase's shard sizes are reported, and no training shard of a
  # routed model falls under 25% of the mean (k-means phase 0 and the re-shard alike).
  for name in ("flat_moe", "dipaco_2x2", "dipaco_4x4", "dipaco_4x4_kmeans"):
    phases = models[name]["shards"]["phases"]
    assert [p["phase"] for p in phases] == ([0] if name.endswith("_kmeans") else [0, 1]), name
    for p in phases:
      assert p["tokens_min"] <= p["tokens_median"] <= p["tokens_max"], (name, p)
      assert p["min_over_mean"] >= modes.GOAL_MIN_OVER_MEAN, (name, p)
      assert 0 <= p["moved_off_label"] < 1, (name, p)
    # The control shares its grid's balanced phase-0 shards: the two differ by the re-shard.
  assert (
    models["dipaco_4x4"]["shards"]["phases"][0]
    == models["dipaco_4x4_kmeans"]["shards"]["phases"][0]
  )
  assert "## Shards per phase" in table and "| dipaco_4x4 | 1 |" in table
  # The outer delta norm per level of the 4x4 grid: the shared level has 16 paths per module.
  levels = models["dipaco_4x4"]["outer"]["levels"]
  assert levels["level_0"]["paths_per_module"] == 16 and levels["level_1"]["modules"] == 4
  assert all(len(v["norm"]) == s.steps // s.inner_steps for v in levels.values())
  assert len(models["dipaco_4x4"]["outer"]["shared_over_modules"]) == s.steps // s.inner_steps
  for png in ("ppl_vs_steps.png", "ppl_vs_window.png"):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _result(ppl, seed, workers=1, best=None):
  final = {"store": {"ppl": {"once": ppl}}}
  if best is not None:
    final["best"] = {"ppl": {"once": best}}
  return {
    "final": final,
    "params": {"paths": 1, "workers": workers},
    "shards": {"min_over_mean": 1.0},
    "seconds": {"train": 10.0, "evaluate": 2.0},
  }


def test_summary_gives_mean_and_range_and_flags_gaps_within_the_seed_range(tmp_path):
  # Seeds 0 and 1: dense_path 520 / 540 (mean 530, range 20), diloco_iid 420 / 450 (435, 30),
  # dense_4x 525 / 527 (526, 2). diloco_iid vs dense_path: gap 95 > 30, resolved in the paper's
  # order; dense_4x vs dense_path: gap 4 < 20, within noise.
  dirs = []
  for seed, (dense, diloco, big) in enumerate([(520, 420, 525), (540, 450, 527)]):
    d = tmp_path / f"s{seed}"
    d.mkdir()
    models = {
      "dense_path": _result(dense, seed),
      "diloco_iid": _result(diloco, seed, workers=4, best=diloco - 1),
      "dense_4x": _result(big, seed),
    }
    (d / "results.json").write_text(
      json.dumps({"sizes": {"steps": 4}, "seed": seed, "models": models})
    )
    dirs.append(str(d))
  summary = report.summarize(dirs)
  m = summary["models"]
  assert (m["dense_path"]["mean"], m["dense_path"]["range"]) == (530, 20)
  assert (m["diloco_iid"]["mean"], m["diloco_iid"]["early_stop_mean"]) == (435, 434)
  assert m["diloco_iid"]["workers"] == 4 and m["dense_path"]["seeds"] == [0, 1]
  gaps = {(g["better_expected"], g["worse_expected"]): g for g in summary["gaps"]}
  assert (
    gaps["diloco_iid", "dense_path"]["gap"] == 95 and gaps["diloco_iid", "dense_path"]["resolved"]
  )
  assert (
    gaps["dense_4x", "dense_path"]["gap"] == 4 and not gaps["dense_4x", "dense_path"]["resolved"]
  )
  assert set(gaps) == {("diloco_iid", "dense_path"), ("dense_4x", "dense_path")}
  md = report.summary_markdown(summary)
  assert "| dense_path | 1 | 1 | 530.00 | 520.00 – 540.00 (20.00) |" in md
  assert "within the seed range (not a result)" in md


def test_a_summary_over_runs_of_two_vocabularies_is_one_line_and_writes_nothing(tmp_path):
  dirs = []
  for seed, vocab in enumerate((8192, 1024)):
    d = tmp_path / f"s{seed}"
    d.mkdir()
    models = {"dense_path": _result(500, seed)}
    sizes = {"steps": 4, "vocab": vocab}
    (d / "results.json").write_text(json.dumps({"sizes": sizes, "seed": seed, "models": models}))
    dirs.append(str(d))
  out = tmp_path / "summary"
  with pytest.raises(SystemExit, match=r"vocabularies of \[1024, 8192\] pieces; perplexities"):
    command.main([f"--summarize={','.join(dirs)}", f"--out={out}"])
  assert not out.exists()


def test_the_long_comparisons_arms_are_built_as_named(tmp_path):
  # Every arm of --long from its config alone (no training): 4 workers each but DiLoCo P=2,
  # the same batch, interleaving and θ̄, and only what the arm's name says differs.
  s = modes.MODES["long"]
  cfg = {m: runs.make_config(m, s, str(tmp_path), "multiply") for m in arms.LONG_MODELS}
  workers = lambda c: c.dipaco.replicas * math.prod(c.dipaco.modules_per_level)
  assert {m: workers(c) for m, c in cfg.items()} == {
    "dense_path": 1,
    "diloco_iid": 4,
    "diloco_iid_olr0.35": 4,
    "diloco_iid_olr1.0": 4,
    "diloco_iid_2": 2,
    "dipaco_2x2": 4,
    "dipaco_2x2_olr1.0": 4,
    "dipaco_2x2_iid": 4,
    "dipaco_2x2_muon": 4,
  }
  for m, c in cfg.items():
    assert (c.data.batch_size, c.data.seq_len, c.data.interleave) == (32, 96, 32), m
    assert c.dipaco.init_from == str(tmp_path / "runs" / "pretrain"), m
  assert cfg["diloco_iid"].outer.lr == 0.7 and cfg["diloco_iid_olr0.35"].outer.lr == 0.35
  assert cfg["dipaco_2x2_iid"].routing.router == "random"
  assert cfg["dipaco_2x2_iid"].routing.discriminative_at_outer_step == -1  # Never.
  assert cfg["dipaco_2x2"].routing.router == "kmeans"
  assert cfg["dipaco_2x2"].routing.discriminative_at_outer_step == s.disc_at
  assert cfg["dipaco_2x2_muon"].inner.optimizer == "muon"
  assert cfg["dipaco_2x2"].inner.optimizer == "adamw"
  # The Muon arm differs from dipaco_2x2 by the optimizer alone.
  a, b = cfg["dipaco_2x2"].to_dict(), cfg["dipaco_2x2_muon"].to_dict()
  a["inner"].pop("optimizer"), b["inner"].pop("optimizer")
  assert a == b
  # An outer-LR variant is its base model at that LR, and nothing else.
  c = runs.make_config("dipaco_2x2_olr1.0", s, str(tmp_path), "multiply").to_dict()
  assert c["outer"].pop("lr") == 1.0 and cfg["dipaco_2x2"].outer.lr == 0.7
  base = cfg["dipaco_2x2"].to_dict()
  base["outer"].pop("lr")
  assert c == base
  assert arms.known("diloco_iid_olr0.5") and not arms.known("diloco_iid_olrx")
  assert not arms.known("diloco_iid_olr<LR>")
  with pytest.raises(ValueError, match="unknown model"):
    arms.run_overrides("diloco_iid_olr-1", s, "p", "s", "none")


def test_the_capacity_arms_route_the_embedding_and_differ_from_the_grid_by_that_alone(tmp_path):
  s = modes.MODES["long"]
  cfg = lambda m: runs.make_config(m, s, str(tmp_path), "multiply").to_dict()
  base, pse, emb = cfg("dipaco_2x2"), cfg("dipaco_2x2_pse"), cfg("dipaco_2x2_emb")
  # Path-specific: each of the 4 paths its own embedding; the first level keeps the head.
  assert pse["dipaco"].pop("path_specific") == "embed" and base["dipaco"].pop("path_specific") == ""
  assert pse["dipaco"].pop("level_groups") == ("head", "block_0-1", "block_2-3")
  # In the first routed level: 2 embeddings, each shared by the 2 paths through its module.
  assert emb["dipaco"].pop("level_groups") == ("head", "embed,block_0-1", "block_2-3")
  assert base["dipaco"].pop("level_groups") == ("embed,head", "block_0-1", "block_2-3")
  emb["dipaco"].pop("path_specific")
  assert pse == base and emb == base  # Same θ̄, phase-0 shards, router, LR: only the placement.
  # The i.i.d. controls: the same placement, random shards, no re-shard.
  iid = cfg("dipaco_2x2_pse_iid")
  assert iid["dipaco"]["path_specific"] == "embed" and iid["routing"]["router"] == "random"
  assert iid["routing"]["discriminative_at_outer_step"] == -1
  assert cfg("dipaco_2x2_emb_iid")["dipaco"]["level_groups"][1] == "embed,block_0-1"


def test_the_arms_json_names_each_arms_grid_and_shards_with_its_ppl_per_seed():
  s = modes.MODES["long"]
  kinds = {m: arms.arm_kind(m, s) for m in arms.LONG_MODELS + ("dipaco_2x2_pse_iid",)}
  assert kinds == {
    "dense_path": ("P=1", "iid"),
    "diloco_iid": ("P=4", "iid"),
    "diloco_iid_olr0.35": ("P=4", "iid"),
    "diloco_iid_olr1.0": ("P=4", "iid"),
    "diloco_iid_2": ("P=2", "iid"),
    "dipaco_2x2": ("2x2", "routed"),
    "dipaco_2x2_olr1.0": ("2x2", "routed"),
    "dipaco_2x2_iid": ("2x2", "iid"),
    "dipaco_2x2_muon": ("2x2", "routed"),
    "dipaco_2x2_pse_iid": ("2x2", "iid"),
  }
  assert arms.arm_kind("dipaco_4x4", s) == ("4x4", "routed")
  assert arms.arm_kind("diloco_iid_16", s) == ("P=16", "iid")
  model = lambda ppl, seeds=(0, 1), spec=None: {
    "ppl": ppl,
    "seeds": list(seeds),
    "mean": sum(ppl) / len(ppl),
    "range": max(ppl) - min(ppl),
    "oracle_ppl": None,
    "random_ppl": None,
    "diagonal_gap": spec,
    "routed_best_share": None,
    "routed_gain_share": None,
    "workers": 4,
  }
  summary = {
    "sizes": dataclasses.asdict(s),
    "mode": "long",
    "commands": ["python benchmarks/reproduce.py --long --seed=0 --out=A"],
    "models": {
      "pretrain": {**model([900.0]), "noise_scale_tokens": [3000.0]},
      "dense_path": model([410.0, 420.0]),
      "diloco_iid": model([260.0, 262.0]),
      "dipaco_2x2": model([250.0, 246.0], spec=[-0.05, -0.04]),
    },
    "gaps": [],
  }
  out = report.arms_json(summary, "python benchmarks/reproduce.py --summarize=A")
  assert out["arms"]["dipaco_2x2"]["ppl"] == [250.0, 246.0]
  assert (out["arms"]["dipaco_2x2"]["grid"], out["arms"]["dipaco_2x2"]["shards"]) == (
    "2x2",
    "routed",
  )
  assert out["arms"]["dipaco_2x2"]["diagonal_gap"] == [-0.05, -0.04]
  assert (out["arms"]["diloco_iid"]["grid"], out["arms"]["diloco_iid"]["shards"]) == ("P=4", "iid")
  assert set(out["arms"]) == {"diloco_iid", "dipaco_2x2"}  # The grids' question ...
  assert set(out["references"]) == {"dense_path"}  # ... and the rest beside it.
  assert out["regime"]["noise_scale_tokens_at_theta"] == [3000.0]
  assert out["commands"][-1] == "python benchmarks/reproduce.py --summarize=A"
  # Each seed's command names its directory as the summary was given it.
  recorded = "python3.11 benchmarks/reproduce.py --long --seed=1 --out=/abs/s1 --models=a,b"
  assert report.command_for(recorded, "runs/s1") == (
    "python benchmarks/reproduce.py --long --seed=1 --out=runs/s1 --models=a,b"
  )


def test_the_compression_and_streaming_arms_are_dipaco_2x2_but_for_the_outer_exchange(tmp_path):
  s = modes.MODES["long"]
  cfg = lambda m: runs.make_config(m, s, str(tmp_path), "multiply").to_dict()
  base = cfg("dipaco_2x2")
  for name, codec, ef, stream in [
    ("dipaco_2x2_int8", "int8", True, (1, 0)),
    ("dipaco_2x2_fp4", "fp4", True, (1, 0)),
    ("dipaco_2x2_fp4_noef", "fp4", False, (1, 0)),
    ("dipaco_2x2_topk2", "topk2", True, (1, 0)),
    ("dipaco_2x2_stream", "fp4", True, (3, 4)),
    ("dipaco_2x2_frag", "fp4", True, (3, 0)),
  ]:
    c, b = cfg(name), cfg("dipaco_2x2")
    wire = lambda o: (o.pop("compression"), o.pop("error_feedback"))
    streamed = lambda o: (o.pop("fragments"), o.pop("overlap"))
    assert (wire(c["outer"]), streamed(c["outer"])) == ((codec, ef), stream), name
    assert (wire(b["outer"]), streamed(b["outer"])) == (("none", True), (1, 0))
    assert c == b, name
  assert base["data"]["shard_dir"] == cfg("dipaco_2x2_fp4")["data"]["shard_dir"]  # Same shards.


def test_outer_norms_of_a_streamed_run_by_hand(tmp_path):
  """Each level's series from the records that hold it (a fragment's sync holds its levels)."""
  recs = [
    {"step": 1, "outer_delta_norm": {"level_0": [3.0]}},
    {"step": 2, "outer_delta_norm": {"level_1": [3.0, 4.0]}},
    {"step": 3, "outer_delta_norm": {"level_0": [1.0]}},
    {"step": 4, "outer_delta_norm": {"level_0": [2.0], "level_1": [0.0, 1.0]}},
  ]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
  cfg = ml_collections.ConfigDict(
    {
      "outer": {"enabled": True, "sqrt_paths_cap": 0.0},
      "dipaco": {"modules_per_level": (1, 2), "replicas": 1},
    }
  )
  out = runs.outer_norms(cfg, str(tmp_path))
  l0, l1 = out["levels"]["level_0"], out["levels"]["level_1"]
  assert (l0["steps"], l0["norm"], l0["peak"], l0["last"]) == ([1, 3, 4], [3.0, 1.0, 2.0], 3.0, 2.0)
  assert (l1["steps"], l1["norm"], l1["modules"], l1["paths_per_module"]) == (
    [2, 4],
    [5.0, 1.0],
    2,
    1,
  )
  assert "shared_over_modules" not in out  # The levels sync at different steps.
  assert out["stable"] is True  # Both below their peaks at the last sync.
