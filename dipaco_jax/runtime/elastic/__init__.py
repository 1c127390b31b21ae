"""Elastic mode (config.dipaco.mode="elastic"): DiPaCo on a preemptible Ray worker pool.

docs/elastic.md. Ray is imported only when a run starts, so importing this
package (the spmd trainer does, for the workdir check) needs no Ray.
"""

from dipaco_jax.runtime.elastic.errors import ElasticConfigError
from dipaco_jax.runtime.elastic.errors import check_workdir_mode
from dipaco_jax.runtime.elastic.errors import started


def run(config, workdir: str, faults=None) -> dict:
  """Trains (or resumes) `workdir` in elastic mode (dipaco_jax/runtime/elastic/driver.py).

  faults: runtime/faults.Faults to inject (tests, benchmarks); None for none.
  """
  from dipaco_jax.runtime.elastic import driver  # pylint: disable=g-import-not-at-top

  return driver.run(config, workdir, faults)
