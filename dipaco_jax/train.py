"""Training in either runtime: `train_and_evaluate(config, workdir)`.

Checks the config and the workdir before anything is written, then runs the
synchronous SPMD loop (runtime/spmd.py) or the elastic Ray pool
(runtime/elastic/), as config.dipaco.mode says. Both run the same recipe
(core/recipe.py) and write the same checkpoints; a rerun resumes.
"""

from typing import Any

from etils import epath

from dipaco_jax import config_check
from dipaco_jax import saved_config
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime import elastic
from dipaco_jax.runtime import spmd


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) the run in `workdir`; returns the final metrics."""
  config_check.validate(config)
  elastic.check_workdir_mode(workdir, config.dipaco.mode)
  path = epath.Path(workdir)
  started = bool(checkpoint.steps(workdir)) or elastic.started(workdir)
  saved_config.check_matches(path, config, started=started, may_grow=config.dipaco.mode == "spmd")
  if not started:  # An earlier attempt that saved nothing never blocks this one.
    saved_config.set_aside_earlier_attempt(path, config)
  if config.dipaco.mode == "elastic":  # The Ray worker pool.
    return elastic.run(config, workdir)
  return spmd.run(config, workdir)
