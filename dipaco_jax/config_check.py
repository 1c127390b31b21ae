"""One validation pass over a config: every field's type, range and choices, then the relations.

    config_check.validate(config)  # Raises config_defaults.ConfigError, one line.

The trainer and the CLIs (cli.start) run it before anything touches the
workdir or compiles; config_defaults.load runs it without the checks a run
adds (θ̄ given, the tokenizer's size, init_from exists). Every field of
config_defaults.base() has a rule in `_rules()` (a test keeps the two equal);
an unknown field is an error naming the nearest valid one. The owners of the
choices (model.POSITIONS, outer.SQRT_MODES, ...) define them.
"""

import difflib
import functools
import math
import os
import re
from typing import Any, Callable

import ml_collections

from dipaco_jax import config_defaults
from dipaco_jax.config_defaults import ConfigError

# (check(value) -> ok, what the value must be).
Rule = tuple[Callable[[Any], bool], str]

# Fields that moved to another section: old name -> new name.
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


@functools.cache
def _defaults() -> dict[str, Any]:
  return _flatten(config_defaults.base())


def field_names() -> tuple[str, ...]:
  """Every dotted field of base() ("model.vocab_size", ...)."""
  return tuple(_defaults())


def _flatten(c, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in c.items():
    if isinstance(v, ml_collections.ConfigDict):
      out.update(_flatten(v, f"{prefix}{k}."))
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
  near = nearest_name(key)
  hint = (
    f"did you mean {prefix}{near}?"
    if near
    else "every field is listed in dipaco_jax/config_defaults.py base()."
  )
  return f"{prefix}{key} is not a config field: {hint}"


def check_name(key: str) -> None:
  """Raises ConfigError (naming the nearest valid field) for a dotted key base() lacks."""
  if key not in _defaults():
    raise ConfigError(unknown_name_message(key))


def _check_names(config) -> dict[str, Any]:
  """The config's fields, flattened; an added or a missing field is an error."""
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f"the config is a {type(config).__name__}, not a ConfigDict: get_config() "
      "must return config_defaults.base() with changes."
    )
  flat = _flatten(config)
  for key in flat:
    check_name(key)
  missing = [k for k in field_names() if k not in flat]
  if missing:
    raise ConfigError(
      f"config.{missing[0]} is missing: build the config on "
      "config_defaults.base() (it sets every field)."
    )
  return flat


# One rule per field.


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _integer(lo: int, *, unset: int | None = None, what: str = "") -> Rule:
  need = f"an integer >= {lo}" + (f" or {unset}" if unset is not None else "") + what
  return (lambda v: _is_int(v) and (v >= lo or v == unset)), need


