"""Run metrics: clu writers (TensorBoard + console) and `metrics.jsonl`.

Only process 0 writes. `metrics.jsonl` holds one JSON object per logged step;
on resume, lines past the resumed step are dropped so the file reads as one
uninterrupted run.
"""

import collections
import json
import math
from typing import Any, Mapping

import jax
import numpy as np
from clu import metric_writers
from etils import epath

from dipaco_jax import errors


def nan_mean(values) -> float:
  """Mean that skips NaN entries (e.g. a worker without validation data); NaN if all are."""
  arr = np.asarray(values, np.float64)
  return float("nan") if np.isnan(arr).all() else float(np.nanmean(arr))


class DivergenceError(errors.UserError):
  """Training diverged: a non-finite loss or params, a loss stuck at ln V, exploding params."""


class NonFiniteLossError(DivergenceError):
  """A worker's training loss (or a parameter) became NaN or Inf."""


_LOWER_LR = (
  "Lower config.inner.lr, raise config.inner.warmup_steps or set "
  "config.inner.clip_norm, then rerun the same command to resume"
)


def guard_losses(
  step: int, losses_W: np.ndarray, labels: list[str], kept: str = "the last good checkpoint is kept"
) -> None:
  """Stops the run with one line on a non-finite loss (DivergenceGuard's first rule)."""
  bad_W = ~np.isfinite(np.asarray(losses_W, np.float64))
  if bad_W.any():
    bad = [labels[w] for w in np.flatnonzero(bad_W)]
    raise NonFiniteLossError(
      f"non-finite training loss at step {step} on paths {bad}: the run "
      f"diverged; {kept}. {_LOWER_LR}."
    )


STUCK_MARGIN = 0.01  # Nats: a loss this close to ln V counts as "at" it.


