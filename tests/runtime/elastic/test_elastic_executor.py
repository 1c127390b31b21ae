"""Elastic outer executors: the result whatever the order of arrival, restarts, quorum."""
# pylint: disable=invalid-name

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax.core import paths
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage

import helpers
import outer_oracle

# ---- Outer executors: order of arrival, restarts, the outer.py math. ----


def _random_phase(workdir, grid, rng):
  """Version 0 of every module (+ zero momentum) and random phase-0 outputs of every worker."""
  store = {}
  for s in grid.groups:
    t = grid.module_template(s.name)
    mods = [
      jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), t)
      for _ in range(s.num_modules)
    ]
    for e, m in enumerate(mods):
      storage.save_tree(storage.module_file(workdir, s.name, e, 0), m)
      storage.save_tree(
        storage.module_file(workdir, s.name, e, 0, "opt"),
        jax.tree.map(np.zeros_like, grid.recipe.outer_tx.init(m)),
      )
    store[s.name] = jax.tree.map(lambda *xs: np.concatenate(xs), *[m[s.name] for m in mods])
  params = paths.assemble(store, grid.topo)
  params = jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(np.float32), params)
  start = paths.assemble(store, grid.topo)  # What each worker started from: its modules.
  for w in range(grid.W):
    for s in grid.groups:
      delta = jax.tree.map(lambda a, b, w=w: a[w : w + 1] - b[w : w + 1], start, params)
      storage.save_tree(storage.delta_file(workdir, w, 1, s.name), {s.name: delta[s.name]})
  return store, params


def _stepped(workdir, grid):
  return {
    (s.name, e): storage.module_file(workdir, s.name, e, 1).read_bytes()
    for s in grid.groups
    for e in range(s.num_modules)
  }


def test_executor_result_does_not_depend_on_arrival_order_and_matches_outer_step(tmp_path):
  cfg = helpers.elastic_config()
  grid = grid_lib.Grid(cfg)
  alpha = [1.0, 0.5, 0.25, 0.75]
  base = str(tmp_path / "base")
  store, params = _random_phase(base, grid, np.random.default_rng(0))
  results = []
  for n, order in enumerate([(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]):
    wd = str(tmp_path / f"order{n}")
    shutil.copytree(base, wd)
    owned = exec_lib.assign_groups([s.name for s in grid.groups], 2)
    exs = [exec_lib.OuterExecutor(cfg, wd, j, owned[j], alpha) for j in range(2)]
    for w in order:
      for ex in exs:
        ex.report(0, w)
    assert sorted(sum((ex.report(0, order[-1])[0] for ex in exs), [])) == sorted(
      grid_lib.module_key(g, e) for g, e in grid.used_modules()
    )
    results.append(_stepped(wd, grid))
  assert results[0] == results[1] == results[2]  # Bytes: the sum is taken in worker order.
  # The same math as the synchronous outer step over all workers at once.
  full, _, _, _ = outer_oracle.outer_step(
    store,
    grid.recipe.outer_tx.init(store),
    params,
    jnp.asarray(alpha, jnp.float32),
    topo=grid.topo,
    cfg=grid.recipe.outer_cfg,
  )
  wd = str(tmp_path / "order0")
  for s in grid.groups:
    for e in range(s.num_modules):
      got = storage.load_tree(storage.module_file(wd, s.name, e, 1), grid.module_template(s.name))
      for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(full[s.name])):
        # One device sums in worker order; the [K, W] einsum may associate differently.
        np.testing.assert_allclose(x[0], np.asarray(y)[e], rtol=0, atol=1e-6)


