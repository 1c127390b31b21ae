"""The shared entry of the CLIs (main, route, evaluate, serve): flags, one check, one-line errors.

    cli.run(main)  # main(argv) calls `config, workdir = cli.start(argv)` first.

Libraries log at WARNING and above (`--library_log_level`; orbax alone printed
~100 INFO lines per tiny run); the project's own lines follow absl's --verbosity.

A user error (`is_user_error`: a wrong config field or flag, a grid or mesh that
cannot work, a missing or damaged input file, an empty shard, a diverged run)
prints one line to stderr and exits with status 1; --verbose_errors shows
its traceback. Any other exception is a bug and keeps its traceback.
"""

import logging
import os
import re
import sys
from typing import Any, Callable, NoReturn

import jax
from absl import app
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from dipaco_jax import config_check
from dipaco_jax import config_defaults
from dipaco_jax import distributed
from dipaco_jax import errors

_VERBOSE = flags.DEFINE_bool(
  "verbose_errors",
  False,
  "Show the traceback of a user error (a bad config field, a "
  "missing file) instead of its one line.",
)
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "Config file (configs/*.py); override fields with --config.section.field=value.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "The run's directory (local or gs://): checkpoints, metrics, shards, "
  "router. An existing run there is resumed.",
)
flags.mark_flags_as_required(["config", "workdir"])
_LIBRARY_LOG_LEVEL = flags.DEFINE_enum(
  "library_log_level",
  "warning",
  ["debug", "info", "warning", "error"],
  "Least severity of the libraries' log lines (orbax, tensorflow-datasets, jax, TensorFlow's "
  "C++ logs); 'info' brings back orbax's lines about every checkpoint. The project's own "
  "lines follow --verbosity.",
)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# TF_CPP_MIN_LOG_LEVEL for each --library_log_level (TensorFlow's C++ logs, read at its import).
_CPP_LEVEL = {"debug": "0", "info": "0", "warning": "1", "error": "2"}

_CONFIG_FLAG = re.compile(r"^--?(?:no)?config\.([^=]+)")
_CONFIG_FILE = re.compile(r"^--?config(?:=(.*))?$")
_FLAG_ERROR = re.compile(r"^flag --config\.([\w.]+)=(.*?): (.*)$")


def is_user_error(e: BaseException) -> bool:
  """Errors of the input, reported in one line: the config, missing files, data, divergence."""
  from dipaco_jax.data import shards  # pylint: disable=g-import-not-at-top

  return isinstance(
    e,
    (
      config_defaults.ConfigError,  # Also TopologyError, MeshError, ElasticConfigError.
      errors.UserError,  # Damaged files, no checkpoint, divergence (metrics.DivergenceError).
      FileNotFoundError,  # A missing input named by the OS.
      shards.EmptyShardError,
      app.UsageError,
      flags.Error,
    ),
  )


def one_line(e: BaseException) -> str:
  """`Type: message` on one line (a multi-line message keeps its first and last lines)."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()] or [repr(e)]
  text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
  return f"{type(e).__name__}: {text}"


def fail(e: BaseException, verbose: bool) -> NoReturn:
  """Prints a user error's one line and exits 1; with `verbose`, re-raises it."""
  if verbose:
    raise e
  print(one_line(e), file=sys.stderr, flush=True)
  sys.exit(1)


def _check_config_args(argv: list[str]) -> None:
  """Refuses a missing config file or an unknown --config.a.b before absl parses them."""
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    if m := _CONFIG_FILE.match(arg):
      path = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
      path = path.split(":", 1)[0]
      if not os.path.isfile(path):
        raise config_defaults.ConfigError(
          f"--config={path}: no such config file; give one of configs/*.py."
        )
    elif m := _CONFIG_FLAG.match(arg):
      if m.group(1) not in config_check.field_names():
        raise config_defaults.ConfigError(
          config_check.unknown_name_message(m.group(1), prefix="--config.")
        )


def _flag_error(e: flags.Error) -> BaseException:
  """absl's `flag --config.a.b=V: reason`, with what the field must be."""
  m = _FLAG_ERROR.match(str(e).splitlines()[0])
  if m is None or m.group(1) not in config_check.field_names():
    return e
  key, value, reason = m.groups()
  return config_defaults.ConfigError(
    f"--config.{key}={value} cannot be read ({reason}): {config_check.requirement(key)}"
  )


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flags_parser: a wrong flag or config field is one line and exit status 1."""
  verbose = "--verbose_errors" in argv
  try:
    _check_config_args(argv)
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(_flag_error(e), verbose)
  except config_defaults.ConfigError as e:
    fail(e, verbose)


class _LibraryFilter(logging.Filter):
  """Passes the project's records, and the others at `level` or above."""

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= self.level or record.pathname.startswith(_PACKAGE_DIR)


def quiet_libraries(level: str) -> None:
  """Drops the libraries' log records below `level` (debug|info|warning|error)."""
  handler = absl_logging.get_absl_handler()
  for f in [f for f in handler.filters if isinstance(f, _LibraryFilter)]:
    handler.removeFilter(f)
  handler.addFilter(_LibraryFilter(logging.getLevelName(level.upper())))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", _CPP_LEVEL[level])


def guard(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  """`main` with user errors reduced to one line (see the module docstring)."""

  def guarded(argv):
    quiet_libraries(_LIBRARY_LOG_LEVEL.value)
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      if not is_user_error(e):
        raise
      fail(e, _VERBOSE.value)

  return guarded


def run(main: Callable[[list[str]], Any]) -> None:
  """app.run(main) with the one-line user errors of parse_flags and guard."""
  app.run(guard(main), flags_parser=parse_flags)


def start(argv: list[str]) -> tuple[Any, str]:
  """Validates the config and --workdir, then the CPU device split and jax.distributed.

  Runs before anything touches the workdir or a backend; returns (config, workdir).
  """
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag=value.")
  config, workdir = _CONFIG.value, _WORKDIR.value
  config_check.validate(config)
  if workdir.strip() in ("", "None", "none"):
    raise config_defaults.ConfigError(
      f"--workdir={workdir!r} names no directory: give the run's directory."
    )
  if config.mesh.cpu_devices:  # Before any backend starts; TPU/GPU runs are unaffected.
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  distributed.initialize()
  return config, workdir
