"""The capacity comparison (benchmarks/reproduce.py --capacity): its plan, gate, verdicts, page."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from reproduction import arms  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import capacity  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import capacity_markdown  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import capacity_page  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import modes  # pylint: disable=g-import-not-at-top,wrong-import-position
from reproduction import runs  # pylint: disable=g-import-not-at-top,wrong-import-position

S = modes.MODES["capacity"]


def test_the_plan_trains_theta_first_and_each_bigger_dense_model_after_its_own_theta():
  order = capacity.plan(S, "all", None)
  assert order[0] == "pretrain"
  assert order[1:13] == capacity.gate_models()  # P = 1, 2, 4, 8 x 3 outer LRs.
  for big in arms.BIG_DENSE:
    assert order.index(f"pretrain_{big}") == order.index(big) - 1
  assert set(capacity.arm_models()) <= set(order)
  assert capacity.plan(S, "gate", None) == ["pretrain", *capacity.gate_models()]
  # Every method at each of its outer LRs.
  assert "diloco_iid_8_olr1.4" in order and "dipaco_2x4_iid_olr0.5" in order


def test_outer_lr_variants_of_every_arm_with_an_outer_step_and_none_without():
  assert arms.outer_lr_variant("dipaco_2x4_iid_olr0.5") == ("dipaco_2x4_iid", 0.5)
  assert arms.outer_lr_variant("diloco_iid_1_olr1") == ("diloco_iid_1", 1.0)
  assert arms.outer_lr_variant("diloco_iid_olr0.35") == ("diloco_iid", 0.35)
  for name in ("dense_path_olr0.5", "pretrain_olr1", "dipaco_9x9_olr0.5", "diloco_iid_olr0"):
    assert arms.outer_lr_variant(name) is None, name
  assert arms.describe("dipaco_2x4_olr0.5").endswith("at outer LR 0.5")


def test_each_arms_config_sizes_batches_grid_and_tokenizer():
  def config(name):
    return runs.make_config(name, S, "/nonexistent/out", "multiply", seed=3)

  pre, fork = config("pretrain"), config("diloco_iid_8_olr1")
  # θ̄ at the small batch; every forked arm at the fork batch, every row another document.
  assert (pre.data.batch_size, pre.data.interleave) == (32, 32)
  assert (fork.data.batch_size, fork.data.interleave) == (256, 256)
  assert fork.dipaco.replicas == 8 and fork.outer.lr == 1.0
  assert fork.dipaco.init_from == "/nonexistent/out/runs/pretrain"
  for c in (pre, fork):
    assert c.model.vocab_size == 1024 and c.data.vocab_path.endswith("dipaco_spm1k.model")
    assert (c.seed, c.data.seed, c.routing.seed) == (3, 3, 3)
  grid = config("dipaco_2x4_olr0.5")
  assert tuple(grid.dipaco.modules_per_level) == (1, 2, 4) and grid.outer.lr == 0.5
  pse = config("dipaco_2x4_pse_olr0.7")
  assert pse.dipaco.path_specific == "embed" and tuple(pse.dipaco.modules_per_level) == (1, 2, 4)
  store = config("dense_store_2x2")
  assert store.model.num_layers == 8 and not store.outer.enabled
  assert store.dipaco.init_from == "/nonexistent/out/runs/pretrain_dense_store_2x2"
  assert config("pretrain_dense_store_2x2").data.batch_size == 32


def test_store_sized_dense_models_hold_as_many_parameters_as_the_grids_stores():
  counts = lambda name: runs.param_counts(runs.make_config(name, S, "/x", "multiply"))
  # Path: embedding 1024 x 32 = 32,768 + 4 blocks of 12,352 + the final norm's 32 = 82,208.
  assert counts("dense_path")["path"] == 82_208
  assert counts("dense_store_2x2")["total"] == counts("dipaco_2x2")["total"] == 131_616
  assert counts("dense_store_2x4")["total"] == counts("dipaco_2x4")["total"] == 181_024
  assert 1.9 < counts("dense_wide")["total"] / 82_208 < 2.0


def record(ppl: float, **kw) -> dict:
  """An arm's record as train_run writes it, with what the page reads."""
  return {
    "final": {"store": {"ppl": {"once": ppl}, "loss": {"once": math.log(ppl)}}},
    "curve": [(1500, ppl * 2), (1635, ppl)],
    "forked": True,
    "params": {"path": 82_208, "total": kw.pop("total", 82_208), "workers": kw.pop("workers", 1)},
    "shards": {"train_tokens": kw.pop("shard_tokens", [21_000_000])},
    "sizes": dataclasses.asdict(S),
    **kw,
  }