def test_streamed_units_step_their_fragment_in_order_whatever_arrives_first(tmp_path):
  # outer.fragments = 2 on the micro grid: embed (1 MiB) is fragment 0, head and the blocks
  # fragment 1; unit 0 syncs embed, unit 1 the others (fragments.py).
  cfg = helpers.elastic_config(**{"outer.fragments": 2})
  grid = grid_lib.Grid(cfg)
  assert grid.sched.synced(0) == {"embed"} and "embed" not in grid.sched.synced(1)
  base = str(tmp_path / "base")
  _random_phase(base, grid, np.random.default_rng(0))  # Deltas of unit 0 (out1) for all groups.
  for w in range(grid.W):  # Unit 1's deltas of the groups it sends: unit 0's again (any will do).
    for g in grid.sched.synced(1):
      storage.delta_file(base, w, 2, g).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(storage.delta_file(base, w, 1, g), storage.delta_file(base, w, 2, g))
  runs, keys = [], sorted(grid_lib.module_key(g, e) for g, e in grid.used_modules())
  for name, order in (("in_order", (0, 1)), ("unit_1_first", (1, 0))):
    wd = str(tmp_path / name)
    shutil.copytree(base, wd)
    ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], [1.0] * grid.W)
    out = [ex.report(unit, w) for unit in order for w in range(grid.W)]
    if order == (1, 0):  # Unit 1 complete first: nothing steps before unit 0 has.
      assert all(not any(d.values()) for d in out[: grid.W]), out[: grid.W]
    stepped = {t: sorted({k for d in out for k in d.get(t, ())}) for t in (0, 1, 2)}
    assert stepped == {0: keys, 1: keys, 2: []}, stepped  # Every module, once a unit.
    # Embed's version 1 (its step after unit 0), the others' version 2 (after unit 1); no more.
    files = {}
    for g, e in grid.used_modules():
      want = 1 if g == "embed" else 2
      for v in (1, 2):
        f = storage.module_file(wd, g, e, v)
        assert f.exists() == (v == want), (name, g, e, v)
      files[(g, e)] = storage.module_file(wd, g, e, want).read_bytes()
    runs.append(files)
  assert runs[0] == runs[1]


def test_executor_restarted_mid_phase_applies_every_delta_once(tmp_path):
  cfg = helpers.elastic_config()
  grid = grid_lib.Grid(cfg)
  alpha = [1.0, 1.0, 1.0, 1.0]
  ref = str(tmp_path / "ref")
  _random_phase(ref, grid, np.random.default_rng(1))
  wd = str(tmp_path / "killed")
  shutil.copytree(ref, wd)
  groups = [s.name for s in grid.groups]
  one = exec_lib.OuterExecutor(cfg, ref, 0, groups, alpha)
  for w in range(4):
    one.report(0, w)
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, alpha)
  ex.report(0, 0)
  ex.report(0, 2)  # No module has all its workers yet: only recorded.
  del ex  # Killed: memory lost; its snapshot stays.
  again = exec_lib.OuterExecutor(cfg, wd, 0, groups, alpha)
  assert again.received[0] == {0, 2}
  for w in (1, 2, 3, 1, 0):  # Duplicates included: each worker counts once.
    again.report(0, w)
  assert _stepped(wd, grid) == _stepped(ref, grid)


def test_executor_forgets_settled_phases_and_still_answers_for_them(tmp_path):
  cfg = helpers.elastic_config(**{"dipaco.outer_steps": 4})
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  _random_phase(wd, grid, np.random.default_rng(2))
  for t in (1, 2):
    _constant_phase(wd, grid, t, {w: 0.5 * w for w in range(4)})
  groups = [s.name for s in grid.groups]
  everything = sorted(grid_lib.module_key(g, e) for g, e in grid.used_modules())
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)
  for t in range(3):
    for w in range(4):
      ex.report(t, w)
  # Phases 0, 1, 2 complete: 0 and 1 settled (their next phase is complete too), 2 kept.
  snap = storage.load_json(exec_lib.snapshot_file(wd, 0))
  assert snap["settled"] == 2 and set(snap["received"]) == {"2"}
  assert {t for t, keys in snap["applied"].items() if keys} == {"2"}
  written = {
    p: p.read_bytes() for p in (storage.root(wd) / "store").glob("*/*/*.npz")
  }  # Versions 0..3 of every module and momentum.
  assert len(written) == 2 * 4 * len(everything)
  again = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)  # Restarted from the snapshot.
  assert again.report(0, 1) == {0: everything, 1: everything}  # A re-report: all stepped.
  assert again.report(2, 3) == {2: everything, 3: []}
  assert again.received == {2: {0, 1, 2, 3}}
  assert {p: p.read_bytes() for p in written} == written  # Nothing stepped again.


