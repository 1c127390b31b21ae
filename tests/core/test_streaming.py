"""Streamed outer sync (outer.fragments, outer.overlap): the schedule, the split, the runs."""

import os
import shutil
import sys

import jax
import numpy as np
import pytest

from dipaco_jax import config_check
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.core import streaming
from dipaco_jax.errors import ConfigError
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import shard_plan
from dipaco_jax.runtime.elastic import errors as elastic_errors
from dipaco_jax.runtime.elastic import fragments
from dipaco_jax.runtime.elastic import grid as grid_lib

import helpers

sys.path.insert(0, os.path.join(helpers.ROOT, "benchmarks"))
import stream_link  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

# Store groups embed [1, 8192, 32] (1 MiB), block_0 [2, ...] (76 KiB), head [1, 32]: the split
# for F = 2 is (embed,) and (block_0, head). H = 2, T = 2: fragment 0 syncs after the odd
# steps, fragment 1 after the even ones.
BASE = {
  "model.vocab_size": 8192,
  "model.num_layers": 1,
  "dipaco.level_groups": ("embed,head", "block_0"),
  "dipaco.modules_per_level": (1, 2),
  "dipaco.replicas": 2,
  "dipaco.outer_steps": 2,
  "early_stopping.enabled": False,
  "eval.every_steps": 2,
  "ckpt.every_steps": 1,
  "ckpt.max_to_keep": 10,
  "inner.warmup_steps": 0,  # Step 1 moves the params (a warmup from 0 would not).
}


def test_the_schedule_by_hand():
  # H = 10, F = 4: o_f = (f + 1) * 10 // 4 mod 10 = 2, 5, 7, 0.
  assert [streaming.offset(f, 4, 10) for f in range(4)] == [2, 5, 7, 0]
  assert streaming.due(2, 4, 10) == [0] and streaming.due(12, 4, 10) == [0]
  assert streaming.due(10, 4, 10) == [3] and streaming.due(20, 4, 10) == [3]
  assert streaming.due(3, 4, 10) == [] and streaming.due(17, 4, 10) == [2]
  # τ = 1: the exchange dispatched after step 2 lands after step 3; none lands after step 4.
  assert streaming.lands(3, 4, 10, 1) and not streaming.lands(4, 4, 10, 1)
  assert not streaming.lands(3, 4, 10, 0)
  # F = 1 is the plain outer step: every group after each multiple of H.
  assert streaming.due(10, 1, 10) == [0] and streaming.due(5, 1, 10) == []


def test_the_split_by_hand():
  f32 = lambda n: jax.ShapeDtypeStruct((n,), np.float32)
  store = {"a": {"w": f32(100)}, "b": {"w": f32(60), "v": f32(0)}, "c": f32(50), "d": f32(10)}
  # Largest first to the lightest: a -> 0 (100); b -> 1 (60); c -> 1 (110); d -> 0 (110).
  assert streaming.split(store, 2) == (("a", "d"), ("b", "c"))
  assert streaming.split(store, 1) == (("a", "b", "c", "d"),)
  # Bytes, not element counts: x (bfloat16) is 200 bytes, y 240, z 180: y -> 0; x -> 1;
  # z -> 1 (200 < 240). Counting elements would have put x (100) first.
  store = {"x": jax.ShapeDtypeStruct((100,), jax.numpy.bfloat16), "y": f32(60), "z": f32(45)}
  assert streaming.split(store, 2) == (("y",), ("x", "z"))


