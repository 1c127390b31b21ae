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
from absl import logging
from etils import epath

from dipaco_jax import errors
from dipaco_jax.config import schema
from dipaco_jax.io import files
from dipaco_jax.io import lock

FILE = files.CONFIG_FILE


def path(workdir: str) -> epath.Path:
  return files.path(workdir) / FILE


_PASS_CONFIG = "pass the run's --config=configs/NAME.py"


def _fill(
  node: ml_collections.ConfigDict,
  saved: dict,
  where: str,
  prefix: str = "",
  fix: str = "edit the file or pass --config",
) -> None:
  for key, value in saved.items():
    name = f"{prefix}{key}"
    if not prefix and key in schema.REMOVED:  # Written before that section left the config.
      continue
    if key not in node:
      raise errors.ConfigError(
        f"{where}: {schema.unknown_name_message(name)} {fix[0].upper()}{fix[1:]}."
      )
    if isinstance(node[key], ml_collections.ConfigDict):
      if not isinstance(value, dict):
        raise errors.ConfigError(f"{where}: config.{name} must be a section, not {value!r}; {fix}.")
      _fill(node[key], value, where, f"{name}.", fix)
      continue
    try:  # JSON has lists where the config has tuples.
      node[key] = tuple(value) if isinstance(value, list) else value
    except TypeError as e:
      raise errors.ConfigError(
        f"{where}: config.{name}={value!r} has the wrong type ({e}); {fix}."
      ) from e


def _read(p: epath.Path, fix: str) -> dict:
  """config.json's fields; damage (not JSON, not an object) is one line ending in `fix`."""
  try:
    saved = json.loads(files.read_text(p))
  except ValueError as e:
    raise errors.DamagedFileError(f"{p} is damaged ({errors.json_problem(e)}); {fix}.") from e
  if not isinstance(saved, dict):
    raise errors.DamagedFileError(f"{p} holds no config; {fix}.")
  return saved


def load(workdir: str) -> ml_collections.ConfigDict:
  """base() with the fields of <workdir>/config.json; ConfigError if there is none."""
  p = path(workdir)
  if not p.exists():
    raise errors.ConfigError(
      f"no --config given and no {p}: {_PASS_CONFIG} (training writes {FILE} when it starts)."
    )
  config = schema.base()
  _fill(config, _read(p, _PASS_CONFIG), str(p))
  return config


def get_config(workdir: str) -> ml_collections.ConfigDict:
  """The config-file entry config_flags calls (`--config=saved_config.py:<workdir>`)."""
  return load(workdir)


# Sections a run's state depends on: its checkpoints fit no other model, grid or data.
_FROZEN_SECTIONS = ("model", "dipaco", "data")
# What the config.json of an earlier attempt that saved nothing may differ in before it is set
# aside: those sections and routing's (its router and shards are in the workdir too).
_ATTEMPT_SECTIONS = (*_FROZEN_SECTIONS, "routing")
GROWABLE = "dipaco.outer_steps"  # The spmd loop resumes with more outer steps.


def _saved_and_new(workdir: epath.Path, config) -> tuple[dict, dict] | None:
  """(config.json with today's defaults for fields added since, the config) as flat dicts.

  A damaged config.json, or one naming a field that does not exist or has the wrong type,
  is one line: the run's config cannot be compared.
  """
  path = workdir / files.CONFIG_FILE
  if not path.exists():
    return None
  old = _read(
    path,
    f"restore it, or move it aside (mv {path} {path}.damaged) to go on with this command's "
    "config unchecked (the trainer then saves it in its place)",
  )
  _fill(schema.base(), old, str(path), fix="edit the file: it is the config the run started with")
  new = json.loads(config.to_json_best_effort())
  default = json.loads(schema.base().to_json_best_effort())
  flat = lambda d, sections: {
    f"{s}.{k}": v for s in sections for k, v in {**default.get(s, {}), **d.get(s, {})}.items()
  }
  return flat(old, _ATTEMPT_SECTIONS), flat(new, _ATTEMPT_SECTIONS)


