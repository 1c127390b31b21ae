"""Bad inputs to every entry point: one stderr line, exit status 1, nothing written changed.

Each case of FAILURES runs one command (main, route, evaluate, serve, aot,
`python -m dipaco_jax.data`) on a damaged or wrong input and asserts:
  * exit status 1;
  * exactly one stderr line besides log records (absl's and the libraries'
    `I/W/E<date> ... file:line]` lines; main runs with --verbosity=-1 so that
    its INFO dump of the config stays out), holding the case's words: the
    problem and the fix;
  * the same files and folders, byte for byte, under the case's tmp_path (the
    run it damaged, the config files it wrote): nothing written before is
    lost and nothing new is left.
Cases that fail while flags, the config or the workdir are read run in this
process, through the same parser and guard as the command (cli.parse_flags,
cli.guard; the data command's main); the others, and every aot case (its flags
are defined only when it runs), run the real command in a child process. The
cases that need a trained run share one tiny run (`trained`, learned positions
up to 24 with data.seq_len=16, prefix 4), copied into each case's tmp_path.
"""

import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Callable

import pytest
from absl import flags

from dipaco_jax import cli
from dipaco_jax import errors
from dipaco_jax.data import __main__ as data_main
from dipaco_jax.data import vocab

import helpers

# The flags that define the shared run: main takes them again to resume it.
RUN = [
  "--config=configs/tiny.py",
  "--config.model.d_model=32",
  "--config.model.num_heads=2",
  "--config.model.head_dim=16",
  "--config.model.positions=learned",
  "--config.model.max_len=24",
  "--config.data.seq_len=16",
  "--config.data.batch_size=2",
  "--config.inner.warmup_steps=2",
  "--config.dipaco.inner_steps=2",
  "--config.dipaco.outer_steps=2",
  "--config.ckpt.every_steps=2",
  "--config.eval.every_steps=2",
  "--config.eval.batches=1",
  "--config.routing.prefix_len=4",
  "--config.eval.rerouting_windows=()",
]
STATE = "checkpoints/4/state/manifest.ocdbt"  # The latest checkpoint's train state.
SHARD = "shards/{split}/worker_00000/part-00000-of-00001-00000.array_record"
TEXT = "hello world"  # 3 tokens of the shipped tokenizer.


def _file(name: str, text: str) -> Callable:
  """Setup: writes tmp_path/name."""
  return lambda w, t: (t / name).write_text(text)


def _in_run(rel: str, text: str) -> Callable:
  """Setup: writes (or overwrites) a file of the run."""
  return lambda w, t: (w / rel).write_text(text)


def _cut(rel: str) -> Callable:
  """Setup: truncates a file of the run to half its size, as a crash would."""
  return lambda w, t: helpers.truncate(w / rel)


def _edit_config(**sections) -> Callable:
  """Setup: sets fields of the run's config.json (section -> {field: value}, or a value)."""

  def edit(w, t):
    saved = json.loads((w / "config.json").read_text())
    for section, value in sections.items():
      saved[section] = {**saved[section], **value} if isinstance(value, dict) else value
    (w / "config.json").write_text(json.dumps(saved))

  return edit


def _remove(rel: str) -> Callable:
  return lambda w, t: shutil.rmtree(w / rel) if (w / rel).is_dir() else (w / rel).unlink()


@dataclasses.dataclass(frozen=True)
class Case:
  """One bad input: `entry`'s argv ({w}: the run, {t}: tmp_path) and the words its line holds."""

  name: str
  entry: str  # main, route, evaluate, serve, aot or data.
  args: list[str]
  want: tuple[str, ...]  # The one line holds each ({w}, {t} filled in); the first starts it.
  setup: Callable | None = None  # (w, t): the damage, the files the case needs.
  run: bool = False  # {w} is a copy of the trained run; else tmp_path/run (absent).
  child: bool = False  # A child process (else in this process, through the same guard).


