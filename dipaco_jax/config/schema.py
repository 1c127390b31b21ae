"""The config's schema, derived from the declarations: `base()`, field names, each field's check.

    c = schema.base()          # Every field at its default: a configs/*.py file starts here.
    schema.check_fields(c)     # ConfigError (one line) for an unknown, missing or invalid field.

A config file calls `base()` and overrides what differs; it may not add a field.
An unknown name is an error naming the nearest valid one. The relations between
fields are checked above the code that defines them (config_check.validate).
"""

import dataclasses
import difflib
import functools
from typing import Any

import ml_collections

from dipaco_jax.config import fields
from dipaco_jax.config import sections
from dipaco_jax.errors import ConfigError

# Fields that moved: old name -> new name.
MOVED = {
  "routing.early_stopping": "early_stopping.enabled",
  "routing.eval_seq_len": "eval.seq_len",
  "routing.eval_max_docs": "eval.max_docs",
  "routing.eval_rerouting_windows": "eval.rerouting_windows",
  "routing.reroute_routers": "eval.rerouters",
  **{
    f"routing.reroute_{k}": f"eval.reroute_{k}"
    for k in ("label_window", "stride", "steps", "lr", "batch_size")
  },
}
# Sections that are no longer config fields: what a flag naming one is told. A run's saved
# config.json from before may still hold one: it is read without it (saved_config.py).
REMOVED = {
  "faults": "fault injection is a test hook, not a config field: "
  "train.train_and_evaluate(config, workdir, faults=runtime.faults.Faults(...))",
}


def _value(f: dataclasses.Field):
  """A field's ConfigDict value: its default, or a typed placeholder where it is unset."""
  if f.default is None:
    return ml_collections.config_dict.placeholder(fields.optional_type(f.type))
  return f.default


def base() -> ml_collections.ConfigDict:
  """Every section with every field at its default (the paper's 150M path where it gives one)."""
  c = ml_collections.ConfigDict()
  for section in sections.SECTIONS:
    node = c
    if section.SECTION:
      node = c[section.SECTION] = ml_collections.ConfigDict()
    for f in dataclasses.fields(section):
      node[f.name] = _value(f)
  return c


@functools.cache
def declared() -> dict[str, dataclasses.Field]:
  """Every dotted field ("model.vocab_size", ...) and its declaration."""
  return {s.key(f.name): f for s in sections.SECTIONS for f in dataclasses.fields(s)}


def field_names() -> tuple[str, ...]:
  return tuple(declared())


def flatten(c, prefix: str = "") -> dict[str, Any]:
  """A ConfigDict's leaves by dotted name."""
  out = {}
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def nearest_name(key: str) -> str | None:
  """The field `key` most likely means: a close name in its section, else any close field."""
  names = field_names()
  section, _, leaf = key.rpartition(".")
  same = [n.rpartition(".")[2] for n in names if n.rpartition(".")[0] == section]
  match = difflib.get_close_matches(leaf, same, n=1, cutoff=0.6)
  if match:
    return f"{section}.{match[0]}" if section else match[0]
  match = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
  return match[0] if match else None


def unknown_name_message(key: str, prefix: str = "config.") -> str:
  if key in MOVED:
    return f"{prefix}{key} is not a config field: it moved to {prefix}{MOVED[key]}."
  if key.split(".")[0] in REMOVED:
    return f"{prefix}{key} is not a config field: {REMOVED[key.split('.')[0]]}."
  near = nearest_name(key)
  hint = (
    f"did you mean {prefix}{near}?"
    if near
    else "every field is declared in dipaco_jax/config/sections.py."
  )
  return f"{prefix}{key} is not a config field: {hint}"


def check_name(key: str) -> None:
  """Raises ConfigError (naming the nearest valid field) for a dotted key no section declares."""
  if key not in declared():
    raise ConfigError(unknown_name_message(key))


def requirement(key: str) -> str:
  """What field `key` must be, its default, and the flag that sets it."""
  return fields.requirement(declared()[key], key)


def field_message(key: str, value) -> str:
  return f"config.{key}={value!r} is invalid: {requirement(key)}"


def check_fields(config) -> dict[str, Any]:
  """Every field known, present and valid by its own rule; returns the flattened config."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f"the config is a {type(config).__name__}, not a ConfigDict: get_config() "
      "must return config.schema.base() with changes."
    )
  flat = flatten(config)
  for key in flat:
    check_name(key)
  missing = [k for k in field_names() if k not in flat]
  if missing:
    raise ConfigError(
      f"config.{missing[0]} is missing: build the config on config.schema.base() "
      "(it sets every field)."
    )
  for key, f in declared().items():
    if not f.metadata["rule"].ok(flat[key]):
      raise ConfigError(field_message(key, flat[key]))
  return flat