def gate_records(p8: float) -> dict:
  return {
    "diloco_iid_1_olr0.7": record(300.0),
    "diloco_iid_1_olr1": record(290.0),
    "diloco_iid_2_olr0.7": record(250.0),
    "diloco_iid_olr0.7": record(220.0),
    "diloco_iid_olr1": record(218.0),
    "diloco_iid_8_olr0.7": record(p8),
  }


def test_saturation_takes_each_ps_best_outer_lr_and_the_gain_of_each_doubling():
  sat = capacity.saturation(gate_records(214.0))
  assert {p: v["arm"] for p, v in sat["curve"].items()} == {
    1: "diloco_iid_1_olr1",
    2: "diloco_iid_2_olr0.7",
    4: "diloco_iid_olr1",
    8: "diloco_iid_8_olr0.7",
  }
  # 1 - 250/290 = 0.13793; 1 - 218/250 = 0.128; 1 - 214/218 = 0.018349 <= 0.02: met.
  assert sat["gains"]["1_to_2"] == pytest.approx(0.137931, abs=1e-6)
  assert sat["gains"]["2_to_4"] == pytest.approx(0.128)
  assert sat["gains"]["4_to_8"] == pytest.approx(0.018349, abs=1e-6)
  assert sat["met"] and "gains 1.8% (gate <= 2%: met)" in capacity.describe_gate(sat)
  # 1 - 210/218 = 0.036697 > 0.02: not met, said so.
  sat = capacity.saturation(gate_records(210.0))
  assert not sat["met"] and "3.7% (gate <= 2%: NOT met" in capacity.describe_gate(sat)


def test_a_later_seed_runs_seed_0s_best_outer_lr_and_those_within_2_percent_of_it():
  seed0 = {
    "diloco_iid_1_olr0.5": record(47.90),  # 47.90 / 47.27 = 1.3% above the best: kept.
    "diloco_iid_1_olr0.7": record(47.27),
    "diloco_iid_1_olr1": record(48.68),  # 2.98% above: dropped.
    "diloco_iid_1_olr1.4": record(70.41),  # Far off: not trained again.
    "diloco_iid_8_olr0.7": record(43.07),  # 3.8% above 41.50: dropped.
    "diloco_iid_8_olr1": record(41.85),  # 0.84% above: kept.
    "diloco_iid_8_olr1.4": record(41.50),  # Best.
    "diloco_iid_8_olr2": record(42.33),  # 42.33 = 41.50 x 1.02 exactly: kept (<=).
    "diloco_iid_olr0.7": record(43.61),  # P = 4 lacks 1.4 in seed 0: every LR still runs.
    "diloco_iid_olr1": record(43.00),
    "diloco_iid_2_olr0.7": record(45.11),  # 2.04% above 44.21: dropped, just.
    "diloco_iid_2_olr1": record(44.21),
    "diloco_iid_2_olr1.4": record(float("nan")),  # Diverged: never kept.
  }
  gate = capacity.gate_models(seed0)
  by = lambda prefix: [m for m in gate if m.startswith(prefix)]
  assert by("diloco_iid_1_") == ["diloco_iid_1_olr0.5", "diloco_iid_1_olr0.7"]
  assert by("diloco_iid_8_") == ["diloco_iid_8_olr1", "diloco_iid_8_olr1.4", "diloco_iid_8_olr2"]
  assert by("diloco_iid_2_") == ["diloco_iid_2_olr1"]
  # Seed 0's P = 2 best at the top of its sweep, 2 not run yet: seed 1 runs all four.
  top = {**seed0, **{f"diloco_iid_2_olr{lr:g}": record(50 - lr) for lr in (0.7, 1.0, 1.4)}}
  assert [m for m in capacity.gate_models(top) if m.startswith("diloco_iid_2_")] == [
    "diloco_iid_2_olr0.7",
    "diloco_iid_2_olr1",
    "diloco_iid_2_olr1.4",
    "diloco_iid_2_olr2",
  ]
  assert by("diloco_iid_olr") == ["diloco_iid_olr0.7", "diloco_iid_olr1", "diloco_iid_olr1.4"]
  # DiPaCo: seed 0 not done with it, every LR stays; seed 0 itself (no reference) runs every LR.
  assert capacity.arm_models(seed0) == capacity.arm_models()
  # Seed 1's gate: 2 + 1 + 3 + 3 arms, against the 3 LRs per P a fresh seed 0 starts with.
  assert len(gate) == 9 and len(capacity.gate_models()) == 12
  assert len(capacity.plan(S, "all", None, seed0)) == len(capacity.plan(S, "all", None)) - 3
  # Seed 0's 2x2 routed sweep done (0.5 2.4% above 0.7, 1.0 far off): only 0.7 again.
  grid = {
    **seed0,
    **{f"dipaco_2x2_olr{lr:g}": record(v) for lr, v in ((0.5, 44.41), (0.7, 43.36), (1, 61.41))},
  }
  assert [m for m in capacity.arm_models(grid) if m.startswith("dipaco_2x2_olr")] == [
    "dipaco_2x2_olr0.7"
  ]


