r"""Dense "1.3B" baseline (paper Table 3 "1B": 11.41 ppl; 24 blocks, d 2048).

  python -m dipaco_jax.main --config=configs/dense_1b.py --workdir=gs://BUCKET/dense_1b \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

TPU memory (docs/tpu.md has the numbers): at the paper's batch (512 x 1024 tokens
per path) the inner step fits one v5p-16 (8 chips): mesh path 1 x data 8 (it does not fit
v5e: 96% of HBM on a v5litepod-16 with FSDP over data 4 x model 4),
with the memory switches set below; checked by compiling for that topology:

  python -m dipaco_jax.aot --config=configs/dense_1b.py --topology=v5p:2x2x2 --slices=1
"""

from dipaco_jax.config import paper
from dipaco_jax.config import schema


def get_config():
  c = paper.settings(schema.base())
  c.model.d_model = 2048
  c.model.num_layers = 24
  c.model.num_heads = 16
  c.model.head_dim = 128
  c.inner.lr = 2e-4  # Paper Table 4, 1.3B column.
  c.dipaco.level_groups = ("embed,block_0-23,head",)
  c.dipaco.modules_per_level = (1,)
  c.outer.enabled = False
  c.dipaco.inner_steps = 1000
  c.dipaco.outer_steps = 88
  c.mesh.model = 1  # Tensor parallel inside the single path (adjust to the slice).
  # Memory (docs/tpu.md): 8 microbatches of 64 sequences, matmul outputs kept for
  # the backward pass, logits 256 positions at a time.
  c.inner.microbatches = 8
  c.model.remat = "save_matmuls"
  c.model.loss_chunk = 256
  return c
