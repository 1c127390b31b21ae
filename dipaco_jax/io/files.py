"""The one path layer for the run's files: local paths and gs:// (any etils.epath URI) alike.

etils.epath does the work; gs:// goes through fsspec/gcsfs, never TensorFlow
(dipaco_jax/__init__.py sets EPATH_USE_TF). What this module adds is writing a
file whole: a reader sees the old contents or the new, never half of them.
Locally that is a temporary name renamed into place; an object store publishes
an object only when its upload completes, so there the object is written
directly (a rename on GCS is a copy plus a delete, and no more atomic).
"""

import io
import json
import os
import uuid
from typing import Any

import numpy as np
from etils import epath

from dipaco_jax import errors

PathLike = str | os.PathLike
# <workdir>/config.json: the trainer writes it, every entry point reads it.
CONFIG_FILE = "config.json"


def path(p: PathLike) -> epath.Path:
  """`p` as an epath.Path (gs://bucket/... stays a URI, never a local `gs:` folder)."""
  return epath.Path(p)


def is_remote(p: PathLike) -> bool:
  """Whether `p` names an object store (gs://, s3://, ...), not the local file system."""
  return "://" in os.fspath(p)


def join(p: PathLike, *parts: str) -> str:
  """`p/parts...` as a string, keeping a URI's scheme."""
  return os.fspath(path(p).joinpath(*parts))


def check_writable(p: PathLike, name: str | None = None, *, file: bool = False) -> None:
  """Refuses an output path that cannot be written, before any work: errors.ArgumentError.

  `p` is a folder to write into (made if missing), or with `file` a file to write. A file
  where a folder must be, or a nearest existing folder this user cannot write, is one line
  that starts with `name` (default: the path). Object stores are not checked here.
  """
  if is_remote(p):
    return
  name = name or os.fspath(p)
  p = os.path.abspath(os.fspath(p))
  if file and os.path.isdir(p):
    raise errors.ArgumentError(f"{name} is a folder: give a file name (e.g. {p}/out.json).")
  q = os.path.dirname(p) if file else p
  while not os.path.lexists(q):  # The nearest existing folder above it.
    q = os.path.dirname(q)
  if not os.path.isdir(q):
    raise errors.ArgumentError(
      f"{name}: {q} is a file, not a folder: give another path (or move {q} aside)."
    )
  if not os.access(q, os.W_OK | os.X_OK):
    raise errors.ArgumentError(
      f"{name}: {q} is not writable by this user: give a folder you can write to (or change "
      "its permissions)."
    )


def write_bytes(p: PathLike, data: bytes) -> None:
  """Writes `data` to `p` whole (see the module docstring), making its parent folders."""
  p = path(p)
  if is_remote(p):
    p.write_bytes(data)
    return
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.parent / f".{p.name}.{uuid.uuid4().hex}.tmp"
  tmp.write_bytes(data)
  tmp.replace(p)


def write_text(p: PathLike, text: str) -> None:
  write_bytes(p, text.encode("utf-8"))


def write_json(p: PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True) -> None:
  """`obj` as JSON, written whole."""
  write_text(p, json.dumps(obj, indent=indent, sort_keys=sort_keys))


def read_text(p: PathLike) -> str:
  return path(p).read_text()


def read_json(p: PathLike) -> Any:
  return json.loads(read_text(p))


def write_npz(p: PathLike, arrays: dict[str, np.ndarray]) -> None:
  """Named arrays to one .npz, written whole."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  write_bytes(p, buf.getvalue())


def read_npz(p: PathLike) -> dict[str, np.ndarray]:
  """The arrays of an .npz (no pickles); a cut file raises what np.load raises."""
  with np.load(io.BytesIO(path(p).read_bytes()), allow_pickle=False) as z:
    return {k: z[k] for k in z.files}


def user_cache_dir() -> str:
  """$DIPACO_CACHE_DIR, else $XDG_CACHE_HOME/dipaco_jax, else ~/.cache/dipaco_jax.

  The project's cache folder: the shard cache, tfds's prepared corpus.
  """
  return os.environ.get("DIPACO_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dipaco_jax"
  )
