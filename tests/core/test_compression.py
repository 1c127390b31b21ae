"""outer.compression by hand: codes and scales, fp4's grid, error feedback, the outer step."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dipaco_jax import train
from dipaco_jax.config import sections
from dipaco_jax.core import compression as comp
from dipaco_jax.core import experiment
from dipaco_jax.core import outer
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.core import sharding
from dipaco_jax.errors import ConfigError
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime.elastic import downlink
from dipaco_jax.runtime.elastic import driver
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import worker as worker_lib

import helpers

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_int8_codes_and_scales_by_hand():
  # Block 1: absmax 2, so codes are x * 127 / 2 rounded half to even: 31.75 -> 32, -63.5 -> -64,
  # 63.5 -> 64, 15.875 -> 16; block 2 is all zeros (scale 0); block 3: 3 alone, padded by 3 zeros.
  x = jnp.array([[0.5, -1.0, 2.0, 0.25, 0, 0, 0, 0, 3.0]], jnp.float32)
  enc = comp.encode(x, "int8", 4)
  assert enc["q"].dtype == jnp.int8
  np.testing.assert_array_equal(enc["q"], [[32, -64, 127, 16, 0, 0, 0, 0, 127, 0, 0, 0]])
  np.testing.assert_array_equal(enc["s"], np.float32([[2 / 127, 0, 3 / 127]]))
  got = comp.decode(enc, "int8", 4, 9)
  np.testing.assert_allclose(got[0], [32 * 2 / 127, -64 * 2 / 127, 2, 16 * 2 / 127, 0, 0, 0, 0, 3])
  # The error of a value is at most half a code step (absmax / 254).
  assert float(jnp.max(jnp.abs(got - x))) <= 2 / 254 + 1e-7


def test_fp4_grid_values_are_exact_and_packed_two_to_a_byte():
  grid = np.float32(E2M1 + [-v for v in E2M1[1:]])
  x = jnp.asarray(grid[None, :])  # absmax 6: the scale is 1, every value a code.
  enc = comp.encode(x, "fp4", 16)
  assert enc["q"].dtype == jnp.uint8 and enc["q"].shape == (1, 8)
  np.testing.assert_array_equal(enc["s"], [[1.0]])
  np.testing.assert_array_equal(comp.decode(enc, "fp4", 16, 15), x)
  # e2m1 bit patterns: 0.5 is 0b0001, 1 is 0b0010, so [0.5, 1] packs to 0x21; -6 is 0b1111.
  pair = comp.encode(jnp.array([[0.5, 1.0, -6.0, 0.0]]), "fp4", 4)
  np.testing.assert_array_equal(pair["q"], [[0x21, 0x0F]])
  # Halfway values round to the even code: 2.5 -> 2, 5 -> 4, 0.25 -> 0; 5.1 -> 6.
  y = comp.roundtrip(jnp.array([[6.0, 2.5, 5.0, 0.25, 5.1]]), "fp4", 5)
  np.testing.assert_array_equal(y, [[6.0, 2.0, 4.0, 0.0, 6.0]])
  # A scaled block: absmax 3, scale 0.5; 0.75 -> 1.5 (a code), 1.1 -> 2.2 -> 2 -> 1.0.
  y = comp.roundtrip(jnp.array([[3.0, 0.75, -1.1]]), "fp4", 3)
  np.testing.assert_allclose(y, [[3.0, 0.75, -1.0]], rtol=1e-7)


def test_bf16_and_none():
  x = jnp.array([[1.0 + 2**-9, 1.0 + 3 * 2**-9, -3.0]], jnp.float32)
  enc = comp.encode(x, "bf16", 64)
  assert enc["q"].dtype == jnp.uint16 and set(enc) == {"q"}
  # bf16 keeps 7 mantissa bits: 1 + 2^-9 -> 1 (a quarter step: down); 1 + 3*2^-9 -> 1 + 2^-7.
  np.testing.assert_array_equal(comp.roundtrip(x, "bf16", 64), [[1.0, 1.0 + 2**-7, -3.0]])
  np.testing.assert_array_equal(comp.roundtrip(x, "none", 64), x)


def test_topk2_by_hand():
  """Two blocks of 4, k = 2: positions, 2-bit codes (sign, |x| >= 3/4 absmax), absmax."""
  x = jnp.array([[0.5, -4.0, 2.0, -3.5, 0, 0, 0.0, 1.0]], jnp.float32)
  enc = comp.encode(x, "topk2", 4, keep=2)
  assert enc["i"].dtype == jnp.uint8 and enc["q"].dtype == jnp.uint8
  # Block 1: the two largest |x| are -4 (position 1) and -3.5 (3); absmax 4; both >= 3: code
  # 0b11 (negative, big). Block 2: 1.0 (3) then a tie of zeros (the lower position, 0: code
  # 0b00 with absmax 1, 0 < 0.75); 1.0 is big, positive: 0b01.
  np.testing.assert_array_equal(enc["i"], [[1, 3, 3, 0]])
  np.testing.assert_array_equal(enc["s"], [[4.0, 1.0]])
  # Four 2-bit codes a byte, the first lowest, padded: [3, 3, 0, 0] -> 0x0F; [1, 0, 0, 0] -> 1.
  np.testing.assert_array_equal(enc["q"], [[0x0F, 0x01]])
  got = comp.decode(enc, "topk2", 4, 8, keep=2)
  # Decoded: a big code is ±absmax, a small one ±absmax / 2 (the zero kept at position 0 of
  # block 2 decodes to +0.5: what feedback takes back next phase).
  np.testing.assert_array_equal(got, [[0, -4.0, 0, -4.0, 0.5, 0, 0, 1.0]])
  assert sum(v.nbytes for v in enc.values()) == comp.wire_bytes(x.shape, "topk2", 4, 2) == 2 * 7
  # k = 1 of 64 (SparseLoCo's 1.56%): the block's absmax alone, exact; 6 bytes a block.
  y = jnp.zeros((2, 64)).at[0, 5].set(-0.3).at[0, 9].set(0.1).at[1, 63].set(2.0)
  np.testing.assert_array_equal(
    comp.roundtrip(y, "topk2", 64), jnp.zeros((2, 64)).at[0, 5].set(-0.3).at[1, 63].set(2.0)
  )
  assert comp.wire_bytes((2, 64), "topk2", 64) == 2 * 6
  # Blocks above 256 values index with uint16.
  big = comp.encode(jnp.ones((1, 300)), "topk2", 300, keep=3)
  assert big["i"].dtype == jnp.uint16
  assert sum(v.nbytes for v in big.values()) == comp.wire_bytes((1, 300), "topk2", 300, 3)


def test_topk2_against_numpy_on_padded_rows():
  """[3, 5, 100] in blocks of 32 (the last padded), k = 3: each block's top 3, 2 bits each."""
  x = np.asarray(jax.random.normal(jax.random.key(2), (3, 5, 100)), np.float32)
  blocks = np.pad(x, [(0, 0), (0, 0), (0, 28)]).reshape(3, 5, 4, 32)
  want = np.zeros_like(blocks)
  for ix in np.ndindex(3, 5, 4):
    b = blocks[ix]
    top = np.argsort(-np.abs(b), kind="stable")[:3]
    s = np.abs(b[top]).max()
    want[ix][top] = np.sign(b[top]) * np.where(np.abs(b[top]) >= 0.75 * s, s, s / 2)
  got = comp.roundtrip(jnp.asarray(x), "topk2", 32, keep=3)
  np.testing.assert_array_equal(got, want.reshape(3, 5, 128)[..., :100])
  enc = comp.encode(jnp.asarray(x), "topk2", 32, keep=3)
  assert sum(v.nbytes for v in enc.values()) == comp.wire_bytes(x.shape, "topk2", 32, 3)


