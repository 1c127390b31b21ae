"""cli: a bad input is one stderr line naming the field, exit 1, and an untouched workdir.

The table runs the trainer's entry (`dipaco_jax.main.main`) in this process
through the same flag parser and error guard as `python -m dipaco_jax.main`;
the slow tests run the real commands as subprocesses.
"""

import glob
import importlib
import logging
import os
import re
import subprocess
import sys

import orbax.checkpoint
import pytest
from absl import flags
from etils import epath
from ml_collections import config_flags

from dipaco_jax import cli
from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax import main
from dipaco_jax import saved_config
from dipaco_jax.config import schema
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import metrics

import helpers

TINY = "configs/tiny.py"

# (flags after --config=configs/tiny.py --workdir=NEW, text the one line must hold).
BAD_INPUTS = [
  # Unknown or moved fields: the nearest valid name.
  (
    ["--config.inner.decay_normz=True"],
    "--config.inner.decay_normz is not a config field: did you mean --config.inner.decay_norms?",
  ),
  (["--config.modle.d_model=64"], "did you mean --config.model.d_model?"),
  (["--config.routing.eval_seq_len=64"], "it moved to --config.eval.seq_len"),
  (["--config.routing.early_stopping=False"], "it moved to --config.early_stopping.enabled"),
  # Types: counts are integers, numbers parse.
  (["--config.dipaco.inner_steps=2.5"], "--config.dipaco.inner_steps=2.5 cannot be read"),
  (
    ["--config.dipaco.modules_per_level=(1,2.5,2)"],
    "config.dipaco.modules_per_level=(1, 2.5, 2) is invalid: it must be a tuple of integers >= 1",
  ),
  (["--config.inner.lr=abc"], "--config.inner.lr=abc cannot be read"),
  (["--config.inner.total_steps=None"], "--config.inner.total_steps=None cannot be read"),
  # Ranges.
  (["--config.inner.lr=-0.001"], "config.inner.lr=-0.001 is invalid: it must be a number > 0"),
  (["--config.outer.lr=0"], "config.outer.lr=0.0 is invalid: it must be a number > 0"),
  (["--config.outer.momentum=1.5"], "config.outer.momentum=1.5 is invalid"),
  (["--config.inner.b2=1.0"], "config.inner.b2=1.0 is invalid"),
  (["--config.data.batch_size=0"], "config.data.batch_size=0 is invalid"),
  (
    ["--config.early_stopping.source=val"],
    "config.early_stopping.source='val' is invalid: it must be one of 'heldout', 'validation'",
  ),
  (["--config.early_stopping.heldout_fraction=1"], "config.early_stopping.heldout_fraction=1"),
  (
    ["--config.outer.sqrt_paths_cap=0.5"],
    "config.outer.sqrt_paths_cap=0.5 is invalid: it must be a number >= 1 (the cap), or 0",
  ),
  (["--config.routing.kmeans_min_share=2"], "config.routing.kmeans_min_share=2"),
  (
    ["--config.data.tfds_name=c4/en"],
    "config.data.tfds_name='c4/en' is invalid: it must be a tfds name with its version pinned, "
    "such as 'c4/en:3.0.1'",
  ),
  (["--config.log_every_steps=0"], "config.log_every_steps=0 is invalid"),
  (["--config.eval.every_steps=0"], "config.eval.every_steps=0 is invalid"),
  (["--config.ckpt.every_steps=0"], "config.ckpt.every_steps=0 is invalid"),
  (
    ["--config.stop_at_step=0"],
    "config.stop_at_step=0 is invalid: it must be an integer >= 1 or -1",
  ),
  (
    ["--config.dispatch_ahead=true"],
    "config.dispatch_ahead='true' is invalid: it must be one of 'auto', 'on', 'off'; "
    "set --config.dispatch_ahead (default 'auto').",
  ),
  (
    ["--config.dipaco.modules_per_level=(1,0,2)"],
    "config.dipaco.modules_per_level=(1, 0, 2) is invalid",
  ),
  (["--config.routing.discriminative_min_share=2"], "discriminative_min_share=2.0 is invalid"),
  # Choices.
  (
    ["--config.model.positions=alibi"],
    "config.model.positions='alibi' is invalid: it must be one of 'rope', 'learned'",
  ),
  (["--config.model.dtype=float16"], "config.model.dtype='float16' is invalid"),
  (
    ["--config.model.mlp=relu"],
    "config.model.mlp='relu' is invalid: it must be one of 'gelu', 'swiglu'",
  ),
  (["--config.dipaco.init=zeros"], "config.dipaco.init='zeros' is invalid"),
  (["--config.routing.router=hash"], "config.routing.router='hash' is invalid"),
  (["--config.outer.weighting=tokens"], "config.outer.weighting='tokens' is invalid"),
  (["--config.outer.sqrt_paths=square"], "config.outer.sqrt_paths='square' is invalid"),
  (["--config.data.empty_shard_policy=skip"], "config.data.empty_shard_policy='skip' is invalid"),
  (["--config.routing.replica_shards=random"], "config.routing.replica_shards='random' is invalid"),
  (["--config.routing.discriminative_target=sizes"], "discriminative_target='sizes' is invalid"),
  (["--config.eval.rerouters=oracle"], "config.eval.rerouters=('oracle',) is invalid"),
  (
    ["--config.dipaco.mode=ray"],
    "config.dipaco.mode='ray' is invalid: it must be one of 'spmd', 'elastic'",
  ),
  (
    ["--config.dipaco.mode=elastic", "--config.stop_at_step=2"],
    "ElasticConfigError: config.stop_at_step=2: the elastic pool stops on no inner step",
  ),
  (
    ["--config.data.task=c5"],
    "config.data.task='c5' is invalid: it must be one of 'dipaco_embedded', 'c4_en'",
  ),
  # Paths that name no folder.
  (
    ["--config.data.shard_dir=None"],
    "config.data.shard_dir='None' is invalid: it must be a path, or unset for <workdir>/shards",
  ),
  (["--config.data.vocab_path="], "config.data.vocab_path='' is invalid"),
  (
    ["--config.data.shard_cache="],
    "config.data.shard_cache='' is invalid: it must be 'auto' (the user's cache dir), 'off'",
  ),
  (["--config.dipaco.init_from=None"], "config.dipaco.init_from='None' is invalid"),
  (
    ["--config.elastic.compile_cache="],
    "config.elastic.compile_cache='' is invalid: it must be 'auto' ($JAX_COMPILATION_CACHE_DIR",
  ),
  # Relations.
  (["--config.model.vocab_size=9000"], "config.model.vocab_size=9000 but the tokenizer"),
  (["--config.model.vocab_size=4096"], "config.model.vocab_size=4096 but the tokenizer"),
  (
    ["--config.model.positions=learned", "--config.data.seq_len=512"],
    "config.data.seq_len=512 exceeds config.model.max_len=256",
  ),
  (["--config.model.head_dim=33"], "config.model.head_dim=33 is odd"),
  (["--config.data.top_k=5"], "config.data.top_k=5 exceeds the 4 paths"),
  (
    ["--config.mesh.data=3"],
    "config.data.batch_size=8 is not divisible by the 'data' mesh axis (3)",
  ),
  (["--config.mesh.path=3"], "the 'path' mesh axis has 3 device groups"),
  (["--config.dipaco.paths=0-0-5"], "path '0-0-5' names module 5 of level 2"),
  (
    ["--config.dipaco.level_groups=('embed','block_0-1','block_2-3')"],
    "groups ['head'] belong to no level",
  ),
  (
    ["--config.routing.discriminative_at_outer_step=10"],
    "discriminative re-shards at outer steps [10] do not fit in 1..9",
  ),
  (
    ["--config.dipaco.init=independent", "--config.dipaco.init_from=/tmp"],
    "config.dipaco.init='independent' with config.dipaco.init_from='/tmp'",
  ),
  # Inputs that do not exist.
  (
    ["--config.data.vocab_path=/nonexistent/spm.model"],
    "config.data.vocab_path='/nonexistent/spm.model'",
  ),
  (
    ["--config.dipaco.init_from=/nonexistent/run"],
    "config.dipaco.init_from='/nonexistent/run' does not exist",
  ),
]


