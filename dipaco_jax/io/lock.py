"""Advisory locks: one command at a time writes a workdir, one process fills a shared cache.

`workdir(path, command)` is held for a trainer's (and route's, evaluate's) whole
life: `<workdir>/lock.json` names the holder (pid, host, command, since) and is
flock()ed. A second command on a live workdir stops in one line naming the
holder; the kernel drops the lock of a process that dies, however it dies, so a
lock file left by a dead process is taken over with one INFO line. The file is
removed at exit, and a workdir made only to hold it is removed again, so a
command that stops on bad input leaves nothing behind.

`exclusive(path)` is the same lock for a shared cache's first fill (the
prepared corpus, the shard cache): a second process waits, then finds the cache
filled.

Object stores (gs://) have no locks: a gs:// workdir takes none (docs/storage.md
says so, and one INFO line); `$DIPACO_LOCKS=off` turns locks off on a filesystem
that has none (one WARNING line).
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import time
from typing import Iterator

from absl import logging

from dipaco_jax import errors
from dipaco_jax.io import files

LOCK_FILE = "lock.json"  # <workdir>/lock.json: what holds the workdir.
ENV = "DIPACO_LOCKS"  # "off": no locks (a filesystem without them).
# What flock() raises where the filesystem has no locks (NFS without lockd, some FUSE mounts).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL)
_held: dict[str, list] = {}  # Lock file -> [fd, depth]: re-entrant within a process.
_said: set[str] = set()  # Lines said once per process.


class WorkdirBusyError(errors.UserError):
  """Another live command holds the workdir."""


class LockError(errors.UserError):
  """A lock that cannot be taken: an unreadable lock file, a filesystem without locks."""


def _once(key: str, log, *args) -> None:
  if key not in _said:
    _said.add(key)
    log(*args)


def _holder(fd: int) -> dict | None:
  """The holder a lock file names, or None (empty: its holder is starting; or not JSON)."""
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    found = json.loads(os.read(fd, 1 << 16).decode())
  except (OSError, ValueError):
    return None
  return found if isinstance(found, dict) else None


def _read_holder(path: str) -> dict | None:
  """The holder the lock file at `path` names (None: none yet, or it is gone)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    return _holder(fd)
  finally:
    os.close(fd)


def _describe(h: dict | None) -> str:
  if h is None:
    return "another process (its lock file names none yet)"
  return (
    f"{h.get('command', 'a command')} (pid {h.get('pid')} on {h.get('host')}, "
    f"since {h.get('since')})"
  )


def _open(path: str, what: str) -> tuple[int, bool]:
  """The lock file's descriptor and whether this made it; LockError if it cannot be opened."""
  try:
    try:
      return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
      return os.open(path, os.O_RDWR), False
  except OSError as e:
    raise LockError(
      f"{what}'s lock file {path} cannot be opened ({e.strerror}): if no command is using "
      f"{os.path.dirname(path)}, remove it (rm -r {path}) and rerun."
    ) from None


def _no_locks(path: str, e: OSError) -> LockError:
  return LockError(
    f"the filesystem of {os.path.dirname(path)} has no file locks ({e.strerror}), so two "
    f"commands on it cannot be kept apart: use a folder on a local disk, or set {ENV}=off to "
    "run without locks (then never start two commands on one workdir or empty cache)."
  )


def _try(path: str, what: str) -> int | None:
  """flock()s the lock file at `path`: its descriptor, or None when another process holds it."""
  while True:
    fd, made = _open(path, what)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      return None
    except OSError as e:
      os.close(fd)
      if made:  # Nothing is left behind by a lock that cannot be taken.
        os.unlink(path)
      if e.errno in _NO_LOCKS:
        raise _no_locks(path, e) from None
      raise
    # The holder before us removes the file as it lets go: locked, but unlinked, is not held.
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        return fd
    except FileNotFoundError:
      pass
    os.close(fd)


