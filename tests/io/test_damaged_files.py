"""Damaged files a run reads: one line naming the file and what to do, and nothing else changes.

Elastic storage (every file a worker, an executor or the driver reads): each file
kind truncated, with one byte flipped (an array's CRC-32, a JSON item's crc32),
stripped of its checksum or deleted, read by the reader the runtime uses; the line
names the file and the move whose rerun writes the same bytes again. Then the
rerun's repair in process (a task's lost outputs rerun, a module version rebuilt to
the same bytes), and Ray's task errors shown as their own one line. The workdir
files of the spmd commands (metrics.jsonl, the shards' metadata, the router pair,
checkpoint items) on one small trained run. tests/runtime/elastic/test_elastic_damage.py runs the
elastic cases end to end on Ray.
"""

import json
import logging
import os
import re
import shutil

import jax
import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax import serve
from dipaco_jax import train
from dipaco_jax.io import checkpoint
from dipaco_jax.routing import rerouting
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime.elastic import coordinator as coord_lib
from dipaco_jax.runtime.elastic import errors as elastic_errors
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import repair
from dipaco_jax.runtime.elastic import storage

import helpers
from failure_rows import Row

_SEVEN = np.float32(7.0).tobytes()  # Every stored array below holds 7.0s: where to flip a byte.


def _tree(v: float = 7.0) -> dict:
  return {"g": {"w": np.full((1, 16), v, np.float32)}}


def _truncate(path):
  helpers.truncate(path)


def _flip(path):
  """One digit of a JSON item's value changed, or one byte of an array's data (7.0s) flipped."""
  data = bytearray(open(path, "rb").read())
  if not str(path).endswith(".json"):
    data[data.index(_SEVEN) + 2] ^= 0x01
  else:
    i = data.index(b'"json"')
    i += next(j for j, c in enumerate(data[i:]) if chr(c).isdigit())
    data[i] = ord("1") if data[i] != ord("1") else ord("2")
  open(path, "wb").write(bytes(data))


def _strip(path):
  """A JSON item rewritten as plain JSON: its checksum removed by hand."""
  with open(path) as f:
    inner = json.load(f)["json"]
  with open(path, "w") as f:
    json.dump(inner, f)


def _delete(path):
  os.remove(path)


DAMAGES = {
  "truncated": (_truncate, r"(BadZipFile|invalid JSON)"),
  "one byte flipped": (_flip, r"(Bad CRC-32|crc32 [0-9a-f]{8} read, [0-9a-f]{8} written)"),
  "its checksum stripped": (_strip, r"no crc32: it is not as this version writes it"),
  "deleted": (_delete, r"missing"),
}


def _rel(*parts) -> str:
  return os.path.join(storage.ROOT, *parts)


