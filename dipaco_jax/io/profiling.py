"""config.profile's window: a jax.profiler trace of inner steps [start, start + n).

Both runtimes trace the same window of global inner steps: the spmd loop into the workdir,
an elastic worker's task into <workdir>/profile/w<worker> (one trace per worker: actors on
one host would otherwise write the same file). TensorBoard's profile tab finds them under
`tensorboard --logdir <workdir>`. Off (num_steps = 0), each call is one comparison.
"""

import jax
from absl import logging


class Window:
  """Starts a trace before the window's first step a run reaches, stops after its last."""

  def __init__(self, config, logdir: str):
    self.first = config.profile.start_step
    self.last = self.first + config.profile.num_steps - 1 if config.profile.num_steps else -1
    self.logdir = logdir
    self.active = False

  def before(self, step: int) -> None:
    """Call before inner step `step` (counted from 1) is dispatched."""
    if self.last < 0 or self.active or not self.first <= step <= self.last:
      return
    jax.profiler.start_trace(self.logdir)
    self.active = True
    logging.info(
      "profiling inner steps %d-%d into %s/plugins/profile", step, self.last, self.logdir
    )

  def after(self, step: int, params) -> None:
    """Call after step `step`; `params`: its output, waited for so its work is in the trace."""
    if self.active and step >= self.last:
      jax.block_until_ready(params)
      self.close()

  def close(self) -> None:
    """Stops a trace still running (a task or a run that ends inside the window)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
