"""Elastic mode end to end on a local Ray cluster: equal to spmd, with kills, quorum, re-shards."""
# pylint: disable=invalid-name

import contextlib
import itertools
import json
import os
import re
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dipaco_jax import evaluate
from dipaco_jax import routing
from dipaco_jax import serve
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.runtime import faults as faults_lib
from dipaco_jax.runtime.elastic import driver as elastic_driver
from dipaco_jax.runtime.elastic import errors as elastic_errors
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import storage

import helpers
import routing_testlib

pytestmark = pytest.mark.ray  # A local Ray cluster (the fixture below, or the command's own).

# ---- End to end on a local Ray cluster. ----


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
  ray = pytest.importorskip("ray")
  # One persistent compilation cache for every actor (Ray's worker processes inherit the
  # environment ray.init starts the node with), as benchmarks/elastic.py: a worker actor
  # restarted after a kill, or the next run's, loads its executables instead of compiling.
  cache = {
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  with pytest.MonkeyPatch.context() as mp:
    for k, v in cache.items():
      mp.setenv(k, v)
    elastic_driver.start_local_ray(num_cpus=4)  # As the command's own cluster, 4 CPUs.
  yield ray
  ray.shutdown()


def _final(workdir):
  return checkpoint.restore_numpy(workdir)


# evaluate.py on micro runs: no re-router fits, a prefix shorter than the 16-token sequences.
_EVAL = {"eval.rerouters": (), "routing.prefix_len": 4}


@pytest.mark.slow
def test_elastic_matches_spmd_and_survives_kills(tmp_path, ray_cluster):
  shards = str(tmp_path / "shards")
  # Gradient accumulation and remat on: the recipe's inner step, in both runtimes.
  step = {"inner.microbatches": 2, "model.remat": "full"}
  cfg = lambda **kw: helpers.elastic_config(
    **{"data.shard_dir": shards, "early_stopping.enabled": True, **_EVAL, **step, **kw}
  )
  spmd = cfg(**{"dipaco.mode": "spmd"})
  ref = train.train_and_evaluate(spmd, str(tmp_path / "spmd"))
  out = train.train_and_evaluate(cfg(), str(tmp_path / "clean"))
  assert out["status"]["done"] == 12 and out["status"]["requeued"] == 0  # 2 phases + eval.
  # elastic.pin_cpus: the command's local cluster gives each worker actor its own cores.
  done = [e for e in storage.read_task_log(str(tmp_path / "clean")) if e["event"] == "done"]
  cores = elastic_driver.cpu_sets(os.sched_getaffinity(0), 2)
  assert {e["actor"]: e["cpus"] for e in done} == dict(enumerate(cores))
  # Validation as tasks on the pool, at the steps train.py evaluates (after each outer step).
  np.testing.assert_allclose(out["val_loss"], ref["val_loss"], rtol=1e-5)
  np.testing.assert_allclose(out["train_loss_mean"], ref["train_loss_mean"], rtol=1e-5)
  a, b = _final(str(tmp_path / "spmd")), _final(str(tmp_path / "clean"))
  for name in ("store", "outer_opt", "params", "inner_opt"):
    for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True):
      # Not bit-identical: the SPMD program is the vmapped step partitioned over 4 devices,
      # the elastic worker's is the same step compiled for one device; XLA fuses the two
      # differently, so AdamW updates differ in the last float32 bits from the first step
      # with a nonzero LR (max |diff| measured: 4.8e-7 after 2 outer steps).
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  np.testing.assert_array_equal(a["step"], b["step"])
  # Early stopping (the driver feeds early_stopping.BestPaths the tasks' evaluations):
  # the same records and best set as spmd's; serving reads both sources of the checkpoint.
  rec_a, rec_b = (checkpoint.read_best_records(str(tmp_path / d)) for d in ("spmd", "clean"))
  assert rec_a["step"] == rec_b["step"] and rec_b["checkpoint_step"] == 4
  np.testing.assert_allclose(rec_a["loss"], rec_b["loss"], rtol=1e-5)
  for path in range(4):
    for source in ("store", "best"):
      x, _ = serve.load_path_params(str(tmp_path / "spmd"), spmd, path, source=source)
      y, info = serve.load_path_params(str(tmp_path / "clean"), cfg(), path, source=source)
      assert info["step"] == 4
      for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=1e-6)
  # Routed evaluation (evaluate.py) of the elastic checkpoint, store and best set.
  reports = []
  for d, c in (("spmd", spmd), ("clean", cfg())):
    evaluate.evaluate_and_write(c, str(tmp_path / d))
    reports.append(json.loads((tmp_path / d / "eval" / "step_4.json").read_text()))
  assert set(reports[1]) == {"store", "best"}
  for k in ("store", "best"):
    np.testing.assert_allclose(
      reports[0][k]["own_shard"]["loss"], reports[1][k]["own_shard"]["loss"], rtol=1e-5
    )

  # Faults: worker and executor SIGKILLs at random moments of their calls (tasks slowed
  # to ~1 s so kills land mid-task), and the driver stopping after 4 accepted tasks,
  # then the same command again: the clean run's bytes. Workers dispatch ahead here (the
  # TPU/GPU default; the clean run reads every step): the same steps, the same bytes.
  faulty = str(tmp_path / "faulty")
  slow, delay = {"dispatch_ahead": "on"}, {"step_delay_s": (0.5, 0.5)}
  first = train.train_and_evaluate(
    cfg(**slow), faulty, faults_lib.Faults(worker_kills=1, stop_after_tasks=4, **delay)
  )
  assert first["stopped"] and first["status"]["done"] >= 4
  out = train.train_and_evaluate(
    cfg(**slow), faulty, faults_lib.Faults(worker_kills=3, executor_kills=2, **delay)
  )
  assert out["step"] == 4 and out["status"]["done"] == 12
  kills = first["status"]["worker_kills"] + out["status"]["worker_kills"]
  assert kills >= 2 and out["status"]["requeued"] >= 2, (first, out)
  c = _final(faulty)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The best set too (the rerun driver replays early stopping from the accepted results).
  assert checkpoint.read_best_records(faulty) == rec_b | {"checkpoint_step": 4}
  for path in range(4):
    x, _ = serve.load_path_params(str(tmp_path / "clean"), cfg(), path, source="best")
    y, _ = serve.load_path_params(faulty, cfg(), path, source="best")
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  assert (tmp_path / "faulty" / "metrics.jsonl").read_text().count('"step"') == 2  # One per phase.
  events = storage.read_task_log(faulty)
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))  # Each accepted once.
  # The kills landed (the log, not the schedule): a worker mid-task, a worker with its
  # outputs half written (seed 0 draws the rerun's 4th dispatch, a training task), an executor.
  kills = [(e["target"], e["how"]) for e in events if e["event"] == "kill"]
  assert ("worker", "timed") in kills and ("worker", "write") in kills, kills
  assert ("executor", "timed") in kills, kills
  assert sum(e["event"] == "failed" for e in events) >= sum(t == "worker" for t, _ in kills)

  # A guard that trips: a worker's task stops as the spmd loop does (the same rule at the same
  # step), and the driver stops the run with that error.
  trip = {"guard.max_param_norm_ratio": 1.001, "inner.lr": 0.05}
  with pytest.raises(guard_lib.DivergenceError) as want:
    train.train_and_evaluate(cfg(**{"dipaco.mode": "spmd", **trip}), str(tmp_path / "trip_spmd"))
  with pytest.raises(guard_lib.DivergenceError) as got:
    train.train_and_evaluate(cfg(**trip), str(tmp_path / "trip_elastic"))
  rule = re.compile(r"parameter norm of \w+ grew [\d.]+x since step 0 .* at step (\d+),")
  assert rule.search(str(want.value)) and rule.search(str(got.value)), (want.value, got.value)
  assert rule.search(str(want.value))[1] == rule.search(str(got.value))[1]


