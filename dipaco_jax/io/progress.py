"""Progress bars for the long steps (routing, fitting, evaluation), on stderr of process 0.

    for batch in progress.bar(batches, desc="router features", unit="doc"):
      ...

A terminal gets a tqdm bar redrawn at most once a second. A log file or a
captured stream (not a TTY) gets one plain line at most every
`LOG_INTERVAL_S` seconds and a last line at the end, so logs and test output
stay short. Either way a step shorter than its first interval prints nothing.
DIPACO_PROGRESS=0 turns every bar off, =1 draws bars even when stderr is not a TTY.
While a terminal shows a bar, absl's log lines are written through tqdm: the bar is
cleared, the line written whole, the bar drawn again below it (a log line never sticks
to the end of the bar's line).
"""

import os
import re
import sys
import time
from typing import Any, Iterable

import tqdm
from absl import logging as absl_logging

LOG_INTERVAL_S = 10.0  # Not a TTY: seconds between lines.
TTY_INTERVAL_S = 1.0  # A TTY: seconds between redraws.
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Lines:
  """A file for tqdm that turns its carriage-return redraws into whole lines."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, s: str) -> None:
    text = _ESCAPES.sub("", s).replace("\r", "").rstrip()
    if text:
      self.stream.write(text + "\n")

  def flush(self) -> None:
    self.stream.flush()


class _AroundBars:
  """A stream for absl's log handler that clears the terminal's bars around each write."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, s: str) -> None:
    with tqdm.tqdm.external_write_mode(file=self.stream):
      self.stream.write(s)

  def flush(self) -> None:
    self.stream.flush()

  def __eq__(self, other) -> bool:  # absl compares its stream with sys.stderr.
    return other is self or other is self.stream

  def __hash__(self) -> int:
    return hash(self.stream)

  def __getattr__(self, name):  # isatty, fileno, encoding: the wrapped stream's.
    return getattr(self.stream, name)


def _log_around_bars() -> None:
  """Routes absl's log lines (to stderr) around the terminal's bars, once."""
  handler = absl_logging.get_absl_handler().python_handler
  stream = handler.stream
  if isinstance(stream, _AroundBars) or stream not in (sys.stderr, sys.__stderr__):
    return  # Already routed, or logging to a file: no bar shares it.
  handler.stream = _AroundBars(stream)


def _process_index() -> int:
  """jax.process_index() once JAX is in use; 0 for a process without it (shard writing)."""
  jax = sys.modules.get("jax")
  return jax.process_index() if jax is not None else 0


def _mode() -> str:
  """'off', 'tty' (redrawn bar) or 'lines' (a line per LOG_INTERVAL_S)."""
  env = os.environ.get("DIPACO_PROGRESS", "")
  if env == "0" or _process_index() > 0:
    return "off"
  if env == "1" or sys.stderr.isatty():
    return "tty"
  return "lines"


def bar(iterable: Iterable | None = None, **kw: Any) -> tqdm.tqdm:
  """tqdm(iterable, **kw) on stderr of process 0, paced as the module docstring says."""
  mode = _mode()
  disable = bool(kw.pop("disable", False)) or mode == "off"
  if mode == "tty":
    _log_around_bars()
    kw = {"mininterval": TTY_INTERVAL_S, "delay": TTY_INTERVAL_S, "dynamic_ncols": True, **kw}
    return tqdm.tqdm(iterable, file=sys.stderr, disable=disable, **kw)
  kw = {"mininterval": LOG_INTERVAL_S, "delay": LOG_INTERVAL_S, **kw}
  # position=0: no cursor moves between nested bars; ascii: plain text in logs.
  return tqdm.tqdm(iterable, file=_Lines(sys.stderr), disable=disable, position=0, ascii=True, **kw)


def note(message: str) -> None:
  """One line on stderr of process 0 (an estimate before a long step), between bar redraws."""
  if _process_index() == 0:
    tqdm.tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def eta(seconds: float) -> str:
  """'42 s', '3.5 min' or '1.2 h'."""
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.1f} h"


class Timer:
  """Seconds per step over steps [skip, skip + n): compile and warm-up excluded."""

  def __init__(self, skip: int = 1, n: int = 3):
    self.skip, self.n = skip, n
    self.steps, self.t0, self.per_step = 0, None, None

  def tick(self) -> float | None:
    """Call after each step; returns the measured seconds/step once, when it is known."""
    self.steps += 1
    if self.steps == self.skip:
      self.t0 = time.perf_counter()
    elif self.steps == self.skip + self.n and self.t0 is not None:
      self.per_step = (time.perf_counter() - self.t0) / self.n
      return self.per_step
    return None