def check_matches(workdir: epath.Path, config, *, started: bool, may_grow: bool) -> None:
  """Refuses to resume a run's state under a different model, grid or data.

  `started`: the workdir holds run state (a checkpoint, elastic storage); without
  it nothing can clash (an earlier attempt's files are set aside instead).
  `may_grow`: the runtime resumes with more outer steps (the spmd loop).
  """
  pair = _saved_and_new(workdir, config)
  if not started:
    return
  if pair is None:  # Accepted: the checkpoint's shapes are still checked where it is read.
    logging.warning(
      "%s holds a run's checkpoints but no %s: this config is not checked against the run's "
      "(only the checkpoint's shapes are) and is saved as its %s.",
      workdir,
      FILE,
      FILE,
    )
    return
  old, new = pair
  changed = [k for k in old if k.split(".")[0] in _FROZEN_SECTIONS and old[k] != new.get(k)]
  if changed == [GROWABLE] and may_grow and new[GROWABLE] > old[GROWABLE]:
    logging.warning(
      "resuming %s with %s=%d (was %d): the inner cosine, unless config.inner.total_steps is "
      "set, now spans the longer run; --config.inner.total_steps=%d keeps the old one.",
      workdir,
      GROWABLE,
      new[GROWABLE],
      old[GROWABLE],
      old[GROWABLE] * old["dipaco.inner_steps"],
    )
    return
  if changed:
    grow = (
      f" A run trains longer with a larger {GROWABLE} alone, in the spmd loop."
      if GROWABLE in changed
      else ""
    )
    shown = ", ".join(f"{k}: {old[k]!r} -> {new.get(k)!r}" for k in changed[:4])
    more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
    raise errors.ConfigError(
      f"{workdir} holds a run whose state does not fit this config ({shown}{more}): rerun "
      f"with its own values, or use a new --workdir (nothing was changed in the old one).{grow}"
    )


# The fields that shape a run's params: a checkpoint fits no config that changes one.
_SHAPE_FIELDS = (
  *(f"model.{k}" for k in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim")),
  *(f"model.{k}" for k in ("mlp_ratio", "mlp", "positions", "tie_embeddings", "attention_kernels")),
  *(f"dipaco.{k}" for k in ("level_groups", "modules_per_level", "path_specific", "paths")),
  "dipaco.replicas",
)


def check_readable(workdir: str, config) -> None:
  """Refuses to read a run's checkpoints (evaluate, serve) under a config of another model or grid.

  Compares the fields that shape the params with <workdir>/config.json (none: nothing to
  compare; the checkpoint's own checks still run).
  """
  pair = _saved_and_new(files.path(workdir), config)
  if pair is None:
    return
  old, new = pair
  learned = "learned" in (old["model.positions"], new["model.positions"])
  fields = _SHAPE_FIELDS + (("model.max_len",) if learned else ())
  changed = [k for k in fields if old.get(k) != new.get(k)]
  if changed:
    shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:4])
    more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
    raise errors.ConfigError(
      f"{workdir} holds a run of another model or grid than this config ({shown}{more}, "
      f"against its {FILE}): drop --config to read the run's own config, or give its values."
    )


def set_aside_earlier_attempt(workdir: epath.Path, config) -> None:
  """Moves the files of an earlier attempt that saved no state and ran another config aside.

  Its config.json, shards and router would refuse or mislead this run; nothing is
  deleted: they go to <workdir>/earlier_attempt_<n>/ (one line says so).
  """
  pair = _saved_and_new(workdir, config)
  if pair is None or jax.process_index() != 0:
    return
  old, new = pair
  if all(old[k] == new.get(k) for k in old):
    return  # The same config again: its shards and router are reused.
  n = 1 + sum(1 for p in workdir.glob("earlier_attempt_*"))
  aside = workdir / f"earlier_attempt_{n}"
  aside.mkdir()
  for entry in workdir.iterdir():  # No other command runs here: this one holds lock.json.
    if not entry.name.startswith("earlier_attempt_") and entry.name != lock.LOCK_FILE:
      entry.rename(aside / entry.name)
  logging.warning(
    "%s held an earlier attempt of another config that saved no checkpoint; its files are "
    "now in %s (delete it when you no longer need them).",
    workdir,
    aside,
  )


def write(workdir: epath.Path, config) -> None:
  """config.json, once the config is valid and the run's shards are ready."""
  path = workdir / files.CONFIG_FILE
  if jax.process_index() == 0 and not path.exists():
    files.write_json(path, json.loads(config.to_json_best_effort()))
