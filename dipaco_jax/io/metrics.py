"""Run metrics (TensorBoard, `metrics.jsonl`, console) and tokens/s.

Only process 0 writes. `metrics.jsonl` holds one JSON object per logged step; on
resume, records past the resumed step are dropped so the log reads as one
uninterrupted run. Nothing here imports TensorFlow (summaries.py writes the
event files).
"""

import contextlib
import json
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
  data = path.read_bytes()  # Line by line: a byte that is not UTF-8 names its line.
  lines = [l for l in data.split(b"\n") if l.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line.decode())
      if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
        raise ValueError("a record is a JSON object with an integer step")
      out.append(record)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and the check above.
      if last_part and i == len(lines) - 1 and not data.endswith(b"\n"):
        return out, True
      problem = (
        errors.json_problem(e)
        if isinstance(e, UnicodeDecodeError | json.JSONDecodeError)
        else str(e)
      )
      raise errors.DamagedFileError(
        f"{path} line {i + 1}: {problem}; remove that line to go on (the other records are kept)."
      ) from None
  return out, False


# Record keys renamed since: a log written before reads with today's names (the same numbers).
# The trainer's routed validation counts every token, the routing prefix included; its names
# say so, apart from `evaluate`'s prefix-excluded perplexity.
RENAMED_KEYS = {
  "val_loss_routed": "val_loss_routed_all_tokens",
  "val_perplexity_routed": "val_perplexity_routed_all_tokens",
}


def _renamed(record: dict) -> dict:
  if not RENAMED_KEYS.keys() & record.keys():
    return record
  return {RENAMED_KEYS.get(k, k): v for k, v in record.items()}


def read_records(workdir: str | os.PathLike) -> list[dict]:
  """Every record of a run's metrics log, in step order, over all its parts.

  Keys of RENAMED_KEYS read with their new names.
  """
  parts = summaries.existing_parts(lambda i: jsonl_part(workdir, i))
  return [_renamed(r) for i, p in enumerate(parts) for r in _records(p, i == len(parts) - 1)[0]]


def curves(records: list[Mapping[str, Any]]) -> dict[str, Any]:
  """A run's training curves from its records (read_records), as arrays by step.

  `train_loss`, `val_loss`: (steps [N], values [N, W]), one column per worker;
  `val_perplexity_routed_all_tokens`: (steps [N], values [N]); `outer_delta_norm`:
  {level: (steps [N], norms [N, K])}. Each holds the records that have the key;
  a key no record has is absent.
  """
  out: dict[str, Any] = {}
  for key in ("train_loss", "val_loss", "val_perplexity_routed_all_tokens"):
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


# TensorBoard's name of each record key: grouped as JAX trainers group them (train/, val/,
# perf/, outer/). A key not listed keeps its own name.
TB_NAMES = {
  "phase": "train/phase",
  "lr": "train/learning_rate",
  "train_loss": "train/loss",
  "grad_norm": "train/grad_norm",
  "param_norm": "train/param_norm",
  "val_loss": "val/loss",
  "val_loss_mean": "val/loss/mean",
  "val_loss_routed_all_tokens": "val/loss_routed_all_tokens",
  "val_perplexity_routed_all_tokens": "val/perplexity_routed_all_tokens",
  "heldout_loss": "heldout/loss",
  "heldout_loss_mean": "heldout/loss/mean",
  "tokens_per_s": "perf/tokens_per_s",
  "step_s": "perf/step_s",
  "tflops_per_device": "perf/per_device_tflops_per_sec",
  "mfu": "perf/mfu",
  "outer_delta_norm": "outer/delta_norm",
}
# Record keys with one value per worker: a scalar per path, their mean, and a histogram.
_HISTOGRAMS = ("train_loss", "val_loss", "heldout_loss", "grad_norm")


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def tensorboard_values(
  record: Mapping[str, Any],
  worker_labels: list[str] | None = None,
  module_labels: Mapping[str, list[str]] | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """A record's TensorBoard scalars and histograms, by tag: every number of the record.

  A number gets its TB_NAMES tag. A per-worker list gives `<tag>/path_<label>` and
  `<tag>/mean` (NaN entries skipped); `param_norm` ({group: [W]}) gives
  `train/param_norm/<group>/path_<label>` and `.../mean`; `outer_delta_norm`
  ({level: [K]}) gives `outer/delta_norm/<level>/<module>`. Labels default to indices.
  """
  scalars, histograms = {}, {}

  def per_worker(tag: str, values: list) -> None:
    labels = worker_labels or [str(w) for w in range(len(values))]
    scalars[f"{tag}/mean"] = nan_mean(values)
    scalars.update({f"{tag}/path_{l}": v for l, v in zip(labels, values)})

  for key, value in record.items():
    tag = TB_NAMES.get(key, key)
    if key in ("step", "outer_delta_norm"):
      continue
    if _number(value):
      scalars[tag] = value
    elif isinstance(value, list) and value and _number(value[0]):
      per_worker(tag, value)
      if key in _HISTOGRAMS:
        histograms[tag] = np.asarray(value, np.float64)
    elif isinstance(value, Mapping):  # param_norm: {group: [per worker]}.
      for group, values in value.items():
        if isinstance(values, list) and values and _number(values[0]):
          per_worker(f"{tag}/{group}", values)
  for level, norms in record.get("outer_delta_norm", {}).items():
    names = (module_labels or {}).get(level) or [f"module_{k}" for k in range(len(norms))]
    scalars.update({f"outer/delta_norm/{level}/{n}": v for n, v in zip(names, norms)})
    histograms[f"outer/delta_norm/{level}"] = np.asarray(norms, np.float64)
  return scalars, histograms


def console_values(record: Mapping[str, Any]) -> dict[str, float]:
  """The console line's numbers: a record's plain numbers and each list's mean."""
  out = {}
  for key, value in record.items():
    if key != "step" and _number(value):
      out[key] = value
    elif isinstance(value, list) and value and _number(value[0]):
      out.setdefault(f"{key}_mean", nan_mean(value))
  return out


def layout(worker_labels: list[str] | None) -> dict[str, list[tuple[str, str]]]:
  """TensorBoard's Custom Scalars page: each per-path metric's paths overlaid on one chart.

  {category: [(chart title, tag regex)]}.
  """
  del worker_labels  # Every path matches the regex, whatever its label.
  return {
    "paths": [
      ("train/loss per path", r"train/loss/(path_.*|mean)"),
      ("val/loss per path (own shard)", r"val/loss/(path_.*|mean)"),
      ("heldout/loss per path", r"heldout/loss/(path_.*|mean)"),
      ("train/grad_norm per path", r"train/grad_norm/(path_.*|mean)"),
    ],
    "run": [
      ("val/perplexity_routed_all_tokens", r"val/perplexity_routed_all_tokens"),
      ("train/learning_rate", r"train/learning_rate"),
      ("perf/per_device_tflops_per_sec", r"perf/per_device_tflops_per_sec"),
      ("outer/delta_norm per module", r"outer/delta_norm/.*"),
    ],
  }


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
    else:
      self._events.layout(layout(worker_labels))

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
    flat = console_values(record)
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