def _constant_phase(workdir, grid, phase: int, values) -> None:
  """Worker w's phase-`phase` outputs if its params ended at values[w] in every leaf.

  Its delta of each group: the module version `phase` it started from (one value, read
  here; NaN where that version does not exist yet) minus values[w].
  """
  for w, v in values.items():
    for s, (g, e) in zip(grid.groups, grid.modules_of_worker(w)):
      exists = storage.module_file(workdir, g, e, phase).exists()
      theta = _value(workdir, grid, g, e, phase) if exists else np.nan
      t = grid.module_template(s.name)
      storage.save_tree(
        storage.delta_file(workdir, w, phase + 1, s.name),
        jax.tree.map(lambda x, d=theta - v: np.full(x.shape, d, x.dtype), t),
      )


def _value(workdir, grid, group, module, version) -> float:
  """The one value every leaf of a module version holds (checked)."""
  tree = storage.load_tree(
    storage.module_file(workdir, group, module, version), grid.module_template(group)
  )
  vals = np.unique(np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]))
  assert len(vals) == 1, vals
  return float(vals[0])


@pytest.mark.parametrize("late", ["next", "drop"])
def test_quorum_steps_without_the_slow_worker_and_handles_its_late_delta(tmp_path, late):
  # Plain averaging (outer lr 1, no momentum, no √P): θ_{t+1} = θ_t − mean_w(θ_t − p_w).
  cfg = helpers.elastic_config(
    **{
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
      "outer.sqrt_paths": "none",
      "dipaco.outer_steps": 3,
      "elastic.quorum": 0.5,
      "elastic.late_deltas": late,
    }
  )
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  for s in grid.groups:  # Version 0 of every module: zeros.
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), grid.module_template(s.name))
      storage.save_tree(storage.module_file(wd, s.name, e, 0), m)
      storage.save_tree(storage.module_file(wd, s.name, e, 0, "opt"), grid.recipe.outer_tx.init(m))
  _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
  groups = [s.name for s in grid.groups]
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)
  # Phase 0: embed (all 4 workers, α 1 each) needs 2 reports; block_0/0 (workers 0, 1) needs 1.
  assert ex.report(0, 0)[0] == ["block_0/0", "block_1/0"]
  assert "embed/0" in ex.report(0, 1)[0]  # Stepped with workers 0 and 1.
  ex.report(0, 2)
  ex.report(0, 3)  # Late for embed; workers 2, 3 (and 1 for block_0/0) missed their steps.
  assert _value(wd, grid, "embed", 0, 1) == (1.0 + 2.0) / 2  # Not 2.5: no slow worker in it.
  assert _value(wd, grid, "block_0", 0, 1) == 1.0  # Worker 0 alone.
  ex = exec_lib.OuterExecutor(cfg, wd, 0, groups, [1.0] * 4)  # Restart: state from the snapshot.
  assert ex.used[0]["embed/0"] == [0, 1]
  ex.report(0, 3)  # A duplicate: no effect.
  _constant_phase(wd, grid, 1, {0: 2.5, 1: 3.5})  # From the versions phase 0 made.
  # Phase 1: workers 0 (2.5) and 1 (3.5) report; θ1 = 1.5 for embed, 1.0 for block_0/0.
  ex.report(1, 0)
  assert ex.report(1, 1)[1] == ["block_0/0", "block_1/0", "block_1/1", "embed/0", "head/0"]
  if late == "next":
    # The late phase-0 deltas (θ0 − p = −3, −4) join: Δ = mean(−1, −2, −3, −4) = −2.5.
    assert _value(wd, grid, "embed", 0, 2) == 1.5 + 2.5
    # block_0/0: on time 1 − 2.5 = −1.5; late worker 1: 0 − 2 = −2 -> Δ = −1.75.
    assert _value(wd, grid, "block_0", 0, 2) == 1.0 + 1.75
  else:  # Dropped: Δ = mean(−1, −2) = −1.5; block_0/0: −1.5.
    assert _value(wd, grid, "embed", 0, 2) == 1.5 + 1.5
    assert _value(wd, grid, "block_0", 0, 2) == 1.0 + 1.5
  _constant_phase(wd, grid, 2, {0: 9.0})
  # The last step (phase 2): in "next" mode it waits for every report (no later step). In
  # "drop" mode block_0/0 steps with worker 0; block_1/0 (workers 0, 2) waits for worker 2's
  # phase-1 report first (staleness is bounded to one phase).
  stepped = ex.report(2, 0)[2]
  assert stepped == ([] if late == "next" else ["block_0/0"])


