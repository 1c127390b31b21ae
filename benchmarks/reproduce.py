r"""The paper's comparison at small scale on the embedded corpus: one command, table and plots.

  python benchmarks/reproduce.py --out=/tmp/dipaco_repro           # full: <= 60 min, 2 cores
  python benchmarks/reproduce.py --quick --out=/tmp/dipaco_repro_q  # ~10 CPU-minutes
  python benchmarks/reproduce.py --smoke --out=/tmp/dipaco_repro_s  # CI: tiny sizes, 1/40 data

The long comparison, in the regime that can answer the paper's question (per-worker batch
32 x 96 tokens with every row from another document, about 1x the gradient noise scale
measured at θ̄; benchmarks/noise_scale.py runs on θ̄ and on the dense run's end): θ̄ 240
steps, then 240 more; every arm 4 workers (DiLoCo P=4 at outer LR 0.7, 0.35 and 1.0, DiPaCo 2x2
routed at outer LR 0.7 and 1.0, the same grid on i.i.d. shards, DiPaCo 2x2 with inner Muon)
and DiLoCo P=2. One output dir per seed, then the summary over seeds (mean and range per
model, oracle and random-path means, gaps within the seed range flagged):

  python benchmarks/reproduce.py --long --seed=0 --out=/tmp/long_s0   # then --seed=1 --out=..._s1
  python benchmarks/reproduce.py --summarize=/tmp/long_s0,/tmp/long_s1 --out=/tmp/long_sum

The summary also writes the arms per seed as JSON (`--arms_json`, default
<out>/specialisation.json: {"arms": {name: {"ppl": [per seed], "grid", "shards", ...}}}, with
each multi-path run's specialisation report: diagonal gap, routed-is-best share), the form
docs/results/specialisation.md reads. The routing levers beside --long's arms (add them with
--models=...): the embedding routed (dipaco_2x2_pse: each path its own; dipaco_2x2_emb: in the
first routed level; each with its _iid control), the 4x4 grid (dipaco_4x4, dipaco_4x4_iid,
diloco_iid_16), `--size min_share=0`; and the outer deltas compressed (dipaco_2x2_int8,
dipaco_2x2_fp4, dipaco_2x2_fp4_noef, dipaco_2x2_topk2) or streamed (dipaco_2x2_stream, and
dipaco_2x2_frag without its overlap).

`--long_b4` is the first long comparison (batch 4 x 96, one document after another: ~0.04x
the noise scale), kept for the results page's appendix.

A seed changes everything a real rerun changes: data.seed (batch order, i.i.d. shards,
held-out documents), the model init (config.seed) and the k-means / router seed
(routing.seed). So each seed trains its own θ̄; sharing one θ̄ would leave its noise
out of the seed range.

Every model uses the shipped 8k SentencePiece tokenizer, the same batch (B x T
per path) and the same number of weight-update steps, as in the paper's
Table 1 / Fig. 8 (the DiPaCo paper, §5):

  pretrain      dense path-size model, `pretrain` steps: θ̄, the fork point.
  dense_path    θ̄ + `steps` more steps (the paper's 150M baseline protocol).
  dense_4x      a dense model with ~4x the path's parameters, trained from
                scratch for pretrain + steps (the paper's 1.3B baseline).
  diloco_iid    DiLoCo: one path, P = 4 replicas on i.i.d. shards, forked from θ̄: as
                many workers as the 2x2 grid (and the flat MoE) has paths.
  diloco_iid_16 DiLoCo with as many replicas as the 4x4 grid has paths (16): the
                comparison at equal workers (the paper's Table 1 pairs DiLoCo P=8
                with DiPaCo 2x4, 8 paths each).
  diloco_kmeans DiLoCo on non-i.i.d. shards: k-means with one cluster per replica.
  flat_moe      P independent paths (one level, K=P), k-means then one
                discriminative re-shard.
  dipaco_2x2    P = 4 paths, blocks split in two levels of 2 modules; embedding
                and head shared; k-means, then one discriminative re-shard.
  dipaco_2x2_kmeans  the same run without the re-shard (k-means throughout).
  dipaco_4x4    16 paths, 4 modules per level; k-means, then discriminative.
  dipaco_4x4_kmeans  the same run without the re-shard (k-means throughout).

Every routing is balanced (`min_share` of the sizes, default 0.5): the k-means shards
(routing.kmeans_min_share) and the discriminative re-shard (discriminative_min_share)
floor each path's share of the router split at half the uniform share, so no path
starves (the goal: no training shard under 25% of the mean, in tokens). The k-means
controls share their grid's balanced phase-0 shards, so each pair differs by the
re-shard alone. `--size min_share=0` gives the unbalanced routing. The results record,
per phase, each run's training tokens per shard (min / median / max, min over mean) and
the share of router documents moved off their argmin path; for the grids also the outer
delta norm per level and outer step (the ×√P rescale's stability).

All forks re-warm the inner LR and anneal it over `steps`; the re-shard does
not restart the schedule (routing.restart_schedule=False), so k-means and
discriminative runs share one LR curve. Every checkpoint (each `eval_every`
outer steps) gets the same routed evaluation: each validation document's
first 32 tokens pick one path (the run's router at that step; trivial for
dense and DiLoCo), that path scores the rest, perplexity excludes the prefix.
The last checkpoint also gets per-path early stopping and, for models with
several paths, re-routing every W tokens (linear and transformer re-routers)
with oracles.

Writes <out>/results.json, results.md, ppl_vs_steps.png, ppl_vs_window.png;
<out>/runs/<model>/ are ordinary run directories (python -m dipaco_jax.evaluate
works on them). Rerunning resumes: finished training and evaluations are reused.
Scale figures (memory and step time vs paths, outer time vs modules) are
benchmarks/scale.py's.
"""
# pylint: disable=g-import-not-at-top,wrong-import-position

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DEVICES = 4  # One DiLoCo replica / 2x2 path per fake device; 4x4 puts 4 paths on each.


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Model sizes, step counts and evaluation settings of one mode."""

  d_model: int
  layers: int
  heads: int
  big_d_model: int  # The ~4x dense model.
  big_layers: int
  big_heads: int
  pretrain: int  # Dense steps before the fork.
  steps: int  # Steps after the fork (every model trains pretrain + steps in all).
  inner_steps: int  # H.
  batch: int
  seq_len: int
  lr: float
  big_lr: float  # The ~4x model's LR (paper: 2e-4 for 1.3B vs 4e-4; here the same LR wins).
  warmup: int  # From scratch.
  fork_warmup: int  # After the fork (DiLoCo re-warms).
  disc_at: int  # Outer step after which the discriminative re-shard runs.
  eval_every: int  # Outer steps between routed evaluations.
  windows: tuple[int, ...]
  reroute_steps: int
  subsample: int  # Keep one document in N (data.subsample).
  paths: int = 4  # P of DiLoCo and flat MoE.
  min_share: float = 0.5  # Balanced routing: each path's share >= this x 1/P (0 = argmin).
  interleave: int = 1  # data.interleave: documents read side by side into a batch's rows.


MODES = {
  "full": Sizes(
    d_model=128,
    layers=4,
    heads=4,
    big_d_model=256,
    big_layers=7,
    big_heads=8,
    pretrain=240,
    steps=240,
    inner_steps=30,
    batch=8,
    seq_len=128,
    lr=2e-3,
    big_lr=2e-3,
    warmup=50,
    fork_warmup=30,
    disc_at=3,
    eval_every=2,
    windows=(8, 16, 32, 64),
    reroute_steps=200,
    subsample=1,
  ),
  "quick": Sizes(
    d_model=64,
    layers=4,
    heads=2,
    big_d_model=128,
    big_layers=6,
    big_heads=4,
    pretrain=60,
    steps=60,
    inner_steps=15,
    batch=4,
    seq_len=96,
    lr=3e-3,
    big_lr=2e-3,
    warmup=15,
    fork_warmup=10,
    disc_at=1,
    eval_every=1,
    windows=(16, 32),
    reroute_steps=30,
    subsample=4,
  ),
  "smoke": Sizes(
    d_model=32,
    layers=2,
    heads=2,
    big_d_model=64,
    big_layers=2,
    big_heads=2,
    pretrain=4,
    steps=4,
    inner_steps=2,
    batch=4,
    seq_len=48,
    lr=3e-3,
    big_lr=2e-3,
    warmup=2,
    fork_warmup=2,
    disc_at=1,
    eval_every=1,
    windows=(8,),
    reroute_steps=2,
    subsample=2,
  ),
}

# The long comparison before the noise-scale work (batch 4 x 96 = ~0.04x the noise scale at θ̄,
# docs/results/comparison.md's appendix): the quick model at twice the full mode's steps.
MODES["long_b4"] = dataclasses.replace(
  MODES["quick"],
  pretrain=480,
  steps=480,
  inner_steps=30,
  warmup=50,
  fork_warmup=30,
  disc_at=3,
  eval_every=4,
  windows=(16,),
  subsample=1,
)
# The long comparison (`--long`), in the regime that can answer the paper's question: the
# per-worker batch (32 x 96 tokens, every row from another document: data.interleave) near
# the gradient noise scale measured at θ̄ (benchmarks/noise_scale.py; every run records its
# own), H = 15, θ̄ 240 steps then 240 more, all the data. Re-routing windows are left out
# (oracle and random-path scores are kept).
MODES["long"] = dataclasses.replace(
  MODES["quick"],
  pretrain=240,
  steps=240,
  inner_steps=15,
  batch=32,
  warmup=30,
  fork_warmup=15,
  disc_at=3,
  eval_every=4,
  windows=(),
  subsample=1,
  interleave=32,
)

# name -> (what it is, how it relates to the paper); the order of the table.
MODELS = {
  "dense_path": "dense, path size (Table 1 baseline, 16.23)",
  "dense_4x": "dense, ~4x path params, from scratch (the 1.3B dense, 11.41)",
  "diloco_iid": "DiLoCo, 4 replicas (the 2x2 grid's paths), i.i.d. shards (DiLoCo Table 3)",
  "diloco_iid_16": "DiLoCo, 16 replicas (the 4x4 grid's paths), i.i.d. shards",
  "diloco_kmeans": "DiLoCo, P replicas, k-means shards (non-i.i.d.)",
  "flat_moe": "flat MoE, P independent paths (Table 1)",
  "dipaco_2x2": "DiPaCo 2x2, k-means then discriminative (balanced)",
  "dipaco_2x2_kmeans": "DiPaCo 2x2, k-means only (control)",
  "dipaco_4x4": "DiPaCo 4x4, k-means then discriminative (balanced)",
  "dipaco_4x4_kmeans": "DiPaCo 4x4, k-means only (control)",
}


# The long comparison (`--models=long`): every arm 4 workers (DiLoCo P=2 asks whether DiLoCo
# is saturated), the controls that tell routing from averaging (the same grid on i.i.d.
# shards; oracle and random-path scores), DiLoCo at the paper's outer LR and a smaller one.
LONG_MODELS = (
  "dense_path",
  "diloco_iid",
  "diloco_iid_olr0.35",
  "diloco_iid_olr1.0",
  "diloco_iid_2",
  "dipaco_2x2",
  "dipaco_2x2_olr1.0",
  "dipaco_2x2_iid",
  "dipaco_2x2_muon",
)
# --long_b4's models (the appendix's comparison).
LONG_B4_MODELS = (
  "dense_path",
  "dense_4x",
  "diloco_iid",
  "diloco_iid_16",
  "dipaco_2x2",
  "dipaco_4x4",
  "dipaco_4x4_kmeans",
)
# The comparisons the summary reads (better model expected first, as in the paper's ordering).
PAIRS = (
  ("diloco_iid", "dense_path"),
  ("dipaco_2x2", "diloco_iid"),
  ("dipaco_2x2", "diloco_iid_olr0.35"),
  ("dipaco_2x2", "diloco_iid_olr1.0"),
  ("dipaco_2x2_olr1.0", "diloco_iid_olr1.0"),
  ("dipaco_2x2", "diloco_iid_2"),
  ("dipaco_2x2", "dipaco_2x2_iid"),
  ("diloco_iid", "diloco_iid_2"),
  ("dipaco_2x2_muon", "dipaco_2x2"),
  ("dipaco_2x2_pse", "dipaco_2x2_pse_iid"),
  ("dipaco_2x2_pse", "dipaco_2x2"),
  ("dipaco_2x2_emb", "dipaco_2x2_emb_iid"),
  ("dipaco_2x2_emb", "dipaco_2x2"),
  ("dipaco_2x2", "dipaco_2x2_int8"),
  ("dipaco_2x2", "dipaco_2x2_fp4"),
  ("dipaco_2x2_fp4", "dipaco_2x2_fp4_noef"),
  ("dipaco_2x2", "dipaco_2x2_topk2"),
  ("dipaco_2x2_fp4", "dipaco_2x2_stream"),
  ("dipaco_2x2_fp4", "dipaco_2x2_frag"),
  ("dipaco_2x2_frag", "dipaco_2x2_stream"),
  ("dipaco_4x4", "diloco_iid_16"),
  ("dipaco_4x4", "dipaco_4x4_iid"),
  ("dipaco_4x4", "dipaco_4x4_kmeans"),
  ("dipaco_4x4", "dipaco_2x2"),
  ("dense_4x", "dense_path"),
  ("dense_4x", "dipaco_4x4"),
)
# The first line of every mode: its regime (each run measures and prints its own noise scale).
_SMALL = (
  "is a small fraction of the gradient noise scale at θ̄ (printed after pretraining), where "
  "whoever averages more workers into a parameter wins: it cannot tell DiPaCo from DiLoCo as "
  "the paper does (docs/results/comparison.md); --long runs the comparison that can."
)
REGIME = {
  "full": f"full mode: the per-worker batch (8 x 128 tokens) {_SMALL}",
  "quick": f"quick mode checks that every model trains and evaluates; its batch (4 x 96 tokens) "
  f"{_SMALL}",
  "smoke": "smoke mode: tiny sizes, the plumbing only (CI); no number of it is a result.",
  "long_b4": f"long_b4 mode (the first long comparison, kept for its appendix): its batch "
  f"(4 x 96 tokens) {_SMALL}",
  "long": "long mode: per-worker batch 32 x 96 tokens, every row from another document, "
  "measured against the gradient noise scale at θ̄ after pretraining (the comparison needs "
  ">= 0.3x).",
}
GOAL_MIN_OVER_MEAN = 0.25  # No training shard under 25% of the mean (tokens), at any phase.

# Not in the default comparison: controls for the investigations of docs/results.md.
INVESTIGATIONS = {
  "dense_path_scratch": "dense, path size, from scratch (no fork, one LR schedule)",
  "diloco_iid_sqrtp": "DiLoCo i.i.d. with the DiPaCo grids' x sqrt(P) on the outer gradient",
  "diloco_iid_2": "DiLoCo, 2 replicas, i.i.d. shards (is DiLoCo saturated at P=4?)",
  "diloco_iid_olr<LR>": "DiLoCo, 4 replicas, i.i.d., outer LR <LR> (the paper's is 0.7)",
  "dipaco_2x2_olr<LR>": "DiPaCo 2x2 as dipaco_2x2 at outer LR <LR> (the paper's is 0.7)",
  "dipaco_2x2_iid": "DiPaCo 2x2 on i.i.d. shards: averaging over modules, no routing",
  "dipaco_2x2_muon": "DiPaCo 2x2 as dipaco_2x2, inner Muon for the matrices (MuLoCo)",
  "dipaco_4x4_iid": "DiPaCo 4x4 on i.i.d. shards: averaging over modules, no routing",
  "dipaco_2x2_pse": "DiPaCo 2x2 as dipaco_2x2, each path its own (tied) embedding",
  "dipaco_2x2_pse_iid": "dipaco_2x2_pse on i.i.d. shards (its control)",
  "dipaco_2x2_emb": "DiPaCo 2x2 as dipaco_2x2, the (tied) embedding in the first routed level",
  "dipaco_2x2_emb_iid": "dipaco_2x2_emb on i.i.d. shards (its control)",
  "dipaco_2x2_int8": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as int8 with error feedback",
  "dipaco_2x2_fp4": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as fp4 with error feedback",
  "dipaco_2x2_fp4_noef": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as fp4, no error feedback",
  "dipaco_2x2_topk2": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as top-1 of 64, 2 bits, with EF",
  "dipaco_2x2_stream": "DiPaCo 2x2 as dipaco_2x2_fp4, synced in 3 fragments landing 4 steps late",
  "dipaco_2x2_frag": "DiPaCo 2x2 as dipaco_2x2_fp4, synced in 3 fragments, each landing at once",
}
# <base>_olr<LR>: the base model at outer LR <LR>, e.g. diloco_iid_olr0.35.
OUTER_LR_BASES = ("diloco_iid", "dipaco_2x2")


def outer_lr_variant(name: str) -> tuple[str, float] | None:
  """(base model, outer LR) of an outer-LR variant's name; None for any other name."""
  for base in OUTER_LR_BASES:
    prefix = base + "_olr"
    if name.startswith(prefix):
      try:
        lr = float(name[len(prefix) :])
      except ValueError:
        return None
      return (base, lr) if lr > 0 else None
  return None


