"""The reproduction's modes: sizes, step counts, evaluation settings and each one's regime."""

import dataclasses

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
  interleave: int = 1  # data.interleave: documents side by side in a batch (0: every row).
  vocab: int = 8192  # The shipped tokenizer of this many pieces (data/vocab.py).
  fork_batch: int = 0  # Per-worker batch after the fork (0: `batch`); θ̄ trains at `batch`.


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

# The capacity comparison (`--capacity`, docs/results/capacity.md): a path small enough to be
# capacity-limited on the embedded corpus (d 32, 4 blocks, the shipped 1k tokenizer: 82k
# parameters, 60% of them in the routed blocks), θ̄ at >= 50 tokens per parameter, then >= 100
# more per path at a per-worker batch several times the gradient noise scale measured at θ̄
# (every row another document), H = 15.
MODES["capacity"] = Sizes(
  d_model=32,
  layers=4,
  heads=2,
  big_d_model=48,  # dense_wide: ~2x the path's parameters.
  big_layers=4,
  big_heads=2,
  pretrain=1500,  # 1500 x 32 x 96 = 4.6M tokens: 56 per parameter.
  steps=360,  # 360 x 256 x 96 = 8.8M tokens per path: 108 per parameter (24 outer steps).
  inner_steps=15,
  batch=32,
  # 256 x 96 = 24,576 tokens: 7.3x the noise scale measured at θ̄ in the pilot (3,360 tokens;
  # at 128 rows, 3.7x, P = 4 -> 8 still gained 2.2% after 15 outer steps).
  fork_batch=256,
  seq_len=96,
  lr=3e-3,
  big_lr=3e-3,
  warmup=100,
  fork_warmup=15,
  disc_at=3,
  eval_every=4,  # 6 evaluations and checkpoints per arm.
  windows=(16, 32, 64),
  reroute_steps=300,
  subsample=1,
  interleave=0,
  vocab=1024,
)
# Its plumbing at tiny sizes (CI): every kind of arm, the arm files and the page.
MODES["capacity_smoke"] = dataclasses.replace(
  MODES["smoke"],
  big_d_model=48,
  big_heads=2,
  batch=4,
  fork_batch=8,
  interleave=0,
  vocab=1024,
  subsample=8,
  windows=(8,),
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
  "capacity": "capacity mode: a path capacity-limited on its data (>= 50 tokens per parameter "
  "for θ̄, >= 100 more per path), per-worker batch 256 x 96 tokens against the noise scale "
  "measured at θ̄, DiLoCo's saturation (P = 4 -> 8 gains <= 2%) measured first "
  "(docs/results/capacity.md).",
  "capacity_smoke": "capacity_smoke mode: tiny sizes, the plumbing only (CI); no number of it "
  "is a result.",
}


GOAL_MIN_OVER_MEAN = 0.25  # No training shard under 25% of the mean (tokens), at any phase.
