"""Append-only run logs on any path: TensorBoard event files (without TensorFlow) and parts.

A local log is one file, appended in place and flushed after each record. An object store
(gs://) cannot append, so there a log is a sequence of parts (`part(0)`, `part(1)`, ...): the
newest part is rewritten whole after each record, so every record is stored at once, and a
new part starts once the newest holds PART_BYTES, which keeps a run's uploads linear in its
length (one file rewritten on every record would be quadratic).

Event files are TFRecord files of `Event` protos, written with TensorBoard's own record
writer and protos: TensorBoard reads them like TensorFlow's, without TensorFlow installed.
"""

import os
import socket
import time
from typing import Any, Callable, Mapping

import numpy as np
from etils import epath
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import tensor_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.histogram import summary_v2 as histogram_summary
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.summary.writer import record_writer

PART_BYTES = 1 << 20  # Largest part rewritten per record on an object store.


def appends_in_place(path: epath.Path) -> bool:
  """Local files append; object stores (any `scheme://`) hold immutable objects."""
  return "://" not in os.fspath(path)


def existing_parts(part: Callable[[int], epath.Path]) -> list[epath.Path]:
  """The log's parts on storage, in order (they are numbered without gaps)."""
  out = []
  while part(len(out)).exists():
    out.append(part(len(out)))
  return out


class AppendLog:
  """One append-only log named by `part(i)`; continues after the parts already stored."""

  def __init__(self, part: Callable[[int], epath.Path], *, part_bytes: int | None = None):
    self._part = part
    self._part_bytes = part_bytes or PART_BYTES
    self._in_place = appends_in_place(part(0))
    self._file = None
    self._index = 0
    self._data = b""  # The newest part's bytes (object stores only).
    if not self._in_place:
      stored = existing_parts(part)
      if stored:
        self._index, self._data = len(stored) - 1, stored[-1].read_bytes()

  def append(self, data: bytes) -> None:
    """Stores `data` after everything appended so far; on return it is on storage."""
    if self._in_place:
      if self._file is None:
        self._part(0).parent.mkdir(parents=True, exist_ok=True)
        self._file = self._part(0).open("ab")
      self._file.write(data)
      self._file.flush()
      return
    if self._data and len(self._data) + len(data) > self._part_bytes:
      self._index, self._data = self._index + 1, b""
    self._data += data
    self._part(self._index).write_bytes(self._data)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


class _Bytes:
  """The file-like sink RecordWriter writes one record into."""

  def __init__(self):
    self.chunks: list[bytes] = []

  def write(self, data: bytes) -> None:
    self.chunks.append(data)

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


def _flat_hparams(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{"a": {"b": 1}}` -> `{"a.b": 1}`; values TensorBoard's hparams take (others as text)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat_hparams(value, f"{prefix}{key}."))
    elif isinstance(value, (bool, int, float, str)):
      out[f"{prefix}{key}"] = value
    else:
      out[f"{prefix}{key}"] = str(value)
  return out


class EventWriter:
  """TensorBoard scalars, histograms and hparams into one new event file of `logdir`."""

  def __init__(self, logdir: str | os.PathLike, *, part_bytes: int | None = None):
    wall = time.time()
    name = f"events.out.tfevents.{int(wall):010d}.{socket.gethostname()}.{os.getpid()}.v2"
    root = epath.Path(logdir)
    # Parts sort after the first file and before a later process's file (TensorBoard reads
    # a directory's event files in name order).
    self._log = AppendLog(
      lambda i: root / (name if i == 0 else f"{name}.{i:05d}"), part_bytes=part_bytes
    )
    self._write([event_pb2.Event(wall_time=wall, file_version="brain.Event:2")])

  def _write(self, events: list[event_pb2.Event]) -> None:
    sink = _Bytes()
    writer = record_writer.RecordWriter(sink)
    for event in events:
      writer.write(event.SerializeToString())
    self._log.append(b"".join(sink.chunks))

  def _summaries(self, step: int, summaries: list[summary_pb2.Summary]) -> None:
    wall = time.time()
    self._write([event_pb2.Event(wall_time=wall, step=int(step), summary=s) for s in summaries])

  def restart(self, step: int) -> None:
    """Marks a resume at `step`: TensorBoard drops the earlier files' points after it."""
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    self._write([event_pb2.Event(wall_time=time.time(), step=int(step), session_log=start)])

  def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    if not scalars:
      return
    summary = summary_pb2.Summary(
      value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    )
    self._summaries(step, [summary])

  def histograms(self, step: int, values: Mapping[str, np.ndarray], buckets: int = 30) -> None:
    """One histogram per tag over the finite entries (a worker without data reads NaN)."""
    out = []
    for tag, x in values.items():
      x = np.asarray(x, np.float64).ravel()
      x = x[np.isfinite(x)]
      if x.size:
        out.append(histogram_summary.histogram_pb(tag, x, buckets=min(buckets, x.size)))
    self._summaries(step, out)

  def layout(self, categories: Mapping[str, list[tuple[str, str]]]) -> None:
    """The Custom Scalars page: {category: [(chart title, tag regex)]}, each chart one plot."""
    layout = layout_pb2.Layout(
      category=[
        layout_pb2.Category(
          title=title,
          chart=[
            layout_pb2.Chart(title=chart, multiline=layout_pb2.MultilineChartContent(tag=[regex]))
            for chart, regex in charts
          ],
        )
        for title, charts in categories.items()
      ]
    )
    # The plugin's own summary (custom_scalar.summary.pb), built without TensorFlow.
    tensor = tensor_pb2.TensorProto(
      dtype=types_pb2.DT_STRING, string_val=[layout.SerializeToString()]
    )
    value = summary_pb2.Summary.Value(
      tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
      metadata=custom_scalar_metadata.create_summary_metadata(),
      tensor=tensor,
    )
    self._summaries(0, [summary_pb2.Summary(value=[value])])

  def hparams(self, hparams: Mapping[str, Any]) -> None:
    self._summaries(0, [hparams_summary.hparams_pb(_flat_hparams(hparams))])

  def close(self) -> None:
    self._log.close()
