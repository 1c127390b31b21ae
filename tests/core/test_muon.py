"""inner.optimizer="muon": Muon on the blocks' matrices, AdamW on the rest, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

from dipaco_jax import errors
from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import inner
from dipaco_jax.core import model
from dipaco_jax.io import checkpoint

import helpers

NS = (3.4445, -4.7750, 2.0315)  # The quintic's coefficients (Keller Jordan's, optax's default).


def _flat(tree, is_leaf=None) -> dict:
  """'group/module/leaf' -> leaf, for every leaf of a params tree."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {"/".join(k.key for k in path): x for path, x in flat}


def test_the_blocks_kernels_go_to_muon_as_matrices_and_the_rest_to_adamw():
  cfg = helpers.model_config(
    vocab_size=64,
    d_model=8,
    num_layers=1,
    num_heads=2,
    head_dim=3,
    max_len=16,
    positions="learned",
    tie_embeddings=False,
    mlp="swiglu",
  )
  params = model.init_params(cfg, jax.random.key(0))
  dims = _flat(
    inner.muon_dims(params),
    is_leaf=lambda x: x is None or isinstance(x, contrib.MuonDimensionNumbers),
  )
  rows, cols = ((0,), (1,)), ((0,), (1, 2))  # ([in axes], [out axes]) of [D, F] and [D, H, K].
  want = {
    "block_0/attn/query/kernel": cols,  # [D, H, K] as D x (H K).
    "block_0/attn/key/kernel": cols,
    "block_0/attn/value/kernel": cols,
    "block_0/attn/out/kernel": ((0, 1), (2,)),  # [H, K, D] as (H K) x D.
    "block_0/mlp_in/kernel": rows,
    "block_0/mlp_gate/kernel": rows,
    "block_0/mlp_out/kernel": rows,
  }
  adamw = {
    "embed/token",  # 2-D, but AdamW's: the embedding and the unembedding.
    "embed/position",
    "head/unembed/kernel",
    "head/norm/scale",
    "block_0/attn_norm/scale",
    "block_0/mlp_norm/scale",
  }
  assert set(_flat(params)) == set(want) | adamw
  got = {
    k: (tuple(np.atleast_1d(d.reduction_axis)), tuple(np.atleast_1d(d.output_axis)))
    for k, d in dims.items()
    if d is not None
  }
  assert got == want and {k for k, d in dims.items() if d is None} == adamw
  # The optimizer keeps Muon's momentum for exactly those leaves, Adam's moments for the rest.
  inner_cfg = sections.InnerConfig(optimizer="muon", total_steps=10)
  state = inner.optimizer(inner_cfg).init(params)
  of = lambda cls: next(
    s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, cls)) if isinstance(s, cls)
  )
  assert set(_flat(of(contrib.MuonState).mu)) == set(want)
  assert set(_flat(of(optax.ScaleByAdamState).mu)) == adamw


def _schedule(t: int, peak: float, total: int, final: float) -> float:
  """warmup_steps = 0: cosine from the peak to final * peak over `total` steps."""
  return peak * (final + (1 - final) * 0.5 * (1 + np.cos(np.pi * min(t, total) / total)))


def _newton_schulz(g: np.ndarray) -> np.ndarray:
  """5 quintic steps on g / ‖g‖_F, on the wide orientation (as Muon)."""
  x = g.T if g.shape[0] > g.shape[1] else g
  x = x / (np.linalg.norm(x) + 1e-8)
  a, b, c = NS
  for _ in range(5):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if g.shape[0] > g.shape[1] else x