@pytest.mark.parametrize(
  "over, words",
  [
    ({"outer.fragments": 4}, "exceeds the 3 groups of the store"),
    ({"outer.fragments": 3}, "exceeds dipaco.inner_steps=2"),
    ({"outer.overlap": 2}, "give at most 1"),
    ({"outer.fragments": 2, "outer.overlap": 1}, "give at most 0"),
    ({"outer.enabled": False, "outer.overlap": 1}, "no outer exchange to stream"),
  ],
)
def test_a_schedule_that_cannot_run_is_one_line(over, words):
  # Both runtimes, before anything starts: the config's load and check, the spmd program's
  # build and the elastic driver's first step (its Grid).
  for mode in ("spmd", "elastic"):
    with pytest.raises(ConfigError) as e:
      helpers.micro_config(**{**BASE, **over, "dipaco.mode": mode})
    assert words in str(e.value) and "\n" not in str(e.value), (mode, e.value)
    cfg = helpers.micro_config(**{**BASE, "dipaco.mode": mode})
    for key, value in over.items():  # Set past the load's check.
      section, field = key.split(".")
      cfg[section][field] = value
    build = experiment.Experiment if mode == "spmd" else grid_lib.Grid
    for check in (config_check.validate, build):
      with pytest.raises(ConfigError) as e:
        check(cfg)
      assert words in str(e.value) and "\n" not in str(e.value), (mode, e.value)


@pytest.mark.parametrize(
  "over, field",
  [
    ({"elastic.quorum": 0.5}, "elastic.quorum=0.5"),
    ({"elastic.progress_every_steps": 1}, "elastic.progress_every_steps=1"),
    ({"routing.discriminative_at_outer_step": 1}, "routing.discriminative_at_outer_step=1"),
    ({"elastic.pace_steps": True}, "elastic.pace_steps=True"),
    ({"elastic.token_weights": True}, "token_weights=True"),
  ],
)
def test_the_elastic_mode_refuses_what_a_streamed_unit_cannot_join_in_one_line(over, field):
  for stream in ({"outer.fragments": 2}, {"outer.overlap": 1}, {}):
    cfg = helpers.micro_config(**{**BASE, **stream, "dipaco.mode": "spmd"})
    cfg.dipaco.mode = "elastic"  # Past the load's check, which refuses it already.
    for key, value in over.items():
      section, name = key.split(".")
      cfg[section][name] = value
    if not stream:  # The field alone runs in elastic mode.
      elastic_errors.check_config(cfg)
      continue
    with pytest.raises(elastic_errors.ElasticConfigError) as e:
      elastic_errors.check_config(cfg)
    assert field in str(e.value) and "\n" not in str(e.value), e.value


def test_the_elastic_units_by_hand():
  # H = 10, F = 4 (offsets 2, 5, 7), T = 2, groups a, b (fragment 0) and c (fragment 3).
  f = lambda tau: fragments.Schedule(
    10, 2, offsets=(2, 5, 7), tau=tau, fragment_of=(("a", 0), ("b", 0), ("c", 3))
  )
  s = f(0)
  # Units end at the syncs: steps 0-2, 2-5, 5-7, 7-10, then 10-12, ..., 17-20: U = 8.
  assert s.U == 8 and [s.span(u) for u in (0, 1, 3, 4, 7)] == [
    (0, 2),
    (2, 5),
    (7, 10),
    (10, 12),
    (17, 20),
  ]
  # Unit 0 sends fragment 0 (a, b), unit 3 fragment 3 (c), units 1-2 no group of this store;
  # the last unit every group (the flush).
  assert s.synced(0) == {"a", "b"} and s.synced(1) == set() and s.synced(3) == {"c"}
  assert s.synced(4) == {"a", "b"} and s.synced(7) == {"a", "b", "c"}
  # Unit 1 starts from a, b's new version (1: the step after unit 0), c from the worker's own.
  assert s.fresh(1) == {"a", "b"} and s.fresh(2) == set() and s.fresh(0) == {"a", "b", "c"}
  assert s.stored(1, "a") == 1 and s.stored(1, "c") == 0 and s.stored(4, "c") == 4
  # Unit 7 reads a at version 5 (unit 4's sync), unit 8 (evaluation) every group at 8.
  assert s.stored(7, "a") == 5 and s.stored(8, "a") == s.stored(8, "c") == 8
  assert [s.need(u, "a") for u in range(9)] == [0, 1, 1, 1, 1, 5, 5, 5, 8]
  # τ = 1: each sync's unit is followed by a 1-step unit, then the landing: 0-1, 1-2, 2-3, 3-5,
  # ...; unit 2 (steps 2-3) starts before fragment 0's step at unit 1's end; unit 3 lands it.
  s = f(1)
  assert s.U == 16 and [s.span(u) for u in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6)]
  assert s.synced(1) == {"a", "b"} and s.synced(2) == set() and s.synced(7) == {"c"}
  assert s.landing(3) == {"a", "b"} and s.landing(9) == {"c"} and s.landing(1) == set()
  assert s.fresh(2) == set() and s.fresh(16) == {"a", "b", "c"}
  assert [s.need(u, "a") for u in (1, 2, 3, 4)] == [0, 0, 2, 2]
  # F = 1, τ = 0: one unit a phase, every group synced after each, version t = phase t.
  s = fragments.Schedule(10, 3, fragment_of=(("a", 0),))
  assert not s.streamed and s.U == 3 and [s.need(u, "a") for u in range(4)] == [0, 1, 2, 3]