@pytest.mark.slow
def test_streamed_elastic_matches_spmd_and_survives_kills(tmp_path, ray_cluster):
  # outer.fragments = 2 on the micro grid (H = 2, T = 2): embed syncs after steps 1, 3 and 4
  # (the flush), head and the blocks after steps 2 and 4; the pool runs 4 units a worker.
  shards = str(tmp_path / "shards")
  cfg = lambda **kw: helpers.elastic_config(
    **{"data.shard_dir": shards, "outer.fragments": 2, "early_stopping.enabled": True, **kw}
  )
  ref = train.train_and_evaluate(cfg(**{"dipaco.mode": "spmd"}), str(tmp_path / "spmd"))
  out = train.train_and_evaluate(cfg(), str(tmp_path / "clean"))
  assert out["status"]["done"] == 20 and out["step"] == 4  # 4 workers x (4 units + evaluation).
  np.testing.assert_allclose(out["val_loss"], ref["val_loss"], rtol=1e-5)
  np.testing.assert_allclose(out["train_loss_mean"], ref["train_loss_mean"], rtol=1e-5)
  a, b = _final(str(tmp_path / "spmd")), _final(str(tmp_path / "clean"))
  for name in ("store", "outer_opt", "params", "inner_opt"):
    for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True):
      # Within 1e-6, not bit for bit: one device's inner step against the 4-device program.
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  # Early stopping on the workers' own params at each phase's start, as the spmd loop's.
  rec_a, rec_b = (checkpoint.read_best_records(str(tmp_path / d)) for d in ("spmd", "clean"))
  assert rec_a["step"] == rec_b["step"]
  np.testing.assert_allclose(rec_a["loss"], rec_b["loss"], rtol=1e-5)
  # Kills of workers (mid-unit) and an executor, the driver stopped after 10 accepted tasks
  # (about two units a worker: once unit 1 is in, embed's version 2 is recorded but never
  # written, as embed does not sync at unit 1, and the rerun's repair must not rebuild it),
  # then the command again: the clean run's bytes.
  # A unit here is one inner step: 1 s each, so a timed kill lands inside a call.
  faulty, delay = str(tmp_path / "faulty"), {"step_delay_s": (1.0, 1.0)}
  first = train.train_and_evaluate(
    cfg(), faulty, faults_lib.Faults(worker_kills=2, stop_after_tasks=10, **delay)
  )
  assert first["stopped"] and first["status"]["done"] >= 10
  out = train.train_and_evaluate(
    cfg(), faulty, faults_lib.Faults(worker_kills=3, executor_kills=2, **delay)
  )
  assert out["step"] == 4 and out["status"]["done"] == 20
  # Kills are drawn among each command's dispatches; a timed one whose call ends first is owed
  # to the actor's next call, so some of them may find no call left: at least one landed.
  assert first["status"]["worker_kills"] + out["status"]["worker_kills"] >= 1, (first, out)
  c = _final(faulty)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert checkpoint.read_best_records(faulty) == checkpoint.read_best_records(
    str(tmp_path / "clean")
  )
  assert (tmp_path / "faulty" / "metrics.jsonl").read_text().count('"step"') == 2  # One a phase.
  events = storage.read_task_log(faulty)
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(5), range(4)))  # Each accepted once.


