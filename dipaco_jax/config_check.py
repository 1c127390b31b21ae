"""The config's one check before a run: every field, the relations between fields, the run's inputs.

    config_check.validate(config)  # Raises errors.ConfigError, one line.

The trainer and the CLIs (cli.start) run it before anything touches the
workdir or compiles; `load` (configs/*.py with dotted overrides) runs it
without the checks a run adds (θ̄ given, the tokenizer's size, init_from
exists). Each field's own rule is in its declaration (config/sections.py); the
relations here read the code that defines them (the grid, the mesh, the routing
schedule, the elastic pool), so this module sits above that code and none of it
imports this one.
"""

import importlib.util
import os
import re
import traceback

import ml_collections

from dipaco_jax.config import paper
from dipaco_jax.config import schema
from dipaco_jax.errors import ConfigError
from dipaco_jax.errors import UserError

# Command lines (the CLIs and aot), before absl parses them.

_CONFIG_FLAG = re.compile(r"^--?(?:no)?config\.([^=]+)")
_CONFIG_FILE = re.compile(r"^--?config(?:=(.*))?$")
_FLAG_ERROR = re.compile(r"^flag --config\.([\w.]+)=(.*?): (.*)$")


# The shipped configs: dipaco_jax/configs/NAME.py (the clone's configs/ links there).
PACKAGE_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped_configs() -> list[str]:
  """`configs/NAME.py` for each config the package ships."""
  names = sorted(n for n in os.listdir(PACKAGE_CONFIGS) if n.endswith(".py"))
  return [f"configs/{n}" for n in names if not n.startswith("_")]


def config_file(path: str) -> str:
  """`path` where such a file exists; else, for `configs/NAME.py`, the package's own copy.

  So `--config=configs/tiny.py` runs from any directory after any install (wheel or
  editable); a file of that name in the working directory comes first.
  """
  if os.path.isfile(path) or os.path.isabs(path):
    return path
  parts = os.path.normpath(path).split(os.sep)
  if len(parts) == 2 and parts[0] == "configs":
    shipped = os.path.join(PACKAGE_CONFIGS, parts[1])
    if os.path.isfile(shipped):
      return shipped
  return path


def check_config_args(argv: list[str]) -> None:
  """Refuses a missing or failing config file or an unknown --config.a.b before absl parses them.

  A `--config=configs/NAME.py` that is not in the working directory is rewritten in `argv`
  (in place) to the package's copy (`config_file`).
  """
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    if m := _CONFIG_FILE.match(arg):
      inline = m.group(1) is not None
      spec = m.group(1) if inline else (argv[i + 1] if i + 1 < len(argv) else "")
      path, *rest = spec.split(":", 1)
      found = config_file(path)
      if found != path:
        spec = ":".join([found, *rest])
        if inline:
          argv[i] = f"--config={spec}"
        else:
          argv[i + 1] = spec
        path = found
      if not os.path.isfile(path):
        raise ConfigError(
          f"--config={path}: no such config file; give a config file's path, or one of the "
          f"shipped {', '.join(shipped_configs())}."
        )
      run_config_file(spec)  # What the file raises or returns, in one line, before absl runs it.
    elif m := _CONFIG_FLAG.match(arg):
      if m.group(1) not in schema.field_names():
        raise ConfigError(schema.unknown_name_message(m.group(1), prefix="--config."))


def _line_in(path: str, e: BaseException) -> str:
  """`, line N` of the config file where `e` was raised (its last frame there), or ''."""
  if isinstance(e, SyntaxError) and e.lineno:
    return f", line {e.lineno}"
  here = os.path.abspath(path)
  lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == here]
  return f", line {lines[-1]}" if lines else ""