class DivergenceGuard:
  """Stops a diverged run at the step it shows, before that state is saved.

  Three rules, checked after every inner step (per worker):
    * a non-finite training loss;
    * a group's parameter norm (embed, block_i, head) above
      `guard.max_param_norm_ratio` times its norm when this process started
      (init or resume): AdamW steps far too large blow the params up long before
      the loss turns NaN (inner.lr=1e6 reaches ~1e13, the loss sits at ln V);
    * a mean training loss over the last `guard.stuck_steps` inner steps at or
      above ln V, the loss of predicting uniformly over the vocabulary: a model
      that learns anything (even unigram counts) is well below it. A random init
      starts near (or above) ln V, so the window must lie after
      `inner.warmup_steps`; it counts steps since this process started. "At"
      allows STUCK_MARGIN: a float32 uniform prediction reads just below ln V.
  0 turns a rule off. The trainer also checks the params are finite before
  each save (`not_finite`).
  """

  def __init__(
    self, config, labels: list[str], initial_norms: dict[str, np.ndarray], last_saved: int | None
  ):
    self.labels = labels
    self.ln_v = math.log(config.model.vocab_size)
    self.warmup = config.inner.warmup_steps
    self.stuck_steps = config.guard.stuck_steps
    self.max_ratio = config.guard.max_param_norm_ratio
    self.norm0_GxW = np.stack([np.asarray(initial_norms[g], np.float64) for g in initial_norms])
    self.groups = list(initial_norms)
    self.last_saved = last_saved
    self.start = last_saved or 0
    self._losses = collections.deque(maxlen=max(self.stuck_steps, 1))

  def _kept(self) -> str:
    return (
      "no checkpoint was saved"
      if self.last_saved is None
      else f"the last checkpoint, step {self.last_saved}, is kept and nothing later was saved"
    )

  def _stop(self, cls, what: str, fix: str):
    raise cls(f"{what}: the run diverged; {self._kept()}. {fix}.")

  def _paths(self, bad_W: np.ndarray) -> list[str]:
    return [self.labels[w] for w in np.flatnonzero(bad_W)]

  def check(self, step: int, loss_W: np.ndarray, norms: dict[str, np.ndarray]) -> None:
    """Raises DivergenceError when a rule fires at inner step `step`."""
    guard_losses(step, loss_W, self.labels, self._kept())
    loss_W = np.asarray(loss_W, np.float64)
    norm_GxW = np.stack([np.asarray(norms[g], np.float64) for g in self.groups])
    ratio_GxW = norm_GxW / np.maximum(self.norm0_GxW, 1e-30)
    bad_GxW = ~(ratio_GxW <= self.max_ratio)  # NaN too.
    if self.max_ratio > 0 and bad_GxW.any():
      g, w = np.unravel_index(
        np.argmax(np.where(bad_GxW, np.nan_to_num(ratio_GxW, nan=np.inf), -np.inf)), ratio_GxW.shape
      )
      self._stop(
        DivergenceError,
        f"parameter norm of {self.groups[g]} grew {ratio_GxW[g, w]:.3g}x since step "
        f"{self.start} (to {norm_GxW[g, w]:.3g}) on paths "
        f"{self._paths(bad_GxW.any(0))} at step {step}, over "
        f"config.guard.max_param_norm_ratio={self.max_ratio:g}",
        _LOWER_LR,
      )
    if not self.stuck_steps:
      return
    self._losses.append(loss_W)
    if len(self._losses) == self.stuck_steps and step - self.stuck_steps >= self.warmup:
      mean_W = np.mean(self._losses, axis=0)
      bad_W = mean_W >= self.ln_v - STUCK_MARGIN
      if bad_W.any():
        self._stop(
          DivergenceError,
          f"training loss stayed at or above ln V = {self.ln_v:.3f} (uniform prediction; "
          f"mean {np.max(mean_W):.3f}) over steps {step - self.stuck_steps + 1}-{step} "
          f"on paths {self._paths(bad_W)}, after warmup",
          "Check config.inner.lr (too high blows the model up, too low never leaves "
          "ln V) and start again in a new --workdir, or raise config.guard.stuck_steps",
        )

  def not_finite(self, step: int) -> None:
    """Stops on non-finite params found before the save at `step`."""
    self._stop(
      NonFiniteLossError,
      f"non-finite parameters after step {step}",
      "Lower config.inner.lr or config.outer.lr, then rerun the same command to resume",
    )


def _plain(x: Any) -> Any:
  if isinstance(x, Mapping):
    return {k: _plain(v) for k, v in x.items()}
  arr = np.asarray(x)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


class MetricsLogger:
  """Writes scalars to clu writers and full records to metrics.jsonl."""

  def __init__(self, workdir: str, *, resume_step: int = 0):
    self.active = jax.process_index() == 0
    self._path = epath.Path(workdir) / "metrics.jsonl"
    self._writer = metric_writers.create_default_writer(workdir, just_logging=not self.active)
    self._lines: list[str] = []
    if self.active and self._path.exists():
      for line in self._path.read_text().splitlines():
        if line.strip() and json.loads(line).get("step", 0) <= resume_step:
          self._lines.append(line)
      self._flush()

  def _flush(self) -> None:
    # Rewritten whole: object stores (gs://) cannot append.
    self._path.write_text("".join(l + "\n" for l in self._lines))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._writer.write_hparams(dict(hparams))

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    """Logs one record: its scalars go to TensorBoard, all of it to jsonl."""
    if not self.active:
      return
    record = {"step": int(step), **_plain(record)}
    scalars = {}
    for key, value in record.items():
      if key == "step":
        continue
      if isinstance(value, (int, float)):
        scalars[key] = value
      elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
        scalars[f"{key}_mean"] = nan_mean(value)
    self._writer.write_scalars(step, scalars)
    self._lines.append(json.dumps(record, sort_keys=True))
    self._flush()

  def close(self) -> None:
    self._writer.flush()
    self._writer.close()