@pytest.mark.slow
def test_quorum_end_to_end_with_a_slow_worker(tmp_path, ray_cluster):
  # Actor 1 sleeps 3 s per inner step, so task (0, 1) (leased to it first) ends long after
  # actor 0 ran (0, 0), (0, 2), (0, 3): with quorum 0.5 every module steps phase 0 without
  # worker 1; its late delta joins phase 1's step (the last, which waits for all).
  wd = str(tmp_path / "run")
  cfg = helpers.elastic_config(
    **{
      "data.shard_dir": str(tmp_path / "shards"),
      "elastic.quorum": 0.5,
    }
  )
  out = train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=(0.0, 3.0)))
  assert out["step"] == 4 and out["status"]["done"] == 12
  assert np.isfinite(out["train_loss_mean"])
  grid = grid_lib.Grid(cfg)
  snap = storage.load_json(exec_lib.snapshot_file(wd, 0))
  # Phase 0 is settled (phase 1 complete too): its record left the snapshot for its own file.
  assert snap["settled"] == 1 and "0" not in snap["received"]
  used0 = storage.load_json(exec_lib.settled_file(wd, 0, 0))["used"]
  assert used0, snap  # Some module stepped phase 0 without every worker.
  assert exec_lib.quorum_steps(wd, 0) == {0: used0}
  for key, used in used0.items():
    g, e = key.split("/")
    through = grid.workers_through(g, int(e))
    assert 1 not in used and set(used) < set(through)
    # Each late delta joined the next step exactly once.
    assert sorted(used + snap["carried"]["1"][key]) == through
  assert "1" not in snap["used"]  # The last step waited for every report ("next").
  events = storage.read_task_log(wd)
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))


