"""Batched decoding of one path model with a KV cache: one prefill call, then one token a step.

Prompts of unequal lengths share a batch right-padded, with per-row
positions: row b's tokens sit at positions 0 .. n_b - 1 exactly as when it
runs alone, and each cache slot holds the position of the same number
(model.Attention, decode=True). So row b decodes at its own position; the
keys of its padding land in slots n_b, n_b + 1, ... which its queries cannot
see (only slots at or before their position) and which its own next tokens
overwrite before they come into view. Learned and RoPE positions both see
the positions of a lone run.

`generate` runs the steps inside one `jax.lax.while_loop` (stopping early
when every row has produced EOS); `complete` is the host side (BOS, padding,
few compiled shapes); `generate_uncached` is the loop serving ran before,
the full forward pass per new token, kept as the reference for tests and
benchmarks/serving.py.
"""
# pylint: disable=invalid-name

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import errors
from dipaco_jax.core import model as model_lib
from dipaco_jax.types import PyTree

BOS_ID = 0  # Shifted inputs start with pad (data.vocab's T5 layout): position n predicts token n.
LENGTH_BUCKET = 32  # Prompt lengths are padded up to a multiple of this: few compiled shapes.


def _pick(logits_BxV, rng, temperature, top_k):
  """Greedy at temperature 0, else a sample of softmax(logits / T) over the top_k (0: all)."""

  def sample(logits_BxV):
    # A traced k (a sort, not lax.top_k): one program serves every top_k.
    V = logits_BxV.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth_Bx1 = jnp.sort(logits_BxV, -1)[:, V - k][:, None]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(rng, logits_BxV / temperature).astype(jnp.int32)

  greedy = lambda logits_BxV: jnp.argmax(logits_BxV, -1).astype(jnp.int32)
  return jax.lax.cond(temperature > 0, sample, greedy, logits_BxV)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "return_logits"))
def generate(
  model: model_lib.Transformer,
  params: PyTree,
  prompts_BxP: jax.Array,
  lengths_B: jax.Array,
  rng: jax.Array,
  temperature: jax.Array | float = 0.0,
  eos_id: jax.Array | int = -1,
  top_k: jax.Array | int = 0,
  *,
  max_new_tokens: int,
  return_logits: bool = False,
):
  """(tokens_BxN, new_B[, logits_BxNxV]): N new tokens per row; new_B count those before EOS.

  prompts_BxP: right-padded rows (BOS first), lengths_B their lengths; eos_id -1: never stop.
  logits[b, i] are the float32 logits token i was picked from. Tokens after a row's EOS are
  meaningless.
  """
  B, P = prompts_BxP.shape
  N = max_new_tokens
  apply = functools.partial(model.apply, decode=True, mutable=["cache"])
  cache = model_lib.init_cache(model.cfg, B, P + N)
  positions_BxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  # Prefill: the whole prompt in one call; only each row's last position is unembedded.
  (feats_BxPxD, unembed_DxV), state = apply(
    {"params": params, "cache": cache}, prompts_BxP, None, positions_BxP, unembed=False
  )
  last_Bx1xD = feats_BxPxD[jnp.arange(B), lengths_B - 1][:, None]
  logits_BxV = model_lib.logits(last_Bx1xD, unembed_DxV)[:, 0]
  token_B = _pick(logits_BxV, jax.random.fold_in(rng, 0), temperature, top_k)
  tokens_BxN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token_B)
  logits_BxNxV = jnp.zeros((B, N, logits_BxV.shape[-1]) if return_logits else (0,), jnp.float32)
  if return_logits:
    logits_BxNxV = logits_BxNxV.at[:, 0].set(logits_BxV)

  def cond(carry):
    i, _, done_B, *_ = carry
    return (i < N) & ~jnp.all(done_B)

  def step(carry):
    i, token_B, done_B, cache, tokens_BxN, logits_BxNxV = carry
    # Token i - 1 stands at position length + i - 1 of its row.
    positions_Bx1 = (lengths_B + i - 1)[:, None]
    logits_Bx1xV, state = apply(
      {"params": params, "cache": cache}, token_B[:, None], None, positions_Bx1
    )
    token_B = _pick(logits_Bx1xV[:, 0], jax.random.fold_in(rng, i), temperature, top_k)
    tokens_BxN = tokens_BxN.at[:, i].set(token_B)
    if return_logits:
      logits_BxNxV = logits_BxNxV.at[:, i].set(logits_Bx1xV[:, 0])
    return i + 1, token_B, done_B | (token_B == eos_id), state["cache"], tokens_BxN, logits_BxNxV

  carry = (1, token_B, token_B == eos_id, state["cache"], tokens_BxN, logits_BxNxV)
  _, _, _, _, tokens_BxN, logits_BxNxV = jax.lax.while_loop(cond, step, carry)
  is_eos_BxN = tokens_BxN == eos_id
  new_B = jnp.where(is_eos_BxN.any(1), jnp.argmax(is_eos_BxN, 1), N)
  return (tokens_BxN, new_B, logits_BxNxV) if return_logits else (tokens_BxN, new_B)