def test_seed_0_walks_an_arms_outer_lr_sweep_past_the_edge_that_holds_its_best():
  walk = lambda recs: capacity.swept("dipaco_2x2", "dipaco", recs)
  at = lambda ppls: {f"dipaco_2x2_olr{lr:g}": record(v) for lr, v in ppls.items()}
  assert walk({}) == [0.5, 0.7]  # Nothing finished: the starting LRs.
  assert walk(at({0.5: 44.41})) == [0.5, 0.7]  # 0.7 not finished: no walk yet.
  # 0.7 best, the top: 1.0 next; then 1.0 best, the top again: 1.4; 1.4 worse: the best is inside.
  assert walk(at({0.5: 44.41, 0.7: 43.36})) == [0.5, 0.7, 1.0]
  assert walk(at({0.5: 44.41, 0.7: 43.36, 1: 43.0})) == [0.5, 0.7, 1.0, 1.4]
  assert walk(at({0.5: 44.41, 0.7: 43.36, 1: 43.0, 1.4: 60.0})) == [0.5, 0.7, 1.0, 1.4]
  # The bottom best: one rung down (0.35); a diverged arm (NaN) ranks last.
  assert walk(at({0.5: 44.0, 0.7: float("nan")})) == [0.35, 0.5, 0.7]
  assert walk(at({0.35: 45.0, 0.5: 44.0, 0.7: 46.0})) == [0.35, 0.5, 0.7]
  # At the ladder's end the sweep stops.
  ends = {f"diloco_iid_olr{lr:g}": record(50 - lr) for lr in (0.7, 1.0, 1.4, 2.0)}
  assert capacity.swept("diloco_iid", "diloco", ends) == [0.7, 1.0, 1.4, 2.0]
  # The plan trains the walked LR right after the sweep it extends, before the next arm.
  own = at({0.5: 44.41, 0.7: 43.36})
  order = capacity.plan(S, "all", None, None, own)
  assert order[order.index("dipaco_2x2_olr0.7") + 1] == "dipaco_2x2_olr1"
  assert "dipaco_2x2_olr1" not in capacity.plan(S, "all", None)


def test_a_resumed_seed_trains_only_arms_left_and_a_lost_theta_they_fork_from():
  names = ["pretrain", "dense_path", "pretrain_dense_wide", "dense_wide", "dipaco_2x4_olr0.5"]
  finished = {n: record(50.0) for n in names[:4]}
  gone = lambda name: False  # A new machine: the JSONs committed, no checkpoint.
  # dipaco_2x4 forks from θ̄ ("pretrain"): θ̄ again, not dense_path nor the wide model's θ̄.
  assert capacity.to_train(names, S, finished, gone) == ["pretrain", "dipaco_2x4_olr0.5"]
  assert capacity.to_train(names, S, finished, lambda name: True) == ["dipaco_2x4_olr0.5"]
  # Nothing left: nothing trained, θ̄ included.
  assert capacity.to_train(names[:4], S, finished, gone) == []
  # The wide model left: its own θ̄ again, the path's θ̄ not.
  less = {n: r for n, r in finished.items() if n != "dense_wide"}
  assert capacity.to_train(names[:4], S, less, gone) == ["pretrain_dense_wide", "dense_wide"]
  assert capacity.to_train(names, S, {}, gone) == names