def test_quorum_grace_window_runs_from_the_quorum(tmp_path, monkeypatch):
  cfg = helpers.elastic_config(
    **{
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
      "outer.sqrt_paths": "none",
      "elastic.quorum": 0.5,
      "elastic.grace_s": 10.0,
    }
  )
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  for s in grid.groups:
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), grid.module_template(s.name))
      storage.save_tree(storage.module_file(wd, s.name, e, 0), m)
      storage.save_tree(storage.module_file(wd, s.name, e, 0, "opt"), grid.recipe.outer_tx.init(m))
  _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
  clock = [100.0]
  monkeypatch.setattr(exec_lib.time, "time", lambda: clock[0])
  ex = exec_lib.OuterExecutor(cfg, wd, 0, ["embed"], [1.0] * 4)
  ex.report(0, 0)
  assert ex.report(0, 1) == {0: [], 1: []}  # Quorum at t=100; the window runs to t=110.
  clock[0] = 105.0
  assert ex.poll() == ({}, True)
  clock[0] = 106.0
  ex.report(0, 2)  # Joins within the window (3 of 4: still not all).
  clock[0] = 110.0
  assert ex.poll() == ({0: ["embed/0"]}, False)
  assert _value(wd, grid, "embed", 0, 1) == (1.0 + 2.0 + 3.0) / 3


# ---- Work in proportion to speed and late work (docs/elastic.md): the weights by hand. ----


def _zero_store(workdir, grid) -> None:
  """Version 0 of every module, and its momentum: zeros."""
  for s in grid.groups:
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), grid.module_template(s.name))
      storage.save_tree(storage.module_file(workdir, s.name, e, 0), m)
      storage.save_tree(
        storage.module_file(workdir, s.name, e, 0, "opt"), grid.recipe.outer_tx.init(m)
      )


def _trained(workdir, phase: int, steps) -> None:
  """Task (phase, w)'s done.json as if it ran steps[w] inner steps (what token_weights reads)."""
  for w, n in steps.items():
    done = storage.worker_out_dir(workdir, w, phase + 1) / "done.json"
    storage.save_json(done, {"phase": phase, "worker": w, "loss": [1.0] * n})


def test_token_weights_scale_alpha_by_the_share_of_h_each_worker_trained(tmp_path):
  # Plain averaging (outer lr 1, no momentum, no √P): θ1 = Σ w_n p_n / Σ w_n from a zero
  # store (Δ_n = 0 − p_n), w_n = α_n · s_n / H (core/contribution.py). H = 4; the workers
  # ended at p = 1, 2, 3, 4 after s = 4, 4, 2, 1 steps with α = 1, 1, 2, 4:
  #   w = 1·4/4, 1·4/4, 2·2/4, 4·1/4 = 1, 1, 1, 1.
  # embed/0 (all four): (1 + 2 + 3 + 4) / 4 = 2.5 (α alone: (1 + 2 + 6 + 16) / 8 = 3.125).
  # block_0/1 (workers 2, 3): (3 + 4) / 2 = 3.5 (α alone: (6 + 16) / 6 = 3.67).
  # block_1/0 (workers 0, 2): (1 + 3) / 2 = 2.0 (α alone: (1 + 6) / 3 = 2.33).
  over = {
    "outer.lr": 1.0,
    "outer.momentum": 0.0,
    "outer.sqrt_paths": "none",
    "dipaco.inner_steps": 4,
    "eval.every_steps": 4,
  }
  got = {}
  for on in (True, False):
    cfg = helpers.elastic_config(**over, **{"elastic.token_weights": on})
    grid = grid_lib.Grid(cfg)
    wd = str(tmp_path / str(on))
    _zero_store(wd, grid)
    _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
    _trained(wd, 0, {0: 4, 1: 4, 2: 2, 3: 1})
    ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], [1.0, 1.0, 2.0, 4.0])
    for w in range(4):
      ex.report(0, w)
    got[on] = [_value(wd, grid, g, e, 1) for g, e in (("embed", 0), ("block_0", 1), ("block_1", 0))]
  assert got[True] == [2.5, 3.5, 2.0]
  np.testing.assert_allclose(got[False], [3.125, 22 / 6, 7 / 3], rtol=1e-6)


