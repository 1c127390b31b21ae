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


def progress_line(workdir: str, config) -> str:
  """How far an elastic run got, from its storage: accepted tasks, inner steps every worker did."""
  from dipaco_jax.core import topology  # pylint: disable=g-import-not-at-top
  from dipaco_jax.runtime.elastic import coordinator  # pylint: disable=g-import-not-at-top

  try:
    done = coordinator.read_results(workdir)
  except Exception:  # pylint: disable=broad-except  # Only said on the way out.
    return "its accepted tasks are stored"
  W, T = topology.from_config(config).num_workers, config.dipaco.outer_steps
  t = 0
  while t < T and all(f"{t}/{w}" in done for w in range(W)):
    t += 1
  return (
    f"{len(done)} of {(T + 1) * W} tasks accepted (every worker past inner step "
    f"{t * config.dipaco.inner_steps} of {T * config.dipaco.inner_steps}), each one's outputs "
    "stored whole"
  )
