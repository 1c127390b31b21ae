r"""The device bundle: what an air-gapped GPU host needs beside the code, in one folder.

  python benchmarks/device_bundle.py                     # -> .device_bundle/ (git ignores it)
  python benchmarks/device_bundle.py --out=DIR --python_version=3.12

On a machine that reaches a package index: downloads the wheels of the packages that
benchmarks/device_check.py imports and that a GPU image with jax, flax, optax, orbax-checkpoint,
tensorboard and sentencepiece lacks (PACKAGES, at constraints.txt's versions, for the host's
Python and x86-64 Linux; a pure-Python sdist is built into a wheel here), and prepares the
embedded corpus' shards of the check's tiny run into DIR/cache (the trainer copies them
instead of tokenizing). The whole must stay under --cap_mib (64 MiB: what a device run
carries); over it, one line names the size and the largest parts. Prints the one command that
installs it offline (also in docs/tpu.md):

  python3 -m pip install -q --no-index --no-deps --find-links .device_bundle/wheels \
    -r .device_bundle/requirements.txt
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = ".device_bundle"  # Under the repo root; .gitignore ignores it.
WHEELS, CACHE, REQUIREMENTS = "wheels", "cache", "requirements.txt"
CAP_MIB = 64
# What device_check.py and its phases import beyond such an image, by distribution name: found
# by running the check's dry run in a venv holding only jax, flax, optax, orbax-checkpoint,
# tensorboard, sentencepiece (their dependencies) and these. tfds's declared pyarrow, requests,
# attrs and googleapis-common-protos are not imported on this path, so not carried.
PACKAGES = (
  "ml-collections",
  "tensorflow-datasets",
  "array-record",
  "dm-tree",
  "immutabledict",
  "promise",
  "six",
  "simple-parsing",
  "docstring-parser",
  "tensorflow-metadata",
  "termcolor",
  "toml",
  "tqdm",
  "wrapt",
  "safetensors",
  "importlib-resources",  # tfds imports it, undeclared, when it prepares the corpus.
)
# The modules device_check.py imports before it starts (a missing one is its one-line error).
NEEDED_MODULES = (
  "ml_collections",
  "array_record",
  "tensorflow_datasets",
  "dipaco_jax.core.experiment",
  "dipaco_jax.data",
)
# pip's platform tags for x86-64 Linux wheels (pip matches each tag exactly).
PLATFORMS = ("manylinux2014_x86_64",) + tuple(f"manylinux_2_{n}_x86_64" for n in range(17, 40))


class BundleError(Exception):
  """The bundle cannot be built as asked: one line, what and the fix."""


def install_command(bundle: str = DEFAULT_DIR) -> str:
  """The one line that installs the bundle's wheels with no network (run in the repo root)."""
  return (
    f"python3 -m pip install -q --no-index --no-deps --find-links {bundle}/{WHEELS} "
    f"-r {bundle}/{REQUIREMENTS}"
  )


def pins(names=PACKAGES, constraints: str = os.path.join(ROOT, "constraints.txt")) -> list[str]:
  """`name==version` of each package as constraints.txt pins it (a BundleError where it doesn't)."""
  with open(constraints) as f:
    pinned = dict(
      (_norm(m.group(1)), m.group(2))
      for m in (re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line) for line in f)
      if m
    )
  missing = [n for n in names if _norm(n) not in pinned]
  if missing:
    raise BundleError(
      f"constraints.txt pins no version of {missing}: add them to pyproject.toml and "
      "regenerate constraints.txt (README)."
    )
  return [f"{n}=={pinned[_norm(n)]}" for n in names]


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def check_size(path: str, cap_mib: float = CAP_MIB) -> int:
  """The folder's bytes; a BundleError naming its size and largest parts when over the cap."""
  total = folder_bytes(path)
  if total > cap_mib * 2**20:
    parts = sorted(
      (
        (folder_bytes(p) if os.path.isdir(p) else os.path.getsize(p), name)
        for name in os.listdir(path)
        for p in [os.path.join(path, name)]
      ),
      reverse=True,
    )
    largest = ", ".join(f"{name} {size / 2**20:.1f} MiB" for size, name in parts[:3])
    raise BundleError(
      f"the bundle {path} is {total / 2**20:.1f} MiB, over the {cap_mib:g} MiB a device run "
      f"carries (largest: {largest}): drop a package from PACKAGES or the prepared cache."
    )
  return total