# fmt: off
FAILURES = [
  # main: config files and their contents.
  Case("main: a config file that raises", "main",
       ["--config={t}/raises.py", "--workdir={w}"],
       ("ConfigError: --config={t}/raises.py: {t}/raises.py, line 3 raised RuntimeError: no "
        "such grid", "fix the file or give another config."),
       _file("raises.py",
             "def get_config():\n  grid = 'x'\n  raise RuntimeError('no such grid')\n")),
  Case("main: a config file with a syntax error", "main",
       ["--config={t}/syntax.py", "--workdir={w}"],
       ("ConfigError: --config={t}/syntax.py: {t}/syntax.py, line 1 raised SyntaxError",
        "fix the file or give another config."),
       _file("syntax.py", "def get_config(:\n  pass\n")),
  Case("main: a config file without get_config", "main",
       ["--config={t}/noget.py", "--workdir={w}"],
       ("ConfigError: --config={t}/noget.py: {t}/noget.py defines no get_config()",
        "returns config.schema.base() with changes from get_config()."),
       _file("noget.py", "CONFIG = {}\n")),
  Case("main: a config file returning a dict", "main",
       ["--config={t}/adict.py", "--workdir={w}"],
       ("ConfigError: --config={t}/adict.py: get_config() returned a dict, not a ConfigDict",
        "return config.schema.base() with changes."),
       _file("adict.py", "def get_config():\n  return {'model': {}}\n")),
  Case("main: a config file returning None", "main",
       ["--config={t}/none.py", "--workdir={w}"],
       ("ConfigError: --config={t}/none.py: get_config() returned a NoneType, not a ConfigDict",
        "return config.schema.base() with changes."),
       _file("none.py", "from dipaco_jax.config import schema\ndef get_config():\n"
             "  c = schema.base()\n")),
  Case("main: a config file importing a missing module", "main",
       ["--config={t}/imports.py", "--workdir={w}"],
       ("ConfigError: --config={t}/imports.py: {t}/imports.py, line 1 raised "
        "ModuleNotFoundError: No module named 'dipaco_presets'", "fix the file"),
       _file("imports.py", "import dipaco_presets\ndef get_config():\n  return None\n")),
  Case("main: a config file setting a field to the wrong type", "main",
       ["--config={t}/wrongtype.py", "--workdir={w}"],
       ("ConfigError: --config={t}/wrongtype.py: {t}/wrongtype.py, line 4 raised TypeError: "
        "Could not override field 'batch_size'", "fix the file or give another config."),
       _file("wrongtype.py", "from dipaco_jax.config import schema\ndef get_config():\n"
             "  c = schema.base()\n  c.data.batch_size = 'eight'\n  return c\n")),
  Case("main: an argument to a config file that takes none", "main",
       ["--config=configs/tiny.py:small", "--workdir={w}"],
       ("ConfigError: --config=configs/tiny.py:small: configs/tiny.py raised TypeError: "
        "get_config() takes 0 positional arguments but 1 was given", "fix the file")),
  # main: flags, workdirs and inputs that are files.
  Case("main: a boolean flag given a word", "main",
       ["--config=configs/tiny.py", "--workdir={w}", "--verbose_errors=sometimes"],
       ("IllegalFlagValueError: flag --verbose_errors=sometimes: ('Non-boolean argument to "
        "boolean flag', 'sometimes')",)),
  Case("main: an unknown flag", "main",
       ["--config=configs/tiny.py", "--workdir={w}", "--work_dir={t}/other"],
       ("UnrecognizedFlagError: Unknown command line flag 'work_dir'", "Did you mean: workdir")),
  Case("main: a workdir that is a file", "main",
       ["--config=configs/tiny.py", "--workdir={t}/notes.txt"],
       ("ArgumentError: --workdir={t}/notes.txt: {t}/notes.txt is a file, not a folder",
        "give another path (or move {t}/notes.txt aside)."),
       _file("notes.txt", "a file\n")),
  Case("main: a workdir under a file", "main",
       ["--config=configs/tiny.py", "--workdir={t}/notes.txt/run"],
       ("ArgumentError: --workdir={t}/notes.txt/run: {t}/notes.txt is a file, not a folder",
        "give another path"),
       _file("notes.txt", "a file\n")),
  Case("main: a read-only workdir", "main",
       ["--config=configs/tiny.py", "--workdir={t}/locked/run"],
       ("ArgumentError: --workdir={t}/locked/run: {t}/locked is not writable by this user",
        "give a folder you can write to (or change its permissions)."),
       lambda w, t: ((t / "locked").mkdir(), os.chmod(t / "locked", 0o555))),
  Case("main: a shard dir that is a file", "main",
       ["--config=configs/tiny.py", "--workdir={w}", "--config.data.shard_dir={t}/notes.txt"],
       ("ConfigError: config.data.shard_dir='{t}/notes.txt' is a file, not a folder",
        "give a folder for the shards (or unset it for <workdir>/shards)."),
       _file("notes.txt", "a file\n")),
  Case("main: a tokenizer file that is not one", "main",
       ["--config=configs/tiny.py", "--workdir={w}", "--config.data.vocab_path={t}/notes.txt"],
       ("ConfigError: config.data.vocab_path='{t}/notes.txt': {t}/notes.txt is not a "
        "SentencePiece model", "pass a .model file as vocab_path."),
       _file("notes.txt", "a file\n")),
  # main: the run's config.json, checkpoints and shards when it resumes; θ̄'s run.
  Case("main: resuming over a damaged config.json", "main",
       ["--workdir={w}", *RUN],
       ("DamagedFileError: {w}/config.json is damaged (invalid JSON at byte 11: Unterminated "
        "string",
        "restore it, or move it aside (mv {w}/config.json {w}/config.json.damaged) to go on "
        "with this command's config unchecked"),
       _in_run("config.json", '{"model": {"d_m'), run=True, child=True),
  Case("main: resuming over a config.json that holds a list", "main",
       ["--workdir={w}", *RUN],
       ("DamagedFileError: {w}/config.json holds no config", "restore it, or move it aside"),
       _in_run("config.json", "[]"), run=True, child=True),
  Case("main: resuming over a config.json with an unknown field", "main",
       ["--workdir={w}", *RUN],
       ("ConfigError: {w}/config.json: config.eval.batchez is not a config field: did you "
        "mean config.eval.batches?", "Edit the file: it is the config the run started with."),
       _edit_config(eval={"batchez": 1}), run=True, child=True),
  Case("main: resuming over a config.json with a field of the wrong type", "main",
       ["--workdir={w}", *RUN],
       ("ConfigError: {w}/config.json: config.eval.batches='one' has the wrong type",
        "edit the file: it is the config the run started with."),
       _edit_config(eval={"batches": "one"}), run=True, child=True),
  Case("main: resuming another run (another model)", "main",
       ["--workdir={w}", *RUN, "--config.model.d_model=64", "--config.model.head_dim=32"],
       ("ConfigError: {w} holds a run whose state does not fit this config (model.d_model: 32 "
        "-> 64, model.head_dim: 16 -> 32)", "rerun with its own values, or use a new --workdir"),
       run=True, child=True),
  Case("main: resuming from a damaged checkpoint", "main",
       ["--workdir={w}", *RUN, "--config.dipaco.outer_steps=3"],  # Finished runs read none.
       ("DamagedCheckpointError: checkpoint step 4 in {w}/checkpoints is damaged "
        "(state/manifest.ocdbt", "move it aside (mv {w}/checkpoints/4 {w}/damaged_checkpoint_4) "
        "to resume from step 2"),
       _cut(STATE), run=True, child=True),
  Case("main: resuming over a truncated shard file", "main",
       ["--workdir={w}", *RUN, "--config.dipaco.outer_steps=3"],
       ("DamagedFileError: shard file {w}/" + SHARD.format(split="train") + " is damaged "
        "(holds 0 documents, its meta.json says", "move {w}/shards aside"),
       _cut(SHARD.format(split="train")), run=True, child=True),
  Case("main: resuming over a damaged shards meta.json", "main",
       ["--workdir={w}", *RUN, "--config.dipaco.outer_steps=3"],
       ("DamagedFileError: shard file {w}/shards/meta.json is damaged (invalid JSON",
        "and rerun: the shards are written again from the same assignment."),
       _cut("shards/meta.json"), run=True, child=True),
  Case("main: θ̄ from a run whose checkpoint is damaged", "main",
       ["--workdir={t}/new", *RUN, "--config.dipaco.init_from={w}"],
       ("DamagedCheckpointError: checkpoint step 4 in {w}/checkpoints is damaged",
        "move it aside (mv {w}/checkpoints/4 {w}/damaged_checkpoint_4)"),
       _cut(STATE), run=True, child=True),
  # route: its workdir, saved config and options.
  Case("route: a workdir that is a file", "route", ["--workdir={t}/notes.txt"],
       ("ArgumentError: --workdir={t}/notes.txt is a file, not a run's folder",
        "give the run's directory."),
       _file("notes.txt", "a file\n")),
  Case("route: a config file that raises", "route",
       ["--config={t}/raises.py", "--workdir={w}"],
       ("ConfigError: --config={t}/raises.py: {t}/raises.py, line 2 raised KeyError: 'grid'",
        "fix the file or give another config."),
       _file("raises.py", "def get_config():\n  return {}['grid']\n")),
  Case("route: a config.json that holds a list", "route", ["--workdir={w}"],
       ("DamagedFileError: {w}/config.json holds no config",
        "pass the run's --config=configs/NAME.py."),
       _in_run("config.json", "[1, 2]"), run=True),
  Case("route: a config.json whose section is a number", "route", ["--workdir={w}"],
       ("ConfigError: {w}/config.json: config.model must be a section, not 3",
        "edit the file or pass --config."),
       _edit_config(model=3), run=True),
  Case("route: a config.json that is not text", "route", ["--workdir={w}"],
       ("DamagedFileError: {w}/config.json is damaged (not UTF-8 text",
        "pass the run's --config=configs/NAME.py."),
       lambda w, t: (w / "config.json").write_bytes(b"\xff\xfe{}"), run=True),
  Case("route: a router folder that is a file", "route", ["--workdir={w}"],
       ("ArgumentError: the router's folder {w}/router/phase_0: {w}/router is a file, not a "
        "folder", "(or move {w}/router aside)."),
       _in_run("router", "a file\n"), run=True, child=True),
  Case("route: k-means over the shards of a random run", "route",
       ["--workdir={w}", "--config.routing.router=kmeans"],
       ("ConfigError: shard dir {w}/shards was written for another config",
        "point the run at a new one (--config.data.shard_dir) or remove this one"),
       run=True, child=True),
  Case("route: a truncated shard file", "route", ["--workdir={w}"],
       ("DamagedFileError: shard file {w}/" + SHARD.format(split="validation") + " is damaged",
        "move {w}/shards aside"),
       _cut(SHARD.format(split="validation")), run=True, child=True),
  Case("route: --process_id without --num_processes", "route",
       ["--config=configs/tiny.py", "--workdir={w}", "--process_id=1"],
       ("IllegalFlagValueError: flags num_processes=None, process_id=1: --process_id=1 "
        "--num_processes=None: need num_processes >= 1 and 0 <= process_id < num_processes.",)),
  # evaluate: --step, checkpoints, shards, its reports' folder, its config.
  Case("evaluate: --step that is not a number", "evaluate", ["--workdir={w}", "--step=last"],
       ("IllegalFlagValueError: flag --step=last: invalid literal for int() with base 10",),
       run=True),
  Case("evaluate: --step that was not saved", "evaluate", ["--workdir={w}", "--step=3"],
       ("NoCheckpointError: --step=3: no checkpoint step 3 in {w}/checkpoints (saved steps: "
        "2, 4)", "give one of them, or leave --step out for the latest."),
       run=True, child=True),
  Case("evaluate: a negative --step", "evaluate", ["--workdir={w}", "--step=-1"],
       ("NoCheckpointError: --step=-1: no checkpoint step -1", "give one of them"),
       run=True, child=True),
  Case("evaluate: a damaged latest checkpoint", "evaluate", ["--workdir={w}"],
       ("DamagedCheckpointError: checkpoint step 4 in {w}/checkpoints is damaged",
        "move it aside (mv {w}/checkpoints/4 {w}/damaged_checkpoint_4)"),
       _cut(STATE), run=True, child=True),
  Case("evaluate: --step of a damaged checkpoint", "evaluate", ["--workdir={w}", "--step=2"],
       ("DamagedCheckpointError: checkpoint step 2 in {w}/checkpoints is damaged",
        "move it aside (mv {w}/checkpoints/2 {w}/damaged_checkpoint_2)"),
       _cut("checkpoints/2/state/manifest.ocdbt"), run=True, child=True),
  Case("evaluate: no checkpoint", "evaluate", ["--workdir={w}"],
       ("NoCheckpointError: no checkpoint in {w}/checkpoints", "train the run first"),
       _remove("checkpoints"), run=True, child=True),
  Case("evaluate: a truncated validation shard", "evaluate", ["--workdir={w}"],
       ("DamagedFileError: shard file {w}/" + SHARD.format(split="validation") + " is damaged",
        "move {w}/shards aside"),
       _cut(SHARD.format(split="validation")), run=True, child=True),
  Case("evaluate: a reports folder that is a file", "evaluate", ["--workdir={w}"],
       ("ArgumentError: evaluate's reports: {w}/eval is a file, not a folder",
        "(or move {w}/eval aside)."),
       _in_run("eval", "a file\n"), run=True, child=True),
  Case("evaluate: a prefix as long as the sequences", "evaluate",
       ["--workdir={w}", "--config.routing.prefix_len=16"],
       ("ConfigError: evaluation scores the tokens after the 16-token routing prefix but its "
        "sequences have 16", "set --config.eval.seq_len above 16 or lower "
        "config.routing.prefix_len."),
       run=True, child=True),
  Case("evaluate: --config of another model", "evaluate",
       ["--config=configs/tiny.py", "--workdir={w}"],
       ("ConfigError: {w} holds a run of another model or grid than this config "
        "(model.d_model: 32 -> 128", "drop --config to read the run's own config"),
       run=True, child=True),
  # serve: its flags and texts.
  Case("serve: no --text", "serve", ["--workdir={w}"],
       ("UsageError: --text is required: the text to route, then continue or score.",),
       run=True),
  Case("serve: --batch_size=0", "serve", ["--workdir={w}", f"--text={TEXT}", "--batch_size=0"],
       ("IllegalFlagValueError: flag --batch_size=0: decode at least 1 text at a time: give "
        "--batch_size >= 1",), run=True),
  Case("serve: a negative --top_k", "serve", ["--workdir={w}", f"--text={TEXT}", "--top_k=-2"],
       ("IllegalFlagValueError: flag --top_k=-2: give --top_k >= 0 (0: every token)",), run=True),
  Case("serve: a negative --temperature", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--temperature=-0.5"],
       ("IllegalFlagValueError: flag --temperature=-0.5: give --temperature >= 0 (0: greedy)",),
       run=True),
  Case("serve: --max_new_tokens=0", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--max_new_tokens=0"],
       ("IllegalFlagValueError: flag --max_new_tokens=0: generate at least 1 token: give "
        "--max_new_tokens >= 1",), run=True),
  Case("serve: a negative --path", "serve", ["--workdir={w}", f"--text={TEXT}", "--path=-1"],
       ("IllegalFlagValueError: flag --path=-1: a path is numbered from 0: give --path >= 0",),
       run=True),
  Case("serve: --path outside the grid", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--path=4", "--max_new_tokens=2"],
       ("ArgumentError: path 4 is not in this grid (paths 0-3)",
        "give --path in that range, or leave it out for the routed path."),
       run=True, child=True),
  Case("serve: an empty text", "serve", ["--workdir={w}", f"--text={TEXT}", "--text="],
       ("ArgumentError: the text has no tokens: an empty prefix cannot be routed.",
        "Pass some text."), run=True, child=True),
  Case("serve: a text too short to score", "serve",
       ["--workdir={w}", "--text=hello", "--mode=score"],
       ("ArgumentError: a text of 2 tokens cannot be scored: its first 4 route it "
        "(config.routing.prefix_len) and are not scored", "give a text of at least 5 tokens."),
       run=True, child=True),
  Case("serve: generating past the learned positions", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--max_new_tokens=40"],
       ("ArgumentError: a prompt of 3 tokens plus --max_new_tokens=40 needs 43 positions but "
        "the model's learned positions end at model.max_len=24",
        "lower --max_new_tokens to 21."), run=True, child=True),
  Case("serve: scoring past the learned positions", "serve",
       ["--workdir={w}", "--text=" + "hello world " * 20, "--mode=score"],
       ("ArgumentError: the text needs 61 positions but the model's learned positions end at "
        "model.max_len=24", "shorten it to 24 tokens."), run=True, child=True),
  Case("serve: a damaged checkpoint", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--max_new_tokens=2"],
       ("DamagedCheckpointError: checkpoint step 4 in {w}/checkpoints is damaged",
        "move it aside"), _cut(STATE), run=True, child=True),
  Case("serve: a damaged early-stopping set", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--max_new_tokens=2", "--source=best"],
       ("DamagedCheckpointError: checkpoint step 4 in {w}/checkpoints is damaged "
        "(best/manifest.ocdbt", "move it aside"),
       _cut("checkpoints/4/best/manifest.ocdbt"), run=True, child=True),
  Case("serve: another model than the run's", "serve",
       ["--workdir={w}", f"--text={TEXT}", "--config.model.positions=rope"],
       ("ConfigError: {w} holds a run of another model or grid than this config "
        "(model.positions: 'learned' -> 'rope'", "drop --config to read the run's own config"),
       run=True, child=True),
  # aot: flags, config files, outputs (child processes: its flags exist only when it runs).
  Case("aot: --slices=0", "aot", ["--config=configs/tiny.py", "--topology=v5e:2x2", "--slices=0"],
       ("AotError: --slices=0: must be >= 1.",), child=True),
  Case("aot: an unknown --steps", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:2x2", "--steps=inner,backward"],
       ("UsageError: --steps: unknown ['backward']; use inner, outer, eval.",), child=True),
  Case("aot: a topology without its shape", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:16"],
       ("AotError: --topology=v5e:16: write CHIP:AxB or CHIP:AxBxC",), child=True),
  Case("aot: no --topology", "aot", ["--config=configs/tiny.py"],
       ("IllegalFlagValueError: flag --topology=None: Flag --topology must have a value other "
        "than None.",), child=True),
  Case("aot: a config file that raises", "aot",
       ["--config={t}/raises.py", "--topology=v5e:2x2"],
       ("ConfigError: --config={t}/raises.py: {t}/raises.py, line 2 raised ZeroDivisionError",
        "fix the file or give another config."),
       _file("raises.py", "def get_config():\n  return 1 / 0\n"), child=True),
  Case("aot: a bad field", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:2x2", "--config.inner.b1=2"],
       ("ConfigError: config.inner.b1=2.0 is invalid", "set --config.inner.b1"), child=True),
  Case("aot: --dcn_gbps=0", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:2x2", "--dcn_gbps=0"],
       ("IllegalFlagValueError: flag --dcn_gbps=0.0: the outer step's DCN time needs a "
        "bandwidth: give --dcn_gbps > 0",), child=True),
  Case("aot: --out under a file", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:2x2", "--out={t}/notes.txt/aot.json"],
       ("ArgumentError: --out={t}/notes.txt/aot.json: {t}/notes.txt is a file, not a folder",
        "give another path"), _file("notes.txt", "a file\n"), child=True),
  Case("aot: an extra argument", "aot",
       ["--config=configs/tiny.py", "--topology=v5e:2x2", "inner"],
       ("UsageError: unexpected arguments ['inner']: every option is a --flag=value.",),
       child=True),
  # The data command.
  Case("data: nothing to do", "data", [], ("ArgumentError: nothing to do: pass --stats.",)),
  Case("data: an unknown task", "data", ["--stats", "--task=c4"],
       ("ArgumentError: flag --task=c4: value should be one of <dipaco_embedded|c4_en>; "
        "see --help.",)),
  Case("data: an unknown split", "data", ["--stats", "--splits=train,test"],
       ("ArgumentError: --splits=train,test: unknown split(s) ['test']",
        "give some of train,validation,router, comma-separated.")),
  Case("data: --max_docs that is not a number", "data", ["--stats", "--max_docs=all"],
       ("ArgumentError: flag --max_docs=all: invalid literal for int()", "; see --help.")),
  Case("data: --max_docs=0", "data", ["--stats", "--max_docs=0"],
       ("ArgumentError: --max_docs=0: count at least 1 document per split",
        "(leave it out for all).")),
  Case("data: an unknown flag", "data", ["--stats", "--max-docs=5"],
       ("ArgumentError: Unknown command line flag 'max-docs'. Did you mean: max_docs",
        "; see --help.")),
  Case("data: --json that is a folder", "data", ["--stats", "--json={t}"],
       ("ArgumentError: --json={t} is a folder: give a file name (e.g. {t}/out.json).",)),
  Case("data: --json under a file", "data", ["--stats", "--json={t}/notes.txt/stats.json"],
       ("ArgumentError: --json={t}/notes.txt/stats.json: {t}/notes.txt is a file, not a folder",
        "give another path"), _file("notes.txt", "a file\n")),
  Case("data: a missing tokenizer", "data", ["--stats", "--vocab_path={t}/spm.model"],
       ("FileNotFoundError: Vocabulary file {t}/spm.model does not exist",
        "pass an existing SentencePiece .model file as vocab_path.")),
  Case("data: C4 without its tokenizer", "data", ["--stats", "--task=c4_en"],
       ("ConfigError: Task 'c4_en' needs data.vocab_path (e.g. "
        "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model for c4_en).",)),
]
# fmt: on