def _reset_flags(argv: list[str], monkeypatch) -> None:
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv.
  flags.FLAGS.unparse_flags()
  for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # The last run's overrides.
    delattr(flags.FLAGS, name)


def _run_main(argv: list[str], monkeypatch, capsys, entry=main) -> tuple[int, list[str]]:
  """`python -m dipaco_jax.main ARGV` (or another entry) in this process: (status, stderr lines)."""
  argv = [entry.__name__, *argv]
  _reset_flags(argv, monkeypatch)
  with pytest.raises(SystemExit) as e:
    cli.guard(entry.main)(cli.parse_flags(argv))
  return e.value.code, [l for l in capsys.readouterr().err.splitlines() if l.strip()]


@pytest.mark.parametrize("args,want", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_a_bad_flag_is_one_line_and_leaves_no_workdir(args, want, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(helpers.ROOT)
  workdir = tmp_path / "run"
  code, lines = _run_main([f"--config={TINY}", f"--workdir={workdir}", *args], monkeypatch, capsys)
  assert code == 1
  assert len(lines) == 1, lines
  assert want in lines[0], lines[0]
  assert not workdir.exists()
  assert not os.path.exists(os.path.join(helpers.ROOT, "None"))


def test_route_refuses_a_process_id_outside_the_job(monkeypatch, capsys, tmp_path):
  from dipaco_jax import route  # pylint: disable=g-import-not-at-top

  monkeypatch.chdir(helpers.ROOT)
  argv = [
    f"--config={TINY}",
    f"--workdir={tmp_path / 'run'}",
    "--num_processes=2",
    "--process_id=2",
  ]
  code, lines = _run_main(argv, monkeypatch, capsys, entry=route)
  assert code == 1 and len(lines) == 1, lines
  assert (
    "--process_id=2 --num_processes=2: need num_processes >= 1 and 0 <= process_id <" in lines[0]
  )
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
  "argv,want",
  [
    (["--config=configs/nope.py", "--workdir=W"], "--config=configs/nope.py: no such config file"),
    ([f"--config={TINY}"], "flag --workdir=None: Flag --workdir must have a value other than None"),
    ([f"--config={TINY}", "--workdir="], "--workdir='' names no directory"),
    ([f"--config={TINY}", "--workdir=W", "extra"], "unexpected arguments ['extra']"),
    (
      ["--config=configs/dipaco_2x4.py", "--workdir=W"],
      "config.dipaco.init_from is required by this config",
    ),
  ],
)
def test_bad_command_lines_are_one_line(argv, want, monkeypatch, capsys):
  monkeypatch.chdir(helpers.ROOT)
  code, lines = _run_main(argv, monkeypatch, capsys)
  assert code == 1 and len(lines) == 1 and want in lines[0], lines
  assert not os.path.exists(os.path.join(helpers.ROOT, "W"))


def test_user_errors_are_named_in_one_place():
  assert cli.is_user_error(errors.ConfigError("x"))
  assert cli.is_user_error(FileNotFoundError("x"))
  assert cli.is_user_error(errors.DamagedFileError("x"))
  assert cli.is_user_error(guard_lib.NonFiniteLossError("x"))
  assert cli.is_user_error(guard_lib.DivergenceError("x"))  # The guard's other stops.
  assert not cli.is_user_error(KeyError("x"))  # A bug: its traceback is kept.
  assert cli.one_line(ValueError("first\n  detail\nlast")) == "ValueError: first ... last"


def _parse_cli(argv: list[str], monkeypatch, capsys, saved_config: bool = True):
  """The config route/evaluate/serve (saved_config) or main run with, or (status, stderr lines)."""
  argv = ["dipaco_jax.evaluate", *argv]
  _reset_flags(argv, monkeypatch)
  try:
    cli.parse_flags(argv, saved_config)
  except SystemExit as e:
    return e.code, [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  return cli._CONFIG.value  # pylint: disable=protected-access


@pytest.fixture(name="saved_run")
def _saved_run(tmp_path, monkeypatch):
  """A workdir whose config.json the trainer's writer saved: tiny with two overrides."""
  monkeypatch.chdir(helpers.ROOT)

  config = config_check.load(TINY, **{"data.batch_size": 4, "eval.max_docs": 7})
  saved_config.write(epath.Path(tmp_path), config)
  return tmp_path, config


def test_the_saved_config_is_the_default_and_overrides_apply_on_top(saved_run, monkeypatch, capsys):
  workdir, saved = saved_run
  got = _parse_cli([f"--workdir={workdir}"], monkeypatch, capsys)
  assert got.to_dict() == saved.to_dict()
  got = _parse_cli([f"--workdir={workdir}", "--config.eval.max_docs=3"], monkeypatch, capsys)
  assert (got.eval.max_docs, got.data.batch_size) == (3, 4)
  got = _parse_cli([f"--config={TINY}", f"--workdir={workdir}"], monkeypatch, capsys)
  assert (got.eval.max_docs, got.data.batch_size) == (0, 8)  # An explicit file wins.
  code, lines = _parse_cli([f"--workdir={workdir}"], monkeypatch, capsys, saved_config=False)
  assert (code, lines) == (
    1,
    [
      "ConfigError: --config is required: give the run's config file, "
      "e.g. --config=configs/tiny.py."
    ],
  )


@pytest.mark.parametrize(
  "text,args,want",
  [
    (None, [], "ConfigError: no --config given and no {w}/config.json: pass the run's --config="),
    (
      '{"eval": {"rerouterz": ["linear"]}}',
      [],
      "ConfigError: {w}/config.json: config.eval.rerouterz is not a config field: did you mean "
      "config.eval.rerouters?",
    ),
    ("{", [], "DamagedFileError: {w}/config.json is damaged (invalid JSON at byte 1"),
    (
      '{"data": {"batch_size": "eight"}}',
      [],
      "ConfigError: {w}/config.json: config.data.batch_size='eight' has the wrong type",
    ),
    (
      "{}",
      ["--config.eval.rerouterz=linear"],
      "ConfigError: --config.eval.rerouterz is not a config field: did you mean "
      "--config.eval.rerouters?",
    ),
  ],
  ids=["no config.json", "misspelt in the file", "damaged", "wrong type", "misspelt override"],
)
def test_a_bad_saved_config_is_one_line(text, args, want, tmp_path, monkeypatch, capsys):
  if text is not None:
    (tmp_path / "config.json").write_text(text)
  code, lines = _parse_cli([f"--workdir={tmp_path}", *args], monkeypatch, capsys)
  assert code == 1 and len(lines) == 1 and lines[0].startswith(want.format(w=tmp_path)), lines


def test_every_entry_point_lists_its_flags_in_help():
  """absl's --help shows the main module's key flags: cli's are adopted by each entry."""
  shared = {"config", "workdir", "verbose_errors", "library_log_level"}
  shared |= {
    "coordinator_address",
    "num_processes",
    "process_id",
  }  # distributed.py's, adopted by cli.
  want = {
    "main": shared,
    "route": shared,
    "evaluate": shared | {"step"},
    "serve": shared
    | {"text", "mode", "source", "path", "max_new_tokens", "temperature", "top_k", "batch_size"},
  }
  for name, names in want.items():
    importlib.import_module(f"dipaco_jax.{name}")  # Defines its flags.
    got = {f.name for f in flags.FLAGS.get_key_flags_for_module(f"dipaco_jax.{name}")}
    assert got == names, name


# Every --config.a.b[=v] the docs and launch scripts write, against the config the text names.
_DOCS = [
  "README.md",
  *[
    os.path.relpath(p, helpers.ROOT)
    for pattern in ("docs/*.md", "docs/results/*.md", "launch/*")
    for p in sorted(glob.glob(os.path.join(helpers.ROOT, pattern)))
  ],
]
_FLAG = re.compile(r"--config\.([A-Za-z0-9_.]+)(?:=((?:'[^']*'|\"[^\"]*\"|[^\s`'\"])*))?")
_CONFIG_FILE = re.compile(r"configs/[a-z0-9_]+\.py")
_CONFIG_SET = re.compile(r"(?:--config=|CONFIG=)(configs/[a-z0-9_]+\.py)")
_PLACEHOLDERS = {"section.field"}  # And names in capitals (routing.FIELD).


def _logical_lines(text: str):
  """(first line number, line) with backslash-continued lines joined."""
  first, buf = None, ""
  for n, raw in enumerate(text.splitlines(), 1):
    first = first or n
    if raw.endswith("\\"):
      buf += raw[:-1] + " "
      continue
    yield first, buf + raw
    first, buf = None, ""


_COMMAND = re.compile(r"python -m dipaco_jax|launch/\w+\.sh|--workdir")


def _doc_flags() -> list[tuple[str, str, bool, list[tuple[str, str | None]]]]:
  """(file:line, config file, is a command, [(field, value or None)]) per line of the docs.

  The config is the one the line names, else the run's config the file sets
  first (--config=configs/X.py: launch/README.md's dipaco_2x4), else tiny.
  A command's flags are checked together; prose names flags one at a time.
  """
  out = []
  for path in _DOCS:
    with open(os.path.join(helpers.ROOT, path)) as f:
      text = f.read()
    first = (_CONFIG_SET.findall(text) or [TINY])[0]
    for n, line in _logical_lines(text):
      named = _CONFIG_FILE.search(line)
      config = named.group(0) if named else first
      found = []
      for m in _FLAG.finditer(line):
        field, value = m.group(1).rstrip("."), m.group(2)
        if field in _PLACEHOLDERS or field != field.lower() or field.endswith("*"):
          continue
        if value and ("$" in value or value.startswith("<")):
          value = None  # Set at run time ($VAR, $(cmd)) or a <placeholder>: the name is checked.
        found.append((field, value.strip("'\"") if value and value[:1] in "'\"" else value))
      if found:
        out.append((f"{path}:{n}", config, bool(_COMMAND.search(line)), found))
  return out


def test_the_docs_write_config_flags():
  lines = _doc_flags()  # README, docs/, launch/.
  assert sum(len(f) for _, _, _, f in lines) >= 30 and sum(c for _, _, c, _ in lines) >= 10


def _parse(config: str, pairs, monkeypatch):
  """The config after `--config=config --config.a.b=v ...`, parsed as the CLI parses it."""
  argv = ["cmd", f"--config={config}", *[f"--config.{f}={v}" for f, v in pairs]]
  monkeypatch.chdir(helpers.ROOT)
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv.
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True)
  config_check.check_config_args(argv)
  fv(argv)
  return holder.value


@pytest.mark.parametrize(
  "where,config,command,found", _doc_flags(), ids=[w for w, _, _, _ in _doc_flags()]
)
def test_every_config_flag_in_the_docs_is_accepted(where, config, command, found, monkeypatch):
  """Names exist; a command's flags pass load's checks together, prose flags each its own rule."""
  for field, _ in found:
    assert field in schema.field_names(), schema.unknown_name_message(field, "--config.")
  pairs = [(f, v) for f, v in found if v is not None]
  if command:
    # gs:// paths and θ̄ are given at run time: the checks that read files are left out.
    config_check.validate(_parse(config, pairs, monkeypatch), for_run=False)
  else:
    for pair in pairs:
      schema.check_fields(_parse(config, [pair], monkeypatch))


_SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}