def _sockets(root) -> list:
  """(process name, socket) of every inet socket of `root` ("driver") and its descendants, now."""
  psutil = pytest.importorskip("psutil")
  out = []
  try:
    procs = [root, *root.children(recursive=True)]
  except psutil.Error:
    return out
  for p in procs:
    try:
      name = "driver" if p.pid == root.pid else p.name()
      out += [(name, c) for c in p.net_connections(kind="inet")]
    except psutil.Error:  # Ended meanwhile.
      pass
  return out


@pytest.mark.cli
@pytest.mark.slow
def test_the_commands_own_cluster_listens_on_loopback_only_and_keeps_its_token_private(tmp_path):
  """Every socket of the command's own Ray cluster is on 127.0.0.1; its token file is 0600.

  The run starts in a child process (as the command does: Ray not started yet, so `_connect`
  starts the cluster), stopped after its first accepted task; this process lists the child's
  and its descendants' sockets (GCS, raylet, agents, driver, actors) every 0.2 s meanwhile.
  """
  psutil = pytest.importorskip("psutil")
  pytest.importorskip("ray")
  over = {
    "model.vocab_size": 8192,
    "early_stopping.enabled": False,
    "dipaco.mode": "elastic",
    "elastic.num_workers": 1,
    "data.shard_dir": str(tmp_path / "shards"),
  }
  code = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "import helpers\n"
    "from dipaco_jax import train\n"
    "from dipaco_jax.runtime import faults\n"
    "import json\n"
    "cfg = helpers.elastic_config(**json.loads(sys.argv[2]))\n"
    "out = train.train_and_evaluate(cfg, sys.argv[3], faults.Faults(stop_after_tasks=1))\n"
    "assert out['stopped'], out\n"
  )
  test_dir = os.path.dirname(os.path.abspath(helpers.__file__))  # Where helpers.py is.
  # A home of its own: Ray's token file is ~/.ray/auth_token, written by the command (0600).
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  env["HOME"] = str(tmp_path / "home")
  for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    env.pop(k, None)
  args = [sys.executable, "-c", code, test_dir, json.dumps(over), str(tmp_path / "run")]
  child = subprocess.Popen(args, cwd=helpers.ROOT, env=env, stderr=subprocess.PIPE, text=True)
  seen = {}  # (process, kind, status, local ip, remote ip) -> times seen
  root = psutil.Process(child.pid)
  try:
    while child.poll() is None:
      for name, c in _sockets(root):
        local, remote = (a.ip if a else "" for a in (c.laddr, c.raddr))  # "": none (unbound).
        key = (name.split(".")[0], c.type.name, c.status, local, remote)
        seen[key] = seen.get(key, 0) + 1
      time.sleep(0.2)
    stderr = child.stderr.read()
  finally:
    if child.poll() is None:
      child.kill()
  assert child.returncode == 0, stderr[-3000:]
  listening = {k for k in seen if k[2] == psutil.CONN_LISTEN}
  # GCS, raylet, the driver and the actors' processes (coordinator, executor, worker) listen.
  names = {k[0] for k in listening}
  assert {"gcs_server", "raylet", "driver", "ray::PathWorker", "ray::Coordinator"} <= names, seen
  exposed = [k for k in seen if any(ip and not elastic_driver.is_loopback(ip) for ip in k[3:])]
  assert not exposed, exposed  # Listening, bound (UDP) and connected: loopback only.
  token = tmp_path / "home" / ".ray" / "auth_token"
  if env.get("RAY_AUTH_MODE", "token").lower() == "token":  # Ray's default: tokens on.
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert re.fullmatch("[0-9a-f]{64}", token.read_text())
  else:  # The user turned Ray's tokens off: the command writes none.
    assert not token.exists()
  assert elastic_driver.is_loopback("::ffff:127.0.0.1") and elastic_driver.is_loopback("::1")
  assert not elastic_driver.is_loopback("0.0.0.0") and not elastic_driver.is_loopback("::")