def _reference(params, grads_list, cfg, matrices):
  """The optimizer's steps in float64 numpy: global clip, then Muon or AdamW per leaf.

  matrices: leaf -> (the [in, out] matrix of an array, the inverse), for Muon's leaves.
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  beta = cfg.muon_beta
  for t, grads in enumerate(grads_list):
    g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
    norm = np.sqrt(sum((x**2).sum() for x in g.values()))
    g = {k: x * min(1.0, cfg.clip_norm / norm) for k, x in g.items()}
    n = t + 1  # The bias corrections' count.
    lr = _schedule(t, cfg.lr, cfg.total_steps, cfg.final_lr_fraction)
    muon_lr = _schedule(t, cfg.muon_lr, cfg.total_steps, cfg.final_lr_fraction)
    for k in p:
      if k in matrices:
        to_matrix, back = matrices[k]
        m[k] = beta * m[k] + (1 - beta) * g[k]
        # Nesterov, each term bias-corrected: β m_n / (1 - β^(n+1)) + (1 - β) g_n / (1 - β^n).
        nesterov = beta * m[k] / (1 - beta ** (n + 1)) + (1 - beta) * g[k] / (1 - beta**n)
        o = _newton_schulz(to_matrix(nesterov))
        o = o * np.sqrt(max(1.0, o.shape[1] / o.shape[0]))  # √(max(1, fan_out / fan_in)).
        p[k] = p[k] - muon_lr * (back(o) + cfg.weight_decay * p[k])
      else:
        m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
        v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g[k] ** 2
        mhat, vhat = m[k] / (1 - cfg.b1**n), v2[k] / (1 - cfg.b2**n)
        decay = cfg.weight_decay * p[k] if p[k].ndim > 1 else 0.0  # decay_norms=False.
        p[k] = p[k] - lr * (mhat / (np.sqrt(vhat) + cfg.eps) + decay)
  return p


def _nest(flat: dict) -> dict:
  out = {}
  for k, x in flat.items():
    *path, leaf = k.split("/")
    node = out
    for name in path:
      node = node.setdefault(name, {})
    node[leaf] = x
  return out


def test_two_steps_match_numpy_muon_and_adamw():
  d, h, k, f, v = 4, 2, 3, 8, 6
  shapes = {
    "embed/token": (v, d),  # AdamW, decayed (a matrix).
    "block_0/attn_norm/scale": (d,),  # AdamW, not decayed.
    "block_0/attn/query/kernel": (d, h, k),  # Muon on D x (H K) = 4 x 6.
    "block_0/attn/out/kernel": (h, k, d),  # Muon on (H K) x D = 6 x 4 (the tall orientation).
    "block_0/mlp_in/kernel": (d, f),  # Muon on 4 x 8: scaled by √2.
  }
  matrices = {
    "block_0/attn/query/kernel": (lambda x: x.reshape(d, h * k), lambda x: x.reshape(d, h, k)),
    "block_0/attn/out/kernel": (lambda x: x.reshape(h * k, d), lambda x: x.reshape(h, k, d)),
    "block_0/mlp_in/kernel": (lambda x: x, lambda x: x),
  }
  rng = np.random.default_rng(0)
  draw = lambda: {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
  params, grads = draw(), [draw(), draw()]
  cfg = sections.InnerConfig(
    optimizer="muon",
    lr=1e-2,
    muon_lr=0.05,
    muon_beta=0.9,
    warmup_steps=0,
    total_steps=4,
    final_lr_fraction=0.1,
    weight_decay=0.3,
    clip_norm=2.0,  # Below both gradients' norms (~8): the clip acts on both parts.
  )
  assert all(np.sqrt(sum((x**2).sum() for x in g.values())) > 4 for g in grads)
  tx = inner.optimizer(cfg)
  p = _nest({n: jnp.asarray(x) for n, x in params.items()})
  state = tx.init(p)
  for g in grads:
    updates, state = jax.jit(tx.update)(_nest(g), state, p)
    p = optax.apply_updates(p, updates)
  want = _reference(params, grads, cfg, matrices)
  got = _flat(p)
  for n in shapes:
    np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-5, err_msg=n)
    assert not np.allclose(got[n], params[n], atol=1e-3), n  # Every leaf moved.
  assert inner.schedule_step(state) == 2


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
  """A micro muon run's experiment and its state after one inner step (the spmd program)."""
  exp = experiment.Experiment(helpers.micro_config(**{"inner.optimizer": "muon"}))
  state = exp.init_state(0)
  batch = exp.put_batch(helpers.synthetic_batch(np.random.default_rng(0), 4, 2, 16, 256))
  params, opt, m = exp.inner_step(state.params, state.inner_opt, batch)
  jax.block_until_ready(m)
  assert np.all(np.isfinite(np.asarray(m["loss"])))
  return exp, state.replace(params=params, inner_opt=opt, step=state.step + 1)


def test_restart_schedule_restarts_both_parts_and_keeps_the_moments(stepped):
  _, state = stepped
  is_s = lambda x: isinstance(
    x, (optax.ScaleByScheduleState, optax.ScaleByAdamState, contrib.MuonState)
  )
  before = [x for x in jax.tree.leaves(state.inner_opt, is_leaf=is_s) if is_s(x)]
  out = inner.restart_schedule(state.inner_opt)
  after = [x for x in jax.tree.leaves(out, is_leaf=is_s) if is_s(x)]
  assert inner.schedule_step(state.inner_opt) == 1 and inner.schedule_step(out) == 0
  kinds = [type(x).__name__ for x in before]
  # AdamW's schedule and Muon's (and that of optax's muon's AdamW part, which holds no leaf).
  assert kinds.count("ScaleByScheduleState") == 3 and kinds.count("MuonState") == 1
  for b, a in zip(before, after, strict=True):
    if isinstance(b, optax.ScaleByScheduleState):
      assert np.all(np.asarray(b.count) == 1) and np.all(np.asarray(a.count) == 0)
      assert a.count.sharding == b.count.sharding
    else:  # Muon's momentum and Adam's moments, with their bias-correction counts, are kept.
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_muon_state_checkpoints_and_restores(stepped, tmp_path):
  exp, state = stepped
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  try:
    ck.save(1, state, {"train": {"position": 1}})
    restored, _ = ck.restore(exp.abstract_state)
  finally:
    ck.close()
  assert jax.tree.structure(restored.inner_opt) == jax.tree.structure(state.inner_opt)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)
  assert inner.schedule_step(restored.inner_opt) == 1


@pytest.mark.parametrize(
  "field,value,need",
  [
    ("inner.optimizer", "sgd", "one of 'adamw', 'muon'"),
    ("inner.muon_lr", -0.02, "a number > 0"),
    ("inner.muon_beta", 1.0, "a number >= 0 and < 1"),
  ],
)
def test_a_bad_muon_field_is_one_line_naming_it(field, value, need):
  with pytest.raises(errors.ConfigError) as e:
    helpers.micro_config(**{field: value})
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(
    f"config.{field}={value!r} is invalid: it must be {need}"
  )