def _command(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", f"dipaco_jax.{module}", *args],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env=_SUBPROCESS_ENV,
    timeout=300,
  )


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
  "module,extra", [("main", []), ("route", []), ("evaluate", []), ("serve", ["--text=hi"])]
)
def test_every_command_prints_one_line(module, extra, tmp_path):
  workdir = tmp_path / "run"
  r = _command(
    module, f"--config={TINY}", f"--workdir={workdir}", "--config.outer.momentum=1.5", *extra
  )
  assert r.returncode == 1
  assert r.stderr.strip().splitlines() == [
    "ConfigError: config.outer.momentum=1.5 is invalid: it must be a number >= 0 and < 1; set "
    "--config.outer.momentum (default 0.9)."
  ]
  assert not workdir.exists()


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
  "module,extra", [("route", []), ("evaluate", []), ("serve", ["--text=hi"])]
)
def test_route_evaluate_serve_read_the_saved_config(module, extra, saved_run):
  workdir, _ = saved_run
  r = _command(module, f"--workdir={workdir}", "--config.outer.momentum=1.5", *extra)
  # The saved config was read (else: --config is required) and the override checked on top.
  assert r.returncode == 1
  assert r.stderr.strip().splitlines() == [
    "ConfigError: config.outer.momentum=1.5 is invalid: it must be a number >= 0 and < 1; set "
    "--config.outer.momentum (default 0.9)."
  ]