@pytest.mark.slow
def test_a_task_timeout_shorter_than_the_task_stops_the_run(tmp_path, ray_cluster):
  """task_timeout_s=6 s for tasks of 20 s (1 s per inner step): stopped at the second cut."""
  cfg = helpers.elastic_config(
    **{
      "data.shard_dir": str(tmp_path / "shards"),
      "dipaco.inner_steps": 20,
      "eval.every_steps": 20,
      "ckpt.every_steps": 20,
      "elastic.num_workers": 1,
      "elastic.task_timeout_s": 6.0,
    }
  )
  wd = str(tmp_path / "run")
  t0 = time.time()
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    train.train_and_evaluate(cfg, wd, faults_lib.Faults(step_delay_s=(1.0,)))
  wall = time.time() - t0
  msg = str(e.value)
  assert msg.startswith("config.elastic.task_timeout_s=6"), msg
  cuts = [x for x in storage.read_task_log(wd) if x["event"] == "timeout"]
  assert {(x["phase"], x["worker"]) for x in cuts} == {(0, 0)}, cuts  # The one actor's task.
  answered = [x["progress"] for x in cuts if x["progress"]]
  stepped = [p for p in answered if elastic_driver.stepping(p)]
  if len(stepped) == 2:  # The rule that fired (or, on a loaded machine, 3 answered attempts).
    m = re.search(
      r"task \(phase 0, worker 0\) timed out 2 times while its worker was stepping \(the last "
      r"attempt: (\d+) of 20 inner steps done in ([\d.]+) s, about (\d+) s for the task's 20\); "
      r"set --config.elastic.task_timeout_s=(\d+) \(3x that\)",
      msg,
    )
    assert m, msg
    steps, elapsed, est, value = int(m[1]), float(m[2]), int(m[3]), int(m[4])
    assert steps == stepped[-1]["steps"] and abs(elapsed - stepped[-1]["elapsed_s"]) < 0.06
    assert abs(est - elapsed * 20 / steps) <= 0.5 and value >= 3 * est
    assert est >= 20  # 20 steps of >= 1 s each: the task's real time, not the timeout's.
  else:  # The first steps' compile took longer than the timeout (a loaded machine).
    assert len(answered) == 3 and "timed out 3 times" in msg, (msg, cuts)
    assert "set --config.elastic.task_timeout_s=" in msg, msg
  assert len(cuts) <= 4 and wall < 180, (len(cuts), wall)  # Stopped, not thrashing.
  assert not [x for x in storage.read_task_log(wd) if x["event"] == "done"]


def _tree_files(root) -> dict:
  return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_elastic_reshard_matches_spmd_and_survives_kills(tmp_path, ray_cluster, monkeypatch):
  with contextlib.ExitStack() as stack:
    _reshard_matches_spmd_and_survives_kills(tmp_path, monkeypatch, stack)


