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
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes",
  None,
  "Number of processes in the run (without --coordinator_address: of an offline job of "
  "independent processes, e.g. `route` writing 1/N of the shards each).",
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "This process's index in [0, num_processes)."
)


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


def process_index_and_count() -> tuple[int, int]:
  """This process's (index, count): jax's in a distributed run, else --process_id/--num_processes.

  Without jax.distributed, the flags describe an offline job of independent processes
  (`python -m dipaco_jax.route ... --num_processes=N --process_id=i`); unset: (0, 1).
  """
  if jax.process_count() > 1:
    return jax.process_index(), jax.process_count()
  count = 1 if _NUM_PROCESSES.value is None else _NUM_PROCESSES.value
  index = 0 if _PROCESS_ID.value is None else _PROCESS_ID.value
  return index, count


@flags.multi_flags_validator(["num_processes", "process_id"])
def _check_process_ids(values: dict) -> bool:
  """At flag parsing, before anything starts: 0 <= process_id < num_processes."""
  count = 1 if values["num_processes"] is None else values["num_processes"]
  index = 0 if values["process_id"] is None else values["process_id"]
  if count < 1 or not 0 <= index < count:
    raise flags.ValidationError(
      f"--process_id={values['process_id']} --num_processes={values['num_processes']}: need "
      "num_processes >= 1 and 0 <= process_id < num_processes."
    )
  return True
