"""Errors the user can fix: the CLIs print their message as one line, without a traceback."""


class UserError(Exception):
  """Bad input or a stopped run: the message says what happened and how to fix it."""


class ConfigError(ValueError):
  """A config that cannot run: the message names the field, the problem and the fix."""


class DamagedFileError(UserError):
  """A file the run wrote cannot be read (truncated or corrupted); the message names it."""


def json_problem(e: ValueError) -> str:
  """Short reason a file is not valid JSON (JSONDecodeError or UnicodeDecodeError)."""
  if hasattr(e, "pos"):
    return f"invalid JSON at byte {e.pos}: {e.msg}"
  return f"not UTF-8 text: {e}"
