"""Shared flags and start-up of the routing CLIs (route, evaluate, serve)."""

import jax
from absl import flags
from ml_collections import config_flags

from dipaco_jax import config_defaults
from dipaco_jax import distributed


def define_flags():
  """--config (configs/*.py, overridable) and --workdir, both required."""
  config = config_flags.DEFINE_config_file(
      "config", None, "Config file (configs/*.py) of the run; override fields with "
      "--config.section.field=value.", lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, "The run's directory (as given to "
                                "dipaco_jax.main): checkpoints, router, shards.")
  flags.mark_flags_as_required(["config", "workdir"])
  return config, workdir


def start(config) -> None:
  """Checks θ̄ is given; CPU device split (config.mesh.cpu_devices) and jax.distributed."""
  config_defaults.check_init_from(config)  # Router features read θ̄ (init_from).
  cpu_devices = config.mesh.get("cpu_devices", 0)
  if cpu_devices:
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  distributed.initialize()