def test_token_weights_with_equal_steps_change_no_bit(tmp_path):
  # Every task trained H steps: each factor s/H is exactly 1, so α keeps its float32 bits.
  alpha = [1.0, 0.5, 0.25, 0.75]
  base = str(tmp_path / "base")
  grid = grid_lib.Grid(helpers.elastic_config())
  _random_phase(base, grid, np.random.default_rng(3))
  _trained(base, 0, {w: grid.H for w in range(4)})
  out = {}
  for on in (False, True):
    cfg = helpers.elastic_config(**{"elastic.token_weights": on})
    wd = str(tmp_path / str(on))
    shutil.copytree(base, wd)
    ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], alpha)
    for w in range(4):
      ex.report(0, w)
    out[on] = _stepped(wd, grid)
  assert out[True] == out[False]


@pytest.mark.parametrize("discount", [0.5, 1.0])
def test_discounted_late_deltas_join_the_next_step_at_discount_per_phase_late(tmp_path, discount):
  # As test_quorum_steps_without_the_slow_worker_and_handles_its_late_delta, "next" with the
  # late deltas' weights × γ (one phase late). Phase 0 (quorum 0.5): embed/0 steps with
  # workers 0, 1 (θ1 = 1.5), block_0/0 with worker 0 (θ1 = 1.0). Phase 1: on time, workers 0
  # (2.5) and 1 (3.5): Δ = 1.5 − 2.5 = −1, 1.5 − 3.5 = −2 (weight 1); late from phase 0,
  # θ0 − p = −3, −4 (weight γ):
  #   embed/0: Δ = (−1 − 2 − 3γ − 4γ) / (2 + 2γ); γ = 0.5: −6.5 / 3 = −13/6, θ2 = 1.5 + 13/6.
  #   block_0/0: on time 1.0 − 2.5 = −1.5; late worker 1: 0 − 2 = −2:
  #     Δ = (−1.5 − 2γ) / (1 + γ); γ = 0.5: −2.5 / 1.5 = −5/3, θ2 = 1.0 + 5/3.
  # γ = 1 is "next": 1.5 + 2.5 = 4.0 and 1.0 + 1.75 = 2.75, bit for bit.
  cfg = helpers.elastic_config(
    **{
      "outer.lr": 1.0,
      "outer.momentum": 0.0,
      "outer.sqrt_paths": "none",
      "dipaco.outer_steps": 3,
      "elastic.quorum": 0.5,
      "elastic.late_deltas": "discount",
      "elastic.late_discount": discount,
    }
  )
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  _zero_store(wd, grid)
  _constant_phase(wd, grid, 0, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})
  ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], [1.0] * 4)
  for w in range(4):
    ex.report(0, w)
  assert _value(wd, grid, "embed", 0, 1) == 1.5 and _value(wd, grid, "block_0", 0, 1) == 1.0
  _constant_phase(wd, grid, 1, {0: 2.5, 1: 3.5})
  ex.report(1, 0)
  ex.report(1, 1)
  embed, block = _value(wd, grid, "embed", 0, 2), _value(wd, grid, "block_0", 0, 2)
  if discount == 1.0:
    assert (embed, block) == (4.0, 2.75)
  else:
    np.testing.assert_allclose([embed, block], [1.5 + 13 / 6, 1.0 + 5 / 3], rtol=1e-6)
  assert ex.carried[1]["embed/0"] == [2, 3]
  # The last step (phase 2) waits for every report, as "next" does.
  _constant_phase(wd, grid, 2, {0: 9.0})
  assert ex.report(2, 0)[2] == []