# (file under the workdir, what is in it, the action's words after "move X aside (mv X
# X.damaged) and rerun the same command", X: "" for the file itself, else that folder).
OUT = _rel("workers", "w1", "out00001")
PROGRESS = _rel("workers", "w1", "progress00001")
FILES = [
  (
    _rel("store", "g", "m0", "v00001.npz"),
    "tree",
    "",
    "the driver rebuilds it from version 0 and phase 0's deltas",
  ),
  (
    _rel("store", "g", "m0", "opt00001.npz"),
    "tree",
    "",
    "the driver rebuilds it from version 0 and phase 0's deltas",
  ),
  (
    _rel("store", "g", "m0", "u00001.npz"),
    "tree",
    "",
    "the driver rebuilds it from version 0 and phase 0's deltas",
  ),
  (
    _rel("store", "g", "m0", "v00000.npz"),
    "tree",
    "",
    "the driver writes version 0 again from the run's initial parameters",
  ),
  (
    os.path.join(OUT, "delta_g.npz"),
    "tree",
    OUT,
    "task (phase 0, worker 1) runs again and writes the same bytes",
  ),
  (
    os.path.join(OUT, "ef_g.npz"),
    "tree",
    OUT,
    "task (phase 0, worker 1) runs again and writes the same bytes",
  ),
  (
    os.path.join(OUT, "done.json"),
    "json",
    OUT,
    "task (phase 0, worker 1) runs again and writes the same bytes",
  ),
  (
    _rel("workers", "w1", "opt00001.npz"),
    "tree",
    OUT,
    "task (phase 0, worker 1) runs again and writes the same bytes",
  ),
  (
    _rel("workers", "w1", "data00001.json"),
    "json",
    OUT,
    "task (phase 0, worker 1) runs again and writes the same bytes",
  ),
  (
    os.path.join(PROGRESS, "at.json"),
    "json",
    PROGRESS,
    "task (phase 1, worker 1) starts from its first step",
  ),
  (
    os.path.join(PROGRESS, "s000002", "opt.npz"),
    "tree",
    PROGRESS,
    "task (phase 1, worker 1) starts from its first step",
  ),
  (_rel("coordinator.json"), "json", "", "the queue is rebuilt from its results and the store"),
  (
    _rel("coordinator", "results00000.json"),
    "json",
    "",
    "that phase's tasks run again and write the same bytes",
  ),
  (_rel("executors", "x0.json"), "json", "", "the executor's reports are sent to it again"),
  (_rel("alpha_phase1.json"), "json", "", "the driver writes it again"),
  (_rel("scores_phase1", "p00002.npz"), "array", "", "path 2 scores the router split again"),
  (_rel("meta.json"), "meta", "", "the driver writes it again"),
]
# Which damages each kind of file meets here (an array file has no JSON checksum to strip).
_DAMAGES_OF = {
  "tree": ("truncated", "one byte flipped", "deleted"),
  "array": ("truncated", "one byte flipped"),
  "json": ("truncated", "one byte flipped", "its checksum stripped"),
  "meta": ("one byte flipped", "its checksum stripped"),
}
CASES = [(f, kind, d, aside, action) for f, kind, aside, action in FILES for d in _DAMAGES_OF[kind]]


def _write(wd, rel: str, kind: str):
  """Writes the file as elastic storage does; returns its reader (the one the runtime uses)."""
  path = os.path.join(wd, rel)
  if kind == "tree":
    storage.save_tree(path, _tree())
    return lambda: storage.load_tree(path, _tree(0.0))
  if kind == "array":
    storage.save_array(path, np.full(16, 7.0, np.float32))
    return lambda: storage.load_array(path)
  if kind == "meta":
    storage.save_json(path, {"mode": "elastic", "format": elastic_errors.FORMAT, "workers": 4})
    return lambda: elastic_errors.check_workdir_mode(wd, "elastic")
  storage.save_json(path, {"loss": [1.25, 1.5], "position": 123, "versions": {"g/0": 1}})
  return lambda: storage.load_json(path)


@pytest.mark.parametrize(
  "rel,kind,damage,aside,action",
  CASES,
  ids=[f"{os.path.relpath(f, storage.ROOT)} {d}" for f, _, d, _, _ in CASES],
)
def test_a_damaged_elastic_file_is_one_line_naming_it_and_the_move(
  tmp_path, rel, kind, damage, aside, action
):
  wd = str(tmp_path / "run")
  read = _write(wd, rel, kind)
  read()  # Intact: read as written.
  hurt, reason = DAMAGES[damage]
  hurt(os.path.join(wd, rel))
  before = helpers.tree_bytes(wd)
  with pytest.raises(errors.DamagedFileError) as e:
    read()
  path, moved = os.path.join(wd, rel), os.path.join(wd, aside or rel)
  msg = str(e.value)
  assert errors.is_user_error(e.value) and "\n" not in msg  # One line, exit status 1.
  assert msg.startswith(f"elastic storage file {path} is damaged ("), msg
  assert msg.endswith(
    f"); move {moved} aside (mv {moved} {moved}.damaged) and rerun the same command: {action}."
  ), msg
  assert re.search(reason, msg), msg
  assert helpers.tree_bytes(wd) == before  # Read only: nothing changed.


def test_a_tree_of_another_model_is_one_line(tmp_path):
  path = str(tmp_path / "t.npz")
  storage.save_tree(path, _tree())
  with pytest.raises(errors.UserError, match=r"has no array \['g'\]\['v'\]: it was written by"):
    storage.load_tree(path, {"g": {"v": np.zeros((1, 16), np.float32)}})


