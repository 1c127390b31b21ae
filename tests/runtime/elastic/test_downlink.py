"""A streamed unit's downlink under outer.compression: the update's codes, the store's bytes."""
# pylint: disable=invalid-name,protected-access

import pathlib

import pytest

from dipaco_jax.runtime.elastic import downlink
from dipaco_jax.runtime.elastic import driver
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage
from dipaco_jax.runtime.elastic import worker as worker_lib

import helpers

# One path (W = 1) of the micro grid, H = 2, T = 2, fp4: groups embed,head / block_0 / block_1.
ONE_PATH = {
  "dipaco.modules_per_level": (1, 1, 1),
  "dipaco.replicas": 1,
  "outer.compression": "fp4",
}
# {unit: {kind of file: groups}} whose bytes unit u reads (u >= 1), when its actor ran every
# unit before it. Versions count units (fragments.py); version v of a group exists where unit
# v - 1 synced it, and u<v> rebuilds it from the version before (Schedule.stored(v - 1)).
#   fragments=2: embed is fragment 0 (synced at step 1 of each phase: units 0 and 2), head and
#   the blocks fragment 1 (step 2: units 1 and 3), and the last unit (3) syncs all. Unit 1
#   starts from embed's v1 (u1 on v0), unit 2 from the rest's v2 (u2 on v0), unit 3 from
#   embed's v3 (u3 on v1), unit 4 (the evaluation) from every group's v4 (embed's u4 on v3,
#   the rest's on v2). Each unit's Δ reference is the version it read: held, nothing read.
#   overlap=1: units are steps 1, 2, 3, 4; units 1 and 3 sync every group; unit 3 lands unit
#   1's sync (v2: u2 on v0), unit 4 reads v4 (u4 on v2); units 1 and 2 read nothing new.
FRAG = ("embed",)
REST = ("head", "block_0", "block_1")
ALL = FRAG + REST
CASES = {
  "fragments": (
    {"outer.fragments": 2},
    {1: {1: FRAG}, 2: {2: REST}, 3: {3: FRAG}, 4: {4: ALL}},
  ),
  "overlap": ({"outer.overlap": 1}, {1: {}, 2: {}, 3: {2: ALL}, 4: {4: ALL}}),
}


def _run(cfg, wd: str, new_actor_each_unit: bool) -> list[dict]:
  """Every unit of the one worker on one actor, each reported to the executor: the results.

  `new_actor_each_unit`: the actor forgets what it held before each unit (a new actor's
  downlink, its guard norms unknown), so it reads every module whole, as before this file.
  """
  grid = grid_lib.Grid(cfg)
  _, _, alpha = driver._prepare(cfg, wd, grid)
  w = worker_lib.PathWorker(cfg, wd, 0)
  ex = exec_lib.OuterExecutor(cfg, wd, 0, [s.name for s in grid.groups], alpha)
  out = []
  for u in range(grid.U + 1):
    if new_actor_each_unit:
      w._link, w._ref = downlink.Downlink(grid, wd, w._rebuild), {}
    out.append(w.run(u, 0))
    if u < grid.U:
      ex.report(u, 0)
  return out


def _npz_bytes(wd: str) -> dict:
  """Every .npz under the workdir's elastic store and worker outputs: name -> bytes."""
  root = pathlib.Path(storage.root(wd))
  return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.npz")}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  """One shard folder for both cases (the driver builds it on first use)."""
  return str(tmp_path_factory.mktemp("shards"))


@pytest.mark.slow  # ~1 CPU-minute a case: two elastic runs of 4 units on one worker, compiled.
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_unit_reads_the_update_codes_and_trains_on_the_same_bytes(
  tmp_path, shards, case
):
  over, reads = CASES[case]
  cfg = helpers.elastic_config(**{**ONE_PATH, **over, "data.shard_dir": shards})
  grid = grid_lib.Grid(cfg)
  assert grid.W == 1 and grid.U == 4 and sorted(grid.sched.groups()) == sorted(ALL)
  if case == "fragments":
    assert grid.sched.synced(0) == set(FRAG) and grid.sched.synced(1) == set(REST)
  coded, whole = str(tmp_path / "coded"), str(tmp_path / "whole")
  got, before = _run(cfg, coded, False), _run(cfg, whole, True)
  size = lambda kind, v, groups: sum(
    storage.size(storage.module_file(coded, g, 0, v, kind)) for g in groups
  )
  for u, want in reads.items():
    codes = sum(size("u", v, gs) for v, gs in want.items())
    assert got[u]["bytes_down"] == codes, (u, got[u]["bytes_down"], codes)
    # A new actor reads every group the unit starts from the store whole (float32).
    assert before[u]["bytes_down"] >= sum(size("v", v, gs) for v, gs in want.items())
  # fp4: 4 bits a weight and a float32 scale a block (~1/7 of float32, npz headers aside).
  assert sum(r.get("bytes_down", 0) for r in got) < sum(r["bytes_down"] for r in before[1:]) / 5
  # Rebuilt from the codes, every version the units trained from is the store's bytes: the
  # same deltas, params, AdamW states and module versions as reading them whole.
  a, b = _npz_bytes(coded), _npz_bytes(whole)
  assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)
  assert [r["loss"] for r in got] == [r["loss"] for r in before]
