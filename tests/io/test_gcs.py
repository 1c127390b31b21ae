"""gs:// workdirs against a GCS emulator on loopback: every file a run writes lands in the bucket.

The emulator is gcp-storage-emulator (pure Python, the `test` extra), in memory,
in a subprocess. gcsfs (etils.epath's gs:// backend here) reaches it through
STORAGE_EMULATOR_HOST, TensorStore (orbax's checkpoint arrays) through
TENSORSTORE_GCS_HTTP_URL. TensorFlow's own GCS client has no endpoint setting, so
nothing here may go through it (epath's backend is checked below).

What the emulator cannot do: TensorStore writes OCDBT manifests with
`ifGenerationMatch` and reads generations from the `x-goog-generation` header,
neither of which the emulator implements (orbax's save fails with "Malformed
StorageGeneration"), and so does serving's direct OCDBT read
(checkpoint.read_rows). So checkpoints are written locally by orbax and
uploaded, then orbax's restore, the early-stopping set and records and
evaluate read them from the bucket; the write side (and read_rows) is orbax's
and TensorStore's own GCS code, given the gs:// URI unchanged.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest
from etils import epath

from dipaco_jax import errors
from dipaco_jax import evaluate
from dipaco_jax import routing
from dipaco_jax import saved_config
from dipaco_jax import train
from dipaco_jax.core import experiment
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.io import files
from dipaco_jax.routing import rerouting
from dipaco_jax.runtime import early_stopping
from dipaco_jax.runtime.elastic import storage as elastic_storage

import helpers


def _free_port() -> int:
  with contextlib.closing(socket.socket()) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
  """The emulator's URL; the environment points gcsfs and TensorStore at it for the session."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  log = open(tmp_path_factory.mktemp("gcs_emulator") / "log.txt", "wb")  # noqa: SIM115
  proc = subprocess.Popen(
    [sys.executable, "-m", "gcp_storage_emulator", "start"]
    + ["--host=127.0.0.1", f"--port={port}", "--in-memory", "--quiet"],
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  deadline = time.time() + 30
  while True:
    try:
      urllib.request.urlopen(url + "/", timeout=1).read()
      break
    except OSError:
      if proc.poll() is not None or time.time() > deadline:
        proc.kill()
        raise RuntimeError(f"the GCS emulator did not start; see {log.name}") from None
      time.sleep(0.05)
  env = {
    "STORAGE_EMULATOR_HOST": url,  # gcsfs (and google-cloud-storage).
    "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore's gcs kvstore.
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore: no credentials lookup.
    # gcsfs's default filesystem asks the Storage Control API (not emulated) for each bucket's
    # layout; the plain one talks JSON API only.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  }
  with pytest.MonkeyPatch.context() as mp:
    for k, v in env.items():
      mp.setenv(k, v)
    yield url
  proc.terminate()
  proc.wait(10)
  log.close()


@pytest.fixture
def bucket(emulator, request):
  """A new empty bucket for one test: gs://<name>."""
  import gcsfs  # pylint: disable=g-import-not-at-top

  name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50]
  name = name.strip("-") + f"-{_free_port()}"
  gcsfs.GCSFileSystem().mkdir(name)
  return f"gs://{name}"


@pytest.fixture(autouse=True)
def _no_local_gs_folder(tmp_path, monkeypatch):
  """Each test runs in an empty cwd; a path mistaken for a local one would leave ./gs:/ there."""
  monkeypatch.chdir(tmp_path)
  yield
  assert not os.path.exists(tmp_path / "gs:"), os.listdir(tmp_path)


def objects(url: str) -> list[str]:
  """Every object under gs://bucket/prefix, relative to it, as the server lists them."""
  import gcsfs  # pylint: disable=g-import-not-at-top

  fs = gcsfs.GCSFileSystem()
  fs.invalidate_cache()
  root = url.removeprefix("gs://").rstrip("/")
  return sorted(p.removeprefix(root + "/") for p in fs.find(root))


def upload(local_dir, url: str) -> None:
  """Copies a local folder's files to gs://bucket/prefix (what orbax would have written there)."""
  import gcsfs  # pylint: disable=g-import-not-at-top

  fs = gcsfs.GCSFileSystem()
  for dirpath, _, names in os.walk(local_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(dirpath, name), local_dir)
      fs.put_file(os.path.join(dirpath, name), f"{url.removeprefix('gs://')}/{rel}")
  fs.invalidate_cache()


def test_gs_paths_go_through_gcsfs_not_tensorflow():
  assert type(files.path("gs://b/x")._backend).__name__ == "_FileSystemSpecBackend"  # pylint: disable=protected-access


def test_paths_keep_their_scheme():
  assert files.join("gs://b/run", "router", "phase_0") == "gs://b/run/router/phase_0"
  assert routing.router_dir("gs://b/run", 1) == "gs://b/run/router/phase_1"
  assert evaluate.rerouter_dir("gs://b/run", 7) == "gs://b/run/router/rerouters_step7"
  assert files.is_remote("gs://b/x") and not files.is_remote("/tmp/x")


def test_local_writes_are_whole_and_leave_no_temporaries(tmp_path):
  p = tmp_path / "a" / "b.json"
  files.write_json(p, {"z": 1, "a": [1, 2]})
  files.write_json(p, {"z": 2})  # Replaces.
  assert files.read_json(p) == {"z": 2}
  assert os.listdir(tmp_path / "a") == ["b.json"]


def test_router_round_trip(bucket):
  c_PxD = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
  r = routing.Router("kmeans", (2, 2), {"centroids": c_PxD}, {"features": "f", "num_docs": 40})
  d = f"{bucket}/run/router/phase_0"
  assert not routing.Router.exists(d)
  r.save(d)
  assert objects(bucket) == ["run/router/phase_0/router.json", "run/router/phase_0/router.npz"]
  assert routing.Router.exists(d)
  back = routing.Router.load(d, grid=(2, 2), feature_dim=3)
  assert back.kind == r.kind and back.info == r.info
  for k, v in r.arrays.items():
    np.testing.assert_array_equal(back.arrays[k], v)
  with pytest.raises(FileExistsError, match="already saved"):
    r.save(d)
  r2 = routing.Router("kmeans", (2, 2), {"centroids": -c_PxD}, {"features": "g"})
  r2.save(d, overwrite=True)
  np.testing.assert_array_equal(routing.Router.load(d).arrays["centroids"], -c_PxD)
  with pytest.raises(FileNotFoundError, match="no saved router"):
    routing.Router.load(f"{bucket}/run/router/phase_9")


def test_rerouters_round_trip(bucket):
  params = {"head": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "b": np.ones(2, np.int32)}
  d = evaluate.rerouter_dir(f"{bucket}/run", 4) + "/transformer"
  assert rerouting.load_transformer(d) is None
  rerouting.save_transformer(params, d)
  assert objects(bucket) == ["run/router/rerouters_step4/transformer/params.msgpack"]
  back = rerouting.load_transformer(d)
  np.testing.assert_array_equal(back["head"]["w"], params["head"]["w"])
  np.testing.assert_array_equal(back["b"], params["b"])


def test_config_json_written_by_the_trainer_is_read_back(bucket):
  cfg = helpers.micro_config(**{"routing.router": "kmeans"})
  workdir = f"{bucket}/run"
  saved_config.write(epath.Path(workdir), cfg)
  assert objects(bucket) == ["run/config.json"]
  back = evaluate.config_from_workdir(workdir)
  assert back.to_dict() == cfg.to_dict()
  resume = dict(started=True, may_grow=True)
  saved_config.check_matches(epath.Path(workdir), cfg, **resume)  # Same config: resumes.
  with pytest.raises(Exception, match="model.d_model: 32 -> 64"):
    saved_config.check_matches(
      epath.Path(workdir), helpers.micro_config(**{"model.d_model": 64}), **resume
    )
  with pytest.raises(errors.ConfigError, match="no --config given and no .*/other/config"):
    evaluate.config_from_workdir(f"{bucket}/other")


def test_elastic_storage_round_trip(bucket):
  tree = {"a": np.arange(3, dtype=np.float32), "b": {"c": np.eye(2, dtype=np.int32)}}
  f = elastic_storage.module_file(f"{bucket}/run", "blocks", 1, 2)
  elastic_storage.save_tree(f, tree)
  elastic_storage.save_json(elastic_storage.worker_data_file(f"{bucket}/run", 0, 1), {"pos": 5})
  assert objects(bucket) == [
    "run/elastic/store/blocks/m1/v00002.npz",
    "run/elastic/workers/w0/data00001.json",
  ]
  back = elastic_storage.load_tree(f, tree)
  np.testing.assert_array_equal(back["b"]["c"], tree["b"]["c"])
  assert elastic_storage.load_json(elastic_storage.worker_data_file(f"{bucket}/run", 0, 1)) == {
    "pos": 5
  }


def test_elastic_task_log_and_queue_results_in_the_bucket(bucket, monkeypatch):
  # gcsfs turns an append into an overwrite: the task log is parts there, each written whole.
  from dipaco_jax.runtime.elastic import coordinator  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import grid as grid_lib  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(elastic_storage, "TASK_LOG_PART_BYTES", 60)  # ~2 events a part.
  wd = f"{bucket}/el"
  log = elastic_storage.TaskLog(wd)
  for t in range(3):
    log.append({"event": "start", "phase": t})
  log.close()
  again = elastic_storage.TaskLog(wd)  # A rerun continues after the stored parts.
  again.append({"event": "done", "phase": 2})
  events = elastic_storage.read_task_log(wd)
  assert [(e["event"], e["phase"]) for e in events] == [
    ("start", 0),
    ("start", 1),
    ("start", 2),
  ] + [("done", 2)]
  assert "el/elastic/tasks-00001.jsonl" in objects(bucket)
  # The queue's per-phase results files, read back by a restarted coordinator.
  cfg = helpers.micro_config(**{"dipaco.mode": "elastic", "model.vocab_size": 8192})
  plan = grid_lib.Grid(cfg).queue_plan()
  q = coordinator.Coordinator(plan, wd)
  for w in range(2):
    q.complete(*q.lease(w), {"loss": [3.0, 2.0 + w]})
  restored = coordinator.Coordinator(plan, wd)
  assert restored.done == {"0/0": {"last_loss": 2.0}, "0/1": {"last_loss": 3.0}}
  assert restored.pending == [(0, 2), (0, 3)]


@pytest.mark.slow  # a micro checkpoint saved, uploaded and restored: 5-8 s
def test_checkpoint_and_early_stopping_records_read_from_the_bucket(bucket, tmp_path):
  cfg = helpers.micro_config()
  exp = experiment.Experiment(cfg)
  state = exp.init_state(0)
  best = early_stopping.BestPaths(exp.state_sharding.params, exp.topo.num_workers)
  best.update(2, np.array([4.0, 3.0, 2.0, 1.0]), state.params, phase=0)
  local = str(tmp_path / "local_run")
  ck = checkpoint.Checkpointer(local, async_save=False)
  ck.save(2, state, {"train": {"position": 3}, "routing": {"phase": 0}}, best=best.saved())
  ck.close()
  workdir = f"{bucket}/run"
  upload(checkpoint.directory(local), f"{workdir}/checkpoints")
  assert "run/checkpoints/2/state/_METADATA" in objects(bucket)

  assert checkpoint.steps(workdir) == [2]
  records = early_stopping.read_meta(workdir)
  assert records["checkpoint_step"] == 2 and records["loss"] == [4.0, 3.0, 2.0, 1.0]
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  got, data_state = ck.restore(exp.abstract_state)
  params_W, _ = ck.restore_best(exp.abstract_state.params)
  ck.close()
  assert data_state == {"train": {"position": 3}, "routing": {"phase": 0}}
  for a, b in zip(jax.tree.leaves((got, params_W)), jax.tree.leaves((state, state.params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # route, train 4 steps, evaluate on the embedded corpus: ~1 min
def test_a_whole_run_on_a_gs_workdir(bucket, tmp_path, monkeypatch):
  """route -> train -> evaluate with --workdir=gs://...: each writer's files are in the bucket."""
  monkeypatch.setattr(shards_lib, "CACHE_DIR", str(tmp_path / "shard_cache"))
  cfg = helpers.micro_config(
    **{
      "model.vocab_size": 8192,
      "data.subsample": 20,
      "routing.router": "kmeans",
      "routing.kmeans_restarts": 1,
      "routing.kmeans_iters": 10,
      "routing.prefix_len": 4,
      "ckpt.every_steps": 4,
      "eval.every_steps": 4,
      "eval.rerouters": ("linear",),
      "eval.rerouting_windows": (8,),
    }
  )
  workdir = f"{bucket}/run"
  local = str(tmp_path / "local_run")  # Checkpoints only (see the module docstring).
  real_directory = checkpoint.directory
  with monkeypatch.context() as m:
    m.setattr(checkpoint, "directory", lambda w: real_directory(local if str(w) == workdir else w))
    report = routing.route_run(cfg, workdir)
    out = train.train_and_evaluate(cfg, workdir)
  assert out["step"] == 4 and "kmeans" in report
  upload(checkpoint.directory(local), f"{workdir}/checkpoints")

  # What evaluate (and the notebook) do: the config from the bucket, then everything else.
  text = evaluate.evaluate_and_write(evaluate.config_from_workdir(workdir), workdir)
  assert "params: best" in text  # The early-stopping set, read back from the bucket.
  assert early_stopping.read_meta(workdir)["checkpoint_step"] == 4
  got = set(objects(bucket))
  for want in (
    "run/config.json",
    "run/metrics.jsonl",
    "run/router/phase_0/router.json",
    "run/router/phase_0/router.npz",
    "run/router/phase_0/report.md",
    "run/router/rerouters_step4/linear/router.json",
    "run/eval/step_4.json",
    "run/eval/step_4.md",
    "run/shards/meta.json",
    "run/shards/train/meta.json",
    "run/shards/train/parts/part-00000-of-00001.json",
    "run/checkpoints/4/data/metadata",
  ):
    assert want in got, (want, sorted(got))
  # Every path's shard: its part's chunk files, streamed up (shard format 3).
  for w in range(4):
    assert any(o.startswith(f"run/shards/train/worker_{w:05d}/part-") for o in got), w
  assert files.read_text(f"{workdir}/eval/step_4.md") == text
