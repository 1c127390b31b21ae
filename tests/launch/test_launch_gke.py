"""launch/gke.sh: the spmd run as a JobSet on GKE, checked by dry runs (no cluster, no kubectl)."""

import os
import pathlib
import shlex
import subprocess

import pytest
import yaml

_LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"
_ARGS = [
  "--project=my-proj",
  "--zone=us-west4-a",
  "--cluster=tpu-cluster",
  "--name=d2x4",
  "--config=configs/dipaco_2x4.py",
  "--workdir=gs://b/run",
]


@pytest.fixture(name="env")
def _env(tmp_path):
  """HOME and TMPDIR in tmp_path, a git checkout with the config, no DIPACO_* settings."""
  repo = tmp_path / "repo"
  (repo / "configs").mkdir(parents=True)
  (repo / "configs" / "dipaco_2x4.py").write_text("# config\n")
  subprocess.run(["git", "init", "-q", str(repo)], check=True)
  subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
  env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
  env.update(HOME=str(tmp_path), TMPDIR=str(tmp_path), DIPACO_LOCAL_REPO=str(repo))
  return env


def gke(env, *args) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["bash", str(_LAUNCH / "gke.sh"), "--dry-run", *_ARGS, *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
    check=False,
  )


def commands(stdout: str) -> list[list[str]]:
  return [shlex.split(line) for line in stdout.splitlines() if not line.startswith("#")]


def manifest(env, name: str = "d2x4") -> dict:
  return yaml.safe_load(pathlib.Path(env["TMPDIR"], f"{name}-jobset.yaml").read_text())


def pod(m: dict) -> dict:
  return m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_a_multislice_run_is_one_jobset_of_one_job_per_slice(env):
  proc = gke(
    env, "--accelerator-type=v5litepod-16", "--node-count=2", "--spot", "--env=A=1", "--", "--x=1"
  )
  assert proc.returncode == 0, proc.stderr
  tar = f"{env['TMPDIR']}/d2x4-code.tar.gz"
  assert [c for c in commands(proc.stdout) if c[0] != "tar"] == [
    "gcloud container clusters get-credentials tpu-cluster --location=us-west4-a "
    "--project=my-proj".split(),
    "kubectl get jobset d2x4 -o name".split(),  # A dry run assumes it is absent.
    f"gcloud storage cp {tar} gs://b/run/code/dipaco_jax.tar.gz --project=my-proj".split(),
    f"kubectl apply -f {env['TMPDIR']}/d2x4-jobset.yaml".split(),
  ]
  m = manifest(env)
  assert (m["kind"], m["metadata"]["name"]) == ("JobSet", "d2x4")
  # One node pool per slice: the pods of a Job never straddle two.
  annotations = m["metadata"]["annotations"]
  assert (
    annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
  )
  job = m["spec"]["replicatedJobs"][0]
  # v5litepod-16: 16 chips, 4x4, four hosts of 4 chips; 2 slices.
  assert (job["name"], job["replicas"]) == ("slice", 2)
  assert job["template"]["spec"]["parallelism"] == job["template"]["spec"]["completions"] == 4
  spec = pod(m)
  assert spec["nodeSelector"] == {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
    "cloud.google.com/gke-tpu-topology": "4x4",
    "cloud.google.com/gke-spot": "true",
  }
  (container,) = spec["containers"]
  assert container["resources"]["limits"] == {"google.com/tpu": 4}
  env_vars = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
  assert env_vars == {
    "DIPACO_DISTRIBUTED": "1",
    "MEGASCALE_NUM_SLICES": "2",
    "MEGASCALE_SLICE_ID": {
      "fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}
    },
    "MEGASCALE_COORDINATOR_ADDRESS": "d2x4-slice-0-0.d2x4",  # Pod 0 of slice 0.
  }
  script = container["args"][0]
  assert container["command"] == ["bash", "-c"]
  assert subprocess.run(["bash", "-n", "-c", script], check=False).returncode == 0
  lines = script.splitlines()
  assert "gcloud storage cp gs://b/run/code/dipaco_jax.tar.gz /opt/dipaco/code.tar.gz" in lines
  install = shlex.split(next(line for line in lines if "worker.sh install" in line))
  assert install[1:4] == [
    "/opt/dipaco/dipaco_jax.new/launch/worker.sh",
    "install",
    "--remote-dir=/opt/dipaco/dipaco_jax",
  ]
  assert "--extras=tpu" in install
  assert shlex.split(lines[-1]) == [
    "exec", "env", "A=1", "/opt/dipaco/venv/bin/python", "-m", "dipaco_jax.main",
    "--config=configs/dipaco_2x4.py", "--workdir=gs://b/run", "--x=1",
  ]  # fmt: skip


@pytest.mark.parametrize(
  "accelerator, topology, hosts, chips",
  [
    ("v4-32", "2x2x4", 4, 4),  # 32 cores = 16 chips.
    ("v5p-128", "4x4x4", 16, 4),  # 64 chips.
    ("v6e-8", "2x4", 1, 8),  # One host of 8 chips.
    ("v5litepod-256", "16x16", 64, 4),
  ],
)
def test_each_accelerator_maps_to_gkes_topology_and_hosts(env, accelerator, topology, hosts, chips):
  proc = gke(env, f"--accelerator-type={accelerator}")
  assert proc.returncode == 0, proc.stderr
  m = manifest(env)
  assert pod(m)["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
  assert m["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == hosts
  assert pod(m)["containers"][0]["resources"]["limits"]["google.com/tpu"] == chips
  names = {e["name"] for e in pod(m)["containers"][0]["env"]}
  assert names == {"DIPACO_DISTRIBUTED"}  # One slice: no MEGASCALE variables.


def test_repo_url_clones_in_the_pod_and_uploads_nothing(env):
  proc = gke(env, "--repo-url=https://github.com/ORG/dipaco_jax", "--branch=v1")
  assert proc.returncode == 0, proc.stderr
  assert not [c for c in commands(proc.stdout) if c[:2] == ["gcloud", "storage"] or c[0] == "tar"]
  script = pod(manifest(env))["containers"][0]["args"][0]
  assert (
    "git clone --depth=1 --branch=v1 https://github.com/ORG/dipaco_jax "
    "/opt/dipaco/dipaco_jax.new" in script.splitlines()
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (["--cluster="], "--cluster=: give the GKE cluster's name"),
    (["--accelerator-type=v6e-8", "--node-count=2"], "GKE joins multi-host slices only"),
    (["--accelerator-type=v4-1536"], "768 chips have no GKE topology here"),
    (["--reserved", "--queued"], "on GKE the node pools hold the capacity"),
    (["--workdir=/tmp/run"], "must be a gs:// path"),
    (["--code-url=/tmp/code.tar.gz"], "must be a gs:// object"),
  ],
)
def test_bad_arguments_stop_before_any_command(env, args, message):
  proc = gke(env, *args)
  assert proc.returncode == 2, proc.stdout
  assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stdout == ""
  assert not pathlib.Path(env["TMPDIR"], "d2x4-jobset.yaml").exists()
