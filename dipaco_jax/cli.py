"""The shared entry of the CLIs (main, route, evaluate, serve): flags, one check, one-line errors.

aot and `python -m dipaco_jax.data` keep their own flags but the same rule: errors.one_line,
exit status 1, --verbose_errors.

    cli.run(main)  # main(argv) calls `config, workdir = cli.start(argv)` first.

Libraries log at WARNING and above (`--library_log_level`; orbax alone printed
~100 INFO lines per tiny run); the project's own lines follow absl's --verbosity.

Which config a command runs with (route, evaluate and serve: `saved_config=True`):
  1. --config=configs/NAME.py given: that file, whatever the workdir holds;
  2. else <workdir>/config.json, the config the trainer saved (saved_config.py);
  3. else a one-line error asking for --config. main always needs --config.
--config.a.b=v overrides apply on top of either, so a run's overrides are given
once, to the trainer, and route/evaluate/serve take only the ones they change.

A user error (`is_user_error`: a wrong config field or flag, a config file that
raises or returns no ConfigDict (config_check.run_config_file runs it first), a
workdir or output path that is a file or unwritable, a grid or mesh that cannot
work, a missing or damaged input file, an empty shard, a diverged run) prints
one line to stderr and exits with status 1; --verbose_errors shows its
traceback. Ctrl-C is one line too, with exit status 130. Any other exception
is a bug and keeps its traceback.
Each entry module calls `flags.adopt_module_key_flags(cli)` so that its --help
lists --config, --workdir and --verbose_errors beside its own flags.
"""

import logging
import os
import re
import sys
from typing import Any, Callable

import jax
from absl import app
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax.io import distributed
from dipaco_jax.io import files
from dipaco_jax.io import hugepages
from dipaco_jax.io import native

flags.adopt_module_key_flags(distributed)  # --coordinator_address, --num_processes, --process_id.
flags.adopt_module_key_flags(errors)  # --verbose_errors.
_VERBOSE = errors.VERBOSE_ERRORS
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  None,
  "Config file (configs/*.py); override fields with --config.section.field=value. "
  "route, evaluate and serve default to the run's saved <workdir>/config.json.",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "The run's directory (local or gs://): checkpoints, metrics, shards, "
  "router, config.json. An existing run there is resumed.",
)
flags.mark_flag_as_required("workdir")
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

_CONFIG_FILE = re.compile(r"^--?config(?:=(.*))?$")
_WORKDIR_ARG = re.compile(r"^--?workdir(?:=(.*))?$")
_HELP = re.compile(r"^--?(?:help|helpshort|helpfull|helpxml)$")


is_user_error = errors.is_user_error  # The errors printed in one line (errors.py).
one_line = errors.one_line  # `Type: message` on one line.
fail = errors.fail  # One line and exit 1; with --verbose_errors, the traceback.


def _flag_value(argv: list[str], pattern: re.Pattern) -> str | None:
  """The value of the last --name=V or --name V before `--` (None when absent)."""
  value = None
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    if m := pattern.match(arg):
      value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
  return value


def _with_config(argv: list[str], saved_config: bool) -> list[str]:
  """argv with the config it runs with (see the module docstring's precedence)."""
  if any(_HELP.match(a) for a in argv[1:]) or _flag_value(argv, _CONFIG_FILE) is not None:
    return argv
  workdir = _flag_value(argv, _WORKDIR_ARG)
  if not saved_config:
    raise errors.ConfigError(
      "--config is required: give the run's config file, e.g. --config=configs/tiny.py."
    )
  if workdir is None:
    return argv  # absl names the missing --workdir.
  check_workdir(workdir, writes=False)
  from dipaco_jax import saved_config as saved  # pylint: disable=g-import-not-at-top

  saved.load(workdir)  # Its errors here, in one line, before config_flags wraps them.
  # First, as config_flags refuses overrides before the --config they apply to.
  return [argv[0], f"--config={saved.__file__}:{workdir}", *argv[1:]]


def parse_flags(argv: list[str], saved_config: bool = False) -> list[str]:
  """absl's flags_parser: a wrong flag or config field is one line and exit status 1.

  With `saved_config`, a command without --config reads <workdir>/config.json.
  """
  verbose = "--verbose_errors" in argv
  try:
    argv = _with_config(argv, saved_config)
    config_check.check_config_args(argv)
    if argv is not sys.argv:
      sys.argv[:] = argv  # config_flags reads its overrides from sys.argv.
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(config_check.flag_error(e), verbose)
  except (errors.ConfigError, errors.UserError) as e:
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
    except KeyboardInterrupt:  # Ctrl-C outside training (which says more: train.py).
      fail(
        errors.Interrupted(
          "stopped by Ctrl-C: every file is written whole, so nothing written is damaged; "
          "rerun the same command to do it again."
        ),
        _VERBOSE.value,
      )
    except Exception as e:  # pylint: disable=broad-except
      if not is_user_error(e):
        raise
      fail(e, _VERBOSE.value)

  return guarded


def run(main: Callable[[list[str]], Any], *, saved_config: bool = False) -> None:
  """app.run(main) with the one-line user errors of parse_flags and guard.

  `saved_config`: without --config, read the run's <workdir>/config.json.
  """
  hugepages.maybe_reexec()  # Before any backend starts; returns at once in the restarted process.
  app.run(guard(main), flags_parser=lambda argv: parse_flags(argv, saved_config))


def check_workdir(workdir: str, *, writes: bool) -> None:
  """A --workdir that is a file is one line; with `writes`, one this user cannot write too."""
  if writes:
    files.check_writable(workdir, f"--workdir={workdir}")
  elif os.path.exists(workdir) and not os.path.isdir(workdir):  # A local path (gs:// is not).
    raise errors.ArgumentError(
      f"--workdir={workdir} is a file, not a run's folder: give the run's directory."
    )


def start(argv: list[str], *, writes: bool = True) -> tuple[Any, str]:
  """Validates the config and --workdir, then the CPU device split and jax.distributed.

  Runs before anything touches the workdir or a backend; returns (config, workdir).
  `writes`: the command writes into the workdir (serve only reads it).
  """
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag=value.")
  config, workdir = _CONFIG.value, _WORKDIR.value
  config_check.validate(config)
  if workdir.strip() in ("", "None", "none"):
    raise errors.ConfigError(f"--workdir={workdir!r} names no directory: give the run's directory.")
  check_workdir(workdir, writes=writes)
  # Before any backend starts: a host without TPU or GPU runs jax on the CPU alone, so an
  # installed libtpu prints no start-up errors (io/native.py).
  native.choose_platforms()
  if config.mesh.cpu_devices:  # Before any backend starts; TPU/GPU runs are unaffected.
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  distributed.initialize()
  return config, workdir
