"""Dispatch ahead (config.dispatch_ahead), the same in both runtimes' loops."""

import jax


def dispatch_ahead(config, backend: str | None = None) -> bool:
  """Whether a loop reads step t's metrics after dispatching step t+1 (docs/performance.md).

  On an accelerator that keeps the device busy while the host reads, logs and guards. On CPU
  the host is the device, so "auto" leaves it off; "on" still waits on every step, one late.
  """
  if config.dispatch_ahead == "auto":
    return (backend or jax.default_backend()) in ("tpu", "gpu")
  return config.dispatch_ahead == "on"
