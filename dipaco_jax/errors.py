"""Errors the user can fix: the CLIs print their message as one line, without a traceback."""

import sys
from typing import NoReturn

from absl import app
from absl import flags

# Every command's --verbose_errors (cli.py, aot/command.py, python -m dipaco_jax.data): here, so a
# command that does not import cli.py (jax, the trainer's flags) shares the one flag.
VERBOSE_ERRORS = flags.DEFINE_bool(
  "verbose_errors",
  False,
  "Show the traceback of a user error (a bad config field, flag or input, a missing file) "
  "instead of its one line.",
)


class UserError(Exception):
  """Bad input or a stopped run: the message says what happened and how to fix it."""


class ConfigError(ValueError):
  """A config that cannot run: the message names the field, the problem and the fix."""


class DamagedFileError(UserError):
  """A file the run wrote cannot be read (truncated or corrupted); the message names it."""


class Interrupted(UserError):
  """Ctrl-C (SIGINT) stopped a command: where it stopped and how to go on; exit status 130."""

  exit_code = 130  # 128 + SIGINT, as a shell reports a command it interrupted.


class ArgumentError(UserError, ValueError):
  """A bad argument (a command's flag, a text to serve): names it, what it must be, the fix.

  A ValueError too, for the library functions that raise it.
  """


def is_user_error(e: BaseException) -> bool:
  """Errors of the input, reported in one line: the config, missing files, data, divergence."""
  return isinstance(
    e,
    (
      ConfigError,  # Also TopologyError, MeshError, ElasticConfigError.
      UserError,  # Damaged files, no checkpoint, empty shards, divergence (guard.DivergenceError).
      FileNotFoundError,  # A missing input named by the OS.
      app.UsageError,
      flags.Error,
    ),
  )


def fail(e: BaseException, verbose: bool) -> NoReturn:
  """Prints a user error's one line and exits 1 (Interrupted: 130); with `verbose`, re-raises it."""
  if verbose:
    raise e
  print(one_line(e), file=sys.stderr, flush=True)
  sys.exit(getattr(e, "exit_code", 1))


def one_line(e: BaseException) -> str:
  """`Type: message` on one line (a multi-line message keeps its first and last lines)."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()] or [repr(e)]
  text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
  return f"{type(e).__name__}: {text}"


def json_problem(e: ValueError) -> str:
  """Short reason a file is not valid JSON (JSONDecodeError or UnicodeDecodeError)."""
  if hasattr(e, "pos"):
    return f"invalid JSON at byte {e.pos}: {e.msg}"
  return f"not UTF-8 text: {e}"