_ENV = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
# Log records (absl's Python and C++ logs and its notice before them, sentencepiece's, libtpu's
# source trace): not messages.
_LOG = re.compile(
  r"^([IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\]|normalizer\.cc\(|=== Source Location Trace|"
  r"learning/\S+\.cc:\d+$|WARNING: All log messages before absl::InitializeLog\(\))"
)


# The trainer's three lines about the run (runtime/console.py), printed before it reads its
# checkpoint, shards and θ̄: what a bad one stops with follows them.
_START = re.compile(
  r"^((spmd|elastic): grid \d|[\d.]+[MB] params per path \("
  r"|workdir .*: the full config in config\.json;)"
)


def message_lines(stderr: str) -> list[str]:
  """stderr's lines that are not log records (see _LOG) or the trainer's start lines."""
  return [
    l
    for l in stderr.splitlines()
    if l.strip() and not _LOG.match(l.strip()) and not _START.match(l.strip())
  ]


def command(entry: str, args: list[str]) -> subprocess.CompletedProcess:
  """`python -m dipaco_jax.<entry> ARGS` in a child process (main quiet below warnings)."""
  module = "dipaco_jax.data" if entry == "data" else f"dipaco_jax.{entry}"
  extra = ["--verbosity=-1"] if entry == "main" else []
  return subprocess.run(
    [sys.executable, "-m", module, *args, *extra],
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    env=_ENV,
    timeout=600,
  )


