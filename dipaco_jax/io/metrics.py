"""Run metrics (TensorBoard, `metrics.jsonl`, console), tokens/s and the divergence guard.

Only process 0 writes. `metrics.jsonl` holds one JSON object per logged step; on
resume, records past the resumed step are dropped so the log reads as one
uninterrupted run. Nothing here imports TensorFlow (summaries.py writes the
event files).
"""

import collections
import contextlib
import json
import math
import os
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np
from absl import logging
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import summaries


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

  Three rules, checked on every inner step's metrics (per worker; one step late when the loop
  dispatches ahead, train.dispatch_ahead, but always before the state is saved):
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


JSONL = "metrics.jsonl"


def jsonl_part(workdir: str | os.PathLike, i: int) -> epath.Path:
  """Part i of the run's metrics log: metrics.jsonl, then metrics-00001.jsonl, ... (gs://)."""
  root = epath.Path(workdir)
  return root / JSONL if i == 0 else root / f"metrics-{i:05d}.jsonl"


def _records(path: epath.Path, last_part: bool) -> tuple[list[dict], bool]:
  """A part's records, and whether it ends in a torn record (a write cut short by a stop)."""
  text = path.read_text()
  lines = [l for l in text.splitlines() if l.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      out.append(json.loads(line))
    except ValueError as e:
      if last_part and i == len(lines) - 1 and not text.endswith("\n"):
        return out, True
      raise errors.DamagedFileError(
        f"{path} line {i + 1}: {errors.json_problem(e)}; remove that line to go on."
      ) from None
  return out, False


def read_records(workdir: str | os.PathLike) -> list[dict]:
  """Every record of a run's metrics log, in step order, over all its parts."""
  parts = summaries.existing_parts(lambda i: jsonl_part(workdir, i))
  return [r for i, p in enumerate(parts) for r in _records(p, i == len(parts) - 1)[0]]


def curves(records: list[Mapping[str, Any]]) -> dict[str, Any]:
  """A run's training curves from its records (read_records), as arrays by step.

  `train_loss`, `val_loss`: (steps [N], values [N, W]), one column per worker;
  `val_perplexity_routed`: (steps [N], values [N]); `outer_delta_norm`:
  {level: (steps [N], norms [N, K])}. Each holds the records that have the key;
  a key no record has is absent.
  """
  out: dict[str, Any] = {}
  for key in ("train_loss", "val_loss", "val_perplexity_routed"):
    rows = [(r["step"], r[key]) for r in records if key in r]
    if rows:
      out[key] = (np.array([s for s, _ in rows], np.int64), np.array([v for _, v in rows], float))
  levels: dict[str, list] = {}
  for r in records:
    for level, norms in r.get("outer_delta_norm", {}).items():
      levels.setdefault(level, []).append((r["step"], norms))
  if levels:
    out["outer_delta_norm"] = {
      level: (np.array([s for s, _ in rows], np.int64), np.array([n for _, n in rows], float))
      for level, rows in levels.items()
    }
  return out


def _drop_after(workdir: str | os.PathLike, resume_step: int) -> None:
  """Removes the records past `resume_step` (and a torn last one) from storage, once."""
  parts = summaries.existing_parts(lambda i: jsonl_part(workdir, i))
  for i, path in enumerate(parts):
    records, torn = _records(path, i == len(parts) - 1)
    kept = [r for r in records if r.get("step", 0) <= resume_step]
    if len(kept) == len(records) and not torn:
      continue
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
    if not kept and i > 0:
      path.unlink()
    elif summaries.appends_in_place(path):  # Atomic: a stop here leaves the old file whole.
      tmp = path.parent / f".{path.name}.tmp"
      tmp.write_text(text)
      tmp.replace(path)
    else:  # An object is replaced whole.
      path.write_text(text)
    for later in parts[i + 1 :]:  # Records are in step order: the later parts are all past it.
      later.unlink()
    return


# Record keys with one value per worker: a TensorBoard scalar per path, and a histogram.
_PER_WORKER = {"train_loss": "train/loss", "val_loss": "val/loss", "heldout_loss": "heldout/loss"}
_HISTOGRAMS = {**_PER_WORKER, "grad_norm": "train/grad_norm"}


def tensorboard_values(
  record: Mapping[str, Any],
  worker_labels: list[str] | None = None,
  module_labels: Mapping[str, list[str]] | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """A record's TensorBoard scalars and histograms, by tag.

  A number keeps its key; a list also gives `<key>_mean` (NaN entries skipped). Per-worker
  lists give `train/loss/path_<label>`; `outer_delta_norm` ({level: [K]}) gives
  `outer/delta_norm/<level>/<module>`. Labels default to indices.
  """
  scalars, histograms = {}, {}
  for key, value in record.items():
    if key == "step":
      continue
    if isinstance(value, (int, float)):
      scalars[key] = value
    elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
      scalars[f"{key}_mean"] = nan_mean(value)
      labels = worker_labels or [str(w) for w in range(len(value))]
      if key in _PER_WORKER:
        scalars.update({f"{_PER_WORKER[key]}/path_{l}": v for l, v in zip(labels, value)})
      if key in _HISTOGRAMS:
        histograms[_HISTOGRAMS[key]] = np.asarray(value, np.float64)
  for level, norms in record.get("outer_delta_norm", {}).items():
    names = (module_labels or {}).get(level) or [f"module_{k}" for k in range(len(norms))]
    scalars.update({f"outer/delta_norm/{level}/{n}": v for n, v in zip(names, norms)})
    histograms[f"outer/delta_norm/{level}"] = np.asarray(norms, np.float64)
  return scalars, histograms


class MetricsLogger:
  """One record per logged step: all of it to metrics.jsonl, its numbers to TensorBoard.

  metrics.jsonl is appended (rolled into numbered parts on gs://, see summaries.py); a resume
  first drops the records past the resumed step, so the log reads as one run, and marks the
  event file so TensorBoard drops them too. The console gets the averaged numbers.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    resume_step: int = 0,
    worker_labels: list[str] | None = None,
    module_labels: Mapping[str, list[str]] | None = None,
  ):
    self.active = jax.process_index() == 0
    self._labels = (worker_labels, module_labels)
    if not self.active:
      return
    _drop_after(workdir, resume_step)
    self._jsonl = summaries.AppendLog(lambda i: jsonl_part(workdir, i))
    self._events = summaries.EventWriter(workdir)
    if resume_step:
      self._events.restart(resume_step + 1)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if self.active:
      self._events.hparams(hparams)

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    """Logs one record of inner step `step`."""
    if not self.active:
      return
    record = {"step": int(step), **_plain(record)}
    self._jsonl.append((json.dumps(record, sort_keys=True) + "\n").encode())
    scalars, histograms = tensorboard_values(record, *self._labels)
    self._events.scalars(step, scalars)
    self._events.histograms(step, histograms)
    flat = {k: v for k, v in scalars.items() if "/" not in k}
    logging.info("[%d] %s", step, ", ".join(f"{k}={v:.6g}" for k, v in sorted(flat.items())))

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._events.close()


class Throughput:
  """The run's tokens/s and the training steps' own time, between consecutive records.

  `tokens_per_s` divides the tokens trained since the previous record by ALL the wall time
  since then (evaluation, metrics writes, checkpoint saves included): over a run the records
  add up to its wall time. `step_s` is the mean time per inner step spent inside `timed()`
  (the batch, the inner and outer steps) and excludes the rest.
  """

  def __init__(
    self, tokens_per_step: int, step: int, clock: Callable[[], float] = time.perf_counter
  ):
    self._tokens_per_step, self._clock = tokens_per_step, clock
    self._step, self._time, self._busy = step, clock(), 0.0

  @contextlib.contextmanager
  def timed(self):
    start = self._clock()
    try:
      yield
    finally:
      self._busy += self._clock() - start

  def rates(self, step: int) -> dict[str, float]:
    """tokens_per_s and step_s since the previous call (or the start); starts a new interval."""
    now = self._clock()
    steps = step - self._step
    out = {
      "tokens_per_s": self._tokens_per_step * steps / max(now - self._time, 1e-9),
      "step_s": self._busy / max(steps, 1),
    }
    self._step, self._time, self._busy = step, now, 0.0
    return out
