"""Elastic mode (config.dipaco.mode="elastic"): DiPaCo on a preemptible Ray worker pool.

docs/elastic.md. Ray is imported only when a run starts, so importing this
package (the spmd trainer does, for the workdir check) needs no Ray.
"""

from dipaco_jax.runtime.elastic.errors import ElasticConfigError
from dipaco_jax.runtime.elastic.errors import check_workdir_mode
from dipaco_jax.runtime.elastic.errors import mode
from dipaco_jax.runtime.elastic.errors import started


def run(config, workdir: str) -> dict:
  """Trains (or resumes) `workdir` in elastic mode (dipaco_jax/runtime/elastic/driver.py)."""
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  return driver.run(config, workdir)


def steps_done(workdir: str, config) -> int | None:
  """Inner steps every worker has done (whole phases accepted), from the run's storage."""
  from dipaco_jax.core import topology  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import coordinator  # pylint: disable=g-import-not-at-top

  try:
    done = coordinator.read_results(workdir)
  except Exception:  # pylint: disable=broad-except  # Only said on the way out.
    return None
  W, T = topology.from_config(config).num_workers, config.dipaco.outer_steps
  t = 0
  while t < T and all(f"{t}/{w}" in done for w in range(W)):
    t += 1
  return t * config.dipaco.inner_steps
