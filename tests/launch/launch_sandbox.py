"""The launch scripts' sandbox: a fake gcloud on PATH that records every call, and its readers."""

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
FAKE_GCLOUD = ROOT / "tests" / "testdata" / "launch" / "gcloud"
WHERE = ["--zone=us-west4-a", "--project=my-proj"]
BASE = ["--project=my-proj", "--zone=us-west4-a", "--name=r"]
MULTI = BASE + ["--accelerator-type=v5litepod-16", "--node-count=2"]
TRAIN = ["--config=configs/dipaco_2x4.py", "--workdir=gs://b/run"]


class Sandbox:
  """A HOME, a fake gcloud and date first on PATH, gcloud's call log and state, a tiny git repo."""

  def __init__(self, tmp: pathlib.Path):
    self.tmp = tmp
    self.bin = tmp / "bin"
    self.bin.mkdir()
    # The fake gcloud runs on this interpreter: `env python3` may be a slow pyenv shim.
    fake = FAKE_GCLOUD.read_text().split("\n", 1)[1]
    (self.bin / "gcloud").write_text(f"#!{sys.executable}\n{fake}")
    (self.bin / "gcloud").chmod(0o755)
    shutil.copy(FAKE_GCLOUD.parent / "date", self.bin / "date")
    self.clock = tmp / "clock"
    self.log = tmp / "calls.jsonl"
    self.state = tmp / "state.json"
    self.repo = tmp / "repo"
    (self.repo / "configs").mkdir(parents=True)
    (self.repo / "configs" / "dipaco_2x4.py").write_text("# config\n")
    (self.repo / ".gitignore").write_text(".venv/\n")
    (self.repo / ".venv").mkdir()
    (self.repo / ".venv" / "big").write_text("left out\n")
    subprocess.run(["git", "init", "-q", str(self.repo)], check=True)
    subprocess.run(["git", "-C", str(self.repo), "add", "."], check=True)
    (self.repo / "untracked.txt").write_text("copied too\n")
    self.env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
    self.env.update(
      PATH=f"{self.bin}:{os.environ['PATH']}",
      HOME=str(tmp),
      TMPDIR=str(tmp),
      FAKE_GCLOUD_LOG=str(self.log),
      FAKE_GCLOUD_STATE=str(self.state),
      FAKE_CLOCK=str(self.clock),
      REAL_DATE=shutil.which("date"),
      DIPACO_LOCAL_REPO=str(self.repo),
      DIPACO_POLL_SECONDS="0",
    )

  def set_states(self, states: dict[str, list[str]]):
    self.state.write_text(json.dumps(states))

  def run(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
      ["bash", str(LAUNCH / script), *args],
      capture_output=True,
      text=True,
      env={**self.env, **env},
      timeout=60,
      check=False,
    )

  def ok(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
    proc = self.run(script, *args, **env)
    assert proc.returncode == 0, proc.stderr
    return proc

  def calls(self) -> list[list[str]]:
    if not self.log.exists():
      return []
    return [json.loads(line) for line in self.log.read_text().splitlines()]


def printed(stdout: str, prefix: str = "") -> list[list[str]]:
  """The commands a run printed (dry run: bare lines; real run: '+ ' lines), as argv lists."""
  out = []
  for line in stdout.splitlines():
    if line.startswith("#") or not line.startswith(prefix):
      continue
    out.append(shlex.split(line[len(prefix) :]))
  return out


def gcloud_calls(cmds):
  return [c[1:] for c in cmds if c[0] == "gcloud"]


def dry_and_real(box, script, *args):
  """Runs a script as a dry run and for real; checks both print the same commands."""
  dry = box.ok(script, "--dry-run", *args)
  assert box.calls() == [], "a dry run must not call gcloud"
  real = box.ok(script, *args)
  assert printed(real.stdout, "+ ") == printed(dry.stdout)
  return printed(dry.stdout), box.calls()


def describe_call(group, name, fmt="state"):
  return ["compute", "tpus", group, "describe", name, *WHERE, f"--format=value({fmt})"]


QR_DESCRIBE = describe_call("queued-resources", "r", "state.state")
VM_DESCRIBE = describe_call("tpu-vm", "r")
MULTI_READY = [QR_DESCRIBE, describe_call("tpu-vm", "r-0"), describe_call("tpu-vm", "r-1")]


def ssh_call(node, command, worker="all"):
  return [
    "compute",
    "tpus",
    "tpu-vm",
    "ssh",
    node,
    *WHERE,
    f"--worker={worker}",
    f"--command={command}",
  ]


def call_steps(calls):
  """Each call as 'verb name' (ssh: start/install, +restart when it replaces; ls: metrics)."""
  out = []
  for c in calls:
    if c[:3] == ["storage", "ls", "-l"]:
      out.append(f"ls {c[3]}")
      continue
    verb, name = c[3], c[4]
    if verb == "scp":
      name = c[5].split(":")[0]
    elif verb == "ssh":
      command = next(a for a in c if a.startswith("--command="))
      verb = "start" if " start " in command else "install"
      verb += "+restart" if "--restart" in command else ""
    out.append(f"{verb} {name}")
  return out