def _reshard_matches_spmd_and_survives_kills(tmp_path, monkeypatch, stack):
  # k-means phase 0, a discriminative re-shard after outer step 1 of 2; scoring tasks on the
  # pool score the router split with the paths at version 1, the driver fits the router.
  # The driver and the spmd loop see the corpus's first 200 documents per split; the
  # worker actors (other processes) the whole corpus: they read only the router split,
  # whose first routing.router_max_docs = 200 labelled documents are those 200.
  routing_testlib.small_corpus(monkeypatch, 200)
  stack.enter_context(helpers.compile_cache(tmp_path / "jax_cache"))  # The driver's and spmd's.
  cfg = lambda **kw: helpers.elastic_config(
    **{
      "early_stopping.enabled": True,
      "routing.router": "kmeans",
      "routing.kmeans_restarts": 2,
      "routing.kmeans_iters": 20,
      "routing.discriminative_at_outer_step": 1,
      "routing.router_max_docs": 200,
      **_EVAL,
      **kw,
    }
  )
  spmd, clean, faulty = (str(tmp_path / d) for d in ("spmd", "clean", "faulty"))
  ref = train.train_and_evaluate(cfg(**{"dipaco.mode": "spmd"}), spmd)
  out = train.train_and_evaluate(cfg(), clean)
  assert out["status"]["done"] == 12 and out["status"]["reshards"] == [1]
  np.testing.assert_allclose(out["val_loss"], ref["val_loss"], rtol=1e-5)
  # The phase's router: fitted on paths within 1e-6 of spmd's, so the same up to float
  # rounding; its shards (and so α and every batch) the same.
  for phase in (0, 1):
    r = [router_lib.Router.load(routing.router_dir(d, phase), grid=(2, 2)) for d in (spmd, clean)]
    assert r[0].kind == r[1].kind == ("kmeans", "linear")[phase]
    for k in r[0].arrays:
      np.testing.assert_allclose(r[0].arrays[k], r[1].arrays[k], rtol=1e-4, atol=1e-5)
  shard_meta = [
    json.loads((tmp_path / d / "shards_phase_1" / "train" / "meta.json").read_text())
    for d in ("spmd", "clean")
  ]
  assert shard_meta[0] == shard_meta[1]
  # The new phase's α differs from phase 0's, so the final state below checks the executors
  # took it (the store matches spmd's only with each phase's α).
  alpha = [
    storage.load_json(storage.root(clean) / "meta.json")["alpha_W"],
    storage.load_json(storage.alpha_file(clean, 1)),
  ]
  assert alpha[0] != alpha[1], alpha
  a, b = _final(spmd), _final(clean)
  for name in ("store", "outer_opt", "params", "inner_opt"):
    for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True):
      # Not bit-identical, as in test_elastic_matches_spmd_and_survives_kills: one device's
      # program against the 4-device SPMD one (last float32 bits of AdamW's updates).
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
  # The data state names the phase; the positions after it are spmd's new feed's.
  exp = experiment.Experiment(cfg(**{"dipaco.mode": "spmd"}))
  states = [checkpoint.Checkpointer(d).restore(exp.abstract_state)[1] for d in (spmd, clean)]
  assert states[0] == states[1] and states[1]["routing"]["phase"] == 1
  # Early stopping's records restarted with the phase: the same per-path records as spmd.
  rec_a, rec_b = (checkpoint.read_best_records(d) for d in (spmd, clean))
  assert rec_a["phase"] == rec_b["phase"] == 1 and rec_a["step"] == rec_b["step"]
  np.testing.assert_allclose(rec_a["loss"], rec_b["loss"], rtol=1e-5)
  shards_rec = [
    [r for r in metrics_lib.read_records(d) if r.get("step") == 2][-1] for d in (spmd, clean)
  ]
  assert shards_rec[1]["shards/phase"] == 1
  assert {k: v for k, v in shards_rec[0].items() if k.startswith("shards/")} == {
    k: v for k, v in shards_rec[1].items() if k.startswith("shards/")
  }

  # Faults around the re-shard: the driver stops after phase 0's 4 tasks (the re-shard
  # due or not yet), then after 2 more (the router fitted and its tasks running), then
  # runs to the end; worker and executor SIGKILLs on the way. The clean run's bytes.
  # Seed 2 draws, of 2 kills each: the 1st invocation's dispatches 0 (killed mid-write) and 1
  # (at a random moment), the 2nd's dispatch 0 (task (1, ·): the new phase's first, mid-write),
  # the 3rd's dispatch 0 (mid-write) and 5.
  slow = cfg(dispatch_ahead="on")
  kw = {"worker_kills": 2, "seed": 2, "step_delay_s": (0.3, 0.3)}
  first = train.train_and_evaluate(slow, faulty, faults_lib.Faults(stop_after_tasks=4, **kw))
  second = train.train_and_evaluate(slow, faulty, faults_lib.Faults(stop_after_tasks=2, **kw))
  assert first["stopped"] and second["stopped"] and second["status"]["reshards"] == [1]
  last = train.train_and_evaluate(slow, faulty, faults_lib.Faults(executor_kills=1, **kw))
  assert last["step"] == 4 and last["status"]["done"] == 12
  kills = [r["status"]["worker_kills"] for r in (first, second, last)]
  assert sum(kills) >= 3, kills
  c = _final(faulty)
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert checkpoint.read_best_records(faulty) == rec_b
  for sub in ("router", "shards_phase_1"):
    assert _tree_files(tmp_path / "faulty" / sub) == _tree_files(tmp_path / "clean" / sub)
  events = storage.read_task_log(faulty)
  assert [e["fitted"] for e in events if e["event"] == "reshard"] == [True]  # Fitted once.
  # Scored on the pool, one task per path; the one killed before its write was scored again.
  scored = [e["path"] for e in events if e["event"] == "scored"]
  assert sorted(scored) == [0, 1, 2, 3] and all(e["docs"] == 200 for e in events if "docs" in e)
  assert sum(e["event"] == "failed_score" for e in events) >= 1
  done = [(e["phase"], e["worker"]) for e in events if e["event"] == "done"]
  assert sorted(done) == sorted(itertools.product(range(3), range(4)))  # Each accepted once.
  kills = [(e["target"], e["how"]) for e in events if e["event"] == "kill"]
  assert ("worker", "timed") in kills and ("worker", "write") in kills, kills
  assert ("executor", "timed") in kills, kills