@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.parametrize(
  "module,want",
  [
    ("main", ["--config", "--workdir", "--verbose_errors"]),
    ("route", ["--config", "--workdir", "--verbose_errors"]),
    ("evaluate", ["--config", "--workdir", "--step"]),
    ("serve", ["--config", "--workdir", "--text", "--mode", "--max_new_tokens"]),
    pytest.param("aot", ["--config", "--topology", "--slices", "--out"], marks=pytest.mark.aot),
    ("data", ["--stats", "--task", "--tfds_data_dir", "--vocab_path"]),
  ],
)
def test_every_command_help_lists_its_flags(module, want):
  r = _command(
    module, "--help"
  )  # Exit statuses differ (absl's 1, the data command's 0): the text is the test.
  missing = [f for f in want if not re.search(rf"--(\[no\])?{f[2:]}\b", r.stdout)]
  assert not missing, r.stdout


@pytest.mark.cli
@pytest.mark.slow
def test_verbose_errors_shows_the_traceback(tmp_path):
  r = _command(
    "main",
    f"--config={TINY}",
    f"--workdir={tmp_path / 'run'}",
    "--config.outer.momentum=1.5",
    "--verbose_errors",
  )
  assert r.returncode != 0
  assert "Traceback (most recent call last)" in r.stderr
  assert "config.outer.momentum=1.5 is invalid" in r.stderr


