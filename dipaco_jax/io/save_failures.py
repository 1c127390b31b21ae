"""Failed saves: one CheckpointSaveError, orbax's waiting threads released, its echoes dropped.

A save that fails (no space left, no permission, any OSError or TensorStore
error of orbax's background write or its commit) stops the run with one
CheckpointSaveError naming the cause, the path and what to do; the older
checkpoints are untouched. After a failure the commit threads orbax left
waiting are released, so the process exits, and the tracebacks orbax, asyncio
and unfinished coroutines would print for it (and for a failed read) are dropped.
"""

import dataclasses
import errno
import functools
import inspect
import logging
import os
import re
import sys
import threading

from absl import logging as absl_logging
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import damage
from dipaco_jax.io import layout


class CheckpointSaveError(errors.UserError):
  """A checkpoint could not be written (no space left, no permission, ...): the run stopped."""


# Status codes TensorStore gives a failed write (its errors are ValueErrors named by the code).
_WRITE_CODES = (
  "RESOURCE_EXHAUSTED",
  "PERMISSION_DENIED",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
  "UNKNOWN",
  "INTERNAL",
  "ABORTED",
  "FAILED_PRECONDITION",
  "DATA_LOSS",
  "NOT_FOUND",
  "ALREADY_EXISTS",
  "OUT_OF_RANGE",
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclasses.dataclass(frozen=True)
class WriteFailure:
  """The storage error that stopped a save, as CheckpointSaveError reports it."""

  reason: str  # "No space left on device"
  path: str | None  # The file or directory the write failed on, when the error names it.
  errno: int | None


def write_failure(err: BaseException | None) -> WriteFailure | None:
  """The storage error in an exception's chain (OSError or TensorStore status), if any."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError):
      code = err.errno
      reason = err.strerror or (os.strerror(code) if code else str(err) or type(err).__name__)
      return WriteFailure(reason, err.filename and str(err.filename), code)
    msg = damage.status_message(err)
    if any(msg.startswith(c + ":") for c in _WRITE_CODES):
      os_code = re.search(r"os_error_code='?(\d+)", msg)
      code = int(os_code.group(1)) if os_code else None
      reason = os.strerror(code) if code else msg.rsplit(": ", 1)[-1]
      path = re.search(r'(?:Failed writing|Error writing local file|local file): "([^"]+)"', msg)
      return WriteFailure(reason, path.group(1) if path else None, code)
    err = err.__cause__ or err.__context__
  return None


def save_error(root: epath.Path, step: int, failure: WriteFailure) -> CheckpointSaveError:
  """The one-line error for step `step` not saved in `root`: the cause, the fix, where to resume."""
  older = [s for s in layout.finished_steps(root) if s < step]
  if failure.errno in _NO_SPACE:
    fix = f"free space on the disk of {root}"
  elif failure.errno in _NOT_WRITABLE:
    fix = f"make {root} writable (fix its permissions, or its mount if read-only)"
  else:
    fix = f"fix the storage of {root} (free space, fix permissions)"
  then = (
    f"resume from step {older[-1]}, the last saved checkpoint"
    if older
    else "start over from step 0 (no checkpoint was saved yet)"
  )
  where = f" ({failure.path})" if failure.path else ""
  return CheckpointSaveError(
    f"checkpoint step {step} could not be saved in {root}: {failure.reason}{where}; {fix}, "
    f"then rerun the same command to {then}."
  )


def release_commit_threads(timeout_s: float = 10.0) -> None:
  """Stops orbax's commit threads that wait for a signal a failed save will never send.

  When orbax's background directory creation fails, each item's commit thread
  keeps waiting for the "directory created" signal for AsyncOptions.timeout_secs
  (20 minutes); they are not daemons, so the process could not exit. Each is
  cancelled (it returns instead of writing) and woken with its signals.
  """
  try:
    from orbax.checkpoint._src.futures import future as ocp_future  # pylint: disable=g-import-not-at-top

    waiting = [
      t
      for t in threading.enumerate()
      if isinstance(t, ocp_future._SignalingThread) and t.is_alive()  # pylint: disable=protected-access
    ]
    for t in waiting:
      t.cancel()
      ocp_future.set_signals(t._receive_signals, operation_id=t._operation_id)  # pylint: disable=protected-access
  except (ImportError, AttributeError) as e:  # Another orbax: its threads time out on their own.
    absl_logging.warning("could not stop orbax's commit threads after a failed save: %s", e)
    return
  for t in waiting:
    threading.Thread.join(t, timeout_s)
    if not t.is_alive():  # It returned before its work: close the coroutine it never ran.
      _close_unstarted(getattr(t, "_target", None))
  # A thread still busy (a loaded host) or an event loop torn down at exit can still drop an
  # unstarted orbax coroutine.
  damage.quiet_unawaited()


def _close_unstarted(obj, depth: int = 4) -> None:
  """Closes the coroutines a function's closure (or a coroutine's arguments) holds unstarted.

  Else each warns "coroutine ... was never awaited" when collected.
  """
  if depth == 0 or obj is None:
    return
  if inspect.iscoroutine(obj):
    if inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:
      for arg in obj.cr_frame.f_locals.values():  # E.g. the coroutine `cancellable` wraps.
        _close_unstarted(arg, depth - 1)
      obj.close()
    return
  for cell in getattr(obj, "__closure__", None) or ():
    try:
      _close_unstarted(cell.cell_contents, depth - 1)
    except ValueError:  # An empty cell.
      pass


class _SaveFailureFilter(logging.Filter):
  """Drops orbax's error records of a failed save (a traceback each, thousands of lines).

  The Checkpointer reports the failure itself, in one line, on the training thread.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (
      record.levelno >= logging.ERROR
      and f"{os.sep}orbax{os.sep}" in record.pathname
      and write_failure(exc) is not None
    )


logging.getLogger("absl").addFilter(_SaveFailureFilter())


# One filter for a failed read's echoes (damage.py) and a failed write's: asyncio logs both alike.
class _EchoFilter(logging.Filter):
  """Drops asyncio's "exception was never retrieved" records of a failed orbax read or write."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    echo = damage.is_echo(exc, loop_closed=False) or write_failure(exc) is not None
    return not ("never retrieved" in record.getMessage() and echo)


logging.getLogger("asyncio").addFilter(_EchoFilter())


def _is_save_echo(unraisable) -> bool:
  """An exception a failed background write leaves behind (callbacks, unfinished coroutines)."""
  exc = unraisable.exc_value
  if damage.is_echo(exc, loop_closed=True) or write_failure(exc) is not None:
    return True
  code = getattr(unraisable.object, "cr_code", None)  # A coroutine dropped at interpreter exit.
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _quiet_save_echoes(previous, unraisable) -> None:
  if not _is_save_echo(unraisable):
    previous(unraisable)


_HOOK_LOCK = threading.Lock()


def install_save_echo_hook() -> None:
  """Once per process: a failed background write's echoes come before it is reported."""
  with _HOOK_LOCK:
    if not getattr(sys.unraisablehook, "_dipaco_save_echoes", False):
      hook = functools.partial(_quiet_save_echoes, sys.unraisablehook)
      hook._dipaco_save_echoes = True  # pylint: disable=protected-access
      sys.unraisablehook = hook
