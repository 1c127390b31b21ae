"""The AOT tool: a run's steps compiled for a TPU topology on any host, and what they need.

compile.py: the chips, the described devices, compiling and reading costs off a
program; report.py: `Report`, the numbers per step; command.py: `python -m
dipaco_jax.aot` (its usage: __main__.py's docstring, which --help prints).
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import os

# Compiling needs libtpu's client but no TPU: don't contend for the lock a
# running TPU job (or any jax process in this environment) holds.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # No local backend but the host's.

from dipaco_jax.aot.command import format_report
from dipaco_jax.aot.command import ok
from dipaco_jax.aot.compile import CHIPS
from dipaco_jax.aot.compile import FIT_FRACTION
from dipaco_jax.aot.compile import AotError
from dipaco_jax.aot.compile import Chip
from dipaco_jax.aot.compile import OutOfMemory
from dipaco_jax.aot.compile import abstract_batch
from dipaco_jax.aot.compile import check_topology
from dipaco_jax.aot.compile import chip_of
from dipaco_jax.aot.compile import collective_table
from dipaco_jax.aot.compile import devices_per_chip
from dipaco_jax.aot.compile import kernel_flops
from dipaco_jax.aot.compile import per_device_bytes
from dipaco_jax.aot.compile import topology_devices
from dipaco_jax.aot.report import Report