def test_an_arm_trained_again_must_land_on_its_committed_curve():
  a = record(43.36)
  assert capacity.mismatch(a, json.loads(json.dumps(a))) is None  # A JSON round trip: the same.
  b = record(43.36)
  b["curve"] = [(1500, 86.72), (1635, 43.37)]
  assert (
    capacity.mismatch(a, b) == "perplexity at step 1635: committed 43.3600, trained again 43.3700"
  )
  assert not capacity.rerouted(a)
  a["final"]["store"]["ppl"]["linear/W=32"] = 44.0
  assert capacity.rerouted(a)


def test_the_levers_go_to_the_grid_whose_routed_arm_is_lower_at_its_best_outer_lr():
  recs = {
    "dipaco_2x2_olr0.5": record(200.0),
    "dipaco_2x2_olr0.7": record(205.0),
    "dipaco_2x4_olr0.5": record(195.0),
    "dipaco_2x4_olr0.7": record(190.0),
    "dipaco_2x4_iid_olr0.7": record(180.0),  # i.i.d. arms do not pick the grid.
  }
  assert capacity.better_grid(recs) == ("2x4", "dipaco_2x4_olr0.7")
  assert capacity.lever_models(recs) == ["dipaco_2x4_pse_olr0.7"]
  assert capacity.lever_models({}) == []


def test_a_verdict_needs_the_gap_beyond_the_larger_seed_range_and_asks_a_third_seed_within_2x():
  agg = {
    "a": {"ppl": [200.0, 202.0], "mean": 201.0, "range": 2.0},
    "b": {"ppl": [206.0, 205.0], "mean": 205.5, "range": 1.0},
    "c": {"ppl": [204.0, 204.0], "mean": 204.0, "range": 0.0},
  }
  v = capacity_page.verdict("a", "b", agg)  # gap 4.5 > 2: resolved; 4.5 > 2 x 2: no third seed.
  assert v["gap"] == pytest.approx(4.5) and v["resolved"] and not v["needs_third_seed"]
  assert v["paper_order_holds"]
  v = capacity_page.verdict("a", "c", agg)  # gap 3.0 > 2 but <= 4: resolved, a third seed asked.
  assert v["resolved"] and v["needs_third_seed"]
  v = capacity_page.verdict("b", "a", agg)  # -4.5: the reverse order, resolved.
  assert v["resolved"] and not v["paper_order_holds"]
  # The best LR variant among those run on the most seeds: 0.5 (seed 0 only, 44.0) is not
  # weighed against 0.7's mean over two seeds (43.0 and 46.0: 44.5).
  lrs = {
    "dipaco_2x2_olr0.5": {"ppl": [44.0], "mean": 44.0, "range": 0.0},
    "dipaco_2x2_olr0.7": {"ppl": [43.0, 46.0], "mean": 44.5, "range": 3.0},
    "dipaco_2x2_olr1": {"ppl": [45.0, 46.0], "mean": 45.5, "range": 1.0},
  }
  assert capacity_page.best_arm(lrs, "dipaco_2x2") == "dipaco_2x2_olr0.7"
  assert capacity_page.best_arm(lrs, "dipaco_2x4") is None
  # One seed: a range of 0 says nothing, so no gap resolves and the sentence says why.
  one = {
    "dipaco_2x2_olr0.5": {"ppl": [40.0], "mean": 40.0, "range": 0.0},
    "diloco_iid_olr1": {"ppl": [43.0], "mean": 43.0, "range": 0.0},
  }
  v = capacity_page.verdict("dipaco_2x2_olr0.5", "diloco_iid_olr1", one)
  assert v["seeds"] == 1 and not v["resolved"] and v["gap"] == pytest.approx(3.0)
  text = capacity_markdown.sentence({"question": "dipaco_vs_diloco", "grid": "2x2", **v}, one)
  assert text.endswith(
    "the paper's order, one seed so far: no range yet, so not a result either way."
  )


def test_bits_per_character_by_hand():
  # 2 bits a token (2 ln 2 nats) over 2 characters a token: 1 bit a character.
  assert capacity.bits_per_char(2 * math.log(2), 2.0) == pytest.approx(1.0)


