"""The elastic driver's checks: task timeouts, Ray resources and token, actor options, input."""
# pylint: disable=invalid-name

import os
import re
import stat
import subprocess
import sys

import pytest

from dipaco_jax import errors
from dipaco_jax import train
from dipaco_jax.runtime.elastic import driver as elastic_driver
from dipaco_jax.runtime.elastic import errors as elastic_errors
from dipaco_jax.runtime.elastic import jit_cache
from dipaco_jax.runtime.elastic import storage

import helpers


def _progress(steps, elapsed_s, since_step_s, of=40):
  """A worker's answer to PathWorker.progress for task (0, 1)."""
  return {
    "phase": 0,
    "worker": 1,
    "steps": steps,
    "of": of,
    "elapsed_s": elapsed_s,
    "since_step_s": since_step_s,
  }


def test_a_task_timeout_shorter_than_the_tasks_stops_the_run_in_one_line():
  Timeouts = elastic_driver._Timeouts  # pylint: disable=protected-access
  t = Timeouts(4.0, 40)
  stepping = _progress(3, 4.2, 0.5)  # 3 of 40 steps in 4.2 s: the task takes ~56 s.
  line = t.expired((0, 1), 0, stepping)
  assert line.startswith("elastic: task (phase 0, worker 1) passed config.elastic.task_timeout_s=4")
  assert "3 of 40 inner steps done in 4.2 s, about 56 s for the task's 40" in line
  # Not counted towards the stop: another task's timeout, an attempt whose worker did not answer
  # (not placed yet), one that made no step lately (a hang: what the timeout is for).
  t.expired((0, 2), 1, stepping)
  assert "did not answer" in t.expired((0, 1), 1, None)
  assert "none lately" in t.expired((0, 1), 1, _progress(20, 104.0, 100.0))
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    t.expired((0, 1), 1, _progress(4, 4.1, 0.2, of=40))
  assert str(e.value) == (
    "config.elastic.task_timeout_s=4 is shorter than a task: task (phase 0, worker 1) timed out "
    "2 times while its worker was stepping (the last attempt: 4 of 40 inner steps done in 4.1 s, "
    "about 41 s for the task's 40); set --config.elastic.task_timeout_s=130 (3x that) or more "
    "and rerun the same command (it resumes)."
  )
  # A task that never steps in time (hung, or a compile longer than the timeout): 3 answered
  # timeouts stop the run too.
  t = Timeouts(4.0, 40)
  for _ in range(2):
    t.expired((1, 0), 0, _progress(0, 4.0, None))
  with pytest.raises(elastic_errors.ElasticConfigError, match="timed out 3 times") as e:
    t.expired((1, 0), 0, _progress(0, 4.0, None))
  assert "--config.elastic.task_timeout_s=40 or more" in str(e.value)
  for n in range(2):  # A re-shard's scoring task: 3 timeouts.
    assert f"({n + 1} of 3 such timeouts" in t.expired_score(2, 0, 5.0)
  with pytest.raises(elastic_errors.ElasticConfigError, match="scoring task of path 2"):
    t.expired_score(2, 0, 5.0)
  # Stepping: a step done lately (within 30 s, or 3x the attempt's mean time per step so far).
  stepping = elastic_driver.stepping
  assert stepping(_progress(10, 100.0, 29.0)) and not stepping(_progress(10, 100.0, 31.0))
  assert stepping(_progress(2, 200.0, 100.0))  # Slow steps (100 s each): still stepping.
  assert not stepping(_progress(0, 10.0, None)) and not stepping(None)


def _node(alive=True, **resources):
  return {"Alive": alive, "Resources": {"memory": 1e9, "node:127.0.0.1": 1.0, **resources}}