def test_a_tasks_error_reaches_the_command_as_its_own_line():
  ray_errors = pytest.importorskip("ray.exceptions")
  cause = errors.DamagedFileError("elastic storage file X is damaged (Bad CRC-32); move X aside")
  err = ray_errors.RayTaskError("PathWorker.run", "Traceback ...\n" * 75, cause)
  assert repair.task_error(err) is cause  # Not Ray's 75 lines.
  bug = ray_errors.RayTaskError("PathWorker.run", "Traceback ...", KeyError("x"))
  assert isinstance(repair.task_error(bug), KeyError)  # A bug keeps Ray's traceback.


# ---- The rerun's repair, in process. ----


def _config(**kw):
  over = {"model.vocab_size": 8192, "early_stopping.enabled": False, "dipaco.mode": "elastic"}
  return helpers.micro_config(**{**over, **kw})


def _phase0(wd, grid, rng):
  """Version 0 of every module, zero momentum and every worker's phase-0 deltas."""
  for s in grid.groups:
    t = grid.module_template(s.name)
    for e in range(s.num_modules):
      m = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), t)
      storage.save_tree(storage.module_file(wd, s.name, e, 0), m)
      opt = jax.tree.map(np.zeros_like, grid.recipe.outer_tx.init(m))
      storage.save_tree(storage.module_file(wd, s.name, e, 0, "opt"), opt)
  for w in range(grid.W):
    for g, _ in grid.modules_of_worker(w):
      d = jax.tree.map(
        lambda x: 0.01 * rng.normal(size=x.shape).astype(np.float32), grid.delta_template(g)
      )
      storage.save_tree(storage.delta_file(wd, w, 1, g), d)


@pytest.mark.slow  # ~10 s: the outer step compiled for each group.
def test_a_module_version_moved_aside_is_rebuilt_to_the_same_bytes(tmp_path):
  cfg = _config(**{"elastic.num_executors": 2})
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  alpha = [1.0, 0.5, 0.25, 0.75]
  _phase0(wd, grid, np.random.default_rng(0))
  owned = exec_lib.assign_groups([s.name for s in grid.groups], 2)
  for j in range(2):
    ex = exec_lib.OuterExecutor(cfg, wd, j, owned[j], alpha)
    for w in range(grid.W):
      ex.report(0, w)
  stepped = helpers.tree_bytes(os.path.join(wd, storage.ROOT, "store"))
  v1 = storage.module_file(wd, "block_1", 1, 1)
  os.rename(v1, f"{v1}.damaged")  # As the line says; its momentum too, for the other kind.
  opt1 = storage.module_file(wd, "block_0", 0, 1, "opt")
  os.rename(opt1, f"{opt1}.damaged")
  v0 = storage.module_file(wd, "embed", 0, 0)
  version0 = {v0: storage.load_tree(v0, grid.module_template("embed"))}
  os.rename(v0, f"{v0}.damaged")
  repair.rebuild_modules(cfg, wd, grid, alpha, lambda: version0)
  got = helpers.tree_bytes(os.path.join(wd, storage.ROOT, "store"))
  assert {k: v for k, v in got.items() if not k.endswith(".damaged")} == stepped


def test_a_tasks_outputs_moved_aside_take_it_off_the_queue_so_it_runs_again(tmp_path):
  cfg = _config()
  grid = grid_lib.Grid(cfg)
  wd = str(tmp_path)
  plan = grid.queue_plan()
  q = coord_lib.Coordinator(plan, wd)
  for w in range(grid.W):
    q.lease(w)
    storage.save_json(storage.worker_out_dir(wd, w, 1) / "done.json", {"loss": [1.0]})
    assert q.complete(0, w, {"loss": [1.0]})
  out = storage.worker_out_dir(wd, 2, 1)
  os.rename(out, f"{out}.damaged")
  repair.check_records(wd, grid)
  repair.forget_lost_outputs(wd, grid)
  assert sorted(coord_lib.read_results(wd)) == ["0/0", "0/1", "0/3"]
  q = coord_lib.Coordinator(plan, wd)  # The rerun's queue: task (0, 2) first.
  assert q.lease(0) == (0, 2)


