"""Transparent huge pages for XLA:CPU's buffers: the CLIs restart themselves once with them.

XLA:CPU allocates each step's temporaries with malloc; glibc serves large ones
with fresh mmaps and unmaps them on free, so every step faults its working set
in again, 4 KiB at a time. On the 2-core CPU the llama_toy step (4 paths, one
per fake device) took ~166,000 page faults and 0.39 s of system time per
step; with glibc's `glibc.malloc.hugetlb=1` tunable (madvise'd transparent huge
pages) it takes ~2,000 and 0.12 s, and tokens/s rose 37% (4,844 to 6,615, one
run each on a loaded machine: docs/results/performance.md).

A tunable is read when the process starts, so `maybe_reexec` runs the same
command again with it set, before any backend starts. It does so only where it
applies: Linux with glibc >= 2.35 and transparent huge pages not disabled.
DIPACO_MALLOC_HUGETLB=0 turns it off; an explicit glibc.malloc.hugetlb in
GLIBC_TUNABLES is kept as given.
"""

import os
import sys

ENV_SWITCH = "DIPACO_MALLOC_HUGETLB"
TUNABLE = "glibc.malloc.hugetlb"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, ...] | None:
  try:
    name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
  except (AttributeError, ValueError, OSError):
    return None
  return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None


def _thp_enabled(path: str = _THP) -> bool:
  try:
    with open(path, encoding="ascii") as f:
      return "[never]" not in f.read()
  except OSError:
    return False


def tuned_env(env: dict[str, str], glibc: tuple[int, ...] | None, thp: bool) -> dict | None:
  """The environment to restart with, or None when the tunable is set, off or useless here."""
  if env.get(ENV_SWITCH, "1") == "0" or TUNABLE in env.get("GLIBC_TUNABLES", ""):
    return None
  if glibc is None or glibc < (2, 35) or not thp:
    return None
  tunables = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), f"{TUNABLE}=1") if t)
  return {**env, "GLIBC_TUNABLES": tunables}


def maybe_reexec() -> None:
  """Restarts this command with huge-page malloc (see the module docstring), or returns."""
  env = tuned_env(dict(os.environ), _glibc_version(), _thp_enabled())
  if env is None or not getattr(sys, "orig_argv", None):
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)
