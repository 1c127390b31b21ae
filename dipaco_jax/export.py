"""Exports a run's paths as Hugging Face Llama checkpoints, the router beside them.

    python -m dipaco_jax.export --workdir=DIR --path=0 [--path=3 ...] --out=OUT
    python -m dipaco_jax.export --workdir=DIR --all --out=OUT

OUT/path_<p>/ is path p as a Llama checkpoint (config.json, model.safetensors, tokenizer.model,
tokenizer_config.json; io/hf_llama.py), loadable with transformers' LlamaForCausalLM;
OUT/router/ the router (routing/portable.py: θ̄ as a Llama for the prefix features, the
fitted arrays, assignment.json), and OUT/README.md how to route an input and load a path.
A config Llama cannot hold (model.mlp gelu, learned positions) is refused in one line naming
the field, as are a path outside the grid and an OUT that holds files; nothing is written
then. Locally the export is written to a folder beside OUT and renamed into place at the end.

The command's config is the run's saved <workdir>/config.json unless --config is given
(cli.py), as for evaluate and serve.
"""

import os
import shutil
import uuid

import jax
from absl import app
from absl import flags

from dipaco_jax import cli
from dipaco_jax import errors
from dipaco_jax import routing
from dipaco_jax import saved_config
from dipaco_jax.config import sections
from dipaco_jax.core import path_params
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.data import vocab as vocab_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.io import files
from dipaco_jax.io import hf_llama
from dipaco_jax.routing import portable

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.


def _define_flags() -> dict:
  """The command's own flags, defined when it runs: serve's --path, evaluate's --step differ."""
  return {
    "path": flags.DEFINE_multi_integer("path", None, "A path to export (repeat for several)."),
    "all": flags.DEFINE_bool("all", False, "Export every path of the grid."),
    "out": flags.DEFINE_string("out", None, "The folder to write (new or empty)."),
    "step": flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest)."),
  }


_FLAGS: dict = {}


def _check(config, workdir: str, paths: list[int], out: str, step: int | None) -> int:
  """Every refusal before anything is read at length or written; returns the step."""
  saved_config.check_readable(workdir, config)
  hf_llama.check_exportable(sections.ModelConfig.of(config))
  topo = topo_lib.from_config(config)
  bad = [p for p in paths if not 0 <= p < topo.num_paths]
  if bad:
    raise errors.ArgumentError(
      f"--path={bad[0]} is not a path of {workdir} ({topo.describe()}): give --path in "
      f"0-{topo.num_paths - 1}, or --all."
    )
  if hf_llama.nonempty(out):
    raise errors.ArgumentError(
      f"--out={out} already holds files: give a new or empty folder (an export never writes "
      "over one)."
    )
  files.check_writable(out, f"--out={out}")
  saved = checkpoint.steps(workdir)
  if not saved:
    checkpoint.latest_step(workdir)  # Its NoCheckpointError names the fix.
  if step is not None and step not in saved:
    raise checkpoint.NoCheckpointError(
      f"--step={step}: no checkpoint step {step} in {checkpoint.directory(workdir)} (saved "
      f"steps: {', '.join(map(str, saved))}): give one of them, or leave --step out."
    )
  return saved[-1] if step is None else step


def _stage(out: str) -> str:
  """Where the files are written: a hidden folder beside a local OUT, or OUT itself."""
  if files.is_remote(out):
    return out
  parent, name = os.path.split(os.path.abspath(out))
  return os.path.join(parent, f".{name}.export-{uuid.uuid4().hex[:8]}")


def export(config, workdir: str, out: str, paths: list[int] | None = None, step=None) -> dict:
  """Writes `paths` (None: all) of the run at `workdir` into `out`; returns what was written."""
  topo = topo_lib.from_config(config)
  paths = sorted(set(range(topo.num_paths) if paths is None else paths))
  step = _check(config, workdir, paths, out, step)
  cfg = sections.ModelConfig.of(config)
  vocab_path = vocab_lib.resolve(config.data.task, config.data.vocab_path)
  sp_proto = files.path(vocab_path).read_bytes()
  phase = checkpoint.routing_phase(checkpoint.read_data_state(workdir, step))
  extractor = (
    routing.extractor_from_config(config)
    if phase > 0 or config.routing.router != "random"
    else None
  )
  path_router = routing.load_phase_router(config, workdir, topo, phase, extractor)
  meta = portable.assignment(path_router, topo, prefix_len=config.routing.prefix_len)
  meta["paths"] = {str(p): meta["paths"][str(p)] for p in paths}
  write = lambda where, params: hf_llama.write(
    where, params, cfg, sp_proto, max_positions=config.data.seq_len
  )
  stage = _stage(out)
  try:
    for p in paths:
      write(
        files.join(stage, portable.path_dir(p)), path_params.load(workdir, config, p, step=step)[0]
      )
    if extractor is not None:
      write(files.join(stage, portable.DIR, portable.BASE_MODEL), jax.device_get(extractor.params))
    portable.write(stage, path_router, meta)
    how = f"router {path_router.kind}, routing phase {phase}"
    readme = portable.readme(out, meta, step=step, workdir=workdir, how=how)
    files.write_text(files.join(stage, "README.md"), readme)
    if stage != out:
      if os.path.isdir(out):
        os.rmdir(out)  # Empty (checked): the staged folder takes its place.
      os.replace(stage, out)
  finally:
    if stage != out and os.path.isdir(stage):
      shutil.rmtree(stage)
  return {"out": out, "step": step, "paths": paths, "router": path_router.kind}


def main(argv):
  out, paths, every = (_FLAGS[k].value for k in ("out", "path", "all"))
  if out is None:
    raise app.UsageError("--out is required: the folder to write the checkpoints into.")
  if bool(paths) == every:
    raise app.UsageError("give --path=P (repeatable) or --all, one of the two.")
  config, workdir = cli.start(argv, writes=False)  # Reads the run; writes only into --out.
  done = export(config, workdir, out, None if every else paths, _FLAGS["step"].value)
  where = ", ".join(portable.path_dir(p) for p in done["paths"])
  print(
    f"wrote {len(done['paths'])} path(s) of step {done['step']} as Llama checkpoints to "
    f"{done['out']} ({where}), the {done['router']} router in {portable.DIR}/; how to route "
    f"an input and load a path: {files.join(done['out'], 'README.md')}"
  )


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  cli.run(main, saved_config=True)
