r"""Dense 150M baseline (paper Table 1 "Baseline": 16.23 ppl after 88k steps).

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

One path, one module, no outer step. Its 24k-step run is θ̄, the model that
every DiLoCo / DiPaCo / flat-MoE config forks from and routes with (their
required config.dipaco.init_from):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

This config is θ̄'s own pretraining, so it needs no init_from ("" = random init).

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits one v5litepod-4 (4 chips): mesh path 1 x data 4,
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/dense_150m.py --topology=v5e:2x2 --slices=1
"""

from dipaco_jax.config import paper
from dipaco_jax.config import schema


def get_config():
  c = paper.settings(schema.base())
  c.dipaco.level_groups = ("embed,block_0-11,head",)
  c.dipaco.modules_per_level = (1,)
  c.outer.enabled = False
  c.dipaco.inner_steps = 1000  # Only the eval/sync interval when dense.
  c.dipaco.outer_steps = 88  # 88k steps in all.
  # Memory and speed (docs/tpu.md): 4 microbatches of 128 sequences (XLA counts 17% fewer
  # HBM bytes per step than 8 of 64), the attention matmuls' outputs kept for the backward
  # pass and the MLP's input projection recomputed (what lets 128 fit), logits 512 positions
  # at a time (docs/results/tpu.md: 256 moved 1.5% more bytes).
  c.inner.microbatches = 4
  c.model.remat = "save_matmuls_except_mlp_in"
  c.model.loss_chunk = 512
  return c