def run_config_file(spec: str) -> ml_collections.ConfigDict:
  """The ConfigDict of `--config=FILE[:ARG]`: FILE's get_config(ARG), each failure one line.

  The file is the user's input: what running it raises (a syntax error, a missing import,
  a field set to the wrong type, an exception of its own) is a ConfigError naming the file
  and line, as is a missing get_config or a result that is not a ConfigDict.
  """
  path, *arg = spec.split(":", 1)
  module_spec = importlib.util.spec_from_file_location("dipaco_config_file", path)
  if module_spec is None or module_spec.loader is None:
    raise ConfigError(f"--config={spec}: {path} is not a Python file; give one of configs/*.py.")
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
      raise ConfigError(
        f"--config={spec}: {path} defines no get_config(); a config file returns "
        "config.schema.base() with changes from get_config()."
      )
    config = get_config(*arg)
  except (ConfigError, UserError):  # Ours, already one line (a saved config.json's).
    raise
  except Exception as e:  # pylint: disable=broad-except  # The user's file raised it.
    reason = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, SyntaxError):
      reason = e.msg
    raise ConfigError(
      f"--config={spec}: {path}{_line_in(path, e)} raised {type(e).__name__}: {reason}; "
      "fix the file or give another config."
    ) from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(
      f"--config={spec}: get_config() returned a {type(config).__name__}, not a ConfigDict: "
      "return config.schema.base() with changes."
    )
  return config


def flag_error(e: Exception) -> Exception:
  """absl's `flag --config.a.b=V: reason` as a ConfigError saying what the field must be."""
  m = _FLAG_ERROR.match(str(e).splitlines()[0]) if str(e) else None
  if m is None or m.group(1) not in schema.field_names():
    return e
  key, value, reason = m.groups()
  return ConfigError(f"--config.{key}={value} cannot be read ({reason}): {schema.requirement(key)}")


# The pass.


def validate(config, *, for_run: bool = True) -> None:
  """Raises ConfigError for the first wrong field or relation; returns when the config can run.

  for_run=False (`load`) skips what a run adds: θ̄ given
  (check_init_from), the tokenizer's size against model.vocab_size (unless
  model.pad_vocab) and init_from's existence; those read files.
  """
  schema.check_fields(config)
  _check_relations(config)
  if for_run:
    _check_run_inputs(config)


def _check_relations(c) -> None:
  """Relations between fields; the grid and the routing schedule check themselves."""
  # pylint: disable=g-import-not-at-top
  from dipaco_jax import routing
  from dipaco_jax.core import attention
  from dipaco_jax.core import sharding
  from dipaco_jax.core import streaming
  from dipaco_jax.core import topology
  from dipaco_jax.runtime.elastic import errors as elastic_errors
  from dipaco_jax.runtime.elastic import pacing

  # pylint: enable=g-import-not-at-top
  topo = topology.from_config(c)  # TopologyError, a ConfigError.
  if c.data.top_k > topo.num_paths:
    raise ConfigError(
      f"config.data.top_k={c.data.top_k} exceeds the {topo.num_paths} paths of "
      "the grid: give each document at most as many shards as there are paths."
    )
  m = c.model
  width = int(m.d_model * m.mlp_ratio)  # ModelConfig.mlp_dim: the sizes the model derives.
  if width < 1:
    raise ConfigError(
      f"config.model.mlp_ratio={m.mlp_ratio} gives an MLP of width int(d_model x mlp_ratio) = "
      f"{width} at model.d_model={m.d_model}: raise mlp_ratio to at least {1 / m.d_model:.3g}."
    )
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
  # The mesh's own 'data' axis (mesh.data <= 0: sized when it is built) is held by Experiment.
  sharding.check_microbatches(c.data.batch_size, c.inner.microbatches, max(c.mesh.data, 1))
  attention.check(m, (c.data.seq_len, c.eval.seq_len))  # The backend: Recipe.from_config.
  if m.loss_chunk and c.data.seq_len % m.loss_chunk:
    raise ConfigError(
      f"config.model.loss_chunk={m.loss_chunk} does not divide config.data.seq_len="
      f"{c.data.seq_len}: choose a divisor of seq_len, or 0 for no chunking."
    )
  if m.weight_grads == "input_first" and m.remat == "save_matmuls":
    raise ConfigError(
      "config.model.weight_grads='input_first' with config.model.remat='save_matmuls': that "
      "policy keeps the outputs of dot_general, which input_first's custom gradient hides, so "
      "every matmul would be recomputed; use remat='save_matmuls_except_mlp_in' (or 'none', "
      "'full'), or weight_grads='autodiff' or 'auto'."
    )
  if c.dipaco.init == "independent" and c.dipaco.init_from:
    raise ConfigError(
      f"config.dipaco.init='independent' with config.dipaco.init_from="
      f"{c.dipaco.init_from!r}: init_from gives every module the same θ̄; set "
      "init='shared' or init_from=''."
    )
  if c.profile.num_steps:
    end = c.dipaco.inner_steps * c.dipaco.outer_steps
    last = c.profile.start_step + c.profile.num_steps - 1
    if last > end:
      raise ConfigError(
        f"config.profile.start_step={c.profile.start_step} with num_steps="
        f"{c.profile.num_steps} traces up to step {last}, past the run's last step {end}: "
        "start earlier or trace fewer steps."
      )
  o = c.outer
  if o.compression == "topk2" and not o.compression_keep <= o.compression_block <= 65536:
    raise ConfigError(
      f"config.outer.compression_keep={o.compression_keep} with compression_block="
      f"{o.compression_block}: topk2 keeps at most a block's values, and a block's positions "
      "are 16-bit; give compression_keep <= compression_block <= 65536."
    )
  # A streamed schedule that fits no phase (both runtimes: Recipe.from_config checks it too).
  streaming.check(o.fragments, o.overlap, c.dipaco.inner_steps, len(topo.store_groups()), o.enabled)
  routing.discriminative_steps(c)  # The re-shards fit in 1..T-1.
  routing.phase0_grid(c, topo)  # The phase-0 router suits the grid and the replicas.
  pacing.check(c)  # Speed-proportional work: elastic only, floors within H.
  if c.dipaco.mode == "elastic":  # What the Ray pool cannot run (ElasticConfigError).
    elastic_errors.check_config(c)