def test_worker_resources_the_local_cluster_lacks_are_refused_a_joined_cluster_waits():
  check = elastic_driver.check_resources
  cfg = lambda res, n=2: helpers.elastic_config(
    **{"elastic.worker_resources": res, "elastic.num_workers": n}
  )
  local = [_node(CPU=3.0)]
  assert check(cfg(""), local, fixed=True) is None  # 1 CPU each: room for 3.
  with pytest.raises(elastic_errors.ElasticConfigError) as e:
    check(cfg('{"TPU": 4}'), local, fixed=True)
  assert str(e.value) == (
    """config.elastic.worker_resources='{"TPU": 4}' asks each worker actor for {"CPU": 1, """
    """"TPU": 4}, but the local Ray cluster (config.elastic.address='', this machine) has no """
    """TPU: it offers {"CPU": 3}; ask for resources this machine has (worker_resources='' = 1 """
    "CPU each), or join a cluster whose nodes advertise TPU with "
    "--config.elastic.address=HOST:PORT."
  )
  with pytest.raises(elastic_errors.ElasticConfigError, match="room for 1 of the config.elastic"):
    check(cfg('{"GPU": 1}'), [_node(CPU=3.0, GPU=1.0)], fixed=True)
  with pytest.raises(elastic_errors.ElasticConfigError, match="no node of the local Ray cluster"):
    check(cfg('{"GPU": 2}'), [_node(CPU=3.0, GPU=1.0)], fixed=True)
  # A joined cluster may grow (a pool still joining, spot VMs re-created): a warning, no stop.
  pool = [_node(CPU=8.0), _node(CPU=8.0, TPU=4.0), _node(False, CPU=8.0, TPU=4.0)]
  assert check(cfg('{"TPU": 1}', 4), pool, fixed=False) is None
  line = check(cfg('{"TPU": 1}', 8), pool, fixed=False)
  assert line.startswith("""elastic: config.elastic.worker_resources='{"TPU": 1}' asks""")
  assert """the cluster's 2 live nodes offer {"CPU": 16, "TPU": 4}: room for 4 of the""" in line
  assert "no node has" not in line
  assert "(no node has TPU)" in check(cfg('{"TPU": 1}', 1), pool[:1], fixed=False)


def test_worker_resources_the_machine_cannot_give_are_refused_before_anything_is_written(
  tmp_path,
):
  # More cores than exist: refused before Ray starts (the command's own cluster's CPUs).
  wd = tmp_path / "run"
  cfg = helpers.elastic_config(**{"elastic.worker_resources": '{"CPU": 100000}'})
  with pytest.raises(elastic_errors.ElasticConfigError, match='worker_resources=\'{"CPU": 100000}'):
    train.train_and_evaluate(cfg, str(wd))
  assert not wd.exists()


def test_rays_token_file_is_written_and_kept_owner_only(tmp_path, monkeypatch):
  private = elastic_driver._private_token  # pylint: disable=protected-access
  monkeypatch.setenv("HOME", str(tmp_path))
  for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    monkeypatch.delenv(k, raising=False)
  token = tmp_path / ".ray" / "auth_token"
  assert elastic_driver.token_file() == token
  private()  # Missing: written owner-only, as Ray would (32 random bytes in hex).
  assert stat.S_IMODE(token.stat().st_mode) == 0o600
  assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
  text = token.read_text()
  assert re.fullmatch("[0-9a-f]{64}", text)
  token.chmod(0o644)  # As Ray 2.60 writes it under umask 022: every local user could read it.
  private()
  assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == text
  other = tmp_path / "elsewhere" / "token"
  monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
  private()
  assert stat.S_IMODE(other.stat().st_mode) == 0o600
  monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")  # No file: the token is in the environment.
  assert elastic_driver.token_file() is None
  monkeypatch.delenv("RAY_AUTH_TOKEN")
  monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
  assert elastic_driver.token_file() is None


