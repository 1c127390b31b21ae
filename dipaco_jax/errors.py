"""Errors the user can fix: the CLIs print their message as one line, without a traceback."""


class UserError(Exception):
  """Bad input or a stopped run: the message says what happened and how to fix it."""


class DamagedFileError(UserError):
  """A file the run wrote cannot be read (truncated or corrupted); the message names it."""