def test_topk2_with_error_feedback_sends_everything_eventually():
  """One Δ, then zeros: each phase sends the largest of what is left; Σ sent + e = Δ always."""
  d = jnp.array([[0.1, -0.7, 0.3, 0.05]], jnp.float32)
  e, total = jnp.zeros((1, 4)), jnp.zeros((1, 4))
  for t in range(12):
    _, sent, e = comp.with_feedback(d if t == 0 else jnp.zeros_like(d), e, "topk2", 4, 1)
    total = total + sent
    np.testing.assert_allclose(total + e, d, rtol=0, atol=1e-7)
  # The first phase sends −0.7 exactly (k = 1: the absmax is a code); the rest follow.
  assert float(jnp.max(jnp.abs(e))) < 0.05


def _fp4_reference(x: np.ndarray, b: int):
  """fp4 in numpy and ml_dtypes: (packed codes, scales, each padded block's code values).

  Each padded block's absmax a, y = x · (6 / a) in float32, cast to float4 e2m1 (ml_dtypes
  rounds to nearest even); the code is its 4 bits (ml_dtypes keeps one a byte), two a byte.
  """
  *lead, n = x.shape
  m = -(-n // b) * b
  x_NxB = np.pad(x, [(0, 0)] * len(lead) + [(0, m - n)]).reshape(*lead, m // b, b)
  a = np.abs(x_NxB).max(-1)
  inv = np.where(a > 0, np.float32(6) / np.where(a > 0, a, np.float32(1)), np.float32(0))
  f4 = (x_NxB * inv[..., None]).astype(ml_dtypes.float4_e2m1fn)
  bits = f4.view(np.uint8).reshape(*lead, m)
  bits = np.pad(bits, [(0, 0)] * len(lead) + [(0, m % 2)])
  return bits[..., 0::2] | (bits[..., 1::2] << 4), a / np.float32(6), f4.astype(np.float32)


@pytest.mark.parametrize(
  "shape, block", [((3, 100), 64), ((2, 5, 33), 8), ((7,), 3), ((4, 64), 16)]
)
def test_fp4_codes_and_values_are_the_reference_bit_for_bit(shape, block):
  """The one-pass codec (codes from the float4 cast's bits, decoded by bitcast) is exact.

  Against numpy + ml_dtypes on values spread over 7 decades, with each code's halfway points
  (ties round to the even code), zero blocks and −0.
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 1e4], size=shape)
  half = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.999, 6.0])
  x.reshape(-1)[: 2 * half.size] = np.concatenate([half, -half])[: x.size]
  if x.ndim == 2:
    x[-1] = -0.0  # A block of −0: scale +0, decoded +0 · code.
  q, s, c = _fp4_reference(x, block)
  enc = comp.encode(jnp.asarray(x), "fp4", block)
  assert np.asarray(enc["q"]).tobytes() == q.tobytes()
  # absmax / 6: XLA may multiply by 1/6 instead (1 ulp); decoding uses the scale sent.
  np.testing.assert_allclose(enc["s"], s, rtol=2e-7, atol=0)
  dec = (c * np.asarray(enc["s"])[..., None]).reshape(*shape[:-1], -1)[..., : shape[-1]]
  assert np.asarray(comp.decode(enc, "fp4", block, shape[-1])).tobytes() == dec.tobytes()
  # A non-finite value makes its block's scale NaN: the whole block decodes NaN (the guard's).
  bad = x.copy()
  bad.reshape(-1)[0] = np.nan
  y = np.asarray(comp.roundtrip(jnp.asarray(bad), "fp4", block)).reshape(-1)
  assert np.isnan(y[: min(block, shape[-1])]).all()


@pytest.mark.parametrize("kind", ["bf16", "int8", "fp4"])
def test_round_trip_error_bound_and_wire_bytes(kind):
  x = jax.random.normal(jax.random.key(0), (3, 5, 100), jnp.float32)
  enc = comp.encode(x, kind, 32)
  y = comp.decode(enc, kind, 32, 100)
  absmax = np.max(np.abs(np.pad(np.asarray(x), [(0, 0), (0, 0), (0, 28)]).reshape(3, 5, 4, 32)), -1)
  step = {"bf16": None, "int8": absmax / 127, "fp4": absmax / 6 * 2}[kind]  # fp4: its widest gap.
  err = np.abs(np.asarray(y - x)).reshape(3, 5, 100)
  if step is None:
    assert np.all(err <= np.abs(np.asarray(x)) * 2**-8)
  else:
    bound = np.repeat(step / 2, 32, axis=-1)[..., :100]
    assert np.all(err <= bound * (1 + 1e-6))
  assert sum(v.nbytes for v in enc.values()) == comp.wire_bytes(x.shape, kind, 32)


def test_error_feedback_telescopes():
  """Σ_t sent_t = Σ_t Δ_t + e_0 − e_T, to float32's rounding; without feedback the error grows."""
  keys = jax.random.split(jax.random.key(1), 20)
  deltas = [1e-3 * jax.random.normal(k, (4, 64)) + 1e-4 for k in keys]
  e = jnp.zeros((4, 64), jnp.float32)
  sent_sum = jnp.zeros((4, 64))
  plain_sum = jnp.zeros((4, 64))
  for d in deltas:
    _, sent, e = comp.with_feedback(d, e, "fp4", 16)
    sent_sum = sent_sum + sent
    plain_sum = plain_sum + comp.roundtrip(d, "fp4", 16)
  true_sum = sum(deltas)
  np.testing.assert_allclose(sent_sum, true_sum - e, rtol=0, atol=1e-8)
  assert float(jnp.max(jnp.abs(sent_sum - true_sum))) < float(
    jnp.max(jnp.abs(plain_sum - true_sum))
  )


@pytest.mark.parametrize(
  "kind, codes",
  [
    # u = −0.5 Δ = [−0.25, 0.5, −1, −0.125], absmax 1: int8 codes u · 127 rounded half to
    # even (−31.75 → −32, 63.5 → 64, −15.875 → −16), scale 1 / 127.
    ("int8", [-32 / 127, 64 / 127, -1.0, -16 / 127]),
    # fp4: u · 6 = [−1.5, 3, −6, −0.75]; −0.75 is halfway between 0.5 and 1: to the even
    # code, 1 (0b010); scale 1 / 6.
    ("fp4", [-0.25, 0.5, -1.0, -1 / 6]),
  ],
)
def test_the_downlink_sends_the_update_coded_by_hand(kind, codes):
  """One module, one worker, plain SGD at lr 0.5: θ' = θ + decode(C(−0.5 Δ)), the wire in hand."""
  cfg = sections.OuterConfig(lr=0.5, momentum=0.0, compression=kind, compression_block=4)
  tx = outer.optimizer(cfg)
  theta = {"g": jnp.array([[1.0, 2.0, 3.0, 4.0]])}
  delta = {"g": jnp.array([[0.5, -1.0, 2.0, 0.25]])}
  new, _, m = outer.module_outer_step(theta, tx.init(theta), delta, jnp.ones(1), tx=tx, cfg=cfg)
  want = np.float32([1.0, 2.0, 3.0, 4.0]) + np.float32(codes)
  np.testing.assert_allclose(new["g"][0], want, rtol=0, atol=1e-7)
  wire = m["update"]["g"]
  np.testing.assert_allclose(wire["s"], [[1 / 127 if kind == "int8" else 1 / 6]], rtol=1e-7)
  if kind == "int8":
    np.testing.assert_array_equal(wire["q"], [[-32, 64, -127, -16]])
  else:  # e2m1 patterns: −1.5 = 0b1011, 3 = 0b0101, −6 = 0b1111, −1 = 0b1010; low nibble first.
    np.testing.assert_array_equal(wire["q"], [[0x5B, 0xAF]])
  # A holder of θ rebuilds θ' from the wire alone (the elastic worker's program).
  r = recipe_lib.Recipe.from_config(helpers.micro_config(**{"outer.compression": kind}))
  rebuilt = jax.tree.map(lambda o, e: outer.apply_update(o, e, cfg), theta, m["update"])
  np.testing.assert_array_equal(rebuilt["g"], new["g"])
  del r


NON_IID = [[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.5, 1.0]]
IID = [[0.0, -1.0, 1.5, 2.0], [0.0, -1.0, 1.5, 2.0]]


def _quadratic(kind: str, feedback: bool, c=NON_IID, phases: int = 200):
  """DiLoCo on f(θ) = ½ Σ_w |θ − c_w|² (2 workers, H = 5 SGD steps): the store's final θ."""
  c = jnp.array(c, jnp.float32)
  cfg = sections.OuterConfig(compression=kind, compression_block=4, error_feedback=feedback)
  tx = outer.optimizer(cfg)

  def phase(carry, _):
    theta, opt, e = carry
    x = jnp.repeat(theta["g"], 2, axis=0)
    for _ in range(5):
      x = x - 0.1 * (x - c)
    _, sent, e_new = comp.with_feedback(theta["g"] - x, e if feedback else None, kind, 4)
    theta, opt, _ = outer.module_outer_step(theta, opt, {"g": sent}, jnp.ones(2), tx=tx, cfg=cfg)
    return (theta, opt, e_new if feedback else e), None

  theta = {"g": jnp.full((1, 4), 10.0)}
  carry = (theta, tx.init(theta), jnp.zeros((2, 4)))
  (theta, _, _), _ = jax.lax.scan(jax.jit(phase), carry, None, length=phases)
  return np.asarray(theta["g"][0])


def test_int8_with_error_feedback_converges_to_the_fp32_point():
  want = _quadratic("none", False)
  np.testing.assert_allclose(want, [0.0, -1.0, 1.5, 2.0], atol=1e-5)  # The mean of the c_w.
  # At the optimum each worker still moves: Δ_w = (θ* − c_w)(1 − 0.9^5), |Δ_w| <= 0.41, so an
  # int8 code step is 0.41 / 127 = 3.2e-3: the codes hold θ within about one step of θ*.
  np.testing.assert_allclose(_quadratic("int8", True), want, atol=0.41 / 127)
  # Workers that agree: Δ_w -> 0 at θ*, the scales with it, and int8 reaches θ* as fp32 does.
  want = _quadratic("none", False, IID)
  np.testing.assert_allclose(_quadratic("int8", True, IID), want, atol=1e-6)
  np.testing.assert_allclose(_quadratic("fp4", True, IID), want, atol=1e-6)


def test_bad_values_are_one_line_errors():
  with pytest.raises(ConfigError, match=r"config\.outer\.compression='int4' is invalid"):
    sections.OuterConfig(compression="int4")
  with pytest.raises(ConfigError, match=r"config\.outer\.compression_block=0 is invalid"):
    sections.OuterConfig(compression_block=0)
  with pytest.raises(ConfigError) as e:
    helpers.micro_config(
      **{"outer.compression": "topk2", "outer.compression_keep": 65, "outer.compression_block": 64}
    )
  assert "compression_keep <= compression_block" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
  "over, axes",
  [({"mesh.model": 2, "mesh.path": 2}, "'model'"), ({"mesh.fsdp": True, "mesh.data": 2}, "'data'")],
)
def test_a_block_across_devices_is_one_line(over, axes):
  """A last axis split over 'model' (or FSDP's 'data') in parts a block straddles is refused.

  The micro model's query kernel [32, 32] (heads x head_dim last) on 'model' = 2: parts of 16;
  under FSDP the largest dim not on 'model' goes to 'data', the last when it is the largest (the
  mlp_out kernel [128, 32] splits its 128, the embedding [256, 32] its 256: mlp_in [32, 128] its
  last, parts of 64). Block 24 fits no part; every split part is a multiple of 16.
  """
  cfg = helpers.micro_config(**{"outer.compression": "fp4", "outer.compression_block": 24, **over})
  with pytest.raises(ConfigError) as e:
    experiment.Experiment(cfg)
  msg = str(e.value)
  assert "\n" not in msg and "config.outer.compression_block=24 puts a block across" in msg
  assert f"split over {axes}" in msg and msg.endswith("config.outer.compression_block=16."), msg
  fit = helpers.micro_config(**{"outer.compression": "fp4", "outer.compression_block": 16, **over})
  experiment.Experiment(fit)  # The block it names is accepted.
  # An axis of one device splits nothing: block 24 pads whole rows there, as in elastic mode.
  experiment.Experiment(
    helpers.micro_config(**{"outer.compression": "fp4", "outer.compression_block": 24})
  )


BASE = {
  "model.vocab_size": 8192,
  "model.num_layers": 1,
  "dipaco.level_groups": ("embed,head", "block_0"),
  "dipaco.modules_per_level": (1, 2),
  "dipaco.replicas": 2,
  "dipaco.outer_steps": 2,
  "early_stopping.enabled": False,
  "eval.every_steps": 2,
  "outer.compression": "int8",
}


# d_model 30, 3 heads of 10: no dim of block_0's attention projections or norm scales
# divides path=4, so those K=2 leaves stay replicated over 'path' (as dipaco_16x16's
# attention projections on path=256): their codes are dealt by rows, summed per module.
NO_DIM_DIVIDES = {"model.d_model": 30, "model.num_heads": 3, "model.head_dim": 10}


@pytest.mark.parametrize("model", [{}, NO_DIM_DIVIDES], ids=["split", "no_dim_divides"])
def test_the_spmd_step_sends_what_the_workers_encode(tmp_path, model):
  """The sharded program's pseudo-gradient is the α-average of the decoded codes (every layout).

  A micro grid on 4 devices: the shared embedding and block_0's two modules on an inner dim
  of 'path' (codes cut along it); or, where no dim divides (d_model 30), block_0's K=2
  attention and norm leaves and the head's K=1 norm replicated (codes dealt by rows).
  """
  cfg = helpers.micro_config(**{**BASE, **model, "data.shard_dir": str(tmp_path)})
  exp = experiment.Experiment(cfg)
  r = exp.recipe
  replicated = lambda g: [
    "path" not in sharding.spec_axes(x.spec) for x in jax.tree.leaves(exp.state_sharding.store[g])
  ]
  assert any(replicated("block_0")) == any(replicated("head")) == bool(model)
  assert not any(replicated("embed"))  # K = 1, split on an inner dim when compressed.
  state = exp.init_state(0)
  moved = jax.tree.map(
    lambda x: x + 1e-3 * jax.random.normal(jax.random.key(3), x.shape, x.dtype), state.params
  )
  ef = jax.tree.map(lambda x: 1e-5 * jnp.ones(x.shape, jnp.float32), state.params)
  start = exp.start_params(state.store)
  alpha = jnp.ones(4, jnp.float32)
  store0, moved, ef = jax.device_get((state.store, moved, ef))  # The step donates its inputs.
  put = lambda t: jax.device_put(t, exp.state_sharding.params)
  store, _, params, _, ef_new = exp.outer_step(
    state.store, state.outer_opt, put(moved), alpha, put(ef), start
  )
  store, params = jax.device_get((store, params))
  for s in r.topo.store_groups():
    for path, x_K in jax.tree_util.tree_flatten_with_path(store0[s.name])[0]:
      get = lambda t, g=s.name: jax.tree_util.tree_flatten_with_path(t[g])[0]
      x_W = dict(get(moved))[path]
      e_W = dict(get(ef))[path]
      d_W = x_K[s.module_of_worker].astype(np.float32) - x_W + e_W
      sent = np.asarray(comp.roundtrip(comp.as_rows(d_W), "int8", 64)).reshape(d_W.shape)
      np.testing.assert_allclose(dict(get(jax.device_get(ef_new)))[path], d_W - sent, atol=1e-7)
      w, _, _ = outer.weights(s, alpha, r.outer_cfg)
      g = np.einsum("kw,w...->k...", np.asarray(w), sent)
      # Nesterov from zero momentum: θ − lr (1 + μ) g; the update comes back coded too.
      u = comp.as_rows(-0.7 * 1.9 * g)
      want = x_K + np.asarray(comp.roundtrip(u, "int8", 64)).reshape(x_K.shape)
      # The program's g and this one differ by float32 ulps, which can move a value at a
      # code's halfway point to the neighbouring code: at most 1 in 1000, one code step off.
      got = dict(get(store))[path]
      off = np.abs(got - want) > 1e-6
      assert off.sum() <= max(1, off.size // 1000), off.sum()
      step = np.max(np.abs(u)) / 127
      np.testing.assert_allclose(got, want, atol=step * 1.01)
      # Every worker holds its module's rebuilt params, the store's bytes.
      np.testing.assert_array_equal(
        dict(get(params))[path], dict(get(store))[path][s.module_of_worker]
      )


@pytest.mark.slow  # ~40 s: three spmd runs of a micro grid.
def test_a_resumed_run_restores_error_feedback_bit_exactly(tmp_path):
  """Stopped after phase 1 of 2 and resumed, a run ends where an uninterrupted one does."""
  shards = str(tmp_path / "shards")
  cfg = lambda **kw: helpers.micro_config(**{**BASE, "data.shard_dir": shards, **kw})
  train.train_and_evaluate(cfg(), str(tmp_path / "whole"))
  train.train_and_evaluate(cfg(stop_at_step=2), str(tmp_path / "cut"))
  mid = checkpoint.restore_numpy(str(tmp_path / "cut"))
  assert any(np.any(x != 0) for x in jax.tree.leaves(mid["ef"]))
  train.train_and_evaluate(cfg(), str(tmp_path / "cut"))
  a = checkpoint.restore_numpy(str(tmp_path / "whole"))
  b = checkpoint.restore_numpy(str(tmp_path / "cut"))
  for k in ("store", "outer_opt", "params", "inner_opt", "ef"):
    for x, y in zip(jax.tree.leaves(a[k]), jax.tree.leaves(b[k]), strict=True):
      np.testing.assert_array_equal(x, y, err_msg=k)


def test_a_run_without_compression_keeps_its_state_layout():
  cfg = helpers.micro_config()
  r = recipe_lib.Recipe.from_config(cfg)
  state = jax.eval_shape(r.init_state, jax.random.key(0), None)
  assert type(state) is recipe_lib.TrainState and recipe_lib.error_feedback(state) is None
  cfg = helpers.micro_config(**{"outer.compression": "fp4"})
  state = jax.eval_shape(recipe_lib.Recipe.from_config(cfg).init_state, jax.random.key(0), None)
  assert type(state) is recipe_lib.TrainStateEF
  cfg = helpers.micro_config(**{"outer.compression": "fp4", "outer.error_feedback": False})
  state = jax.eval_shape(recipe_lib.Recipe.from_config(cfg).init_state, jax.random.key(0), None)
  assert type(state) is recipe_lib.TrainState


@pytest.mark.slow  # ~20 s (more under load): an elastic phase and an executor step compile.
def test_an_elastic_worker_reads_the_coded_update_and_rebuilds_the_version(tmp_path):
  """Phase 1 of a worker that ran phase 0: it reads u1 (codes), not v1, and holds v1's bytes.

  The link hooks see those bytes; a worker without v0 (a new actor) reads v1 whole.
  """
  cfg = helpers.micro_config(
    **{
      **BASE,
      "data.shard_dir": str(tmp_path / "shards"),
      "dipaco.mode": "elastic",
      "outer.compression": "fp4",
      "dipaco.replicas": 1,
      "dipaco.modules_per_level": (1, 1),
    }
  )
  wd = str(tmp_path / "run")
  grid = grid_lib.Grid(cfg)
  _, _, alpha = driver._prepare(cfg, wd, grid)  # pylint: disable=protected-access
  w = worker_lib.PathWorker(cfg, wd, 0)
  w.run(0, 0)
  exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], alpha).report(0, 0)
  held, _ = w._receive(1, 0)  # pylint: disable=protected-access
  groups = [g for g, _ in grid.modules_of_worker(0)]
  u = sum(storage.size(storage.module_file(wd, g, 0, 1, "u")) for g in groups)
  v = sum(storage.size(storage.module_file(wd, g, 0, 1)) for g in groups)
  got = worker_lib.PathWorker(cfg, wd, 1)._receive(1, 0)  # pylint: disable=protected-access
  assert got[1] == v and u < v / 5  # A new actor reads v1 whole; fp4's update is ~1/7 of it.
  for x, y in zip(jax.tree.leaves(held), jax.tree.leaves(got[0]), strict=True):
    np.testing.assert_array_equal(x, y)  # The rebuilt version is v1's bytes.
  link = downlink.Downlink(grid, wd, w._rebuild)  # pylint: disable=protected-access
  assert sum(link.module(g, 0, 0)[1] for g in groups) == v  # It holds v0 (read whole)...
  w._link = link  # pylint: disable=protected-access
  assert w._receive(1, 0)[1] == u  # pylint: disable=protected-access  # ... so reads u1 only.