# ---- The spmd commands' workdir files, on one small trained run. ----


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A micro run of 2 outer steps (checkpoints 2 and 4, early stopping's set) and its config."""
  wd = tmp_path_factory.mktemp("trained") / "run"  # Its shards in it: a copy is a whole run.
  cfg = helpers.micro_config(**{"model.vocab_size": 8192, "early_stopping.enabled": True})
  train.train_and_evaluate(cfg, str(wd))
  assert checkpoint.steps(str(wd)) == [2, 4]
  return cfg, wd


def _copy(trained, tmp_path):
  cfg, wd = trained
  shutil.copytree(wd, tmp_path / "run")
  return cfg, tmp_path / "run"


def _longer(cfg):
  """The run's config with one more outer step: a resume that reads everything."""
  del cfg
  over = {"model.vocab_size": 8192, "early_stopping.enabled": True, "dipaco.outer_steps": 3}
  return helpers.micro_config(**over)


def _refused(fn, cls=errors.UserError):
  with pytest.raises(cls) as e:
    fn()
  assert errors.is_user_error(e.value) and "\n" not in str(e.value)
  return str(e.value)


@pytest.mark.slow
def test_metrics_jsonl_damaged_mid_file_stops_the_resume_naming_its_line(trained, tmp_path):
  cfg, w = _copy(trained, tmp_path)
  path = w / "metrics.jsonl"
  lines = path.read_bytes().split(b"\n")
  for bad, what in [
    (b'{"step": 2, "x": "\xff"}', "not UTF-8 text"),
    (b"[2, 3]", "a record is a JSON object with an integer step"),
  ]:
    path.write_bytes(b"\n".join([lines[0], bad, *lines[1:]]))
    before = helpers.tree_bytes(w)
    msg = _refused(lambda: train.train_and_evaluate(_longer(cfg), str(w)), errors.DamagedFileError)
    assert msg.startswith(f"{path} line 2: {what}") and msg.endswith(
      "remove that line to go on (the other records are kept)."
    ), msg
    assert helpers.tree_bytes(w) == before


@pytest.mark.slow
def test_a_shard_split_meta_deleted_or_disagreeing_is_one_line(trained, tmp_path):
  cfg, w = _copy(trained, tmp_path)
  shards = w / "shards"
  meta = shards / "train" / "meta.json"
  good = meta.read_text()
  fix = f"move {shards} aside (mv {shards} {shards}.damaged) and rerun"
  edits = [
    (lambda: meta.unlink(), f"missing, though {shards}/meta.json lists 'train'"),
    (
      lambda: meta.write_text(json.dumps({**json.loads(good), "tokens": [1, 2, 3, 4]})),
      f"its token counts differ from {shards}/meta.json's",
    ),
    (
      lambda: meta.write_text(json.dumps({**json.loads(good), "num_workers": 3})),
      "{'tokens': 4, 'docs': 4, 'files': 4} entries for 3 workers",
    ),
  ]
  for edit, reason in edits:
    meta.write_text(good)
    edit()
    before = helpers.tree_bytes(tmp_path)
    msg = _refused(lambda: train.train_and_evaluate(_longer(cfg), str(w)), errors.DamagedFileError)
    assert msg.startswith(f"shard file {meta} is damaged ({reason}); {fix}"), msg
    assert helpers.tree_bytes(tmp_path) == before


def test_a_router_pair_that_disagrees_is_one_line_with_the_move(tmp_path):
  d = tmp_path / "router" / "phase_0"
  c = np.arange(8, dtype=np.float32).reshape(4, 2)
  router_lib.Router("kmeans", (4,), {"centroids": c}).save(str(d))
  meta = d / router_lib.META_FILE
  good = json.loads(meta.read_text())
  fix = f"move {d} aside (mv {d} {d}.damaged) and rerun to fit it again"
  for edit, reason in [
    ({"feature_dim": 3}, "it says 3 features and 4 paths, router.npz holds 2 and 4"),
    (
      {"grid": [2]},
      'router.json and router.npz do not fit: ValueError("a kmeans router for '
      "grid 2 needs arrays {'centroids': (2, 2)}; got {'centroids': (4, 2)}",
    ),
    ({"format_version": 0}, "router format 0, this code reads"),
  ]:
    meta.write_text(json.dumps({**good, **edit}))
    before = helpers.tree_bytes(tmp_path)
    msg = _refused(lambda: router_lib.Router.load(str(d)), errors.DamagedFileError)
    assert msg.startswith(f"router file {meta} is damaged ({reason}") and fix in msg, msg
    assert helpers.tree_bytes(tmp_path) == before


@pytest.mark.parametrize("damage", ["truncated", "one byte flipped"])
def test_a_damaged_transformer_rerouter_is_one_line_with_the_move(tmp_path, damage):
  d = str(tmp_path / "rerouters_step4" / "transformer")
  rerouting.save_transformer({"w": np.full(16, 7.0, np.float32)}, d)
  assert rerouting.load_transformer(d)["w"].tolist() == [7.0] * 16
  path = os.path.join(d, rerouting.PARAMS_FILE)
  (_truncate if damage == "truncated" else _flip)(path)
  before = helpers.tree_bytes(tmp_path)
  msg = _refused(lambda: rerouting.load_transformer(d), errors.DamagedFileError)
  assert msg == (
    f"re-router file {path} is damaged (its crc32 does not match); move {d} aside (mv {d} "
    f"{d}.damaged) and rerun evaluate: it fits the transformer re-router again."
  ), msg
  assert helpers.tree_bytes(tmp_path) == before


def _drop_item(w, step: int, item: str):
  shutil.rmtree(w / "checkpoints" / str(step) / item)


@pytest.mark.slow
def test_a_checkpoint_item_deleted_is_damage_not_an_unverified_read(trained, tmp_path):
  cfg, w = _copy(trained, tmp_path)
  _drop_item(w, 4, checkpoint.CHECKSUMS)
  mv = f"move it aside (mv {w}/checkpoints/4 {w}/damaged_checkpoint_4) to resume from step 2"
  want = (
    f"checkpoint step 4 in {w}/checkpoints is damaged (checksums/: missing, though its data "
    f"item lists it"
  )
  before = helpers.tree_bytes(w)
  for read in [
    lambda: train.train_and_evaluate(_longer(cfg), str(w)),  # Resume.
    lambda: serve.load_path_params(str(w), cfg, 1),  # One path's rows.
    lambda: checkpoint.restore_worker_params(str(w), 1),  # θ̄ of another run.
  ]:
    msg = _refused(read, checkpoint.DamagedCheckpointError)
    assert msg.startswith(want) and mv in msg, msg
  assert helpers.tree_bytes(w) == before
  # The audit's case: the checksums gone and 11 bytes of the store flipped; serving refuses.
  store = w / "checkpoints" / "4" / "state" / "d"
  for f in sorted(store.iterdir())[:1]:
    data = bytearray(f.read_bytes())
    for i in range(11):
      data[len(data) // 2 + i] ^= 0xFF
    f.write_bytes(bytes(data))
  msg = _refused(lambda: serve.load_path_params(str(w), cfg, 1), checkpoint.DamagedCheckpointError)
  assert msg.startswith(want), msg
  shutil.rmtree(w)
  cfg, w = _copy(trained, tmp_path)
  _drop_item(w, 4, "best")  # Early stopping's set, listed as saved with the step.
  msg = _refused(
    lambda: serve.load_path_params(str(w), cfg, 1, source="best"), checkpoint.DamagedCheckpointError
  )
  assert "(best/: missing, though its data item lists it as saved with the step)" in msg, msg


@pytest.mark.slow
def test_a_step_that_predates_checksums_is_read_unverified_at_warning(trained, tmp_path, caplog):
  cfg, w = _copy(trained, tmp_path)
  for step in (2, 4):
    _drop_item(w, step, checkpoint.CHECKSUMS)
    meta = w / "checkpoints" / str(step) / "data" / "metadata"
    data = json.loads(meta.read_text())
    del data["saved_items"]
    meta.write_text(json.dumps(data))
  with caplog.at_level(logging.WARNING, logger="absl"):
    serve.load_path_params(str(w), cfg, 1)
  said = [r for r in caplog.records if "has no checksums" in r.getMessage()]
  assert [r.levelno for r in said] == [logging.WARNING]


# The rows this file adds to docs/failures.md (tests/project/test_failure_table.py).
_E = "the elastic driver"
TABLE = [
  Row(
    f"elastic {os.path.relpath(f, storage.ROOT)} {d}",
    _E,
    f"DamagedFileError: elastic storage file … is damaged (…); move "
    f"{'it' if not aside else os.path.relpath(aside, storage.ROOT)} aside (mv …) and rerun "
    f"the same command: {action}",
    1,
    "every file byte for byte (the read changes nothing)",
    "tests/io/test_damaged_files.py",
  )
  for f, _, d, aside, action in CASES
] + [
  Row(
    "elastic: a stored tree of another model",
    _E,
    "UserError: … has no array …: it was written by another model or grid; use a new --workdir",
    1,
    "nothing written",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "metrics.jsonl: a byte that is not UTF-8 mid-file",
    "main (resume)",
    "DamagedFileError: WORKDIR/metrics.jsonl line 2: not UTF-8 text … remove that line to go "
    "on (the other records are kept)",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "metrics.jsonl: a line that is a JSON list mid-file",
    "main (resume)",
    "DamagedFileError: WORKDIR/metrics.jsonl line 2: a record is a JSON object with an integer "
    "step; remove that line to go on",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "shards: a split's meta.json deleted",
    "main (resume)",
    "DamagedFileError: shard file …/train/meta.json is damaged (missing, though …/meta.json "
    "lists 'train'); move … aside (mv …) and rerun: the shards are written again",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "shards: a split's token counts differ from the dir's meta.json",
    "main (resume)",
    "DamagedFileError: shard file …/train/meta.json is damaged (its token counts differ from "
    "…/meta.json's); move … aside",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "shards: a split's meta.json with fewer workers than its lists",
    "main (resume)",
    "DamagedFileError: shard file …/train/meta.json is damaged ({…} entries for 3 workers); "
    "move … aside",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "router.json says another feature dim than router.npz",
    "route, main, evaluate, serve",
    "DamagedFileError: router file …/router.json is damaged (it says 3 features and 4 paths, "
    "router.npz holds 2 and 4); move … aside (mv …) and rerun to fit it again",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "router.json says another grid than router.npz",
    "route, main, evaluate, serve",
    "DamagedFileError: router file …/router.json is damaged (router.json and router.npz do "
    "not fit: … needs arrays {'centroids': (2, 2)}; got {'centroids': (4, 2)} …); move … aside",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "router.json of another router format",
    "route, main, evaluate, serve",
    "DamagedFileError: router file …/router.json is damaged (router format 0, this code reads "
    "…); move … aside (mv …) and rerun to fit it again",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "a checkpoint step's checksums item deleted",
    "main (resume), serve, init_from",
    "DamagedCheckpointError: checkpoint step 4 in …/checkpoints is damaged (checksums/: "
    "missing, though its data item lists it …); move it aside (mv …) to resume from step 2",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "the checksums item deleted and 11 bytes of the store flipped",
    "serve",
    "DamagedCheckpointError: checkpoint step 4 … is damaged (checksums/: missing, though its "
    "data item lists it …)",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "a checkpoint step's early-stopping set deleted",
    "serve --source=best",
    "DamagedCheckpointError: … (best/: missing, though its data item lists it as saved with "
    "the step); move it aside",
    1,
    "every file byte for byte",
    "tests/io/test_damaged_files.py",
  ),
  Row(
    "a checkpoint saved before checksums existed",
    "serve, main, evaluate",
    "WARNING: checkpoint step 4 … has no checksums (saved before they were added): its arrays "
    "are read unverified",
    0,
    "read as saved",
    "tests/io/test_damaged_files.py",
    "tolerated",
  ),
  Row(
    "a Ray task's own error (a damaged file read by a worker)",
    _E,
    "DamagedFileError: … (the task's error itself, not Ray's traceback)",
    1,
    "the run's files",
    "tests/io/test_damaged_files.py",
  ),
]
