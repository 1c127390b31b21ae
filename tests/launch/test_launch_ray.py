"""launch/ray_*.sh: elastic mode on a head CPU VM and a pool of spot TPU VMs."""

import json
import pathlib
import shlex
import subprocess
import sys
import tarfile

import pytest

from launch_sandbox import BASE
from launch_sandbox import TRAIN
from launch_sandbox import WHERE
from launch_sandbox import describe_call
from launch_sandbox import dry_and_real
from launch_sandbox import gcloud_calls

# --- ray_*.sh: elastic mode on a head CPU VM and a pool of spot TPU VMs ------------------------

_RAY = [*BASE, "--accelerator-type=v5litepod-4", "--pool-size=2", *TRAIN]
_HEAD_STATUS = [
  "compute",
  "instances",
  "describe",
  "r-head",
  *WHERE,
  "--format=value(status)",
]
_HEAD_IP = [*_HEAD_STATUS[:-1], "--format=value(networkInterfaces[0].networkIP)"]
_FIREWALL = ["compute", "firewall-rules", "describe", "r-ray", "--project=my-proj"]
_FIREWALL += ["--format=value(name)"]


def _tpu_create(name, *flags):
  return [
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    name,
    *WHERE,
    "--accelerator-type=v5litepod-4",
    "--version=v2-alpha-tpuv5-lite",
    *flags,
  ]


def _ray_start(script: str) -> list[str]:
  """The `ray start` line of a startup script's wrapper, as argv."""
  (line,) = [ln for ln in script.splitlines() if ln.startswith("exec ") and " start " in ln]
  return shlex.split(line)[1:]


def _check_script(path):
  """A generated startup script parses and passes shellcheck."""
  subprocess.run(["bash", "-n", str(path)], check=True)
  shellcheck = pathlib.Path(sys.executable).parent / "shellcheck"
  proc = subprocess.run(
    [shellcheck, "-S", "warning", str(path)], capture_output=True, text=True, check=False
  )
  assert proc.returncode == 0, proc.stdout


def test_ray_head_creates_firewall_code_and_head_once(box):
  dry, real = dry_and_real(box, "ray_head.sh", *_RAY, "--internal-ip")
  tarball = f"{box.tmp}/r-code.tar.gz"
  startup = box.tmp / "r-ray-head.sh"
  firewall = ["compute", "firewall-rules", "create", "r-ray", "--project=my-proj"]
  firewall += ["--network=default", "--direction=INGRESS", "--action=ALLOW", "--rules=tcp"]
  firewall += ["--source-tags=r-ray", "--target-tags=r-ray"]
  upload = ["storage", "cp", tarball, "gs://b/run/code/dipaco_jax.tar.gz", "--project=my-proj"]
  create = ["compute", "instances", "create", "r-head", *WHERE, "--machine-type=e2-standard-8"]
  create += ["--image-family=debian-12", "--image-project=debian-cloud", "--boot-disk-size=50GB"]
  create += ["--network=default", "--tags=r-ray", f"--metadata-from-file=startup-script={startup}"]
  create += ["--scopes=cloud-platform", "--no-address"]
  assert gcloud_calls(dry) == real == [_FIREWALL, firewall, _HEAD_STATUS, upload, create]
  with tarfile.open(tarball) as tar:
    assert "configs/dipaco_2x4.py" in tar.getnames()
  script = startup.read_text()
  _check_script(startup)
  assert "gcloud storage cp gs://b/run/code/dipaco_jax.tar.gz /opt/dipaco/code.tar.gz" in script
  assert "--venv=/opt/dipaco/venv" in script and "--extras=elastic\n" in script
  assert _ray_start(script) == [
    "/opt/dipaco/venv/bin/ray",
    "start",
    "--block",
    "--head",
    "--port=6379",
    "--include-dashboard=false",
    "--disable-usage-stats",
    "--node-ip-address=$ip",
  ]
  assert "computeMetadata/v1/instance/network-interfaces/0/ip" in script
  assert "Restart=always" in script and "systemctl restart dipaco-ray.service" in script
  # Again: both exist, nothing is created and no code is uploaded over the running cluster's.
  proc = box.ok("ray_head.sh", *_RAY)
  assert box.calls()[len(real) :] == [_FIREWALL, _HEAD_STATUS]
  assert "firewall rule r-ray exists" in proc.stdout and "RUNNING: using it" in proc.stdout


