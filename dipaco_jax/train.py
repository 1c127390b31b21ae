"""Training in either runtime: `train_and_evaluate(config, workdir)`.

Checks the config and the workdir before anything is written, then runs the
synchronous SPMD loop (runtime/spmd.py) or the elastic Ray pool
(runtime/elastic/), as config.dipaco.mode says. Both run the same recipe
(core/recipe.py) and write the same checkpoints; a rerun resumes, and a rerun of
a run that already reached its last step says so in one line and trains nothing.
The workdir is locked for the run's life (io/lock.py): a second command on it stops
in one line. Ctrl-C stops the run in one line: the step reached, the last
checkpoint (intact: a save is atomic, and one in flight completes first) and the
command that resumes. The console gets a few lines about the run and a summary at its end
(runtime/console.py); the full config is the workdir's config.json.
"""

from typing import Any

import jax
from etils import epath

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax import saved_config
from dipaco_jax.io import checkpoint
from dipaco_jax.io import lock
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.runtime import console
from dipaco_jax.runtime import elastic
from dipaco_jax.runtime import spmd


def _final_metrics(workdir: str, step: int) -> dict[str, Any]:
  """A finished run's result as its runtime returned it, from its last evaluated record."""
  for r in reversed(metrics_lib.read_records(workdir)):
    if "val_loss" in r and r["step"] <= step:
      out = {"step": step, "val_loss": r["val_loss"], "val_loss_mean": r.get("val_loss_mean")}
      out.update(
        {
          k: r[k]
          for k in ("val_loss_routed_all_tokens", "val_perplexity_routed_all_tokens")
          if k in r
        }
      )
      return out
  return {"step": step}


def train_and_evaluate(config, workdir: str, faults=None) -> dict[str, Any]:
  """Trains (or resumes) the run in `workdir`; returns the final metrics.

  faults: what to inject into an elastic run (runtime/faults.Faults; tests and
  benchmarks only, never a config field); None for a run.
  """
  if faults is not None and config.dipaco.mode != "elastic":
    raise ValueError("faults= injects into the elastic pool; the spmd loop takes none.")
  config_check.validate(config)
  # Before anything is read or written: a live run's files are never touched (io/lock.py).
  with lock.workdir(workdir, "train", enabled=jax.process_index() == 0):
    return _train(config, workdir, faults)


def _train(config, workdir: str, faults) -> dict[str, Any]:
  """train_and_evaluate under the workdir's lock."""
  elastic.check_workdir_mode(workdir, config.dipaco.mode)
  path = epath.Path(workdir)
  saved = checkpoint.steps(workdir)
  started = bool(saved) or elastic.started(workdir)
  saved_config.check_matches(path, config, started=started, may_grow=config.dipaco.mode == "spmd")
  if saved and saved[-1] >= console.stop_step(config):  # Nothing left to train.
    saved_config.write(path, config)  # Where check_matches found none, as its warning says.
    console.say(console.complete_line(config, workdir, saved[-1]))
    return _final_metrics(workdir, saved[-1])
  if not started:  # An earlier attempt that saved nothing never blocks this one.
    saved_config.set_aside_earlier_attempt(path, config)
  console.say(console.start_lines(config, workdir, saved[-1] if saved else 0))
  try:
    if config.dipaco.mode == "elastic":  # The Ray worker pool.
      result = elastic.run(config, workdir, faults)
    else:
      result = spmd.run(config, workdir)
  except KeyboardInterrupt as e:  # The runtime's own cleanup (the save in flight) is done.
    if config.dipaco.mode == "elastic":  # Its progress is its storage's.
      line = console.interrupted_line(config, workdir, elastic.progress_line(workdir, config))
    else:
      line = console.interrupted_line(config, workdir, getattr(e, "step", None))
    raise errors.Interrupted(line) from None
  if not result.get("stopped"):  # The elastic driver's planned stop (faults) resumes later.
    console.say(console.end_lines(config, workdir))
  return result