def _stamp(fd: int, command: str) -> dict | None:
  """Writes this process into the lock file; returns the holder it named before (if any)."""
  before = _holder(fd)
  me = {
    "command": command,
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "since": datetime.datetime.now().isoformat(timespec="seconds"),
  }
  os.ftruncate(fd, 0)
  os.pwrite(fd, json.dumps(me).encode(), 0)
  return before


def _release(path: str) -> None:
  fd = _held[path][0]
  del _held[path]
  try:
    os.unlink(path)  # While still held: a waiter then finds its file unlinked and opens anew.
  except FileNotFoundError:
    pass
  os.close(fd)


def _off() -> bool:
  if os.environ.get(ENV, "").lower() in ("off", "0", "false"):
    _once("off", logging.warning, "%s=off: no locks are taken (a workdir or cache is yours).", ENV)
    return True
  return False


def _made_dirs(folder: str) -> list[str]:
  """Makes `folder` and its missing parents; returns those it made, deepest first."""
  made = []
  f = os.path.abspath(folder)
  while not os.path.isdir(f):
    made.append(f)
    f = os.path.dirname(f)
  os.makedirs(folder, exist_ok=True)
  return made


@contextlib.contextmanager
def workdir(path: str, command: str, *, enabled: bool = True) -> Iterator[None]:
  """Holds `path`'s workdir lock while the block runs (WorkdirBusyError if a live command has it).

  `command`: what holds it, in the line another command shows ("train", "route",
  "evaluate"). `enabled`: False for the processes of a multi-process job but the
  first (the job holds it once). Re-entrant in one process.
  """
  if not enabled or _off():
    yield
    return
  if files.is_remote(path):
    _once(
      f"remote:{path}",
      logging.info,
      "%s is an object store: no lock keeps a second command off it (docs/storage.md).",
      path,
    )
    yield
    return
  lock_path = os.path.join(os.path.abspath(path), LOCK_FILE)
  if lock_path in _held:
    _held[lock_path][1] += 1
    try:
      yield
    finally:
      _held[lock_path][1] -= 1
    return
  made = _made_dirs(path)
  try:
    fd = _try(lock_path, f"the workdir {path}")
    if fd is None:
      holder = _read_holder(lock_path)
      raise WorkdirBusyError(
        f"{path} is in use by {_describe(holder)}: wait for it to end, stop it"
        + (f" (kill {holder['pid']})" if holder and "pid" in holder else "")
        + ", or give another --workdir; nothing in it was changed."
      )
  except BaseException:
    _remove_made(made)
    raise
  before = _stamp(fd, command)
  _held[lock_path] = [fd, 1]
  if before is not None and before.get("pid") != os.getpid():
    logging.info(
      "%s: took over the lock of %s, which is no longer running.", path, _describe(before)
    )
  try:
    yield
  finally:
    _release(lock_path)
    _remove_made(made)


def _remove_made(made: list[str]) -> None:
  """Removes the folders `workdir` made, if they are still empty (nothing was written)."""
  for folder in made:
    try:
      os.rmdir(folder)
    except OSError:
      return


@contextlib.contextmanager
def exclusive(path: str, what: str, *, wait_line_s: float = 60.0) -> Iterator[None]:
  """Holds the lock file `path` (made, and its folder), waiting while another process holds it.

  For a shared cache's first fill: the caller checks again, under the lock, whether
  another process filled it meanwhile. `what` names the cache in the line said
  while waiting (one line every `wait_line_s`). A remote path takes no lock.
  """
  if files.is_remote(path) or _off():
    yield
    return
  if path in _held:
    _held[path][1] += 1
    try:
      yield
    finally:
      _held[path][1] -= 1
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, said = None, 0.0
  while fd is None:
    fd = _try(path, what)
    if fd is None:
      if time.monotonic() - said >= wait_line_s:
        said = time.monotonic()
        logging.info("waiting for %s to finish %s", _describe(_read_holder(path)), what)
      time.sleep(0.2)
  _stamp(fd, what)
  _held[path] = [fd, 1]
  try:
    yield
  finally:
    _release(path)
