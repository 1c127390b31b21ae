"""launch/project.sh (step 0), service accounts and internal IPs."""

import pytest

from launch_sandbox import BASE
from launch_sandbox import MULTI
from launch_sandbox import WHERE
from launch_sandbox import gcloud_calls
from launch_sandbox import printed
from launch_sandbox import ssh_call

# --- step 0, service account, internal IPs -----------------------------------------------------

_SA = "tpu@my-proj.iam.gserviceaccount.com"
_ENABLE = [
  "services",
  "enable",
  "tpu.googleapis.com",
  "compute.googleapis.com",
  "--project=my-proj",
]


def _bucket(verb, bucket, *flags):
  return ["storage", "buckets", verb, bucket, "--project=my-proj", *flags]


def _grant(bucket, account):
  return _bucket(
    "add-iam-policy-binding",
    bucket,
    f"--member=serviceAccount:{account}",
    "--role=roles/storage.objectAdmin",
  )


def test_project_enables_apis_makes_the_bucket_and_grants_the_tpu_account(box):
  args = ["--project=my-proj", "--zone=us-west4-a", "--workdir=gs://my-bucket/runs/x"]
  describe = _bucket("describe", "gs://my-bucket", "--format=value(name)")
  create = _bucket(
    "create", "gs://my-bucket", "--location=us-west4", "--uniform-bucket-level-access"
  )
  number = ["projects", "describe", "my-proj", "--format=value(projectNumber)"]
  dry = box.ok("project.sh", "--dry-run", *args)
  assert box.calls() == []
  default_account = "PROJECT_NUMBER-compute@developer.gserviceaccount.com"
  assert gcloud_calls(printed(dry.stdout)) == [
    _ENABLE,
    describe,
    create,
    number,
    _grant("gs://my-bucket", default_account),
  ]
  real = box.ok("project.sh", *args)
  default_account = "123456789012-compute@developer.gserviceaccount.com"  # the fake's number
  assert box.calls() == [
    _ENABLE,
    describe,
    create,
    number,
    _grant("gs://my-bucket", default_account),
  ]
  assert gcloud_calls(printed(real.stdout, "+ ")) == box.calls()


def test_project_reuses_a_bucket_and_grants_the_given_account(box):
  box.set_states({"buckets/gs://team-b": ["team-b"]})
  proc = box.ok("project.sh", "--project=my-proj", "--bucket=team-b/", f"--service-account={_SA}")
  assert box.calls() == [
    _ENABLE,
    _bucket("describe", "gs://team-b", "--format=value(name)"),
    _grant("gs://team-b", _SA),
  ]
  assert "gs://team-b exists: using it" in proc.stdout


@pytest.mark.parametrize(
  "args, message",
  [
    ([], "no bucket: pass --bucket=gs://NAME"),
    (["--bucket=gs://My_Bucket"], "--bucket=gs://My_Bucket: a bucket name is"),
    (["--bucket=b", "--service-account=me"], "--service-account=me is not a service account"),
    (["--bucket=bb", "--zone=west"], "--zone=west is not a zone name"),
  ],
)
def test_project_bad_argument_stops_before_gcloud(box, args, message):
  proc = box.run("project.sh", "--project=my-proj", *args)
  assert proc.returncode == 2 and message in proc.stderr
  assert box.calls() == []


def test_create_with_service_account_and_internal_ips(box):
  flags = [f"--service-account={_SA}", "--internal-ip"]
  box.ok("create.sh", *BASE, "--accelerator-type=v4-8", *flags, "--spot")
  assert box.calls()[-1][5:] == [
    *WHERE,
    "--accelerator-type=v4-8",
    "--version=tpu-ubuntu2204-base",
    f"--service-account={_SA}",
    "--internal-ips",
    "--spot",
  ]
  box.ok("create.sh", *MULTI, "--name=q", *flags)
  assert box.calls()[-1][2:5] == ["queued-resources", "create", "q"]
  assert box.calls()[-1][-4:] == [
    "--node-count=2",
    "--node-prefix=q",
    f"--service-account={_SA}",
    "--internal-ips",
  ]


def test_internal_ip_reaches_the_workers_by_internal_ip(box):
  box.set_states({"tpu-vm/r": ["READY"]})
  box.ok("setup.sh", *BASE, "--internal-ip")
  box.ok("logs.sh", *BASE, "--internal-ip", "--no-follow")
  scp, ssh, tail = [c for c in box.calls() if c[3] in ("scp", "ssh")]
  assert scp[3:] == [
    "scp",
    f"{box.tmp}/r-code.tar.gz",
    "r:dipaco_jax.tar.gz",
    *WHERE,
    "--worker=all",
    "--internal-ip",
  ]
  assert ssh[-1] == tail[-1] == "--internal-ip"
  assert tail[:-1] == ssh_call("r", "tail -n 100 dipaco_train.log", worker="0")