@pytest.mark.ray
@pytest.mark.cli
def test_a_resource_no_node_has_stops_the_command_in_one_line_before_any_work(tmp_path):
  """`python -m dipaco_jax.main` asking TPUs of this CPU machine: exit 1, one line, no workdir."""
  pytest.importorskip("ray")
  wd = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "dipaco_jax.main", "--config=configs/tiny.py", f"--workdir={wd}"]
  flags = ["--config.dipaco.mode=elastic", '--config.elastic.worker_resources={"TPU": 4}']
  r = subprocess.run(
    cmd + flags, cwd=helpers.ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert r.returncode == 1, r.stderr[-3000:]
  errors_ = [l for l in r.stderr.splitlines() if "Error" in l]
  assert errors_ == [
    "ElasticConfigError: config.elastic.worker_resources='{\"TPU\": 4}' asks each worker actor "
    'for {"CPU": 1, "TPU": 4}, but the local Ray cluster (config.elastic.address=\'\', this '
    'machine) has no TPU: it offers {"CPU": 3}; ask for resources this machine has '
    "(worker_resources='' = 1 CPU each), or join a cluster whose nodes advertise TPU with "
    "--config.elastic.address=HOST:PORT."
  ], r.stderr[-3000:]
  assert "Traceback" not in r.stderr
  assert not wd.exists()


# ---- Bad input. ----


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("mesh.path", 2, "config.mesh.path=2"),
    ("elastic.num_workers", 0, "config.elastic.num_workers=0"),
    ("stop_at_step", 2, "config.stop_at_step=2"),
    ("elastic.late_deltas", "later", "config.elastic.late_deltas='later'"),
    ("elastic.worker_resources", "TPU=4", "worker_resources='TPU=4'"),
  ],
)
def test_bad_config_is_refused(tmp_path, field, value, match):
  # Refused by load's config check (elastic check_config is part of it), else by the trainer's.
  with pytest.raises(errors.ConfigError, match=match):
    train.train_and_evaluate(helpers.elastic_config(**{field: value}), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_bad_mode_and_address_are_refused(tmp_path):
  with pytest.raises(errors.ConfigError, match="config.dipaco.mode='async'"):
    train.train_and_evaluate(helpers.elastic_config(**{"dipaco.mode": "async"}), str(tmp_path))
  cfg = helpers.elastic_config(
    **{"elastic.address": "127.0.0.1:1", "data.shard_dir": str(tmp_path / "s")}
  )
  with pytest.raises(
    elastic_errors.ElasticConfigError, match="elastic.address='127.0.0.1:1' does not"
  ):
    train.train_and_evaluate(cfg, str(tmp_path / "run"))


def test_workdir_of_the_other_mode_is_refused(tmp_path):
  (tmp_path / "spmd" / "checkpoints").mkdir(parents=True)
  with pytest.raises(elastic_errors.ElasticConfigError, match="mode='spmd'"):
    train.train_and_evaluate(helpers.elastic_config(), str(tmp_path / "spmd"))
  storage.save_json(storage.root(str(tmp_path / "el")) / "meta.json", {"mode": "elastic"})
  with pytest.raises(elastic_errors.ElasticConfigError, match="mode='elastic'"):
    train.train_and_evaluate(
      helpers.elastic_config(**{"dipaco.mode": "spmd"}), str(tmp_path / "el")
    )


@pytest.mark.ray
def test_actor_options_match_the_launch_scripts():
  # launch/ray_actions.sh starts TPU VM nodes with --resources='{"TPU": chips}' and the driver
  # with worker_resources='{"TPU": 1}': one worker actor per chip, 1 CPU each.
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  assert driver._worker_options('{"TPU": 1}') == {
    "max_restarts": -1,
    "max_concurrency": 2,
    "num_cpus": 1,
    "resources": {"TPU": 1},
  }
  assert driver._worker_options('{"CPU": 4, "GPU": 1}')["num_cpus"] == 4
  assert driver._worker_options("")["resources"] is None
  # The coordinator and executors stay on the driver's node (the head, not a spot TPU VM).
  pytest.importorskip("ray")
  context = type("Context", (), {"get_node_id": lambda self: "ab" * 28})()
  fake_ray = type("Ray", (), {"get_runtime_context": staticmethod(lambda: context)})
  strategy = driver._control_options(fake_ray)["scheduling_strategy"]
  assert (strategy.node_id, strategy.soft) == ("ab" * 28, False)


def test_cpu_sets_share_the_machines_cores_among_the_worker_actors():
  cpu_sets = elastic_driver.cpu_sets
  assert cpu_sets({0, 1}, 2) == [[0], [1]]
  assert cpu_sets({0, 1}, 1) == [[0, 1]]
  # 8 cores (one missing from the affinity), 3 actors: 2 each, the 7th core left over.
  assert cpu_sets({0, 1, 2, 3, 4, 6, 7}, 3) == [[0, 1], [2, 3], [4, 6]]
  assert cpu_sets({5, 9}, 3) == [[5], [9], [5]]  # More actors than cores: in turn.


def test_compile_cache_folder_of_each_setting(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("DIPACO_CACHE_DIR", str(tmp_path / "user"))
  assert jit_cache.directory("auto") == str(tmp_path / "user" / "jax_cache")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))  # The user's own wins.
  assert jit_cache.directory("auto") == str(tmp_path / "env")
  assert jit_cache.directory("gs://b/jit") == "gs://b/jit"
  assert jit_cache.directory("off") is None
