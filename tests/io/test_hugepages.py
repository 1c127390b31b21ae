"""The CLIs' restart with huge-page malloc (dipaco_jax/io/hugepages.py)."""

import os
import subprocess
import sys

import pytest

from dipaco_jax.io import hugepages

import helpers


@pytest.mark.parametrize(
  "env,glibc,thp,want",
  [
    ({}, (2, 36), True, "glibc.malloc.hugetlb=1"),
    # Other tunables are kept, the new one appended.
    (
      {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
      (2, 36),
      True,
      "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1",
    ),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), True, None),  # The user's choice.
    ({"DIPACO_MALLOC_HUGETLB": "0"}, (2, 36), True, None),  # Switched off.
    ({}, (2, 34), True, None),  # glibc before the tunable existed.
    ({}, None, True, None),  # Not glibc (musl, macOS).
    ({}, (2, 36), False, None),  # Transparent huge pages disabled.
  ],
)
def test_tuned_env(env, glibc, thp, want):
  got = hugepages.tuned_env(env, glibc, thp)
  assert (None if got is None else got["GLIBC_TUNABLES"]) == want
  if got is not None:
    assert {k: v for k, v in got.items() if k != "GLIBC_TUNABLES"} == {
      k: v for k, v in env.items() if k != "GLIBC_TUNABLES"
    }


def test_thp_setting_is_read_from_the_kernel_file(tmp_path):
  f = tmp_path / "enabled"
  f.write_text("always [madvise] never\n")
  assert hugepages._thp_enabled(str(f))  # pylint: disable=protected-access
  f.write_text("always madvise [never]\n")
  assert not hugepages._thp_enabled(str(f))  # pylint: disable=protected-access
  assert not hugepages._thp_enabled(str(tmp_path / "missing"))  # pylint: disable=protected-access


@pytest.mark.cli
def test_a_command_restarts_once_with_the_tunable():
  # The child prints its tunables after maybe_reexec: set once, by exactly one restart.
  code = (
    "import os, sys; from dipaco_jax.io import hugepages; "
    "print('start', flush=True); hugepages.maybe_reexec(); "
    "print(os.environ.get('GLIBC_TUNABLES', ''))"
  )
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.ENV_SWITCH)}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, cwd=helpers.ROOT, capture_output=True, text=True
  ).stdout.split()
  expected = hugepages.tuned_env(env, hugepages._glibc_version(), hugepages._thp_enabled())  # pylint: disable=protected-access
  if expected is None:  # This host cannot use it: no restart.
    assert out == ["start", ""]
  else:
    assert out == ["start", "start", "glibc.malloc.hugetlb=1"]