def _assembled(state, exp, group):
  """Each worker's module of `group` as the store holds it [W, ...] (numpy leaves)."""
  s = next(s for s in exp.topo.store_groups() if s.name == group)
  return jax.tree.map(lambda x: x[s.module_of_worker], state["store"][group])


def _momentum(state):
  """The outer Nesterov momentum, store-shaped (optax's trace)."""
  return jax.tree.leaves(
    state["outer_opt"], is_leaf=lambda x: isinstance(x, dict) and "trace" in x
  )[0]["trace"]


def _equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow  # ~30 s: two spmd runs of a micro grid.
def test_fragments_sync_at_their_own_steps_and_the_last_step_flushes(tmp_path):
  shards = str(tmp_path / "shards")
  cfg = lambda **kw: helpers.micro_config(**{**BASE, "data.shard_dir": shards, **kw})
  train.train_and_evaluate(cfg(**{"outer.fragments": 2}), str(tmp_path / "f2"))
  train.train_and_evaluate(cfg(stop_at_step=1), str(tmp_path / "f1"))
  exp = experiment.Experiment(cfg(**{"outer.fragments": 2}))
  assert exp.fragments == (("embed",), ("block_0", "head"))
  at = lambda s: checkpoint.restore_numpy(str(tmp_path / "f2"), s)
  plain = checkpoint.restore_numpy(str(tmp_path / "f1"), 1)  # No sync yet at step 1 (H = 2).
  s1, s2, s4 = at(1), at(2), at(4)
  # Step 1: fragment 0 (embed) synced; fragment 1's store and momentum untouched, and its
  # workers' params the same local progress as the plain run's.
  assert not _equal(s1["store"]["embed"], plain["store"]["embed"])
  assert _equal(s1["params"]["embed"], _assembled(s1, exp, "embed"))
  for g in ("block_0", "head"):
    assert _equal(s1["store"][g], plain["store"][g]), g
    assert _equal(s1["params"][g], plain["params"][g]), g
    assert all(not np.any(x) for x in jax.tree.leaves(_momentum(s1)[g])), g
  assert any(np.any(x) for x in jax.tree.leaves(_momentum(s1)["embed"]))
  # Step 2: fragment 1 synced; embed trained on locally since step 1 (not the store's).
  for g in ("block_0", "head"):
    assert not _equal(s2["store"][g], s1["store"][g]), g
    assert _equal(s2["params"][g], _assembled(s2, exp, g)), g
  assert _equal(s2["store"]["embed"], s1["store"]["embed"])
  assert not _equal(s2["params"]["embed"], _assembled(s2, exp, "embed"))
  # The last step (4 = H T): fragment 1 due, fragment 0 flushed: every worker holds the store's.
  for g in ("embed", "block_0", "head"):
    assert not _equal(s4["store"][g], at(3)["store"][g]), g
    assert _equal(s4["params"][g], _assembled(s4, exp, g)), g


