r"""DiPaCo 16x16 with path-specific modules: 256 paths, ~20B parameters (12.39 ppl).

First θ̄, the dense model every path forks from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/dipaco_16x16.py --workdir=gs://BUCKET/dipaco_16x16 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

The headline run (paper Fig. 8/9): blocks 0, 5, 6, 11 and the (tied)
embedding are private to each path (§4.2); blocks 1-4 form level 1 and 7-10
level 2 (16 modules each); top-2 overlapping training shards (§2.4.4).
Routing: product k-means phase-0 shards (§7.3: hundreds of paths), then one
discriminative re-shard after outer step 107 with the LR schedule restarted,
scoring 2**18 router documents with all 256 paths; the reasons:
dipaco_jax/config/paper.py, fork().

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits 4 x v5p-512 (1024 chips): mesh path 256 x data 4 (not v5e:
the replicated store of the shared levels leaves too little HBM),
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/dipaco_16x16.py --topology=v5p:8x8x4 --slices=4
"""

from dipaco_jax.config import paper


def get_config():
  # Top-2 overlapping training shards; evaluation never overlaps.
  c = paper.grid(16, 16, path_specific="embed,block_0,block_5,block_6,block_11", top_k=2)
  # Memory (docs/tpu.md): 8 microbatches of 64 sequences, matmul outputs kept for
  # the backward pass, logits 256 positions at a time.
  c.inner.microbatches = 8
  c.model.remat = "save_matmuls"
  c.model.loss_chunk = 256
  # Attention's kernels as [D, H K] / [H K, D] matrices: no dim of [896, 16, 64] divides
  # path = 256, H K = 1024 does, so the outer step splits these modules over 'path' instead
  # of summing their 16-module stacks (docs/tpu.md); the step is compute-bound on v5p, where
  # the layout's extra HBM bytes cost no time. θ̄ of dense_150m ([D, H, K]) is read reshaped.
  c.model.attention_kernels = "matrix"
  return c