def _check_run_inputs(c) -> None:
  """θ̄ given and present; the tokenizer's size against model.vocab_size."""
  # pylint: disable=g-import-not-at-top
  from etils import epath

  from dipaco_jax.config import sections
  from dipaco_jax.data import vocab
  from dipaco_jax.io import theta

  # pylint: enable=g-import-not-at-top
  paper.check_init_from(c)
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
  shard_dir = c.data.shard_dir
  if shard_dir and os.path.exists(shard_dir) and not os.path.isdir(shard_dir):  # Local paths.
    raise ConfigError(
      f"config.data.shard_dir={shard_dir!r} is a file, not a folder: give a folder for the "
      "shards (or unset it for <workdir>/shards)."
    )
  if c.dipaco.init_from:  # Its params' shapes are checked where they are read (io/theta.py).
    theta.check_source(c.dipaco.init_from, sections.ModelConfig.of(c))
    theta.check_tokenizer(c.dipaco.init_from, epath.Path(path).read_bytes(), path)


def load(path: str, **overrides) -> ml_collections.ConfigDict:
  """Loads `configs/NAME.py`, applies dotted overrides, checks and locks it.

  An unknown field is an error. The checks a run adds (θ̄ given, the tokenizer's
  size, init_from exists) wait for the trainer and the CLIs, which call
  config_check.validate(config) before they touch the workdir.
  """
  path = config_file(path)
  spec = importlib.util.spec_from_file_location("dipaco_config", path)
  if spec is None or spec.loader is None or not path.endswith(".py"):
    raise ConfigError(f"no config file at {path}: give a configs/NAME.py path.")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except FileNotFoundError as e:
    raise ConfigError(f"no config file at {path}: give a configs/NAME.py path.") from e
  c = module.get_config()
  for key, value in overrides.items():
    schema.check_name(key)
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    try:
      node[leaf] = value
    except TypeError as e:
      raise ConfigError(
        f"config.{key}={value!r} has the wrong type: {schema.requirement(key)}"
      ) from e
  validate(c, for_run=False)
  c.lock()
  return c
