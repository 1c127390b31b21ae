"""Writes constraints.txt: the tested version of every package setup.py pulls in.

  python tools/freeze_constraints.py            # rewrites constraints.txt from this environment
  python tools/freeze_constraints.py --check    # exits 1 if constraints.txt differs from it

Run it in the venv where the tests pass. It follows setup.py's requirements (install_requires and
every extra) through the installed packages' own requirements, as pip would resolve them on this
platform, and pins each package found at its installed version. pip, setuptools and wheel are
build tools, not pinned; dipaco_jax itself is not listed; nor is the `cuda` extra, which installs
only on a GPU host (UNPINNED_EXTRAS). CI and launch/worker.sh install with
`-c constraints.txt`, so a new dependency in setup.py needs this rerun (tests/test_constraints.py
says so).
"""

import argparse
import difflib
import os
import platform
import runpy
import sys
from importlib import metadata
from unittest import mock

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, "constraints.txt")
_UNPINNED = {"pip", "setuptools", "wheel", "dipaco-jax"}
# Extras for hardware no test host has: their packages do not install here, so nothing of theirs
# is pinned. jax's own extra behind each pins its plugin to jax's version, which this file pins
# (tests/test_constraints.py checks that).
UNPINNED_EXTRAS = {"cuda": "jax[cuda12], for CUDA GPU hosts"}


def setup_kwargs(setup_py: str = os.path.join(ROOT, "setup.py")) -> dict:
  """The arguments setup.py passes to setuptools.setup, read without building."""
  captured = {}
  with mock.patch("setuptools.setup", lambda **kwargs: captured.update(kwargs)):
    runpy.run_path(setup_py, run_name="__main__")
  return captured


def setup_requirements(setup_py: str = os.path.join(ROOT, "setup.py")) -> list[str]:
  """install_requires and the requirements of every extra but UNPINNED_EXTRAS."""
  captured = setup_kwargs(setup_py)
  reqs = list(captured.get("install_requires", []))
  for name, extra_reqs in captured.get("extras_require", {}).items():
    if name not in UNPINNED_EXTRAS:
      reqs += extra_reqs
  return reqs


def _applies(req: Requirement, extras: set[str]) -> bool:
  """Whether req is needed here when its parent was asked for with these extras."""
  if req.marker is None:
    return True
  return any(req.marker.evaluate({"extra": e}) for e in extras | {""})


def closure(requirements: list[str]) -> dict[str, str]:
  """{distribution name: installed version} for everything the requirements pull in."""
  todo = [(Requirement(r), {""}) for r in requirements]
  seen_extras: dict[str, set[str]] = {}
  pinned = {}
  while todo:
    req, parent_extras = todo.pop()
    if not _applies(req, parent_extras):
      continue
    key = canonicalize_name(req.name)
    extras = set(req.extras)
    if key in seen_extras and extras <= seen_extras[key]:
      continue
    seen_extras[key] = seen_extras.get(key, set()) | extras
    try:
      dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
      sys.exit(
        f"error: {req.name} (required as '{req}') is not installed in {sys.prefix}: "
        "install the project first (pip install -e '.[test]')"
      )
    if key not in _UNPINNED:
      pinned[dist.metadata["Name"]] = dist.version
    for sub in dist.requires or []:
      todo.append((Requirement(sub), seen_extras[key]))
  return pinned


def render(pinned: dict[str, str]) -> str:
  """The constraints file's text: a header saying where it comes from, then name==version."""
  header = [
    "# The tested version of every package `pip install -e '.[test]'` pulls in: CI and",
    "# launch/worker.sh install with `-c constraints.txt`. Made by tools/freeze_constraints.py",
    f"# on Python {sys.version_info.major}.{sys.version_info.minor}, {sys.platform} "
    f"{platform.machine()}; rerun it after changing setup.py.",
    *(f"# Not pinned: the `{name}` extra ({why})." for name, why in UNPINNED_EXTRAS.items()),
  ]
  body = [f"{name}=={pinned[name]}" for name in sorted(pinned, key=str.lower)]
  return "\n".join(header + body) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=CONSTRAINTS)
  parser.add_argument("--check", action="store_true", help="compare instead of writing")
  args = parser.parse_args()
  text = render(closure(setup_requirements()))
  if args.check:
    with open(args.out) as f:
      old = f.read()
    if old != text:
      diff = difflib.unified_diff(
        old.splitlines(), text.splitlines(), args.out, "installed", n=0, lineterm=""
      )
      sys.exit("\n".join(diff) + f"\n{args.out} is stale: rerun python tools/freeze_constraints.py")
    print(f"{args.out} matches this environment")
    return
  with open(args.out, "w") as f:
    f.write(text)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