def write_seed(results, seed: int, shift: float, vocab: int = 1024) -> None:
  sizes = dataclasses.asdict(dataclasses.replace(S, vocab=vocab))
  pre = record(400.0, chars_per_scored_token=2.0, routed_share=0.6)
  pre.update(forked=False, noise_scale={"noise_scale_tokens": 2_500.0 + 100 * seed})
  recs = {
    "pretrain": pre,
    **gate_records(214.0 + shift),
    "diloco_iid_8_olr1": record(216.0 + shift, workers=8),
    "dense_store_2x4": record(212.0 + shift, total=181_024),
    "dipaco_2x4_olr0.5": record(205.0 + shift, total=181_024, workers=8),
    "dipaco_2x4_iid_olr0.5": record(207.0 - shift, total=181_024, workers=8),
  }
  for name, r in recs.items():
    capacity.write_arm(results, seed, name, {**r, "sizes": sizes, "seed": seed})


def test_the_page_and_its_json_from_two_seeds_arm_files(tmp_path):
  results = str(tmp_path / "results")
  write_seed(results, 0, 0.0)
  write_seed(results, 1, 1.0)
  page = str(tmp_path / "docs" / "capacity.md")
  doc = capacity_page.write(results, page, str(tmp_path / "docs" / "capacity.json"), ["cmd"])
  saved = json.loads((tmp_path / "docs" / "capacity.json").read_text())
  assert saved == json.loads(json.dumps(doc))
  reg = saved["regime"]
  # 360 steps x 256 x 96 tokens / 82,208 = 107.6 per parameter per path; θ̄ 1500 x 32 x 96.
  assert reg["tokens_per_param_path"] == pytest.approx(360 * 256 * 96 / 82_208)
  assert reg["tokens_per_param_theta"] == pytest.approx(1500 * 32 * 96 / 82_208)
  # Per seed 24,576 (256 x 96) / 2,500 and / 2,600; the JSON's headline is their mean.
  assert reg["batch_over_noise_scale"] == pytest.approx((24_576 / 2_500 + 24_576 / 2_600) / 2)
  # Seed 0: 1 - 214/218; seed 1: 1 - 215/218 (P = 8 at 0.7 beats its 1.0 arm in both).
  assert reg["diloco_gain_4_to_8"] == pytest.approx((1 - 214 / 218 + 1 - 215 / 218) / 2)
  grid = saved["arms"]["dipaco_2x4_olr0.5"]
  assert grid["ppl"] == [205.0, 206.0] and grid["seeds"] == [0, 1]
  assert (grid["grid"], grid["shards"], grid["params"]) == ("2x4", "routed", 181_024)
  assert saved["arms"]["dipaco_2x4_iid_olr0.5"]["shards"] == "iid"
  assert saved["arms"]["dense_store_2x4"]["grid"] == "dense"
  assert saved["arms"]["diloco_iid_8_olr0.7"]["grid"] == "P=8"
  # bits per char: ln(205) nats / ln 2 / 2 characters a token.
  assert grid["bits_per_char"][0] == pytest.approx(math.log(205.0) / math.log(2) / 2)
  q = {x["question"]: x for x in saved["questions"]}
  # DiPaCo 205.5 vs DiLoCo P=8's best (0.7: 214.5), vs the 2x4 store's dense 212.5, vs i.i.d.
  assert q["dipaco_vs_diloco"]["worse_expected"] == "diloco_iid_8_olr0.7"
  assert q["dipaco_vs_diloco"]["gap"] == pytest.approx(9.0)
  assert q["dipaco_vs_dense_store"]["gap"] == pytest.approx(7.0)
  assert q["routed_vs_iid"]["gap"] == pytest.approx(1.0) and not q["routed_vs_iid"]["resolved"]
  text = open(page).read()
  assert (
    "| tokens per parameter per path after the fork | 64k x 524k / 150M ≈ 224 | 1.0 | 108 |" in text
  )
  assert "P = 4 -> 8 gains 1.8% (gate <= 2%: met)" in text
  assert capacity_markdown.GATE_NOT_MET not in text  # Said only where a seed misses the gate.
  lines = capacity_markdown.gate_lines({0: gate_records(210.0)})
  assert "3.7% (gate <= 2%: NOT met" in lines[0] and lines[-1] == capacity_markdown.GATE_NOT_MET
  # The status names what each seed has and what it still lacks (dense_path was never written).
  done = len(os.listdir(os.path.join(results, "seed0")))
  planned = len(capacity.plan(S, "all", None))
  status = f"- seed 0: {done} of {planned} arms finished; still to run: "
  assert status in text and "`dense_path`" in text.split(status)[1].splitlines()[0]
  assert os.path.exists(str(tmp_path / "docs" / "capacity_ppl_vs_steps.png"))


