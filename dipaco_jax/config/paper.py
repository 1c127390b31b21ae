"""The paper's settings on top of `schema.base()`: C4 on TPU, runs forked from θ̄, its grids.

    c = paper.grid(2, 4)  # configs/dipaco_2x4.py: the paper's 2x4 grid of 150M paths.

Paper facts: §3 (θ̄ pretrained 24k dense steps), §4 (one discriminative phase),
Table 4 (hyperparameters); the inferences are written where they are made.
"""

import ml_collections

from dipaco_jax.config import schema
from dipaco_jax.errors import ConfigError


def settings(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The paper's data and hardware settings on top of `base()` (C4, TPU)."""
  c.data.task = "c4_en"  # C4 English through tfds (set tfds_data_dir, vocab_path).
  c.model.dtype = "bfloat16"  # TPU compute dtype.
  c.ckpt.every_steps = 1000
  c.eval.every_steps = 1000
  c.log_every_steps = 100
  return c


# The one discriminative re-shard of the τ = 150 paper runs (§4: "All instances of
# DiPaCo use one phase of discriminative routing"). The paper gives no step for its
# main runs; its one branch point (Fig. 10, flat MoE) is at 16k steps with the cosine
# restarted. Those runs fork from θ̄ at 24k, so we read the 16k as steps of path
# training: after outer step 107 (16,050 inner steps), leaving 320 outer steps
# (48,000 inner steps) on the discriminative shards. By then the paths have diverged
# enough for their scores to label documents.
DISCRIMINATIVE_AT_OUTER_STEP = 107

# Router-split documents every path scores at the re-shard. The c4_en router split is
# 1% of C4's train split (~3.66M documents; the paper holds out 0.005, ~1.8M). 2**18
# documents: at 256 paths (16x16), scoring them (≤ 1,024 tokens each, forward only) is
# about one outer step of training (2**18 x 256 x 1024 x 2 x 150M ≈ 2.1e19 FLOPs vs
# 256 x 150 x 512 x 1024 x 6 x 150M ≈ 1.8e19); the linear router is fitted full batch
# on one device (2**18 x 896 float32 = 0.94 GB of features, against 13 GB for the whole
# split); and even at 256 paths it leaves ~1,024 labelled documents per path for the
# 897 numbers each path's row of the regression holds.
ROUTER_MAX_DOCS = 2**18

# The dense pretraining that makes θ̄ (§3.1): dense_150m for 24k steps.
PRETRAIN_COMMAND = (
  "python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=DENSE_WORKDIR "
  "--config.dipaco.outer_steps=24 --config.data.tfds_data_dir=gs://BUCKET/tfds "
  "--config.data.vocab_path=gs://BUCKET/t5_32k.model"
)


def fork(
  c: ml_collections.ConfigDict, *, router: str, discriminative: bool = True
) -> ml_collections.ConfigDict:
  """A run forked from θ̄ with the paper's routing (§2.4): phase-0 `router`, one re-shard.

  `init_from` becomes required (check_init_from): every DiLoCo / DiPaCo run of
  the paper starts from the 24k-step dense model, whose features also route.
  discriminative=False (DiLoCo) keeps the phase-0 shards to the end.
  """
  c.dipaco.init_from = ml_collections.config_dict.placeholder(str)  # Required: check_init_from.
  c.routing.router = router  # Phase-0 shards from θ̄'s prefix features (§2.2, §2.3).
  if discriminative:
    c.routing.discriminative_at_outer_step = DISCRIMINATIVE_AT_OUTER_STEP
    c.routing.discriminative_phases = 1
    c.routing.restart_schedule = True  # Fig. 10: the cosine restarts at the branch point.
    c.routing.router_max_docs = ROUTER_MAX_DOCS
    # The restarted cosine spans the steps after the re-shard, so the run ends at the
    # LR floor like every 88k-step run of the paper (phase 0 uses the same length).
    # A reference: it follows --config overrides of H, T and the re-shard step.
    c.inner.total_steps = c.dipaco.get_ref("inner_steps") * (
      c.dipaco.get_ref("outer_steps") - c.routing.get_ref("discriminative_at_outer_step")
    )
  return c


def check_init_from(config) -> None:
  """Refuses a run whose config requires θ̄ (`dipaco.init_from` is None) but got none."""
  if config.dipaco.init_from is None:
    raise ConfigError(
      "config.dipaco.init_from is required by this config (the paper forks its DiLoCo and "
      "DiPaCo runs from θ̄, a dense model pretrained for 24k steps, and routes with its "
      f"features): train θ̄ first with `{PRETRAIN_COMMAND}`, then pass "
      "--config.dipaco.init_from=DENSE_WORKDIR (or --config.dipaco.init_from='' to start "
      "from random parameters instead)."
    )


def grid(k1: int, k2: int, *, path_specific: str = "", top_k: int = 1) -> ml_collections.ConfigDict:
  """The paper's two-level grids of 150M paths (levels inferred, see README).

  Embedding + final norm shared by all paths (K=1); blocks 0-5 form level 1
  with k1 modules, blocks 6-11 level 2 with k2; τ = 150 inner steps for
  (88k − 24k) / 150 ≈ 427 outer steps after 24k dense steps. Forked from θ̄:
  product k-means shards (§7.3, Table 5), one discriminative re-shard.
  """
  c = settings(schema.base())
  c.dipaco.level_groups = ("embed,head", "block_0-5", "block_6-11")
  c.dipaco.modules_per_level = (1, k1, k2)
  c.dipaco.path_specific = path_specific
  c.dipaco.inner_steps = 150  # τ (paper Fig. 9)
  c.dipaco.outer_steps = 427
  c.data.top_k = top_k
  return fork(c, router="product_kmeans")
