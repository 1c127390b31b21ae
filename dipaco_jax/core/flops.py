"""Model FLOPs of training: what MFU counts (the AOT report, benchmarks, perf/ in TensorBoard)."""

import math

import jax

from dipaco_jax.core import model as model_lib

# Model FLOPs conventions for MFU: attention's score and value matmuls counted over every
# (query, key) pair ("full": PaLM App. B, 12 L T H K per token) or over the causal half that a
# causal model needs ("causal": 6 L T H K, as MaxText counts). The AOT report's MFU is the causal
# one; both are printed.
CONVENTIONS = ("causal", "full")


def model_flops_per_token(
  cfg: model_lib.ModelConfig, seq_len: int, convention: str = "causal"
) -> float:
  """Training FLOPs per token: 6 x matmul params + attention (PaLM, App. B; see CONVENTIONS).

  The params are counted from the model's own tree, so every MLP kind (gelu, swiglu's third
  matrix) counts as built.
  """
  if convention not in CONVENTIONS:
    raise ValueError(f"convention={convention!r}: use one of {CONVENTIONS}")
  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  # Lookup tables do no matmul; a tied table does one (the unembedding).
  n -= cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
  if cfg.positions == "learned":
    n -= cfg.max_len * cfg.d_model
  attention = 12.0 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  return 6.0 * n + (attention / 2 if convention == "causal" else attention)