def test_ray_head_starts_a_stopped_head(box):
  box.set_states({"firewall-rules/r-ray": ["r-ray"], "instances/r-head": ["TERMINATED"]})
  box.ok("ray_head.sh", *_RAY)
  assert box.calls()[-1] == ["compute", "instances", "start", "r-head", *WHERE]


def test_ray_workers_join_the_head_with_their_chips(box):
  box.set_states({"instances/r-head": ["RUNNING"], "ip/r-head": ["10.1.2.3"]})
  dry, real = dry_and_real(box, "ray_workers.sh", *_RAY, "--spot")
  startup = box.tmp / "r-ray-worker.sh"
  flags = ["--spot", "--network=default", "--tags=r-ray"]
  flags += [f"--metadata-from-file=startup-script={startup}"]
  vm = lambda name: [describe_call("tpu-vm", name), _tpu_create(name, *flags)]
  assert gcloud_calls(dry) == real == [_HEAD_IP, *vm("r-0"), *vm("r-1")]
  script = startup.read_text()
  _check_script(startup)
  assert "--extras=tpu,elastic\n" in script
  start = _ray_start(script)
  assert start[:4] == ["/opt/dipaco/venv/bin/ray", "start", "--block", "--address=10.1.2.3:6379"]
  (resources,) = [a for a in start if a.startswith("--resources=")]
  assert json.loads(resources.split("=", 1)[1]) == {"TPU": 4}  # v5litepod-4: 4 chips, 1 host
  # The driver asks for one chip per worker actor and as many actors as the pool has chips.
  box.ok("ray_train.sh", *_RAY)
  command = box.calls()[-1][-1]
  assert "--config.elastic.num_workers=8" in command
  assert "'--config.elastic.worker_resources={\"TPU\": 1}'" in command
  # Again: every VM is there; nothing is created twice.
  box.ok("ray_workers.sh", *_RAY, "--spot")
  again = [_HEAD_IP, describe_call("tpu-vm", "r-0"), describe_call("tpu-vm", "r-1")]
  assert box.calls()[len(real) + 2 :] == again


@pytest.mark.parametrize(
  "accelerator, pool, chips, workers",
  [
    ("v5litepod-1", 8, 1, 8),
    ("v5litepod-8", 1, 8, 8),
    ("v5litepod-16", 2, 4, 32),  # 4 hosts of 4 chips each
    ("v4-8", 2, 4, 8),  # v4 and v5p sizes count cores, 2 per chip
    ("v5p-16", 1, 4, 8),
  ],
)
def test_ray_resources_follow_the_accelerator_type(box, accelerator, pool, chips, workers):
  box.set_states({"instances/r-head": ["RUNNING"]})
  args = [*BASE, f"--accelerator-type={accelerator}", f"--pool-size={pool}", *TRAIN]
  box.ok("ray_workers.sh", "--dry-run", *args, "--head-address=head.internal")
  start = _ray_start((box.tmp / "r-ray-worker.sh").read_text())
  assert start[3:5] == ["--address=head.internal:6379", f'--resources={{"TPU": {chips}}}']
  box.ok("ray_train.sh", *args)
  assert f"--config.elastic.num_workers={workers} " in box.calls()[-1][-1]


def test_ray_train_starts_the_elastic_driver_on_the_head(box):
  box.set_states({"instances/r-head": ["RUNNING"]})
  args = [*_RAY, "--restart", "--internal-ip", "--", "--config.elastic.num_workers=6"]
  dry, real = dry_and_real(box, "ray_train.sh", *args)
  start = (
    "sudo bash /opt/dipaco/dipaco_jax/launch/worker.sh start --venv=/opt/dipaco/venv "
    "--log-file=/opt/dipaco/driver.log --no-distributed --restart -- "
    "--config=configs/dipaco_2x4.py --workdir=gs://b/run --config.dipaco.mode=elastic "
    "--config.elastic.address=auto --config.elastic.num_workers=8 "
    "'--config.elastic.worker_resources={\"TPU\": 1}' --config.elastic.num_workers=6"
  )
  ssh = ["compute", "ssh", "r-head", *WHERE, f"--command={start}", "--internal-ip"]
  assert gcloud_calls(dry) == real == [_HEAD_STATUS, ssh]


