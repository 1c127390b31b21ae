"""Damaged checkpoints: an unreadable file or array of a step, reported in one line.

A file that cannot be read (truncated, missing, a compressed chunk that does
not decode, bad or missing zarr metadata, a missing chunk) or an array whose
bytes do not match its checksum (checksums.py) gives one DamagedCheckpointError
naming the step, the file or the item's array (and row) and the older
checkpoint to resume from; nothing falls back silently.
"""

import contextlib
import functools
import json
import os
import re
import sys
import warnings

import tensorstore as ts
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import layout

# TensorStore status codes of unreadable bytes (not of a missing array or a shape mismatch).
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE")
# FAILED_PRECONDITION while reading a stored value: a chunk that does not decode (zstd
# "Data corruption detected", a truncated stream, a size that does not fit the zarr metadata)
# or metadata that does not parse. An array missing from an OCDBT database is NOT_FOUND.
_READ_FAILED = re.compile(r'^FAILED_PRECONDITION: .*?Error reading "([^"]+)"')
_MISSING = re.compile(
  r'^NOT_FOUND: .*?(?:Metadata at "(?P<meta>[^"]+)" .* does not exist'
  r'|chunk .* stored at "(?P<chunk>[^"]+)" .* is missing)'
)


class DamagedCheckpointError(errors.DamagedFileError):
  """A file of a checkpoint step cannot be read."""


def _json_files(step_dir: epath.Path) -> list[epath.Path]:
  """orbax's JSON files of a step: its own, and each item's (array metadata included)."""
  out = []
  for p in step_dir.iterdir():
    for q in p.iterdir() if p.is_dir() else [p]:
      if q.name in layout.JSON_FILES:
        out.append(q)
      elif q.name == "array_metadatas" and q.is_dir():
        out.extend(q.iterdir())
  return sorted(out, key=str)


def _bad_json(step_dir: epath.Path) -> str | None:
  """'<file>: <reason>' for the first of a step's JSON files that does not parse."""
  for p in _json_files(step_dir):
    try:
      json.loads(p.read_text())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
      return f"{p.relative_to(step_dir)}: {errors.json_problem(e)}"
  return None


def saved_items(step_dir: epath.Path) -> list[str] | None:
  """The items the step's data item says were saved with it (None: it predates the list)."""
  try:
    items = json.loads((step_dir / "data" / "metadata").read_text()).get(layout.SAVED_ITEMS)
  except (OSError, ValueError, AttributeError):  # Missing or unreadable: reported on its own.
    return None
  return items if isinstance(items, list) else None


def _missing_file(step_dir: epath.Path) -> str | None:
  """'<file>: missing' for the first file a finished step must hold and does not."""
  listed = saved_items(step_dir)
  for item, names in layout.REQUIRED.items():
    item_dir = step_dir / item
    if not item_dir.is_dir():
      if item in layout.ALWAYS_SAVED:
        return f"{item}/: missing"
      if listed is not None and item in listed:
        return f"{item}/: missing, though its data item lists it as saved with the step"
      continue
    ocdbt = any(p.name == "d" or p.name.startswith("ocdbt.process_") for p in item_dir.iterdir())
    for name in names:
      if (name != "manifest.ocdbt" or ocdbt) and not (item_dir / name).exists():
        return f"{item}/{name}: missing"
  return None


def _saved_arrays(step_dir: epath.Path, item: str) -> set[str]:
  """The array names an item's _METADATA lists (what orbax saved in it)."""
  try:
    tree = json.loads((step_dir / item / "_METADATA").read_text())["tree_metadata"]
  except (OSError, ValueError, KeyError):
    return set()
  return {".".join(str(k["key"]) for k in v["key_metadata"]) for v in tree.values()}


def status_message(err: BaseException) -> str:
  """An orbax/TensorStore error's message without the TensorStore spec it ends with."""
  return str(err).split(" [tensorstore_spec")[0]


def _is_damage(msg: str) -> bool:
  """Whether a TensorStore status message reports stored bytes that cannot be read."""
  return any(msg.startswith(c + ":") for c in _DAMAGE_CODES) or bool(
    _READ_FAILED.match(msg) or _MISSING.match(msg)
  )