def check_length(cfg: model_lib.ModelConfig, longest: int, max_new_tokens: int) -> None:
  """Learned positions end at model.max_len: the prompt and new tokens must fit."""
  if cfg.positions == "learned" and longest + max_new_tokens - 1 > cfg.max_len:
    raise errors.ArgumentError(
      f"a prompt of {longest - 1} tokens plus max_new_tokens={max_new_tokens} needs "
      f"{longest + max_new_tokens - 1} positions but model.max_len={cfg.max_len} (learned "
      "positions): shorten the text or lower max_new_tokens."
    )


def complete(
  model: model_lib.Transformer,
  params: PyTree,
  prompts: list[np.ndarray],
  *,
  max_new_tokens: int,
  eos_id: int,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  return_logits: bool = False,
) -> list:
  """New tokens (before EOS) for each prompt, decoded together; with logits [n, V] if asked.

  The batch is padded to a power of two and the prompts (BOS added) to a multiple of
  LENGTH_BUCKET, so serving compiles few programs.
  """
  if max_new_tokens < 1 or temperature < 0 or top_k < 0:
    raise errors.ArgumentError(
      f"max_new_tokens={max_new_tokens}, temperature={temperature}, top_k={top_k}: "
      "max_new_tokens must be >= 1, temperature and top_k >= 0 (0: greedy, all tokens)."
    )
  if not prompts:
    return []
  cfg = model.cfg
  lengths = [len(p) + 1 for p in prompts]
  longest = max(lengths)
  check_length(cfg, longest, max_new_tokens)
  P = -(-longest // LENGTH_BUCKET) * LENGTH_BUCKET
  if cfg.positions == "learned":
    P = min(P, cfg.max_len)  # Padding positions index the table too.
  B = 1 << (len(prompts) - 1).bit_length()
  prompts_BxP = np.full((B, P), BOS_ID, np.int32)
  lengths_B = np.ones(B, np.int32)  # Filler rows: BOS alone.
  for b, ids in enumerate(prompts):
    prompts_BxP[b, 1 : lengths[b]] = ids
    lengths_B[b] = lengths[b]
  out = generate(
    model,
    params,
    prompts_BxP,
    lengths_B,
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.int32(eos_id),
    jnp.int32(top_k),
    max_new_tokens=max_new_tokens,
    return_logits=return_logits,
  )
  tokens_BxN, new_B = np.asarray(out[0]), np.asarray(out[1])
  rows = [tokens_BxN[b, : new_B[b]].tolist() for b in range(len(prompts))]
  if not return_logits:
    return rows
  logits_BxNxV = np.asarray(out[2])
  # A row's logits up to and including the one its EOS was picked from.
  return [(r, logits_BxNxV[b, : min(len(r) + 1, max_new_tokens)]) for b, r in enumerate(rows)]


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, inputs_BxT):
  return model.apply({"params": params}, inputs_BxT)


def generate_uncached(
  model: model_lib.Transformer,
  params: PyTree,
  prompt: np.ndarray,
  *,
  max_new_tokens: int,
  eos_id: int,
) -> tuple[list[int], np.ndarray]:
  """Greedy new tokens (before EOS) and their logits [n, V]: the whole model per new token."""
  n0 = len(prompt)
  size = -(-(n0 + max_new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET
  buf_1xS = np.zeros((1, size + 1), np.int32)
  buf_1xS[0, 0] = BOS_ID
  buf_1xS[0, 1 : n0 + 1] = prompt
  n, logits = n0, []
  while n < n0 + max_new_tokens:
    logits.append(np.asarray(_forward(model, params, buf_1xS[:, :size]))[0, n])
    nxt = int(np.argmax(logits[-1]))
    if nxt == eos_id:
      break
    buf_1xS[0, n + 1] = nxt
    n += 1
  return buf_1xS[0, n0 + 1 : n + 1].tolist(), np.asarray(logits).reshape(len(logits), -1)