def known(name: str) -> bool:
  """A model this script can train (a MODELS or INVESTIGATIONS name, or an outer-LR variant)."""
  if name in MODELS or name in INVESTIGATIONS and "<" not in name:
    return True
  return outer_lr_variant(name) is not None


def ordered(names) -> list[str]:
  """`names` in the table's order: MODELS, INVESTIGATIONS, then outer-LR variants by LR."""
  fixed = [n for n in [*MODELS, *INVESTIGATIONS] if n in names]
  variants = [n for n in names if outer_lr_variant(n)]
  return fixed + sorted(variants, key=lambda n: (outer_lr_variant(n)[0], -outer_lr_variant(n)[1]))


def _block_levels(layers: int) -> tuple[str, str]:
  """Blocks split in two levels: the first half and the second half."""
  h = layers // 2
  span = lambda a, b: f"block_{a}" if a == b else f"block_{a}-{b}"
  return span(0, h - 1), span(h, layers - 1)


def run_overrides(
  name: str, s: Sizes, pretrain_dir: str, shared_shards: str, sqrt_paths: str, sqrt_cap: float = 0.0
) -> dict:
  """Config overrides (on configs/tiny.py) of one model; shared_shards: a shard dir prefix."""
  variant = outer_lr_variant(name)
  if variant:
    base, lr = variant
    return {
      **run_overrides(base, s, pretrain_dir, shared_shards, sqrt_paths, sqrt_cap),
      "outer.lr": lr,
    }
  everything = f"embed,block_0-{s.layers - 1},head"
  fork = {
    "dipaco.init_from": pretrain_dir,
    "inner.warmup_steps": s.fork_warmup,
    "dipaco.outer_steps": s.steps // s.inner_steps,
  }
  kmeans = {"routing.router": "kmeans", "routing.kmeans_min_share": s.min_share}
  disc = {
    **kmeans,
    "routing.discriminative_at_outer_step": s.disc_at,
    "routing.discriminative_min_share": s.min_share,
    "routing.restart_schedule": False,
  }
  grid = lambda k: {
    "dipaco.level_groups": ("embed,head", *_block_levels(s.layers)),
    "dipaco.modules_per_level": (1, k, k),
    "outer.sqrt_paths": sqrt_paths,
    "outer.sqrt_paths_cap": sqrt_cap,
  }
  dense = {
    "dipaco.level_groups": (everything,),
    "dipaco.modules_per_level": (1,),
    "outer.enabled": False,
    "data.shard_dir": shared_shards + "_dense",
  }
  if name == "pretrain":
    return {**dense, "dipaco.outer_steps": s.pretrain // s.inner_steps}
  if name == "dense_path":
    return {**dense, **fork}
  if name == "dense_path_scratch":
    return {**dense, "dipaco.outer_steps": (s.pretrain + s.steps) // s.inner_steps}
  if name == "dense_4x":
    return {
      **dense,
      "model.d_model": s.big_d_model,
      "model.num_layers": s.big_layers,
      "model.num_heads": s.big_heads,
      "model.head_dim": s.big_d_model // s.big_heads,
      "dipaco.level_groups": (f"embed,block_0-{s.big_layers - 1},head",),
      "inner.lr": s.big_lr,
      "dipaco.outer_steps": (s.pretrain + s.steps) // s.inner_steps,
    }
  diloco = {
    "dipaco.level_groups": (everything,),
    "dipaco.modules_per_level": (1,),
    "dipaco.replicas": s.paths,
    "outer.sqrt_paths": "none",
    **fork,
  }
  if name == "diloco_iid":
    return diloco
  if name == "diloco_iid_16":  # Equal workers with dipaco_4x4.
    return {**diloco, "dipaco.replicas": 16}
  if name == "diloco_iid_2":
    return {**diloco, "dipaco.replicas": 2}
  if name == "diloco_iid_sqrtp":
    return {**diloco, "outer.sqrt_paths": sqrt_paths}
  if name == "diloco_kmeans":
    return {**diloco, **kmeans, "routing.replica_shards": "router"}
  if name == "flat_moe":
    return {
      "dipaco.level_groups": (everything,),
      "dipaco.modules_per_level": (s.paths,),
      **fork,
      **disc,
    }
  if name == "dipaco_2x2":  # Same phase-0 shards as its control (same θ̄, seed, grid).
    return {**grid(2), **fork, **disc, "data.shard_dir": shared_shards + "_2x2"}
  if name == "dipaco_2x2_iid":  # No router: i.i.d. shards from the fork to the end.
    return {**grid(2), **fork, "routing.router": "random"}
  if name == "dipaco_2x2_muon":
    return {
      **grid(2),
      **fork,
      **disc,
      "data.shard_dir": shared_shards + "_2x2",
      "inner.optimizer": "muon",
    }
  if name == "dipaco_4x4_iid":
    return {**grid(4), **fork, "routing.router": "random"}
  compressed = {
    "dipaco_2x2_int8": {"outer.compression": "int8"},
    "dipaco_2x2_fp4": {"outer.compression": "fp4"},
    "dipaco_2x2_fp4_noef": {"outer.compression": "fp4", "outer.error_feedback": False},
    "dipaco_2x2_topk2": {"outer.compression": "topk2"},
    # Streamed: fp4 in 3 fragments synced H/3 apart, each update landing 4 steps late.
    "dipaco_2x2_stream": {"outer.compression": "fp4", "outer.fragments": 3, "outer.overlap": 4},
    "dipaco_2x2_frag": {"outer.compression": "fp4", "outer.fragments": 3},  # Its τ = 0 ablation.
  }
  if name in compressed:  # The same run as dipaco_2x2 but for the wire format of its deltas.
    return {
      **run_overrides("dipaco_2x2", s, pretrain_dir, shared_shards, sqrt_paths, sqrt_cap),
      **compressed[name],
    }
  # Where the capacity sits: the quick model's tied embedding holds ~73% of a path's
  # parameters; these put it in the routed part (same phase-0 shards as dipaco_2x2).
  first, second = _block_levels(s.layers)
  pse = {**grid(2), "dipaco.path_specific": "embed", "dipaco.level_groups": ("head", first, second)}
  emb = {**grid(2), "dipaco.level_groups": ("head", f"embed,{first}", second)}
  capacity = {"dipaco_2x2_pse": pse, "dipaco_2x2_emb": emb}
  if name in capacity:
    return {**capacity[name], **fork, **disc, "data.shard_dir": shared_shards + "_2x2"}
  if name.endswith("_iid") and name[: -len("_iid")] in capacity:
    return {**capacity[name[: -len("_iid")]], **fork, "routing.router": "random"}
  if name == "dipaco_2x2_kmeans":
    return {**grid(2), **fork, **kmeans, "data.shard_dir": shared_shards + "_2x2"}
  if name == "dipaco_4x4":  # Same phase-0 shards as its control.
    return {**grid(4), **fork, **disc, "data.shard_dir": shared_shards + "_4x4"}
  if name == "dipaco_4x4_kmeans":
    return {**grid(4), **fork, **kmeans, "data.shard_dir": shared_shards + "_4x4"}
  raise ValueError(f"unknown model {name!r}; choose from {['pretrain', *MODELS, *INVESTIGATIONS]}.")


def make_config(name: str, s: Sizes, out: str, sqrt_paths: str, seed: int = 0, sqrt_cap=0.0):
  """configs/tiny.py with this mode's sizes and the model's overrides."""
  from dipaco_jax import config_check

  common = {
    "model.d_model": s.d_model,
    "model.num_layers": s.layers,
    "model.num_heads": s.heads,
    "model.head_dim": s.d_model // s.heads,
    "model.max_len": max(256, s.seq_len),
    "inner.lr": s.lr,
    "inner.warmup_steps": s.warmup,
    "dipaco.inner_steps": s.inner_steps,
    "data.seq_len": s.seq_len,
    "data.batch_size": s.batch,
    "data.subsample": s.subsample,
    "data.interleave": s.interleave,
    # A seed varies what a real rerun varies: data order and shards, init, router fits.
    "data.seed": seed,
    "seed": seed,
    "routing.seed": seed,
    "mesh.cpu_devices": CPU_DEVICES,
    "log_every_steps": s.inner_steps,
    "ckpt.every_steps": s.inner_steps,
    "ckpt.async_save": False,
    "eval.every_steps": s.inner_steps,
    "eval.batches": 2,
    "eval.rerouting_windows": s.windows,
    "eval.rerouters": ("linear", "transformer"),  # docs/results.md compares both.
    "eval.reroute_steps": s.reroute_steps,
    # k-means on a small validation split can leave a path without validation documents;
    # early stopping reads a held-out slice of each training shard (the default source), so
    # the validation split is used for the final numbers only.
    "data.empty_shard_policy": "allow_validation",
    "early_stopping.source": "heldout",
  }
  over = {
    **common,
    **run_overrides(
      name,
      s,
      os.path.join(out, "runs", "pretrain"),
      os.path.join(out, "shards"),
      sqrt_paths,
      sqrt_cap,
    ),
  }
  c = config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)
  c.ckpt.max_to_keep = c.dipaco.outer_steps + 2  # Every outer step is evaluated afterwards.
  return c


def param_counts(config) -> dict:
  """Parameters of one path and of the whole store (unique parameters)."""
  import jax

  from dipaco_jax.core import experiment

  exp = experiment.Experiment(config)
  n = lambda t: int(sum(np.prod(x.shape) for x in jax.tree.leaves(t)))
  params_W = exp.abstract_state.params
  return {
    "path": n(params_W) // exp.topo.num_workers,
    "total": n(exp.abstract_state.store),
    "paths": exp.topo.num_paths,
    "workers": exp.topo.num_workers,
  }


def _read_json(path: str) -> dict:
  """A file this script wrote before, or {} (a fresh run)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _checkpoint_steps(workdir: str) -> list[int]:
  from dipaco_jax.io import checkpoint

  return checkpoint.steps(workdir)


def evaluate_run(config, workdir: str, s: Sizes, *, final_full: bool) -> tuple[dict, int]:
  """Routed ppl at every `eval_every`-th outer step, full report at the last (cached).

  Returns the reports by step and how many of them this call computed.
  """
  from dipaco_jax import evaluate
  from dipaco_jax.runtime import early_stopping

  cache_path = os.path.join(workdir, "reproduce_eval.json")
  cache = _read_json(cache_path)
  computed = 0
  steps = _checkpoint_steps(workdir)
  last = steps[-1]
  every = s.eval_every * s.inner_steps
  for step in steps:
    key = str(step)
    if key in cache or (step % every and step != last):
      continue
    run = evaluate.load_run(config, workdir, step)
    # Re-routing and oracles at the last step of a run with several paths; else once only.
    full = step == last and final_full and run.exp.topo.num_paths > 1
    kw = dict(windows=None if full else [], rerouters=None if full else (), oracle=full)
    rep = {"store": evaluate.evaluate(run, per_sequence=full, **kw)}
    if full:  # The specialisation report from the same scores (benchmarks/specialisation.py's).
      write_specialisation(run, evaluate.specialisation(run, rep["store"]))
    if step == last and early_stopping.read_meta(workdir) is not None:
      rep["best"] = evaluate.evaluate(run, params="best", **kw)
    cache[key] = {
      k: {
        f: r[f]
        for f in (
          "ppl",
          "loss",
          "phase",
          "router",
          "scored_tokens",
          "num_sequences",
          "per_path",
          "switches_per_sequence",
        )
      }
      for k, r in rep.items()
    }
    with open(cache_path + ".tmp", "w") as f:
      json.dump(cache, f, indent=1)
    os.replace(cache_path + ".tmp", cache_path)
    computed += 1
  return cache, computed


def write_specialisation(run, spec) -> None:
  """<workdir>/specialisation_step<S>.json, as benchmarks/specialisation.py writes it."""
  import specialisation  # pylint: disable=import-outside-toplevel  # Beside this script.

  specialisation.write(
    specialisation.record(run, spec, "store"), specialisation.default_path(run.workdir, run.step)
  )


def read_specialisation(workdir: str) -> dict | None:
  """The specialisation report of the run's last checkpoint, when written."""
  import specialisation  # pylint: disable=import-outside-toplevel

  steps = _checkpoint_steps(workdir) if os.path.isdir(workdir) else []
  if not steps:
    return None
  return _read_json(specialisation.default_path(workdir, steps[-1])) or None


# The specialisation report's numbers a summary carries (the matrices stay in the run's JSON).
SPEC_KEYS = ("loss", "routed_best_share", "diagonal_gap", "routed_gain_share", "loss_matrix")


def specialisation_summary(spec: dict | None) -> dict | None:
  return {k: spec[k] for k in SPEC_KEYS} if spec else None


def phase_report(config, workdir: str, phase: int) -> dict:
  """One phase's shard sizes and the router's share of documents moved off their argmin path.

  Tokens per training shard: min / median / max / mean, min over mean; the router's
  documents per path and the moved-off share are on the router split (router.json).
  """
  from dipaco_jax import data as data_lib
  from dipaco_jax import routing
  from dipaco_jax.routing import report as router_report

  shards = data_lib.ShardSet(routing.shard_dir(config, workdir, phase))
  directory = routing.router_dir(workdir, phase)
  info = routing.Router.load(directory).info if routing.Router.exists(directory) else {}
  return {
    "phase": phase,
    **router_report.token_stats(shards.sizes("train")),
    "moved_off_label": float(info.get("moved_off_label", 0.0)),
    # Router-split documents per path, routed and before balancing (argmin / best path).
    "router_docs": [info.get(k) for k in ("docs_min", "docs_median", "docs_max")],
    "router_argmin_docs": [info.get(f"argmin_docs_{k}") for k in ("min", "median", "max")],
  }


def shard_report(config, workdir: str) -> dict:
  """Every phase's shard sizes; the last phase's tokens per worker, validation purity and NMI."""
  from dipaco_jax import data as data_lib
  from dipaco_jax import routing
  from dipaco_jax.routing import report as router_report

  phase = 0
  while os.path.isdir(routing.shard_dir(config, workdir, phase + 1)):
    phase += 1
  phases = [phase_report(config, workdir, k) for k in range(phase + 1)]
  shards = data_lib.ShardSet(routing.shard_dir(config, workdir, phase))
  workers, domains = [], []
  for w, n in enumerate(shards.num_docs("validation")):
    for d in shards.documents(w, "validation").read_many(range(int(n))):
      workers.append(w)
      domains.append(d.domain)
  ids, names = router_report.domain_index(domains)
  rep = router_report.report(np.asarray(workers), len(shards.num_docs("validation")), ids, names)
  return {
    "phase": phase,
    "phases": phases,
    "min_over_mean": min(p["min_over_mean"] for p in phases),
    "train_tokens": shards.sizes("train").tolist(),
    "validation_docs": shards.num_docs("validation").tolist(),
    "validation_domain_purity": float(rep.purity),
    "validation_domain_nmi": float(rep.nmi),
  }


def outer_norms(config, workdir: str) -> dict | None:
  """The outer delta norm per level and outer step (×√P's stability); None without outer steps.

  Per level: P (paths through each module), the norm of each outer step (the root of the
  modules' summed squares) and per module (that over √K), the first, the peak and the last.
  With several levels, `shared_over_modules` is, per outer step, the shared level's
  per-module norm over the mean per-module norm of the others (the ×√P rescale gives the
  shared level √P_shared / √P_level times their factor). `stable` is a coarse reading:
  every level's norm has turned down by the last outer step (below its peak), as the inner
  LR anneals; a ×√P step too large for its level keeps growing instead. None with fewer
  than 4 outer steps (the first ones fall in the inner warmup, where norms grow anyway).
  """
  from dipaco_jax.io import metrics

  if not config.outer.enabled:
    return None
  records = [r for r in metrics.read_records(workdir) if "outer_delta_norm" in r]
  if not records:
    return None
  workers = math.prod(config.dipaco.modules_per_level) * config.dipaco.replicas
  levels = {}
  # Streamed (outer.fragments > 1): a sync's record holds its fragment's levels only.
  names = list(dict.fromkeys(level for r in records for level in r["outer_delta_norm"]))
  for level in names:
    mine = [r for r in records if level in r["outer_delta_norm"]]
    k = len(mine[0]["outer_delta_norm"][level])
    norms = [float(np.sqrt(np.sum(np.square(r["outer_delta_norm"][level])))) for r in mine]
    peak = max(norms)
    levels[level] = {
      "modules": k,
      "paths_per_module": workers // k,
      "steps": [int(r["step"]) for r in mine],
      "norm": norms,
      "per_module": [n / math.sqrt(k) for n in norms],
      "first": norms[0],
      "peak": peak,
      "last": norms[-1],
      "max_over_first": peak / norms[0] if norms[0] > 0 else float("nan"),
      "last_over_peak": norms[-1] / peak if peak > 0 else float("nan"),
    }
  out = {"levels": levels, "sqrt_paths_cap": config.outer.sqrt_paths_cap}
  aligned = len({tuple(v["steps"]) for v in levels.values()}) == 1
  if len(names) > 1 and aligned:  # Per outer step: the levels synced at the same steps.
    shared, rest = levels[names[0]]["per_module"], [levels[n]["per_module"] for n in names[1:]]
    out["shared_over_modules"] = [
      s / float(np.mean(o)) if np.mean(o) > 0 else float("nan") for s, *o in zip(shared, *rest)
    ]
  enough = len(records) >= 4
  out["stable"] = all(v["last"] < v["peak"] for v in levels.values()) if enough else None
  return out


NOISE_SCALE_AT = ("pretrain", "dense_path")  # Dense runs: one path, the whole corpus.


def noise_report(config, workdir: str, s: Sizes) -> dict:
  """benchmarks/noise_scale.py at the run's last checkpoint (cached in the workdir)."""
  import noise_scale  # pylint: disable=import-outside-toplevel  # Beside this script.

  step = _checkpoint_steps(workdir)[-1]
  path = os.path.join(workdir, f"noise_scale_step{step}.json")
  rep = _read_json(path)
  if not rep:
    smoke = s.pretrain < 20  # A handful of gradients: the plumbing only.
    rep = noise_scale.measure(
      config,
      workdir,
      step=step,
      batch=s.batch,
      groups=2 if smoke else 8,
      repeats=1 if smoke else 6,
    )
    with open(path, "w") as f:
      json.dump(rep, f, indent=1)
  print("   " + noise_scale.describe(rep).replace("\n", "\n   "), flush=True)
  return {
    k: rep[k]
    for k in (
      "step",
      "loss",
      "noise_scale_tokens",
      "noise_scale_sequences",
      "per_repeat_noise_scale_tokens",
      "run_batch_tokens",
      "run_batch_over_noise_scale",
      "groups",
      "repeats",
      "batch_sequences",
    )
  }


def train_run(
  name: str, s: Sizes, out: str, sqrt_paths: str, seed: int = 0, sqrt_cap: float = 0.0
) -> dict:
  """Trains (or resumes) one model and evaluates its checkpoints; returns its record."""
  from dipaco_jax import train

  config = make_config(name, s, out, sqrt_paths, seed, sqrt_cap)
  workdir = os.path.join(out, "runs", name)
  # Seconds of the call that did the work (a rerun that resumes finished work keeps them).
  timing_path = os.path.join(workdir, "reproduce_seconds.json")
  seconds = _read_json(timing_path)
  before = (_checkpoint_steps(workdir) or [0])[-1]
  t0 = time.perf_counter()
  train.train_and_evaluate(config, workdir)
  t1 = time.perf_counter()
  evals, computed = evaluate_run(config, workdir, s, final_full=name != "pretrain")
  t2 = time.perf_counter()
  if _checkpoint_steps(workdir)[-1] > before or "train" not in seconds:
    seconds["train"] = t1 - t0
  if computed or "evaluate" not in seconds:
    seconds["evaluate"] = t2 - t1
  with open(timing_path, "w") as f:
    json.dump(seconds, f)
  forked = bool(config.dipaco.init_from)
  first = s.pretrain if forked else 0
  curve = [
    (first + int(k), v["store"]["ppl"]["once"])
    for k, v in sorted(evals.items(), key=lambda kv: int(kv[0]))
  ]
  final = evals[str(max(int(k) for k in evals))]
  described = {**MODELS, **INVESTIGATIONS, "pretrain": "dense pretraining (θ̄)"}
  variant = outer_lr_variant(name)
  if variant:
    described[name] = INVESTIGATIONS[variant[0] + "_olr<LR>"].replace("<LR>", f"{variant[1]:g}")
  return {
    "name": name,
    "description": described[name],
    # The regime: the per-worker batch against the gradient noise scale, at θ̄ and at the end
    # of the dense run (the noise scale grows as the loss falls).
    "noise_scale": noise_report(config, workdir, s) if name in NOISE_SCALE_AT else None,
    "shards": shard_report(config, workdir),
    "outer": outer_norms(config, workdir),
    "specialisation": specialisation_summary(read_specialisation(workdir)),
    "params": param_counts(config),
    "curve": curve,
    "forked": forked,
    "final": final,
    "steps": curve[-1][0],
    "seconds": seconds,
  }


def table(results: dict, s: Sizes) -> str:
  """The results table (markdown): final routed ppl, early stopping, best re-routing."""
  lines = [
    "| model | paths | workers (replicas x paths) | params / path | params total | steps | "
    "ppl (once) | ppl (early stop) | best re-routing | oracle (once) | random path |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
  ]
  for name in ordered(results):
    if name not in results:
      continue
    r = results[name]
    store, best = r["final"]["store"], r["final"].get("best")
    rr = {k: v for k, v in store["ppl"].items() if "/W=" in k and not k.startswith("oracle")}
    rr_text = f"{min(rr.values()):.2f} ({min(rr, key=rr.get)})" if rr else "–"
    fmt = lambda rep, k: "–" if rep is None or k not in rep["ppl"] else f"{rep['ppl'][k]:.2f}"
    lines.append(
      f"| {name} | {r['params']['paths']} | {r['params']['workers']} | "
      f"{r['params']['path'] / 1e6:.2f}M | {r['params']['total'] / 1e6:.2f}M | {r['steps']} | "
      f"{fmt(store, 'once')} | {fmt(best, 'once')} | {rr_text} | {fmt(store, 'oracle/once')} | "
      f"{fmt(store, 'random/once')} |"
    )
  pre = results.get("pretrain")
  if pre:
    lines.append(
      f"\nθ̄ (dense pretraining, {s.pretrain} steps): routed ppl "
      f"{pre['final']['store']['ppl']['once']:.2f}."
    )
  for name in NOISE_SCALE_AT:
    ns = (results.get(name) or {}).get("noise_scale")
    if ns:
      lines.append(
        f"\nGradient noise scale at {name}'s end (step {ns['step']}, loss {ns['loss']:.3f}): "
        f"{ns['noise_scale_tokens']:,.0f} tokens; the per-worker batch "
        f"({ns['run_batch_tokens']:,.0f} tokens) is {ns['run_batch_over_noise_scale']:.2f}x it."
      )
  return "\n".join(lines) + "\n"


def shard_table(results: dict) -> str:
  """Training tokens per shard at every phase, and the share moved off the argmin path."""
  lines = [
    "| model | phase | tokens min | median | max | min / mean | moved off argmin |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name in ordered(results):
    r = results.get(name)
    if not r or r["params"]["workers"] == 1:
      continue
    for p in r["shards"]["phases"]:
      low = " (under 25%)" if p["min_over_mean"] < GOAL_MIN_OVER_MEAN else ""
      lines.append(
        f"| {name} | {p['phase']} | {p['tokens_min']:,.0f} | {p['tokens_median']:,.0f} | "
        f"{p['tokens_max']:,.0f} | {p['min_over_mean']:.2f}{low} | {p['moved_off_label']:.3f} |"
      )
  return "\n".join(lines) + "\n"


def outer_table(results: dict) -> str:
  """The outer delta norm per level: P per module, first / last norm, max over first."""
  lines = [
    "| model | level | modules | paths / module | first | peak | last | last / peak | "
    "shared / module (first → last) | stable |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for name in ordered(results):
    o = (results.get(name) or {}).get("outer")
    if not o:
      continue
    ratio = o.get("shared_over_modules")
    ratio = f"{ratio[0]:.2f} → {ratio[-1]:.2f}" if ratio else "–"
    stable = {True: "yes", False: "no", None: "too few outer steps"}[o["stable"]]
    for level, v in o["levels"].items():
      lines.append(
        f"| {name} | {level} | {v['modules']} | {v['paths_per_module']} | {v['first']:.3g} | "
        f"{v['peak']:.3g} | {v['last']:.3g} | {v['last_over_peak']:.2f} | {ratio} | {stable} |"
      )
  return "\n".join(lines) + "\n"


def window_table(results: dict) -> str:
  """Routed ppl vs re-routing window W for the models with several paths."""
  lines = []
  for name in ordered(results):
    r = results.get(name)
    if not r or r["params"]["paths"] == 1:
      continue
    for params in ("store", "best"):
      if params not in r["final"]:
        continue
      p = r["final"][params]["ppl"]
      cells = ", ".join(f"{k} {v:.2f}" for k, v in p.items())
      lines.append(f"- {name} ({params}): {cells}")
  return "\n".join(lines) + "\n"


def plot(results: dict, s: Sizes, out: str) -> list[str]:
  """ppl_vs_steps.png (every model) and ppl_vs_window.png (models with several paths)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  fig, ax = plt.subplots(figsize=(8, 5))
  for name in ["pretrain", *ordered(results)]:
    if name not in results:
      continue
    xs, ys = zip(*results[name]["curve"])
    if results[name]["forked"] and "pretrain" in results:
      px, py = results["pretrain"]["curve"][-1]
      xs, ys = (px, *xs), (py, *ys)
    ax.plot(
      xs,
      ys,
      marker="o",
      ms=3,
      label=name,
      ls="--" if name.startswith("dense") else "-",
      color="black" if name == "pretrain" else None,
    )
  ax.axvline(s.pretrain, color="grey", lw=0.5)
  ax.text(s.pretrain, ax.get_ylim()[1], " fork from θ̄", va="top", fontsize=8, color="grey")
  ax.set(
    xlabel="weight-update steps",
    ylabel="routed validation perplexity (prefix excluded)",
    yscale="log",
    title="Validation perplexity vs steps (embedded corpus)",
  )
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  files.append(os.path.join(out, "ppl_vs_steps.png"))
  fig.savefig(files[-1], dpi=120, bbox_inches="tight")
  plt.close(fig)

  multi = [n for n in ordered(results) if results[n]["params"]["paths"] > 1]
  fig, axes = plt.subplots(
    1, max(len(multi), 1), figsize=(3.2 * max(len(multi), 1), 3.6), squeeze=False
  )
  for ax, name in zip(axes[0], multi):
    ppl = results[name]["final"]["store"]["ppl"]
    labels = [*(str(w) for w in s.windows), "once"]
    for kind, style in (("linear", "o-"), ("transformer", "s-"), ("oracle", "^--")):
      if not s.windows or f"{kind}/W={s.windows[0]}" not in ppl:
        continue
      once = ppl["oracle/once" if kind == "oracle" else "once"]
      ax.plot(labels, [*(ppl[f"{kind}/W={w}"] for w in s.windows), once], style, ms=4, label=kind)
    ax.set(title=name, xlabel="re-route every W tokens")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("routed validation perplexity")
  axes[0][0].legend(fontsize=8)
  fig.suptitle("Perplexity vs re-routing frequency (global modules)")
  fig.tight_layout()
  files.append(os.path.join(out, "ppl_vs_window.png"))
  fig.savefig(files[-1], dpi=120, bbox_inches="tight")
  plt.close(fig)
  return files


def _final_ppl(r: dict, params: str = "store") -> float | None:
  rep = r["final"].get(params)
  return None if rep is None else rep["ppl"]["once"]


def summarize(dirs: list[str]) -> dict:
  """Mean and range per model over the seeds' results.json; which gaps exceed the seed range.

  A gap between two models' means counts as resolved only when it is larger than the
  seed range (max - min) of each of the two; otherwise it is flagged as within noise.
  """
  runs = []
  for d in dirs:
    path = os.path.join(d, "results.json")
    if not os.path.exists(path):
      raise SystemExit(f"--summarize: {path} does not exist; run reproduce.py --out={d} first.")
    runs.append(_read_json(path))
  sizes = {json.dumps(r["sizes"], sort_keys=True) for r in runs}
  if len(sizes) > 1:
    raise SystemExit(f"--summarize: {dirs} were run at different sizes; summarize one size.")
  models = {}
  for name in ["pretrain", *ordered({n for r in runs for n in r["models"]})]:
    have = [r for r in runs if name in r["models"]]
    if not have:
      continue
    vals = [_final_ppl(r["models"][name]) for r in have]
    best = [_final_ppl(r["models"][name], "best") for r in have]
    m0 = have[0]["models"][name]
    # Oracle (best path per document in hindsight) and a random path (the loss averaged over
    # paths), for models with several paths.
    other = {
      k: [r["models"][name]["final"]["store"]["ppl"].get(f"{k}/once") for r in have]
      for k in ("oracle", "random")
    }
    noise = [r["models"][name].get("noise_scale") for r in have]
    specs = [r["models"][name].get("specialisation") for r in have]
    models[name] = {
      "seeds": [r["seed"] for r in have],
      "ppl": vals,
      "mean": float(np.mean(vals)),
      "min": float(np.min(vals)),
      "max": float(np.max(vals)),
      "range": float(np.max(vals) - np.min(vals)),
      "early_stop_mean": float(np.mean(best)) if None not in best else None,
      **{f"{k}_mean": float(np.mean(v)) if None not in v else None for k, v in other.items()},
      **{f"{k}_ppl": v if None not in v else None for k, v in other.items()},
      "noise_scale_tokens": [n["noise_scale_tokens"] for n in noise] if all(noise) else None,
      "batch_over_noise_scale": [n["run_batch_over_noise_scale"] for n in noise]
      if all(noise)
      else None,
      # The specialisation report per seed (models with several paths, when written).
      **{k: [sp[k] for sp in specs] if all(specs) else None for k in SPEC_KEYS[1:4]},
      "description": m0.get("description"),
      "paths": m0["params"]["paths"],
      "workers": m0["params"]["workers"],
      "shard_min_over_mean": min(r["models"][name]["shards"]["min_over_mean"] for r in have),
      "seconds": float(np.mean([sum(r["models"][name]["seconds"].values()) for r in have])),
    }
  gaps = []
  for a, b in PAIRS:
    if a in models and b in models:
      gap = models[b]["mean"] - models[a]["mean"]  # > 0: a is better, as the paper orders.
      noise = max(models[a]["range"], models[b]["range"])
      seeds = min(len(models[a]["ppl"]), len(models[b]["ppl"]))  # A range needs two.
      gaps.append(
        {
          "better_expected": a,
          "worse_expected": b,
          "gap": gap,
          "seed_range": noise,
          "resolved": abs(gap) > noise and seeds > 1,
          "one_seed": seeds < 2,
          "paper_order_holds": gap > 0,
        }
      )
  return {
    "dirs": dirs,
    "sizes": runs[0]["sizes"],
    "mode": runs[0].get("mode"),
    "commands": [_command_for(r.get("command"), d) for r, d in zip(runs, dirs)],
    "models": models,
    "gaps": gaps,
  }


def _command_for(command: str | None, out: str) -> str | None:
  """A run's recorded command, its --out spelled as the summary was given the directory."""
  if not command:
    return command
  words = ["python", *command.split()[1:]]
  return " ".join(f"--out={out}" if w.startswith("--out=") else w for w in words)


# The routing question's arms (the `grid` values of the arms JSON); the others are references.
ARM_GRIDS = ("2x2", "4x4", "P=4", "P=16")


def arm_kind(name: str, s: Sizes) -> tuple[str, str]:
  """(grid, shards) of a model: "2x2" / "4x4" / "P=<replicas>", "routed" / "iid"."""
  o = run_overrides(name, s, "THETA", "SHARDS", "none")
  ks = tuple(o.get("dipaco.modules_per_level", (1,)))
  routed_ks = [k for k in ks if k > 1]
  grid = "x".join(map(str, routed_ks)) if routed_ks else f"P={o.get('dipaco.replicas', 1)}"
  return grid, "iid" if o.get("routing.router", "random") == "random" else "routed"


def arms_json(summary: dict, command: str) -> dict:
  """The routing question's machine-readable result: one record per arm, ppl per seed.

  `arms` holds the grids and DiLoCo at the grids' worker counts (ARM_GRIDS); `references`
  the rest (dense, DiLoCo P=2) in the same form. Gaps are the summary's (mean difference
  against the larger seed range of the two).
  """
  s = Sizes(**summary["sizes"])
  out = {"arms": {}, "references": {}}
  for name, m in summary["models"].items():
    if name == "pretrain":
      continue
    grid, shards = arm_kind(name, s)
    record = {
      "ppl": m["ppl"],
      "grid": grid,
      "shards": shards,
      "seeds": m["seeds"],
      "mean": m["mean"],
      "range": m["range"],
      "oracle_ppl": m["oracle_ppl"],
      "random_path_ppl": m["random_ppl"],
      **{k: m.get(k) for k in SPEC_KEYS[1:4]},
      "workers": m["workers"],
      "description": m.get("description"),
    }
    out["arms" if grid in ARM_GRIDS else "references"][name] = record
  pre = summary["models"].get("pretrain", {})
  out["regime"] = {
    "mode": summary.get("mode"),
    "sizes": summary["sizes"],
    "noise_scale_tokens_at_theta": pre.get("noise_scale_tokens"),
    "batch_over_noise_scale_at_theta": pre.get("batch_over_noise_scale"),
  }
  out["gaps"] = summary["gaps"]
  out["commands"] = [*summary["commands"], command]
  return out


def summary_markdown(summary: dict) -> str:
  """The summary's table (mean and range per model) and its gaps."""
  lines = [
    f"# Over {len({s for m in summary['models'].values() for s in m['seeds']})} seeds "
    f"({', '.join(summary['dirs'])})",
    "",
    "| model | paths | workers | ppl mean | min – max (range) | oracle mean | random path mean | "
    "early stop mean | seeds | smallest shard / mean |",
    "|---|---:|---:|---:|---|---:|---:|---:|---|---:|",
  ]
  fmt = lambda v: "–" if v is None else f"{v:.2f}"
  for name, m in summary["models"].items():
    lines.append(
      f"| {name} | {m['paths']} | {m['workers']} | {m['mean']:.2f} | {m['min']:.2f} – "
      f"{m['max']:.2f} ({m['range']:.2f}) | {fmt(m.get('oracle_mean'))} | "
      f"{fmt(m.get('random_mean'))} | {fmt(m['early_stop_mean'])} | "
      f"{','.join(map(str, m['seeds']))} | {m['shard_min_over_mean']:.2f} |"
    )
  for name, m in summary["models"].items():
    if m.get("noise_scale_tokens"):
      lines.append(
        f"\nGradient noise scale at {name}'s end, per seed: "
        f"{', '.join(f'{t:,.0f}' for t in m['noise_scale_tokens'])} tokens; the per-worker "
        f"batch is {', '.join(f'{x:.2f}' for x in m['batch_over_noise_scale'])}x it."
      )
  lines += ["", "| expected better | expected worse | gap (ppl) | seed range | reading |"]
  lines.append("|---|---|---:|---:|---|")
  for g in summary["gaps"]:
    order = "paper's order" if g["paper_order_holds"] else "reversed"
    noise = (
      "exceeds the seed range"
      if g["resolved"]
      else "one seed: no range (not a result)"
      if g.get("one_seed")
      else "within the seed range (not a result)"
    )
    lines.append(
      f"| {g['better_expected']} | {g['worse_expected']} | {g['gap']:+.2f} | "
      f"{g['seed_range']:.2f} | {order}, {noise} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="/tmp/dipaco_repro", help="Output directory (resumable).")
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument(
    "--quick", action="store_true", help="Smaller model, 1/4 of the data: ~10 CPU-minutes."
  )
  mode.add_argument("--smoke", action="store_true", help="Seconds-long sizes (CI).")
  mode.add_argument(
    "--long",
    action="store_true",
    help="The long comparison, per-worker batch near the gradient noise scale: the quick model "
    "at batch 32 x 96, 240 + 240 steps, all data; runs the --models=long list unless --models "
    "is given. One --seed per --out.",
  )
  mode.add_argument(
    "--long_b4",
    action="store_true",
    help="The long comparison as first run (batch 4 x 96, ~0.04x the noise scale; 480 + 480 "
    "steps): the results page's appendix.",
  )
  ap.add_argument(
    "--models",
    default="",
    help=f"Comma list of models to run (pretraining always runs first); also "
    f"{', '.join(INVESTIGATIONS)}; 'long' is the long comparison: {','.join(LONG_MODELS)}.",
  )
  ap.add_argument(
    "--summarize",
    default="",
    metavar="DIR1,DIR2,...",
    help="Only summarize: mean and range per model over these runs' results.json (one per "
    "seed), written to --out as summary.json and summary.md.",
  )
  ap.add_argument(
    "--arms_json",
    default="",
    help='With --summarize: where to write the arms per seed ({"arms": {name: {ppl, grid, '
    "shards, ...}}}; docs/results/specialisation.json); default <out>/specialisation.json.",
  )
  ap.add_argument(
    "--size",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="Override one field of the mode's sizes, e.g. --size steps=480 "
    "(investigations; repeatable).",
  )
  ap.add_argument(
    "--seed",
    type=int,
    default=0,
    help="data.seed of every run: batch order and the i.i.d. shards (noise checks).",
  )
  ap.add_argument(
    "--sqrt_paths_cap",
    type=float,
    default=0.0,
    help="outer.sqrt_paths_cap of the DiPaCo grids: the ×√P factor at most this (0 = none).",
  )
  ap.add_argument(
    "--sqrt_paths",
    default="multiply",
    choices=("multiply", "divide", "none"),
    help="outer.sqrt_paths of the DiPaCo grids (DiLoCo uses none, flat MoE has "
    "one path per module).",
  )
  args = ap.parse_args(argv)
  if args.summarize:
    summary = summarize([d for d in args.summarize.split(",") if d])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    md = summary_markdown(summary)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
      f.write(md)
    arms_path = args.arms_json or os.path.join(args.out, "specialisation.json")
    command = " ".join(["python", "benchmarks/reproduce.py", *(argv or sys.argv[1:])])
    with open(arms_path, "w") as f:
      json.dump(arms_json(summary, command), f, indent=1)
    print(md)
    print(f"\nwrote: {args.out}/summary.{{json,md}} and {arms_path} (the arms per seed)")
    return
  name = "smoke" if args.smoke else "quick" if args.quick else "long" if args.long else "full"
  name = "long_b4" if args.long_b4 else name
  if not args.models:
    args.models = "long" if name.startswith("long") else ",".join(MODELS)
  s = MODES[name]
  fields = {f.name: f.type for f in dataclasses.fields(Sizes)}
  for item in args.size:
    key, _, value = item.partition("=")
    if key not in fields or not value:
      ap.error(f"--size {item!r}: use FIELD=VALUE with FIELD one of {sorted(fields)}")
    cast = float if fields[key] is float else int
    if "tuple" in str(fields[key]):
      s = dataclasses.replace(s, **{key: tuple(int(v) for v in value.split(","))})
    else:
      s = dataclasses.replace(s, **{key: cast(value)})
  if args.models == "long":
    models = list(LONG_B4_MODELS if name == "long_b4" else LONG_MODELS)
  else:
    models = [m for m in args.models.split(",") if m]
  unknown = sorted(m for m in models if not known(m))
  if unknown:
    ap.error(f"unknown models {unknown}; choose from {[*MODELS, *INVESTIGATIONS]}")
  from dipaco_jax.io import hugepages

  hugepages.maybe_reexec()  # As the CLIs: huge-page malloc for XLA:CPU (docs/performance.md).
  print(REGIME[name], flush=True)  # First: whether this mode can answer the paper's question.
  from dipaco_jax.io import native

  native.choose_platforms()  # As the CLIs: no libtpu start-up errors on a CPU host.
  import jax

  jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  os.makedirs(args.out, exist_ok=True)
  started = time.time()
  results = {}
  for m in ["pretrain", *models]:
    print(f"== {m}", flush=True)
    results[m] = train_run(m, s, args.out, args.sqrt_paths, args.seed, args.sqrt_paths_cap)
    r = results[m]
    print(
      f"   ppl {r['final']['store']['ppl']['once']:.2f}  train {r['seconds']['train']:.0f}s "
      f"evaluate {r['seconds']['evaluate']:.0f}s",
      flush=True,
    )
  files = plot(results, s, args.out)
  report = {
    "mode": name,
    "sizes": dataclasses.asdict(s),
    "sqrt_paths": args.sqrt_paths,
    "sqrt_paths_cap": args.sqrt_paths_cap,
    "seed": args.seed,
    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    "machine": {
      "cpus": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "fake_cpu_devices": CPU_DEVICES,
      "load_average": os.getloadavg(),
    },
    "wall_seconds": time.time() - started,
    "model_seconds": sum(sum(r["seconds"].values()) for r in results.values()),
    "models": results,
    "plots": files,
  }
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(report, f, indent=1)
  md = (
    f"# Reproduction ({name} mode, seed {args.seed})\n\n{table(results, s)}\n"
    f"## Shards per phase (training tokens per worker)\n\n{shard_table(results)}\n"
    f"## Outer delta norm per level\n\n{outer_table(results)}\n"
    f"## Re-routing\n\n{window_table(results)}\n"
    f"Training + evaluation: {report['model_seconds'] / 60:.1f} min "
    f"(this call: {report['wall_seconds'] / 60:.1f} min).\n"
  )
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(md)
  print(md)
  bad = [m for m, r in results.items() if not math.isfinite(r["final"]["store"]["ppl"]["once"])]
  if bad:
    raise SystemExit(f"non-finite perplexity for {bad}")


if __name__ == "__main__":
  main()