def download(pin: str, wheels: str, python_version: str) -> None:
  """One wheel of `pin` for the target Python on x86-64 Linux; a pure-Python sdist built here."""
  pip = [sys.executable, "-m", "pip", "-q"]
  tags = [f"--platform={p}" for p in PLATFORMS]
  binary = pip + [
    "download",
    "--no-deps",
    "--only-binary=:all:",
    f"--python-version={python_version}",
  ]
  p = subprocess.run(
    binary + ["--implementation=cp", *tags, "-d", wheels, pin], capture_output=True, text=True
  )
  if p.returncode == 0:
    return
  with tempfile.TemporaryDirectory() as tmp:  # An sdist only (promise): build its wheel.
    q = subprocess.run(pip + ["wheel", "--no-deps", "-w", tmp, pin], capture_output=True, text=True)
    built = os.listdir(tmp) if q.returncode == 0 else []
    if len(built) != 1 or not built[0].endswith("-py3-none-any.whl"):
      raise BundleError(
        f"pip found no wheel of {pin} for Python {python_version} on x86-64 Linux and built no "
        f"pure-Python one ({(p.stderr or q.stderr).strip().splitlines()[-1:]}): pick another "
        "version in constraints.txt, or drop it from PACKAGES."
      )
    shutil.move(os.path.join(tmp, built[0]), wheels)


# The device check's tiny spmd run (its trainer phase), whose shards the bundle prepares.
TRAINER_CONFIG = "configs/tiny.py"
SUBSAMPLE = 20  # The tiny run's share of the corpus: 1 document in 20.


def trainer_command(workdir: str, dry_run: bool) -> list[str]:
  """The tiny spmd run: a few inner steps, two outer steps, evaluation and a checkpoint.

  One document in SUBSAMPLE: shards (what the bundle prepares) written in seconds, ~700k
  tokens, 4x what the GPU run trains on (40 steps x 4 paths x 8 x 128).
  """
  H = 2 if dry_run else 20
  fields = {
    "data.subsample": SUBSAMPLE,
    "dipaco.inner_steps": H,
    "dipaco.outer_steps": 2,
    "eval.every_steps": 2 * H,
    "eval.batches": 2,
    "ckpt.every_steps": 2 * H,
    "log_every_steps": H,
  }
  cmd = [sys.executable, "-m", "dipaco_jax.main", f"--config={TRAINER_CONFIG}"]
  return cmd + [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in fields.items()]


def prepare_cache(cache: str) -> None:
  """The check's tiny run's shards, prepared once into `cache` (its DIPACO_CACHE_DIR)."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, DIPACO_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = trainer_command(os.path.join(tmp, "run"), dry_run=True)
    p = subprocess.run(
      cmd + ["--config.stop_at_step=1"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if p.returncode != 0:
      raise BundleError(f"preparing the shards failed: {p.stderr.strip().splitlines()[-1:]}")
  # A run that finds its shards in the cache copies them and reads no corpus: tfds's prepared
  # copy (24 MiB) stays behind (a host that misses the cache prepares it from the shipped text).
  shutil.rmtree(os.path.join(cache, "tfds"), ignore_errors=True)


def build(out: str, python_version: str, cap_mib: float) -> int:
  """Wheels, their requirements file and the prepared shards in `out`; its size in bytes."""
  wanted = pins()
  if os.path.exists(out):
    shutil.rmtree(out)
  wheels = os.path.join(out, WHEELS)
  os.makedirs(wheels)
  for pin in wanted:
    download(pin, wheels, python_version)
  with open(os.path.join(out, REQUIREMENTS), "w") as f:
    f.write("\n".join(wanted) + "\n")
  prepare_cache(os.path.join(out, CACHE))
  return check_size(out, cap_mib)


def main(argv) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.path.join(ROOT, DEFAULT_DIR), help="the bundle's folder")
  p.add_argument("--python_version", default="3.12", help="the GPU host's Python (X.Y)")
  p.add_argument("--cap_mib", type=float, default=CAP_MIB, help="the most the bundle may weigh")
  args = p.parse_args(argv)
  try:
    size = build(args.out, args.python_version, args.cap_mib)
  except BundleError as e:
    print(f"device_bundle: {e}", file=sys.stderr)
    return 1
  rel = os.path.relpath(args.out, ROOT)
  print(f"wrote {args.out}: {size / 2**20:.1f} MiB")
  print(f"install on the device host, in the repo root: {install_command(rel)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
