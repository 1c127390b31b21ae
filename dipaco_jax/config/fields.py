"""How a config field is declared: its default, its rule (type and range or choices), its help.

A config section is a frozen dataclass whose fields are made by `field`:

    @dataclasses.dataclass(frozen=True)
    class InnerConfig(fields.Section):
      SECTION = "inner"
      lr: float = fields.field(4e-4, fields.number(0), "Peak AdamW LR (paper 150M: 4e-4).")

From the declarations come the defaults (`schema.base()`), the check of every
field (`schema.check_fields`, and each section object checks its own fields
when it is built) and the run's objects (`InnerConfig.of(config)`).
"""

import dataclasses
import json
import math
import types
import typing
from typing import Any, Callable, ClassVar

from dipaco_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Rule:
  """What a field's value must be: `ok(value)`, and the words that say so."""

  ok: Callable[[Any], bool]
  need: str


def field(default: Any, rule: Rule, help: str) -> Any:  # pylint: disable=redefined-builtin
  """A declared field: its default, its rule and one line of help."""
  return dataclasses.field(default=default, metadata={"rule": rule, "help": help})


class Section:
  """A config section: a frozen dataclass of declared fields (SECTION "" is the top level)."""

  SECTION: ClassVar[str]

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not f.metadata["rule"].ok(value):
        key = self.key(f.name)
        raise ConfigError(f"config.{key}={value!r} is invalid: {requirement(f, key)}")

  @classmethod
  def key(cls, name: str) -> str:
    """The field's dotted name in the config ("inner.lr")."""
    return f"{cls.SECTION}.{name}" if cls.SECTION else name

  @classmethod
  def of(cls, config, **given):
    """The section of a ConfigDict as this dataclass; `given` replaces fields (derived values)."""
    node = config[cls.SECTION] if cls.SECTION else config
    kw = {}
    for f in dataclasses.fields(cls):
      if f.name not in given and f.name not in node:
        raise ConfigError(
          f"config.{cls.key(f.name)} is missing: build the config on config.schema.base()."
        )
      kw[f.name] = given[f.name] if f.name in given else node[f.name]
    return cls(**kw)


def requirement(f: dataclasses.Field, key: str) -> str:
  """What declared field `key` must be, the flag that sets it, and its default."""
  default = "unset" if f.default is None else repr(f.default)
  return f"it must be {f.metadata['rule'].need}; set --config.{key} (default {default})."


def optional_type(annotation) -> type | None:
  """T of an `T | None` annotation (the field may be unset), else None."""
  if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else None
  return None


# Rules.


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, *, unset: int | None = None, what: str = "") -> Rule:
  need = f"an integer >= {lo}" + (f" or {unset}" if unset is not None else "") + what
  return Rule(lambda v: _is_int(v) and (v >= lo or v == unset), need)


def number(lo: float, *, above: bool = True, hi: float | None = None) -> Rule:
  need = f"a number {'>' if above else '>='} {lo}" + (f" and < {hi}" if hi is not None else "")

  def ok(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      return False
    return (v > lo if above else v >= lo) and (hi is None or v < hi)

  return Rule(ok, need)


def fraction() -> Rule:
  at_least_0 = number(0, above=False).ok
  return Rule(lambda v: at_least_0(v) and v <= 1, "a number in [0, 1]")


def choice(choices) -> Rule:
  return Rule(lambda v: v in choices, "one of " + ", ".join(repr(x) for x in choices))


def boolean() -> Rule:
  return Rule(lambda v: isinstance(v, bool), "True or False")


def string() -> Rule:
  return Rule(lambda v: isinstance(v, str), "a string")


def names_a_folder(v) -> bool:
  return isinstance(v, str) and v.strip() not in ("", "None", "none")


def ray_resources(v) -> bool:
  """The empty string, or a JSON object of Ray resources, each amount a number >= 0."""
  if not isinstance(v, str):
    return False
  if not v:
    return True
  try:
    res = json.loads(v)
  except json.JSONDecodeError:
    return False
  return isinstance(res, dict) and all(isinstance(x, (int, float)) and x >= 0 for x in res.values())


def path(unset: str) -> Rule:
  """None (the default) or a real path: a flag cannot set None, and "None" names no folder."""
  return Rule(
    lambda v: v is None or names_a_folder(v),
    f"a path, or unset for {unset} (leave the flag out: a flag cannot set None)",
  )


def tuple_of(item: Rule, need: str, *, nonempty: bool = False) -> Rule:
  return Rule(
    lambda v: (
      isinstance(v, (tuple, list)) and (len(v) > 0 or not nonempty) and all(item.ok(x) for x in v)
    ),
    need,
  )


def custom(ok: Callable[[Any], bool], need: str) -> Rule:
  return Rule(ok, need)
