r"""Tiny 2x2 DiPaCo on the embedded corpus: minutes on a 2-core CPU.

  python -m dipaco_jax.main --config=configs/tiny.py --workdir=/tmp/dipaco_tiny

Grid: level 0 = embedding + head shared by all paths (K=1); level 1 = blocks
0-1 and level 2 = blocks 2-3, two modules each: 4 paths. Shards are i.i.d.
(random assignment) until a router is fitted.
"""

from dipaco_jax.config import schema


def get_config():
  c = schema.base()
  c.model.vocab_size = 8192  # The shipped SentencePiece model.
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.head_dim = 32
  c.model.max_len = 256

  c.inner.lr = 2e-3  # Small models take a larger LR than the paper's 4e-4.
  c.inner.warmup_steps = 50

  c.dipaco.level_groups = ("embed,head", "block_0-1", "block_2-3")
  c.dipaco.modules_per_level = (1, 2, 2)
  c.dipaco.inner_steps = 50  # H
  c.dipaco.outer_steps = 10  # T

  c.data.seq_len = 128
  c.data.batch_size = 8

  c.mesh.cpu_devices = 4  # One path per CPU device (faster than one device).

  c.ckpt.every_steps = 50
  c.eval.every_steps = 50
  c.eval.batches = 4
  return c
