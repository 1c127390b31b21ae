r"""Flat MoE: 8 independent 150M paths, one level over everything (Table 1: 14.62).

First θ̄, the dense model every path forks from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/flat_moe_8.py --workdir=gs://BUCKET/flat_moe_8 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

No parameter is shared; the outer Nesterov step still runs on each path's own
delta (paper §2.6.1 footnote). Routing (§2.6.3: flat MoE with the discriminative
router): k-means phase-0 shards (one routed level of 8 modules), then one
discriminative re-shard after outer step 107 with the LR schedule restarted,
as Fig. 10's flat MoE; the reasons: dipaco_jax/config/paper.py, fork().

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits 2 x v5litepod-16 (32 chips): mesh path 8 x data 4,
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/flat_moe_8.py --topology=v5e:4x4 --slices=2
"""

from dipaco_jax.config import paper
from dipaco_jax.config import schema


def get_config():
  c = paper.settings(schema.base())
  c.dipaco.level_groups = ("embed,block_0-11,head",)
  c.dipaco.modules_per_level = (8,)
  c.dipaco.inner_steps = 150
  c.dipaco.outer_steps = 427
  # Memory and speed (docs/tpu.md): 4 microbatches of 128 sequences (XLA counts 17% fewer
  # HBM bytes per step than 8 of 64), the attention matmuls' outputs kept for the backward
  # pass and the MLP's input projection recomputed (what lets 128 fit), logits 512 positions
  # at a time (docs/results/tpu.md: 256 moved 1.5% more bytes).
  c.inner.microbatches = 4
  c.model.remat = "save_matmuls_except_mlp_in"
  c.model.loss_chunk = 512
  return paper.fork(c, router="kmeans")