_SMALL = helpers.SMALL_RUN


def _last_line(stderr: str) -> str:
  """The last line of stderr (splitlines also splits tqdm's carriage-return redraws)."""
  return [l for l in stderr.splitlines() if l.strip()][-1]


@pytest.mark.cli
@pytest.mark.slow
def test_a_diverged_run_and_a_damaged_checkpoint_stop_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  args = [f"--config={TINY}", f"--workdir={workdir}", *_SMALL]
  assert _command("main", *args, "--config.stop_at_step=2").returncode == 0
  ckpts = workdir / "checkpoints"
  before = helpers.tree_bytes(ckpts)
  # issue #11: inner.lr=1e6 once ran to the end (params ~1e13, loss at ln V) and exited 0.
  r = _command("main", *args, "--config.inner.lr=1e6")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
  line = _last_line(r.stderr)
  assert re.fullmatch(
    r"DivergenceError: parameter norm of \w+ grew \S+x since step 2 .* at step "
    r"3, .*: the run diverged; the last checkpoint, step 2, is kept and "
    r"nothing later was saved\. Lower config\.inner\.lr, .*",
    line,
  ), line
  assert helpers.tree_bytes(ckpts) == before
  helpers.truncate(ckpts / "2" / "state" / "manifest.ocdbt")
  r = _command("main", *args)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
  line = _last_line(r.stderr)
  assert line.startswith(
    f"DamagedCheckpointError: checkpoint step 2 in {ckpts} is damaged "
    "(state/manifest.ocdbt: Length in header ("
  ), line
  assert line.endswith(
    f"); move it aside (mv {ckpts}/2 {workdir}/damaged_checkpoint_2) to start "
    "the run over from step 0 (no older checkpoint is intact)."
  ), line


def test_library_log_lines_below_warning_are_dropped_and_the_projects_kept():
  orbax_file = os.path.join(os.path.dirname(orbax.checkpoint.__file__), "checkpoint_manager.py")
  ours = os.path.abspath(metrics.__file__)
  keep = cli._LibraryFilter(logging.WARNING).filter
  record = lambda path, level: logging.LogRecord("absl", level, path, 1, "m", None, None)
  assert not keep(record(orbax_file, logging.INFO))
  assert keep(record(orbax_file, logging.WARNING))
  assert keep(record(ours, logging.INFO))
  assert cli._LibraryFilter(logging.INFO).filter(record(orbax_file, logging.INFO))
