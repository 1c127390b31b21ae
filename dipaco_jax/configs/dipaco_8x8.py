r"""DiPaCo 8x8: 64 paths of 150M, 1.2B parameters in all (paper Fig. 9: 13.37 ppl).

First θ̄, the dense model every path forks from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/dipaco_8x8.py --workdir=gs://BUCKET/dipaco_8x8 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

Levels (inferred; the paper gives no split): see dipaco_jax/config/paper.py, grid().
Routing: product k-means phase-0 shards (Table 5's discriminative 8x8 run is
"based on product k-means"), then one discriminative re-shard after outer step
107 with the LR schedule restarted; the reasons: dipaco_jax/config/paper.py, fork().

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits 4 x v5p-128 (256 chips): mesh path 64 x data 4 (not
v5e: the replicated store leaves too little HBM; FSDP over 'data' made it worse, 101%),
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/dipaco_8x8.py --topology=v5p:4x4x4 --slices=4
"""

from dipaco_jax.config import paper


def get_config():
  c = paper.grid(8, 8)
  # Memory (docs/tpu.md): 8 microbatches of 64 sequences, matmul outputs kept for
  # the backward pass, logits 256 positions at a time.
  c.inner.microbatches = 8
  c.model.remat = "save_matmuls"
  c.model.loss_chunk = 256
  return c