@pytest.mark.parametrize(
  "script, args, message, calls",
  [
    (
      "ray_workers.sh",
      [],
      "no head address: the head VM r-head does not exist. Run ray_head.sh first, or pass "
      "--head-address=HOST",
      [_HEAD_IP],
    ),
    ("ray_workers.sh", ["--head-address=10.0.0.2:6379"], "give the host only", []),
    ("ray_workers.sh", ["--pool-size=0"], "--pool-size=0: need a whole number >= 1", []),
    ("ray_workers.sh", ["--node-count=2"], "the Ray pool is --pool-size single TPU VMs", []),
    ("ray_head.sh", ["--node-dir=opt/dipaco"], "--node-dir=opt/dipaco: need an absolute", []),
    ("ray_head.sh", ["--code-url=/tmp/c.tgz"], "--code-url=/tmp/c.tgz must be a gs://", []),
    ("ray_train.sh", [], "head r-head is absent, not RUNNING: run ray_head.sh", [_HEAD_STATUS]),
  ],
)
def test_ray_bad_input_gives_one_clear_error(box, script, args, message, calls):
  proc = box.run(script, *_RAY, *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert proc.stderr.count("error:") == 1
  assert box.calls() == calls


def test_ray_watch_recreates_a_preempted_vm_and_leaves_the_driver_alone(box):
  box.set_states(
    {
      "firewall-rules/r-ray": ["r-ray"],
      "instances/r-head": ["RUNNING"],
      "tpu-vm/r-0": ["READY", "PREEMPTED"],
      "tpu-vm/r-1": ["READY"],
    }
  )
  box.ok("ray_watch.sh", *_RAY, "--spot", "--max-polls=3")
  steps = []
  for c in box.calls():
    if c[:2] == ["compute", "tpus"]:
      steps.append(f"{c[3]} {c[4]}")
    elif c[:2] == ["compute", "ssh"]:
      steps.append("start driver" + (" --restart" if " --restart " in c[-1] else ""))
    elif c[:2] == ["storage", "ls"]:
      steps.append(f"ls {c[3]}")
    else:
      steps.append(f"{c[1]} {c[2]}")
  poll = ["instances describe", "instances describe", "describe r-0", "describe r-1"]
  assert steps == [
    "firewall-rules describe",
    *poll,
    "start driver",
    *poll[:3],
    "delete r-0",
    "create r-0",  # with the same startup script: it joins the head at boot
    "describe r-1",
    "ls gs://b/run/elastic/tasks.jsonl",  # the driver is left alone: no restart
    *poll,
    "ls gs://b/run/elastic/tasks.jsonl",
  ]
  (create,) = [c for c in box.calls() if c[3:4] == ["create"]]
  startup = box.tmp / "r-ray-worker.sh"
  assert create == _tpu_create(
    "r-0",
    "--spot",
    "--network=default",
    "--tags=r-ray",
    f"--metadata-from-file=startup-script={startup}",
  )
  assert "--address=10.128.0.2:6379" in _ray_start(startup.read_text())


def test_ray_delete_removes_the_pool_then_the_head(box):
  box.set_states({"instances/r-head": ["RUNNING"], "tpu-vm/r-1": ["PREEMPTED"]})
  box.ok("ray_delete.sh", *_RAY)
  assert box.calls() == [
    describe_call("tpu-vm", "r-0"),
    describe_call("tpu-vm", "r-1"),
    ["compute", "tpus", "tpu-vm", "delete", "r-1", *WHERE, "--quiet"],
    _HEAD_STATUS,
    ["compute", "instances", "delete", "r-head", *WHERE, "--quiet"],
  ]
