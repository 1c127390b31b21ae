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
  # pylint: disable=g-import-not-at-top
  from dipaco_jax.core import streaming
  from dipaco_jax.core import topology
  from dipaco_jax.runtime.elastic import coordinator
  from dipaco_jax.runtime.elastic import fragments

  # pylint: enable=g-import-not-at-top
  try:
    done = coordinator.read_results(workdir)
  except Exception:  # pylint: disable=broad-except  # Only said on the way out.
    return "its accepted tasks are stored"
  W, T = topology.from_config(config).num_workers, config.dipaco.outer_steps
  H, o = config.dipaco.inner_steps, config.outer
  F, tau = (o.fragments, o.overlap) if o.enabled else (1, 0)
  # The tasks' units (one a phase, unless streamed): their steps need no group split.
  s = fragments.Schedule(H, T, tuple(streaming.offset(f, F, H) for f in range(F - 1)), tau)
  u = 0
  while u < s.U and all(f"{u}/{w}" in done for w in range(W)):
    u += 1
  return (
    f"{len(done)} of {(s.U + 1) * W} tasks accepted (every worker past inner step "
    f"{s.span(u)[0]} of {T * H}), each one's outputs stored whole"
  )
