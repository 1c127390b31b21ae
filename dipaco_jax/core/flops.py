"""Model FLOPs of training: what the trainer's per-device TFLOP/s counts (perf/ in TensorBoard)."""

import math

import jax

from dipaco_jax.core import model as model_lib


def model_flops_per_token(cfg: model_lib.ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 x matmul params + 12 L T H K for attention (PaLM, App. B).

  The params are counted from the model's own tree, so every MLP kind counts as built; lookup
  tables do no matmul (a tied table does one: the unembedding).
  """
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  n -= cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
  if cfg.positions == "learned":
    n -= cfg.max_len * cfg.d_model
  return 6.0 * n + 12.0 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