def _in_process(entry: str, args: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
  """The command in this process, through its own parser and guard: (status, stderr lines)."""
  with pytest.raises(SystemExit) as e:
    if entry == "data":
      data_main.main(args)
    else:
      module = importlib.import_module(f"dipaco_jax.{entry}")
      argv = [module.__name__, *args]
      monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv.
      flags.FLAGS.unparse_flags()
      for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # The last case's.
        delattr(flags.FLAGS, name)
      cli.guard(module.main)(cli.parse_flags(argv, saved_config=entry != "main"))
  return e.value.code, [l for l in capsys.readouterr().err.splitlines() if l.strip()]


def snapshot(root) -> tuple[dict[str, bytes], list[str]]:
  """Every file's bytes and every folder under root."""
  folders = sorted(os.path.relpath(d, root) for d, _, _ in os.walk(root))
  return helpers.tree_bytes(root), folders


@pytest.fixture(name="trained", scope="module")
def _trained(tmp_path_factory):
  """The shared tiny run: 4 paths, 2 checkpoints (steps 2 and 4), learned positions to 24."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  r = command("main", [f"--workdir={workdir}", *RUN])
  assert r.returncode == 0, r.stderr[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  return workdir


def run_case(case: Case, tmp_path, request, monkeypatch=None, capsys=None):
  """Sets the case up and runs it: (status, message lines, w, t, snapshot before)."""
  w = tmp_path / "run"
  if case.run:
    shutil.copytree(request.getfixturevalue("trained"), w)
  if case.setup is not None:
    case.setup(w, tmp_path)
  args = [a.format(w=w, t=tmp_path) for a in case.args]
  before = snapshot(tmp_path)
  if case.child:
    r = command(case.entry, args)
    code, lines = r.returncode, message_lines(r.stderr)
  else:
    code, lines = _in_process(case.entry, args, monkeypatch, capsys)
  return code, lines, w, before


def _params(cases):
  """Each case with what it needs: a child process (cli), the trained run (slow), libtpu (aot)."""

  def marks(c):
    need = [pytest.mark.slow] if c.run or c.child else []
    need += [pytest.mark.cli] if c.run or c.child else []
    return need + ([pytest.mark.aot] if c.entry == "aot" else [])

  return [pytest.param(c, id=c.name, marks=marks(c)) for c in cases]


@pytest.mark.parametrize("case", _params(FAILURES))
def test_a_bad_input_is_one_line_and_changes_nothing(case, tmp_path, request, monkeypatch, capsys):
  if "read-only" in case.name and os.geteuid() == 0:
    pytest.skip("root writes into read-only folders: the refusal cannot show")
  code, lines, w, before = run_case(case, tmp_path, request, monkeypatch, capsys)
  want = [f.format(w=w, t=tmp_path) for f in case.want]
  assert code == 1, lines
  assert len(lines) == 1, lines
  assert lines[0].startswith(want[0]), lines[0]
  for words in want[1:]:
    assert words in lines[0], (words, lines[0])
  assert snapshot(tmp_path) == before


def test_the_table_covers_every_entry_point():
  entries = {c.entry for c in FAILURES}
  assert entries == {"main", "route", "evaluate", "serve", "aot", "data"}
  assert len(FAILURES) >= 40
  assert len({c.name for c in FAILURES}) == len(FAILURES)


def test_verbose_errors_raises_the_error_and_a_bug_keeps_its_traceback(
  tmp_path, monkeypatch, capsys
):
  (tmp_path / "raises.py").write_text("def get_config():\n  raise RuntimeError('no grid')\n")
  argv = ["dipaco_jax.main", f"--config={tmp_path}/raises.py", "--workdir=W", "--verbose_errors"]
  monkeypatch.setattr(sys, "argv", argv)
  flags.FLAGS.unparse_flags()
  with pytest.raises(errors.ConfigError, match="line 2 raised RuntimeError: no grid") as e:
    cli.parse_flags(argv)
  assert isinstance(e.value.__cause__, RuntimeError)  # The file's own traceback, chained.
  with pytest.raises(errors.ArgumentError, match="--max_docs=0: count at least 1 document"):
    data_main.main(["--stats", "--max_docs=0", "--verbose_errors"])
  monkeypatch.setattr(data_main, "stats", lambda *a, **k: {}["split"])  # A bug, not an input.
  with pytest.raises(KeyError):
    data_main.main(["--stats", "--max_docs=1"])
  assert capsys.readouterr().err == ""


@pytest.mark.cli
@pytest.mark.aot
@pytest.mark.slow
def test_aot_verbose_errors_shows_the_traceback():
  r = command(
    "aot", ["--config=configs/tiny.py", "--topology=v5e:2x2", "--slices=0", "--verbose_errors"]
  )
  assert r.returncode == 1
  assert "Traceback (most recent call last)" in r.stderr
  assert message_lines(r.stderr)[-1] == "AotError: --slices=0: must be >= 1."


@pytest.mark.cli
@pytest.mark.slow
def test_serving_past_the_trained_length_warns_in_one_line_and_answers(trained):
  """Within the learned positions (24) but past data.seq_len (16): the output and one warning."""
  r = command("serve", [f"--workdir={trained}", f"--text={TEXT}", "--max_new_tokens=16"])
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out["new_tokens"] >= 1 and out["loaded"]["step"] == 4
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, lines
  assert lines[0].endswith(
    "a prompt of 3 tokens plus --max_new_tokens=16 runs to 19 tokens, past the 16 the model "
    "was trained on (config.data.seq_len): what lies past them is extrapolated; lower "
    "--max_new_tokens to 13 to stay within them."
  ), lines[0]
  text = "hello world " * 6
  assert len(vocab.load(vocab.DEFAULT_VOCAB_PATH).encode(text)) == 19
  r = command("serve", [f"--workdir={trained}", f"--text={text}", "--mode=score"])
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out["scored_tokens"] == 19 - 4 and out["loss"] > 0
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].endswith(
    "the text runs to 19 tokens, past the 16 the model was trained on (config.data.seq_len): "
    "what lies past them is extrapolated; shorten it to 16 tokens to stay within them."
  ), lines


@pytest.mark.cli
@pytest.mark.slow
def test_resuming_without_config_json_warns_and_saves_it(trained, tmp_path):
  """Accepted: the checkpoint's shapes are still checked; one warning, config.json written."""
  w = tmp_path / "run"
  shutil.copytree(trained, w)
  saved = (w / "config.json").read_text()
  (w / "config.json").unlink()
  r = command("main", [f"--workdir={w}", *RUN])
  assert r.returncode == 0, r.stderr[-3000:]
  warned = [l for l in r.stderr.splitlines() if "no config.json" in l]
  assert len(warned) == 1 and warned[0].endswith(
    f"{w} holds a run's checkpoints but no config.json: this config is not checked against "
    "the run's (only the checkpoint's shapes are) and is saved as its config.json."
  ), warned
  assert json.loads((w / "config.json").read_text()) == json.loads(saved)
