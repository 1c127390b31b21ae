r"""DiPaCo 2x4: 8 paths of 150M, 0.5B parameters in all (paper Fig. 9: 14.86 ppl).

First θ̄, the dense model every path forks from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/dipaco_2x4.py --workdir=gs://BUCKET/dipaco_2x4 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

Levels (inferred; the paper gives no split): see dipaco_jax/config/paper.py, grid().
Routing: product k-means phase-0 shards on θ̄'s prefix features, then one
discriminative re-shard after outer step 107 (16,050 of 64,050 inner steps)
with the LR schedule restarted; the reasons: dipaco_jax/config/paper.py, fork().

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits 2 x v5litepod-16 (32 chips): mesh path 8 x data 4,
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/dipaco_2x4.py --topology=v5e:4x4 --slices=2 \
      --config.mesh.data=4
"""

from dipaco_jax.config import paper


def get_config():
  c = paper.grid(2, 4)
  # Memory and speed (docs/tpu.md): 4 microbatches of 128 sequences (XLA counts 17% fewer
  # HBM bytes per step than 8 of 64), the attention matmuls' outputs kept for the backward
  # pass and the MLP's input projection recomputed (what lets 128 fit), logits 512 positions
  # at a time (docs/results/tpu.md: 256 moved 1.5% more bytes).
  c.inner.microbatches = 4
  c.model.remat = "save_matmuls_except_mlp_in"
  c.model.loss_chunk = 512
  return c