@pytest.mark.slow  # ~40 s: three spmd runs of a micro grid and one inner step.
def test_an_update_in_flight_lands_tau_steps_late_and_resumes_bit_exactly(tmp_path):
  """τ = 1: the update of step 2's deltas lands after step 3, on top of step 3's own change."""
  shards = str(tmp_path / "shards")
  cfg = lambda **kw: helpers.micro_config(
    **{**BASE, "data.shard_dir": shards, "outer.overlap": 1, **kw}
  )
  cut, whole = str(tmp_path / "cut"), str(tmp_path / "whole")
  train.train_and_evaluate(cfg(stop_at_step=2), cut)
  train.train_and_evaluate(cfg(**{"outer.overlap": 0}, stop_at_step=2), str(tmp_path / "at_once"))
  s2 = checkpoint.restore_numpy(cut, 2)
  at_once = checkpoint.restore_numpy(str(tmp_path / "at_once"), 2)
  exp = experiment.Experiment(cfg())
  # Dispatched after step 2: the store is the plain run's, the workers still on their θ_2, and
  # the jump θ_new − θ_2 in flight (in the checkpoint).
  assert _equal(s2["store"], at_once["store"])
  for g in ("embed", "block_0", "head"):
    for x, j, y in zip(
      *(jax.tree.leaves(t[g]) for t in (s2["params"], s2["jump"], at_once["params"]))
    ):
      assert np.any(j != 0), g
      np.testing.assert_allclose(x + j, y, rtol=0, atol=1e-6, err_msg=g)
  # Step 3 by hand from the step-2 checkpoint: one inner step on θ_2, then the jump lands.
  saved = checkpoint.Checkpointer(cut)
  state, data_state = saved.restore(exp.abstract_state, 2)
  saved.close()
  plan = shard_plan.ShardPlan(cfg(), cut, exp)
  plan.restore(data_state)
  params, _, _ = exp.inner_step(
    state.params, state.inner_opt, exp.put_batch(plan.train_it.next_batch())
  )
  want, zeros = exp.land(params, state.jump)
  want = jax.device_get(want)
  shutil.copytree(cut, whole + "_from2")
  train.train_and_evaluate(cfg(stop_at_step=3), whole + "_from2")
  s3 = checkpoint.restore_numpy(whole + "_from2", 3)
  assert _equal(s3["params"], want)
  assert all(not np.any(x) for x in jax.tree.leaves(s3["jump"]))  # Nothing in flight.
  assert all(not np.any(x) for x in jax.tree.leaves(jax.device_get(zeros)))
  # Stopped in flight (step 2) and resumed: the same bytes as a run that never stopped.
  train.train_and_evaluate(cfg(), cut)
  train.train_and_evaluate(cfg(), whole)
  a, b = checkpoint.restore_numpy(whole), checkpoint.restore_numpy(cut)
  for k in ("store", "outer_opt", "params", "inner_opt", "jump"):
    assert _equal(a[k], b[k]), k
  # The last step: nothing left in flight, every worker on the store's modules.
  for g in ("embed", "block_0", "head"):
    assert _equal(a["params"][g], _assembled(a, exp, g)), g


def test_the_link_queues_transfers_and_counts_only_the_wait(monkeypatch):
  """benchmarks/stream_link.py's link by hand: 1 byte a second (8 bits), a fake clock."""
  clock = {"t": 0.0}
  monkeypatch.setattr(stream_link.time, "perf_counter", lambda: clock["t"])
  monkeypatch.setattr(stream_link.time, "sleep", lambda s: clock.update(t=clock["t"] + s))
  link = stream_link.Link(8.0, {"a": 3, "b": 1}, scale=1.0)
  link.sent(2, ("a",))  # 2 x 3 bytes (up and down): busy until 6.
  clock["t"] = 4.0
  link.sent(4, ("b",))  # Queued behind a: busy until 6 + 2 = 8.
  link.landed(4, [])  # Waits 8 - 4 = 4.
  clock["t"] = 9.0
  link.sent(8, ("a", "b"))  # The link is free: 9 + 8 = 17.
  clock["t"] = 20.0
  link.landed(8, [])  # Done already: no wait.
  assert link.exposed_s == 4.0 and link.busy_until == 17.0
  # Steady phases (H = 4, T = 3: phase 1 only) from the dispatches after steps 4 and 8.
  (p,) = stream_link.steady_phases(link.events, 4, 3)
  assert p == {"phase": 1, "seconds": 5.0, "exposed_s": 0.0, "share": 0.0}