def _bad_bytes(err: BaseException | None, step_dir: epath.Path) -> str | None:
  """'<file>: <reason>' when an orbax/TensorStore error (or its cause) reports unreadable bytes."""
  while err is not None:
    msg = status_message(err)
    files = re.findall(r'local file "([^"]+)"', msg)
    item = os.path.relpath(files[-1], os.path.abspath(step_dir)) if files else "an OCDBT file"
    if any(msg.startswith(code + ":") for code in _DAMAGE_CODES):
      what = item
      array = re.search(r'Error reading "([^"]+)/', msg)
      if files and files[-1].endswith("/") and array:  # TensorStore names the item, not the file.
        what = f"{what} data of array {array.group(1)}"
      return f"{what}: {msg.rsplit(': ', 1)[-1]}"
    if m := _READ_FAILED.match(msg):
      array, key = m.group(1).rsplit("/", 1) if "/" in m.group(1) else (m.group(1), "")
      part = "metadata" if key in (".zarray", "zarr.json") else "data"
      reason = re.split(r'(?:local file|database at) "[^"]*": ', msg)[-1].split("; at byte")[0]
      return f"{item} {part} of array {array}: {reason}"
    if m := _MISSING.match(msg):
      array, part = (m.group("meta") or m.group("chunk")).rsplit("/", 1)
      if array in _saved_arrays(step_dir, item):  # Else the caller asked for an unsaved array.
        return (
          f"{item} array {array}: {'zarr metadata' if m.group('meta') else f'chunk {part}'} missing"
        )
    err = err.__cause__ or err.__context__
  return None


def _quick_check(step_dir: epath.Path) -> bool:
  """Whether a step's files are there, its JSON parses and its OCDBT indexes list (data unread)."""
  if _missing_file(step_dir) is not None or _bad_json(step_dir) is not None:
    return False
  for manifest in step_dir.glob("*/manifest.ocdbt"):
    try:
      kv = ts.KvStore.open({"driver": "ocdbt", "base": layout.kv_url(manifest.parent)}).result()
      kv.list().result()
    except Exception:  # pylint: disable=broad-except
      return False
  return True


def damaged(root: epath.Path, step: int, what: str) -> DamagedCheckpointError:
  """The one-line error for `what` of step `step` in `root`, naming the step to resume from."""
  older = [s for s in layout.finished_steps(root) if s < step]
  intact = next((s for s in reversed(older) if _quick_check(root / str(s))), None)
  aside = f"mv {root / str(step)} {root.parent / f'damaged_checkpoint_{step}'}"
  then = (
    f"to resume from step {intact}, the newest intact checkpoint"
    if intact is not None
    else "to start the run over from step 0 (no older checkpoint is intact)"
  )
  return DamagedCheckpointError(
    f"checkpoint step {step} in {root} is damaged ({what}); move it aside ({aside}) {then}."
  )


# A restore that fails on a damaged file leaves echoes: orbax stops at the first unreadable
# array while its other reads go on; they fail too (asyncio logs "Task exception was never
# retrieved"), are closed unawaited, or their TensorStore callbacks find orbax's event loop
# closed, during and after the failed call. The damage is reported once, in one line; these
# would print a traceback each, so they are dropped (asyncio's records: save_failures.py).
_ORBAX_READ_ERROR = "Encountered error while reading array index"


def is_echo(exc: BaseException | None, loop_closed: bool) -> bool:
  """Whether an exception (or one in its chain) is an echo of a failed read."""
  while exc is not None:
    msg = status_message(exc)
    if (
      msg.startswith(_ORBAX_READ_ERROR)
      or _is_damage(msg)
      or (loop_closed and isinstance(exc, RuntimeError) and msg == "Event loop is closed")
    ):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def quiet_unawaited() -> None:
  """Drops "coroutine ... was never awaited" warnings from here on (a failed read's or write's).

  orbax's reads and writes left unstarted when one of them fails are collected
  later, at any point up to interpreter exit, each warning with its own lines.
  The process stops on the one-line error that the failure gives.
  """
  warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)


def _quiet_echoes(previous, unraisable) -> None:
  """sys.unraisablehook while (and after) a checkpoint is read: drops the echoes."""
  if not is_echo(unraisable.exc_value, loop_closed=True):
    previous(unraisable)


@contextlib.contextmanager
def reading(root: epath.Path, step: int):
  """Turns an unreadable file of checkpoint `step` into one DamagedCheckpointError."""
  step_dir = root / str(step)
  bad = (_missing_file(step_dir) or _bad_json(step_dir)) if step_dir.exists() else None
  if bad is not None:
    raise damaged(root, step, bad)
  previous = sys.unraisablehook
  sys.unraisablehook = functools.partial(_quiet_echoes, previous)
  try:
    yield
  except DamagedCheckpointError:
    sys.unraisablehook = previous
    raise
  except Exception as e:  # pylint: disable=broad-except
    bad = _bad_bytes(e, step_dir)
    if bad is None:
      sys.unraisablehook = previous
      raise
    quiet_unawaited()
    raise damaged(root, step, bad) from e  # The hook stays: echoes come later too.
  sys.unraisablehook = previous
