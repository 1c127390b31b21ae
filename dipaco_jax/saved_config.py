"""A run's saved config, <workdir>/config.json, read back as a config file.

The trainer writes config.json when a run starts. route, evaluate and serve
read it when no --config is given (cli.py passes `--config=<this file>:<workdir>`,
so --config.a.b=v overrides apply on top as they do on a configs/*.py file).
The fields start from schema.base(), so each keeps its type; a field
the file names that base() lacks is an error naming the nearest field.
"""

import json

import jax
import ml_collections
from etils import epath

from dipaco_jax import errors
from dipaco_jax.config import schema
from dipaco_jax.io import files

FILE = files.CONFIG_FILE


def path(workdir: str) -> epath.Path:
  return files.path(workdir) / FILE


def _fill(node: ml_collections.ConfigDict, saved: dict, where: str, prefix: str = "") -> None:
  for key, value in saved.items():
    name = f"{prefix}{key}"
    if key not in node:
      raise errors.ConfigError(
        f"{where}: {schema.unknown_name_message(name)} Edit the file or pass --config."
      )
    if isinstance(node[key], ml_collections.ConfigDict):
      if not isinstance(value, dict):
        raise errors.ConfigError(f"{where}: config.{name} must be a section, not {value!r}.")
      _fill(node[key], value, where, f"{name}.")
      continue
    try:  # JSON has lists where the config has tuples.
      node[key] = tuple(value) if isinstance(value, list) else value
    except TypeError as e:
      raise errors.ConfigError(
        f"{where}: config.{name}={value!r} has the wrong type ({e}); edit the file or pass "
        "--config."
      ) from e


def load(workdir: str) -> ml_collections.ConfigDict:
  """base() with the fields of <workdir>/config.json; ConfigError if there is none."""
  p = path(workdir)
  if not p.exists():
    raise errors.ConfigError(
      f"no --config given and no {p}: pass the run's --config=configs/NAME.py (training "
      f"writes {FILE} when it starts)."
    )
  try:
    saved = json.loads(files.read_text(p))
  except ValueError as e:
    raise errors.DamagedFileError(
      f"{p} is damaged ({errors.json_problem(e)}); pass the run's --config=configs/NAME.py."
    ) from e
  if not isinstance(saved, dict):
    raise errors.DamagedFileError(f"{p} holds no config; pass the run's --config=configs/NAME.py.")
  config = schema.base()
  _fill(config, saved, str(p))
  return config


def get_config(workdir: str) -> ml_collections.ConfigDict:
  """The config-file entry config_flags calls (`--config=saved_config.py:<workdir>`)."""
  return load(workdir)


# Sections of the config that must not change when a run resumes.
_FROZEN_SECTIONS = ("model", "dipaco", "data")


def check_matches(workdir: epath.Path, config) -> None:
  """Refuses to resume a workdir written by a different grid, model or data."""
  path = workdir / files.CONFIG_FILE
  if path.exists():
    old, new = files.read_json(path), json.loads(config.to_json_best_effort())
    # A field added since the run started (model.mlp, ...) had its default then.
    default = json.loads(schema.base().to_json_best_effort())
    changed = [
      s for s in _FROZEN_SECTIONS if {**default.get(s, {}), **old.get(s, {})} != new.get(s)
    ]
    if changed:
      raise errors.ConfigError(
        f"{workdir} holds a run with different config sections {changed}; "
        "its checkpoints would not fit. Use a new --workdir (nothing was "
        "changed in the old one)."
      )


def write(workdir: epath.Path, config) -> None:
  """config.json, once the config is valid and the run's shards are ready."""
  path = workdir / files.CONFIG_FILE
  if jax.process_index() == 0 and not path.exists():
    files.write_json(path, json.loads(config.to_json_best_effort()))
