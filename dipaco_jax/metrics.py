"""Run metrics: clu writers (TensorBoard + console) and `metrics.jsonl`.

Only process 0 writes. `metrics.jsonl` holds one JSON object per logged step;
on resume, lines past the resumed step are dropped so the file reads as one
uninterrupted run.
"""

import json
import math
from typing import Any, Mapping

import jax
import numpy as np
from clu import metric_writers
from etils import epath


def nan_mean(values) -> float:
  """Mean that skips NaN entries (e.g. a worker without validation data); NaN if all are."""
  arr = np.asarray(values, np.float64)
  return float("nan") if np.isnan(arr).all() else float(np.nanmean(arr))


class NonFiniteLossError(FloatingPointError):
  """A worker's training loss became NaN or Inf."""


def guard_losses(step: int, losses_W: np.ndarray, labels: list[str]) -> None:
  """Stops the run with a clear message on a non-finite loss."""
  bad = [labels[i] for i, v in enumerate(np.asarray(losses_W)) if not math.isfinite(v)]
  if bad:
    raise NonFiniteLossError(
        f"non-finite training loss at step {step} on paths {bad}; the last good "
        "checkpoint is kept. Lower config.inner.lr, raise config.inner.warmup_steps "
        "or set config.inner.clip_norm, then rerun the same command to resume.")


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
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self.active)
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
