r"""DiLoCo with 8 replicas of one 150M model (paper Table 1: 15.02 ppl).

First θ̄, the dense model the replicas fork from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/diloco_8.py --workdir=gs://BUCKET/diloco_8 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

One level, one module, 8 workers (replicas) each on its own shard; DiLoCo's
defaults: H = 500, T = 128 after 24k steps of dense pretraining. Shards are
DiLoCo's non-i.i.d. setting (15.02 is its non-i.i.d. number): k-means on θ̄'s
prefix features with one cluster per worker (routing.replica_shards="router");
DiLoCo has no discriminative re-shard.

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits 2 x v5litepod-16 (32 chips): mesh path 8 x data 4,
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/diloco_8.py --topology=v5e:4x4 --slices=2
"""

from dipaco_jax.config import paper
from dipaco_jax.config import schema


def get_config():
  c = paper.settings(schema.base())
  c.dipaco.level_groups = ("embed,block_0-11,head",)
  c.dipaco.modules_per_level = (1,)
  c.dipaco.replicas = 8
  c.dipaco.inner_steps = 500  # H (DiLoCo)
  c.dipaco.outer_steps = 128  # T (DiLoCo): 64k inner steps.
  c.inner.warmup_steps = 1000  # Re-warmed after forking, as in DiLoCo.
  c.outer.sqrt_paths = "none"  # DiLoCo's recipe: the plain mean over replicas.
  c.routing.replica_shards = "router"  # One k-means cluster per worker (phase 0 only).
  # Memory and speed (docs/tpu.md): 4 microbatches of 128 sequences (XLA counts 17% fewer
  # HBM bytes per step than 8 of 64), the attention matmuls' outputs kept for the backward
  # pass and the MLP's input projection recomputed (what lets 128 fit), logits 512 positions
  # at a time (docs/results/tpu.md: 256 moved 1.5% more bytes).
  c.inner.microbatches = 4
  c.model.remat = "save_matmuls_except_mlp_in"
  c.model.loss_chunk = 512
  return paper.fork(c, router="kmeans", discriminative=False)
