"""What a training run says on the console: a few lines at its start, a summary at its end.

The full config is the run's `config.json`, never the console. Both runtimes end with the
same summary, read from the workdir's files (the last checkpoint, the last evaluated
record of metrics.jsonl), so a rerun of a finished run says the same in one line.
Lines go to stderr of process 0, between progress-bar redraws (io/progress.py).
"""

import math
import os
import shlex
import sys
from typing import Any

import jax

from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.io import metrics as metrics_lib
from dipaco_jax.io import progress

SERVE_EXAMPLE = "And it came to pass"  # A King James line: the embedded corpus has it.


def stop_step(config) -> int:
  """The inner step this command stops at: the run's end, or config.stop_at_step before it."""
  total = config.dipaco.inner_steps * config.dipaco.outer_steps
  return total if config.stop_at_step < 0 else min(config.stop_at_step, total)


def params_per_path(config) -> int:
  """One path's parameter count (shapes only: nothing is computed)."""
  params = recipe_lib.Recipe.from_config(config).abstract_params()
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def _millions(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def start_lines(config, workdir: str, done: int) -> list[str]:
  """The run in three lines: grid and params, steps, where its files go."""
  recipe = recipe_lib.Recipe.from_config(config)
  H, T = config.dipaco.inner_steps, config.dipaco.outer_steps
  stop = stop_step(config)
  m = config.model
  steps = f"{stop} inner steps ({T} outer steps of H={H}"
  steps += ")" if stop == H * T else f"; stopping at step {stop}, config.stop_at_step)"
  if done:
    steps += f", resuming from step {done}"
  steps += (
    f"; batch {config.data.batch_size} x {config.data.seq_len} tokens per worker; evaluation "
    f"every {config.eval.every_steps}, checkpoint every {config.ckpt.every_steps}"
  )
  return [
    f"{config.dipaco.mode}: {recipe.topo.describe()}",
    f"{_millions(params_per_path(config))} params per path ({m.num_layers} blocks, d_model "
    f"{m.d_model}, vocab {m.vocab_size}); {steps}",
    f"workdir {workdir}: the full config in config.json; checkpoints/, metrics.jsonl and "
    "TensorBoard event files as it trains",
  ]


def _last_eval(workdir: str) -> dict[str, Any]:
  """The last record with a validation loss (the run's final evaluation), or {}."""
  try:
    records = metrics_lib.read_records(workdir)
  except Exception:  # pylint: disable=broad-except  # A summary never stops a finished run.
    return {}
  for r in reversed(records):
    if "val_perplexity_routed_all_tokens" in r or "val_loss_mean" in r:
      return r
  return {}


def _quality(record: dict[str, Any], *, short: bool = False) -> str:
  if "val_perplexity_routed_all_tokens" in record:
    ppl = (
      f"routed validation perplexity, all tokens {record['val_perplexity_routed_all_tokens']:.1f}"
    )
    return (
      ppl
      if short
      else (
        f"{ppl} (every token, the routing prefix included, each scored by its document's path; "
        "`evaluate` reports the prefix-excluded perplexity)"
      )
    )
  if "val_loss_mean" in record:
    loss = f"validation loss {record['val_loss_mean']:.4f}"
    return loss if short else f"{loss} (mean over paths, each on its own shard)"
  return "no evaluation recorded"


def _where(workdir: str, step: int) -> list[str]:
  q = workdir if " " not in workdir else f"'{workdir}'"
  return [
    f"  checkpoints  {os.path.join(workdir, checkpoint.DIRNAME)} (step {step})",
    f"  metrics      {os.path.join(workdir, metrics_lib.JSONL)}",
    f"  TensorBoard  tensorboard --logdir {q}",
    f"  evaluate     python -m dipaco_jax.evaluate --workdir={q}",
    f'  serve        python -m dipaco_jax.serve --workdir={q} --text="{SERVE_EXAMPLE}"',
  ]


def end_lines(config, workdir: str) -> list[str]:
  """The summary after a run stops: where it stopped, its quality, its files, what to run next."""
  steps = checkpoint.steps(workdir)
  step = steps[-1] if steps else 0
  total = config.dipaco.inner_steps * config.dipaco.outer_steps
  quality = _quality(_last_eval(workdir))
  if step >= total:
    head = f"Finished at step {step}: {quality}."
  else:
    head = (
      f"Stopped at step {step} of {total} (config.stop_at_step): {quality}. The same command "
      "with --config.stop_at_step=-1 trains on to the end."
    )
  return [head, *_where(workdir, step)]


def complete_line(config, workdir: str, step: int) -> str:
  """One line: the run in `workdir` already stopped where this command would stop."""
  total = config.dipaco.inner_steps * config.dipaco.outer_steps
  quality = _quality(_last_eval(workdir), short=True)
  if step >= total:
    more = config.dipaco.outer_steps * 2
    longer = (
      f"rerun with a larger outer_steps, e.g. --config.dipaco.outer_steps={more} (it resumes "
      f"from step {step})"
      if config.dipaco.mode == "spmd"
      else "train a new workdir with a larger --config.dipaco.outer_steps (the elastic pool "
      "does not extend a finished run)"
    )
    return (
      f"{workdir} is complete at step {step}, {quality}; to train longer, {longer}; to "
      f"evaluate it: python -m dipaco_jax.evaluate --workdir={workdir}"
    )
  return (
    f"{workdir} already stopped at step {step}, its config.stop_at_step, {quality}; "
    "--config.stop_at_step=-1 trains on to the end."
  )


def rerun_command() -> str:
  """This command as the user gave it, when it is the trainer's CLI; else a description."""
  if sys.argv and sys.argv[0].endswith(os.path.join("dipaco_jax", "main.py")):
    return shlex.join(["python", "-m", "dipaco_jax.main", *sys.argv[1:]])
  return "the same command (the same config and workdir)"


def interrupted_line(config, workdir: str, reached: int | str | None) -> str:
  """One line after Ctrl-C: the step reached, what is kept, the command that resumes.

  `reached`: the spmd loop's inner step (None: before its first), or the elastic
  pool's progress (elastic.progress_line).
  """
  if isinstance(reached, str):
    return (
      f"stopped by Ctrl-C with {reached}: the run resumes from them; to go on, run "
      f"{rerun_command()}"
    )
  saved = checkpoint.steps(workdir)
  at = "before its first step" if not reached else f"at inner step {reached} of {stop_step(config)}"
  kept = (
    f"its last checkpoint, step {saved[-1]}, is intact and the run resumes from it"
    if saved
    else "no checkpoint was saved yet, so the run starts again from step 0"
  )
  return f"stopped by Ctrl-C {at}: {kept}; to go on, run {rerun_command()}"


def say(lines: list[str] | str) -> None:
  """Lines on stderr of process 0, between progress-bar redraws."""
  for line in [lines] if isinstance(lines, str) else lines:
    progress.note(line)