def _number(lo: float, *, above: bool = True, hi: float | None = None) -> Rule:
  need = f"a number {'>' if above else '>='} {lo}" + (f" and < {hi}" if hi is not None else "")

  def ok(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      return False
    return (v > lo if above else v >= lo) and (hi is None or v < hi)

  return ok, need


def _fraction() -> Rule:
  ok, _ = _number(0, above=False)
  return (lambda v: ok(v) and v <= 1), "a number in [0, 1]"


def _choice(choices) -> Rule:
  return (lambda v: v in choices), "one of " + ", ".join(repr(x) for x in choices)


def _bool() -> Rule:
  return (lambda v: isinstance(v, bool)), "True or False"


def _string() -> Rule:
  return (lambda v: isinstance(v, str)), "a string"


def _names_a_folder(v) -> bool:
  return isinstance(v, str) and v.strip() not in ("", "None", "none")


def _path(unset: str) -> Rule:
  """None (the default) or a real path: a flag cannot set None, and "None" names no folder."""
  return (
    (lambda v: v is None or _names_a_folder(v)),
    f"a path, or unset for {unset} (leave the flag out: a flag cannot set None)",
  )


def _tuple(item: Rule, need: str, *, nonempty: bool = False) -> Rule:
  return (
    lambda v: (
      isinstance(v, (tuple, list)) and (len(v) > 0 or not nonempty) and all(item[0](x) for x in v)
    )
  ), need


@functools.cache
def _rules() -> dict[str, Rule]:
  """Every field of base() and its check."""
  # pylint: disable=g-import-not-at-top
  from dipaco_jax import data as data_lib
  from dipaco_jax import train
  from dipaco_jax.core import experiment
  from dipaco_jax.core import model
  from dipaco_jax.core import outer
  from dipaco_jax.data import prepare
  from dipaco_jax.routing import discriminative
  from dipaco_jax.routing import phases
  from dipaco_jax.routing import rerouting
  from dipaco_jax.runtime import early_stopping
  from dipaco_jax.runtime.elastic import errors as elastic_errors

  # pylint: enable=g-import-not-at-top
  count, count0 = _integer(1), _integer(0)
  rerouters = _choice(rerouting.KINDS)[1].removeprefix("one of ")
  return {
    "seed": count0,
    "log_every_steps": count,
    "stop_at_step": _integer(1, unset=-1),
    "dispatch_ahead": _choice(train.DISPATCH_AHEAD),
    "model.vocab_size": count,
    "model.pad_vocab": _bool(),
    "model.d_model": count,
    "model.num_layers": count,
    "model.num_heads": count,
    "model.head_dim": count,
    "model.mlp_ratio": _number(0),
    "model.max_len": count,
    "model.positions": _choice(model.POSITIONS),
    "model.tie_embeddings": _bool(),
    "model.dtype": _choice(model.DTYPES),
    "model.remat": _choice(tuple(model.REMAT_POLICIES)),
    "model.attention": _choice(model.ATTENTION),
    "model.mlp": _choice(model.MLPS),
    "model.loss_chunk": _integer(0, what=" (0 = off)"),
    "inner.lr": _number(0),
    "inner.warmup_steps": count0,
    "inner.total_steps": (
      (lambda v: v is None or _is_int(v) and v >= 1),
      "an integer >= 1, or unset for H*T",
    ),
    "inner.final_lr_fraction": _fraction(),
    "inner.b1": _number(0, above=False, hi=1),
    "inner.b2": _number(0, above=False, hi=1),
    "inner.eps": _number(0),
    "inner.weight_decay": _number(0, above=False),
    "inner.clip_norm": _number(0, above=False),
    "inner.decay_norms": _bool(),
    "inner.microbatches": count,
    "outer.enabled": _bool(),
    "outer.lr": _number(0),
    "outer.momentum": _number(0, above=False, hi=1),
    "outer.nesterov": _bool(),
    "outer.weighting": _choice(outer.WEIGHTINGS),
    "outer.sqrt_paths": _choice(outer.SQRT_MODES),
    "outer.sqrt_paths_cap": (
      lambda v: _number(0, above=False)[0](v) and (v == 0 or v >= 1),
      "a number >= 1 (the cap), or 0 (no cap)",
    ),
    "dipaco.level_groups": _tuple(_string(), "a tuple of strings, one per level", nonempty=True),
    "dipaco.modules_per_level": _tuple(
      _integer(1), "a tuple of integers >= 1 (K per level)", nonempty=True
    ),
    "dipaco.path_specific": _string(),
    "dipaco.paths": _tuple(_string(), "a tuple of paths such as '0-1-0'"),
    "dipaco.replicas": count,
    "dipaco.inner_steps": count,
    "dipaco.outer_steps": count,
    "dipaco.init": _choice(experiment.INITS),
    # None: required, given at run time (config_defaults.check_init_from).
    "dipaco.init_from": (
      (lambda v: v is None or v == "" or _names_a_folder(v)),
      "a dense run's workdir, or '' for a random θ̄",
    ),
    "dipaco.mode": _choice(elastic_errors.MODES),
    "data.task": _choice(data_lib.TASKS),
    "data.tfds_data_dir": _path("tfds's default directory"),
    "data.tfds_name": (
      lambda v: isinstance(v, str) and re.match(data_lib.TFDS_NAME_PATTERN, v) is not None,
      f"a tfds name with its version pinned, such as {data_lib.C4_TFDS_NAME!r}",
    ),
    "data.vocab_path": _path("the task's shipped tokenizer"),
    "data.seq_len": count,
    "data.batch_size": count,
    "data.seed": count0,
    "data.subsample": count,
    "data.top_k": count,
    "data.shard_dir": _path("<workdir>/shards"),
    "data.shard_cache": (
      lambda v: isinstance(v, str) and _names_a_folder(v),
      "'auto' (the user's cache dir), 'off', or a cache folder (local or gs://)",
    ),
    "data.empty_shard_policy": _choice(prepare.EMPTY_POLICIES),
    "mesh.path": _integer(1, unset=-1),
    "mesh.data": _integer(1, unset=-1),
    "mesh.model": count,
    "mesh.num_slices": count0,
    "mesh.cpu_devices": count0,
    "mesh.fsdp": _bool(),
    "ckpt.every_steps": count,
    "ckpt.max_to_keep": count,
    "ckpt.async_save": _bool(),
    "routing.router": _choice(phases.PHASE0_ROUTERS),
    "routing.prefix_len": count,
    "routing.feature_batch_size": count,
    "routing.kmeans_restarts": count,
    "routing.kmeans_iters": count,
    "routing.kmeans_min_share": _fraction(),
    "routing.seed": count0,
    "routing.replica_shards": _choice(phases.REPLICA_SHARDS),
    "routing.router_max_docs": _integer(0, what=" (0 = all)"),
    "routing.balance_docs": _integer(0, what=" (0 = calibrate on the router split)"),
    "routing.discriminative_at_outer_step": _integer(1, unset=-1),
    "routing.discriminative_phases": count,
    "routing.discriminative_every": count,
    "routing.discriminative_target": _choice(discriminative.TARGETS),
    "routing.discriminative_min_share": _fraction(),
    "routing.restart_schedule": _bool(),
    "routing.score_len": _integer(0, what=" (0 = eval.seq_len)"),
    "eval.every_steps": count,
    "eval.batches": count,
    "eval.seq_len": _integer(0, what=" (0 = data.seq_len)"),
    "eval.max_docs": _integer(0, what=" (0 = all)"),
    "eval.rerouting_windows": _tuple(count, "a tuple of integers >= 1"),
    "eval.rerouters": _tuple(
      _choice(rerouting.KINDS),
      f"a tuple of any of {rerouters}, written as a Python tuple: "
      "--config.eval.rerouters=\"('linear','transformer')\"",
    ),
    "eval.reroute_label_window": _integer(0, what=" (0 = to the end)"),
    "eval.reroute_stride": count,
    "eval.reroute_steps": count,
    "eval.reroute_lr": _number(0),
    "eval.reroute_batch_size": count,
    "early_stopping.enabled": _bool(),
    "early_stopping.source": _choice(early_stopping.SOURCES),
    "early_stopping.heldout_docs": count,
    "early_stopping.heldout_fraction": _number(0, above=False, hi=1),
    "guard.stuck_steps": _integer(0, what=" (0 = rule off)"),
    "guard.max_param_norm_ratio": (
      (lambda v: _number(0, above=False)[0](v) and (v == 0 or v > 1)),
      "a number > 1, or 0 (rule off)",
    ),
    "elastic.address": _string(),
    "elastic.num_workers": count,
    "elastic.num_executors": count,
    "elastic.worker_resources": _string(),  # Its JSON: elastic check_config.
    "elastic.pin_cpus": _bool(),
    "elastic.task_timeout_s": _number(0),
    "elastic.progress_every_steps": _integer(0, what=" (0 = off)"),
    "elastic.compile_cache": (
      _names_a_folder,
      "'auto' ($JAX_COMPILATION_CACHE_DIR or the user's cache dir), 'off', or a folder",
    ),
    "elastic.step_delay_s": _tuple(_number(0, above=False), "a tuple of seconds >= 0"),
    "elastic.chaos_worker_kills": count0,
    "elastic.chaos_executor_kills": count0,
    "elastic.chaos_seed": count0,
    "elastic.stop_after_tasks": _integer(1, unset=-1),
    "elastic.quorum": (
      (lambda v: _number(0)[0](v) and v <= 1),
      "a fraction in (0, 1] of a module's α-weight (1.0 = wait for every report)",
    ),
    "elastic.grace_s": _number(0, above=False),
    "elastic.late_deltas": _choice(elastic_errors.LATE_DELTAS),
  }


def requirement(key: str) -> str:
  """What field `key` must be, and its default."""
  default = _defaults()[key]
  return (
    f"it must be {_rules()[key][1]}; set --config.{key} "
    f"(default {'unset' if default is None else repr(default)})."
  )


def field_message(key: str, value) -> str:
  return f"config.{key}={value!r} is invalid: {requirement(key)}"


# Command lines (the CLIs and aot), before absl parses them.

_CONFIG_FLAG = re.compile(r"^--?(?:no)?config\.([^=]+)")
_CONFIG_FILE = re.compile(r"^--?config(?:=(.*))?$")
_FLAG_ERROR = re.compile(r"^flag --config\.([\w.]+)=(.*?): (.*)$")


def check_config_args(argv: list[str]) -> None:
  """Refuses a missing config file or an unknown --config.a.b before absl parses them."""
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    if m := _CONFIG_FILE.match(arg):
      path = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
      path = path.split(":", 1)[0]
      if not os.path.isfile(path):
        raise ConfigError(f"--config={path}: no such config file; give one of configs/*.py.")
    elif m := _CONFIG_FLAG.match(arg):
      if m.group(1) not in field_names():
        raise ConfigError(unknown_name_message(m.group(1), prefix="--config."))


def flag_error(e: Exception) -> Exception:
  """absl's `flag --config.a.b=V: reason` as a ConfigError saying what the field must be."""
  m = _FLAG_ERROR.match(str(e).splitlines()[0]) if str(e) else None
  if m is None or m.group(1) not in field_names():
    return e
  key, value, reason = m.groups()
  return ConfigError(f"--config.{key}={value} cannot be read ({reason}): {requirement(key)}")


# The pass.


def check_fields(config) -> None:
  """Every field known and set, each by its own rule (no relations between fields)."""
  flat = _check_names(config)
  for key, (ok, _) in _rules().items():
    if not ok(flat[key]):
      raise ConfigError(field_message(key, flat[key]))


def validate(config, *, for_run: bool = True) -> None:
  """Raises ConfigError for the first wrong field or relation; returns when the config can run.

  for_run=False (config_defaults.load) skips what a run adds: θ̄ given
  (check_init_from), the tokenizer's size against model.vocab_size (unless
  model.pad_vocab) and init_from's existence; those read files.
  """
  check_fields(config)
  _check_relations(config)
  if for_run:
    _check_run_inputs(config)


def _check_relations(c) -> None:
  """Relations between fields; the grid and the routing schedule check themselves."""
  # pylint: disable=g-import-not-at-top
  from dipaco_jax import routing
  from dipaco_jax.core import sharding
  from dipaco_jax.core import topology
  from dipaco_jax.runtime.elastic import errors as elastic_errors

  # pylint: enable=g-import-not-at-top
  topo = topology.from_config(c)  # TopologyError, a ConfigError.
  if c.data.top_k > topo.num_paths:
    raise ConfigError(
      f"config.data.top_k={c.data.top_k} exceeds the {topo.num_paths} paths of "
      "the grid: give each document at most as many shards as there are paths."
    )
  m = c.model
  if m.positions == "rope" and m.head_dim % 2:
    raise ConfigError(
      f"config.model.head_dim={m.head_dim} is odd: RoPE rotates pairs of "
      "dimensions, so use an even head_dim (or model.positions='learned')."
    )
  if m.positions == "learned":
    for key in ("data.seq_len", "eval.seq_len", "routing.score_len"):
      section, field = key.split(".")
      if c[section][field] > m.max_len:
        raise ConfigError(
          f"config.{key}={c[section][field]} exceeds config.model.max_len="
          f"{m.max_len}, the learned positions: raise model.max_len or shorten "
          "the sequences."
        )
  if c.mesh.path > 0:  # The device count is checked when the mesh is built.
    sharding.check_path_axis(c.mesh.path, topo.num_workers)
  if c.mesh.data > 0:
    sharding.check_batch_divides(c.data.batch_size, c.mesh.data)
  mb = c.inner.microbatches
  if c.data.batch_size % (mb * max(c.mesh.data, 1)):
    raise ConfigError(
      f"config.inner.microbatches={mb} does not split config.data.batch_size="
      f"{c.data.batch_size} into equal microbatches over the 'data' axis: choose a "
      "divisor of batch_size / mesh.data."
    )
  if m.loss_chunk and c.data.seq_len % m.loss_chunk:
    raise ConfigError(
      f"config.model.loss_chunk={m.loss_chunk} does not divide config.data.seq_len="
      f"{c.data.seq_len}: choose a divisor of seq_len, or 0 for no chunking."
    )
  if c.dipaco.init == "independent" and c.dipaco.init_from:
    raise ConfigError(
      f"config.dipaco.init='independent' with config.dipaco.init_from="
      f"{c.dipaco.init_from!r}: init_from gives every module the same θ̄; set "
      "init='shared' or init_from=''."
    )
  routing.discriminative_steps(c)  # The re-shards fit in 1..T-1.
  routing.phase0_grid(c, topo)  # The phase-0 router suits the grid and the replicas.
  if c.dipaco.mode == "elastic":  # What the Ray pool cannot run (ElasticConfigError).
    elastic_errors.check_config(c)


def _check_run_inputs(c) -> None:
  """θ̄ given and present; the tokenizer's size against model.vocab_size."""
  # pylint: disable=g-import-not-at-top
  from etils import epath

  from dipaco_jax.data import vocab

  # pylint: enable=g-import-not-at-top
  config_defaults.check_init_from(c)
  if c.data.vocab_path is None and c.data.task != "dipaco_embedded":
    raise ConfigError(
      f"config.data.vocab_path is unset but data.task={c.data.task!r} has no "
      "shipped tokenizer: set --config.data.vocab_path (e.g. "
      f"{vocab.T5_VOCAB_PATH})."
    )
  path = vocab.resolve(c.data.task, c.data.vocab_path)
  try:
    size = vocab.load(path).vocab_size()
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"config.data.vocab_path={path!r}: {e}") from e
  v = c.model.vocab_size
  if v < size or (v > size and not c.model.pad_vocab):
    raise ConfigError(
      f"config.model.vocab_size={v} but the tokenizer {path} has {size} tokens: set "
      f"model.vocab_size={size}"
      + ("" if v < size else " (or model.pad_vocab=True to keep the extra rows)")
      + "."
    )
  if c.dipaco.init_from and not epath.Path(c.dipaco.init_from).exists():
    raise ConfigError(
      f"config.dipaco.init_from={c.dipaco.init_from!r} does not exist: give the "
      "workdir of a finished dense run, or '' for a random θ̄."
    )
