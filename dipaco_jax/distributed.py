"""Multi-process start-up: `jax.distributed.initialize` when launched on several hosts."""

import os

import jax
from absl import flags
from absl import logging

_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  None,
  "host:port of process 0 (multi-process runs off TPU; TPU VMs detect it).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def initialize() -> None:
  """Starts jax.distributed for multi-host runs; a no-op for one process."""
  explicit = _COORDINATOR.value is not None
  if explicit:
    if _NUM_PROCESSES.value is None or _PROCESS_ID.value is None:
      raise flags.ValidationError("--coordinator_address needs --num_processes and --process_id.")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  elif os.environ.get("DIPACO_DISTRIBUTED") == "1":
    jax.distributed.initialize()  # TPU VMs: everything is auto-detected.
  else:
    return
  logging.info(
    "process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