def test_a_page_over_runs_of_two_vocabularies_is_one_line_and_writes_nothing(tmp_path):
  results = str(tmp_path / "results")
  write_seed(results, 0, 0.0)
  write_seed(results, 1, 1.0, vocab=8192)
  page = tmp_path / "docs" / "capacity.md"
  with pytest.raises(SystemExit, match=r"vocabularies \[1024, 8192\]; perplexities do not"):
    capacity_page.write(results, str(page), str(tmp_path / "docs" / "capacity.json"), [])
  assert not (tmp_path / "docs").exists()


def _reproduce(*args, cwd):
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "benchmarks", "reproduce.py"), *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=1800,
    check=False,
  )


@pytest.mark.cli
def test_a_fork_batch_that_does_not_divide_the_mesh_is_one_line_before_anything_runs(tmp_path):
  proc = _reproduce(
    "--capacity", f"--out={tmp_path / 'out'}", f"--results={tmp_path / 'r'}",
    "--size", "fork_batch=6", cwd=tmp_path,
  )  # fmt: skip
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("--capacity: arm diloco_iid_1_olr0.7: config.data.batch_size=6 is not")
  assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()


# θ̄, one DiLoCo and one DiPaCo arm at tiny sizes, then the page: minutes in a child process.
@pytest.mark.slow
@pytest.mark.cli
def test_capacity_smoke_writes_each_arms_json_and_the_page(tmp_path):
  results = tmp_path / "results"
  proc = _reproduce(
    "--capacity_smoke", f"--out={tmp_path / 'out'}", f"--results={results}",
    "--models=diloco_iid_olr0.7,dipaco_2x4_olr0.5", cwd=tmp_path,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert sorted(os.listdir(results / "seed0")) == [
    "diloco_iid_olr0.7.json",
    "dipaco_2x4_olr0.5.json",
    "pretrain.json",
  ]
  pre = json.loads((results / "seed0" / "pretrain.json").read_text())
  assert pre["sizes"]["vocab"] == 1024 and 1.0 < pre["chars_per_scored_token"] < 4.0
  assert 0 < pre["routed_share"] < 1 and pre["noise_scale"]["noise_scale_tokens"] > 0
  page = tmp_path / "capacity.md"
  proc = _reproduce("--capacity_page", f"--results={results}", f"--page={page}", cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads((tmp_path / "capacity.json").read_text())
  assert set(doc["arms"]) == {"diloco_iid_olr0.7", "dipaco_2x4_olr0.5"}
  assert all(math.isfinite(x) for a in doc["arms"].values() for x in a["ppl"])
  # A new machine: the JSONs kept, the run directory lost. θ̄ is trained again (an arm left
  # forks from it) and checked against its JSON; the finished arms are not trained again.
  shutil.rmtree(tmp_path / "out")
  before = {f: (results / "seed0" / f).read_text() for f in os.listdir(results / "seed0")}
  more = "--models=diloco_iid_olr0.7,dipaco_2x4_olr0.5,dipaco_2x2_olr0.5"
  proc = _reproduce(
    "--capacity_smoke", f"--out={tmp_path / 'out'}", f"--results={results}", more, cwd=tmp_path
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")] == [
    "== pretrain",
    "== dipaco_2x2_olr0.5",
  ]
  assert "pretrain: the same curve as its committed JSON (kept)" in proc.stdout
  assert all((results / "seed0" / f).read_text() == text for f, text in before.items())
  # θ̄'s JSON not what training gives: one line, and nothing written over.
  shutil.rmtree(tmp_path / "out")
  pre = json.loads((results / "seed0" / "pretrain.json").read_text())
  pre["curve"][-1][1] += 1.0
  (results / "seed0" / "pretrain.json").write_text(json.dumps(pre))
  kept = {f: (results / "seed0" / f).read_text() for f in os.listdir(results / "seed0")}
  more += ",dipaco_2x2_olr0.7"
  proc = _reproduce(
    "--capacity_smoke", f"--out={tmp_path / 'out'}", f"--results={results}", more, cwd=tmp_path
  )
  assert proc.returncode == 1, proc.stderr[-4000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("--capacity: pretrain trained again for seed 0 is not its committed run")
  assert {f: (results / "seed0" / f).read_text() for f in os.listdir(results / "seed0")} == kept
