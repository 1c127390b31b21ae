"""KV-cache decoding: the same tokens and logits as the full forward pass per token, batched."""
# pylint: disable=invalid-name

import jax
import numpy as np
import pytest

from dipaco_jax.core import decoding
from dipaco_jax.core import model as model_lib

import helpers

V, N = 64, 10  # vocab, new tokens


def _model(**overrides):
  """A 2-block model and N(0, 1/4) params drawn in numpy (no init program to compile)."""
  fields = dict(vocab_size=V, d_model=32, num_layers=2, num_heads=2, head_dim=16, max_len=48)
  cfg = helpers.model_config(**{**fields, **overrides})
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: (0.5 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  return model_lib.Transformer(cfg), params


def _prompts(*lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, V, size=n).astype(np.int32) for n in lengths]


@pytest.mark.parametrize(
  "positions,attention,mlp",
  [
    ("rope", "xla", "gelu"),
    # ~6 CPU-seconds of compiles: outside the fast suite (-m "not slow").
    pytest.param("learned", "auto", "swiglu", marks=pytest.mark.slow),
  ],
)
def test_cached_batch_matches_full_forward_per_token_and_each_prompt_alone(
  positions, attention, mlp
):
  model, params = _model(positions=positions, attention=attention, mlp=mlp)
  prompts = _prompts(3, 14, 1)  # Unequal lengths: rows 0 and 2 decode beside padding.
  batch = decoding.complete(model, params, prompts, max_new_tokens=N, eos_id=-1, return_logits=True)
  for prompt, (tokens, logits) in zip(prompts, batch):
    ref_tokens, ref_logits = decoding.generate_uncached(
      model, params, prompt, max_new_tokens=N, eos_id=-1
    )
    assert tokens == ref_tokens and len(tokens) == N
    # Same float32 ops over a longer, zero-weighted key axis: equal up to summation order
    # (measured <= 1.2e-6 on logits of size ~3).
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  # The batch's padding and neighbours change nothing: row 1 decoded alone is the same.
  (alone,) = decoding.complete(model, params, prompts[1:2], max_new_tokens=N, eos_id=-1)
  assert alone == batch[1][0]
  # The test can fail: the rows' continuations differ from one another.
  assert len({tuple(t) for t, _ in batch}) == 3


def test_init_cache_holds_keys_and_values_per_block_and_slot():
  model, _ = _model(num_layers=3)
  cache = model_lib.init_cache(model.cfg, batch=4, length=20)
  assert set(cache) == {"block_0", "block_1", "block_2"}
  # [B, S, H, K] = [4, 20, 2, 16], zeros in the compute dtype.
  for block in cache.values():
    assert set(block["attn"]) == {"cached_key", "cached_value"}
    for leaf in block["attn"].values():
      assert leaf.shape == (4, 20, 2, 16) and leaf.dtype == np.float32 and not leaf.any()


# The tests below decode 3 prompts of at most 22 tokens, N tokens with logits: the
# program compiled above serves them all (temperature, top_k and eos_id are traced).


def _tokens(batch):
  return [tokens for tokens, _ in batch]


def test_eos_stops_each_row_at_its_own_step():
  model, params = _model()
  prompts = _prompts(5, 9, 2, seed=3)
  kw = dict(max_new_tokens=N, return_logits=True)
  free = _tokens(decoding.complete(model, params, prompts, eos_id=-1, **kw))
  eos = free[1][4]  # Row 1's fifth token, made the stop token.
  stopped = _tokens(decoding.complete(model, params, prompts, eos_id=eos, **kw))
  for row, out in zip(free, stopped):
    first = row.index(eos) if eos in row else N
    assert out == row[:first]  # Everything before the first EOS, nothing after.
  assert len(stopped[1]) <= 4


def test_top_k_sampling_draws_only_among_the_k_likeliest():
  model, params = _model()
  prompts = _prompts(4, 7, 2, seed=5)
  kw = dict(max_new_tokens=N, eos_id=-1, temperature=2.0, return_logits=True)
  drawn = decoding.complete(model, params, prompts, seed=0, top_k=3, **kw)
  off_greedy = 0
  for tokens, logits in drawn:
    top3_NxK = np.argsort(logits, -1)[:, -3:]
    assert all(t in top3_NxK[i] for i, t in enumerate(tokens))
    off_greedy += sum(t != int(np.argmax(lg)) for t, lg in zip(tokens, logits))
  assert off_greedy > 0  # At temperature 2 among 3 tokens, some draws are not the argmax.
  again = decoding.complete(model, params, prompts, seed=0, top_k=3, **kw)
  assert _tokens(again) == _tokens(drawn)  # One seed, one draw.
  # top_k 0 draws among all 64 tokens: some draws fall outside the top 3.
  wide = decoding.complete(model, params, prompts, seed=0, top_k=0, **kw)
  outside = [
    t not in np.argsort(lg, -1)[i, -3:] for tokens, lg in wide for i, t in enumerate(tokens)
  ]
  assert any(outside)


def test_decoding_bad_inputs():
  model, params = _model(positions="learned")  # max_len 48
  with pytest.raises(ValueError, match="needs 50 positions but model.max_len=48"):
    decoding.complete(model, params, _prompts(40), max_new_tokens=10, eos_id=-1)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    decoding.complete(model, params, _prompts(4), max_new_tokens=0, eos_id=-1)
  with pytest.raises(ValueError, match="top_k=-1"):
    decoding.complete(model, params, _prompts(4), max_new_tokens=2, eos_id=-1, top_k=-1)
