"""The launch tests' fixture: a fresh sandbox (launch_sandbox.py) per test."""

import pytest

from launch_sandbox import Sandbox


@pytest.fixture
def box(tmp_path):
  return Sandbox(tmp_path)
