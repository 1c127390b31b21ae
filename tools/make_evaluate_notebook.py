"""Writes notebooks/evaluate.ipynb from the cells below; --execute also runs it on a trained run.

  python tools/make_evaluate_notebook.py                          # cells only (no outputs)
  python tools/make_evaluate_notebook.py --execute --workdir=DIR  # with DIR's outputs (committed)

The committed notebook carries the outputs of a tiny run (configs/tiny.py with
model.mlp=swiglu, then `python -m dipaco_jax.evaluate --workdir=DIR`);
tests/project/test_notebook.py runs it in CI, from a fresh kernel outside the clone, on an empty
WORKDIR that its training cell fills.
Edit the cells here, never the .ipynb.
"""

import argparse
import os
import sys
import tempfile
import time
import tomllib

import nbformat
from nbformat import v4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "evaluate.ipynb")

# The project's repository (pyproject.toml, [project.urls]): the notebook's Colab badge and its
# install cell. A fork sets its own there.
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
  REPO_URL = tomllib.load(_f)["project"]["urls"]["Repository"]
_GITHUB = "https://github.com/"
COLAB_URL = (
  "https://colab.research.google.com/github/"
  + REPO_URL.removeprefix(_GITHUB)
  + "/blob/main/notebooks/evaluate.ipynb"
)
# The training cell's time for configs/tiny.py (500 inner steps) on a 2-core CPU: 5m07s idle (the
# README's figure), 19m50s under a load average of 12 (python -m dipaco_jax.main, measured).
TRAIN_TIME = "5 minutes on this project's idle 2-core CPU (20 while other jobs shared it)"
BADGE = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({COLAB_URL})"

CELLS = [
  (
    "md",
    f"""# Evaluate a dipaco_jax run

{BADGE}

Loads a run's latest checkpoint with the config it was trained with (`WORKDIR/config.json`), plots
its training curves (per-path loss, outer delta norms per module, the trainer's routed validation
perplexity over all tokens, the prefix included), routes the validation set by each sequence's
prefix, and shows routed perplexity (prefix excluded),
per-path losses, perplexity when re-routing every W tokens, shard sizes, how the learned shards
line up with the document domains, and whether each path specialises on its own shard. Same
numbers as `python -m dipaco_jax.evaluate` and `benchmarks/specialisation.py` (see
`docs/routing.md`), whose saved re-routers it loads. Paths are named as in TensorBoard:
`path_0-1-0` is module 0 of level 0, 1 of level 1, 0 of level 2.

**Colab** (a fresh runtime): *Runtime > Run all*. The parameters cell below is a form: `WORKDIR`
is the run's `--workdir`, a folder in this runtime or a `gs://bucket/run` (the notebook asks you
to sign in to Google Cloud); `REPO_URL` is where dipaco_jax is installed from (`{REPO_URL}`, the
repository of `pyproject.toml`'s `[project.urls]`; set yours for a fork). When `WORKDIR` holds no
run (no `config.json`), the training cell trains `CONFIG` there first, as
`python -m dipaco_jax.main --config=configs/tiny.py --workdir=WORKDIR` does (the configs ship
inside the package: no clone needed). The tiny run (500 inner steps) took {TRAIN_TIME}; a
Colab CPU runtime (2 vCPUs) should take about as long (an estimate from that timing, not measured
on Colab). `TRAIN_OVERRIDES` shortens it, e.g.
`{{"model.mlp": "swiglu", "dipaco.outer_steps": 2}}` for 100 steps; its default trains Llama's
SwiGLU MLP instead of the config's GELU, so that the last cell can export a path as a Hugging
Face Llama checkpoint and load it back with `transformers`.

The outputs below are a tiny run's (`configs/tiny.py` with `model.mlp=swiglu`, stopped after 200
of its 500 inner steps with `config.stop_at_step=200` on a 2-core CPU, then
`python -m dipaco_jax.evaluate`).""",
  ),
  (
    "code",
    """#@title Parameters
# A Colab form; CI and scripts set the same names through the environment (DIPACO_NB_<NAME>).
import json
import os

WORKDIR = "/tmp/dipaco_tiny"  #@param {type:"string"}
REPO_URL = "%s"  #@param {type:"string"}
# What the training cell trains when WORKDIR holds no run: a config file (configs/NAME.py is
# the package's own) and {"section.field": value} overrides, as --config.section.field=value.
CONFIG = "configs/tiny.py"  #@param {type:"string"}
# model.mlp="swiglu": Llama's MLP, so the export cell can write the run as Llama checkpoints.
TRAIN_OVERRIDES = "{\\"model.mlp\\": \\"swiglu\\"}"  #@param {type:"string"}
MAX_DOCS = 0  #@param {type:"integer"}
# Evaluation overrides of the run's config, e.g. {"routing.prefix_len": 32}.
OVERRIDES = "{}"  #@param {type:"string"}
# Where the export cell writes path 0 as a Hugging Face Llama checkpoint (a local folder).
EXPORT_DIR = "/tmp/dipaco_tiny_hf"  #@param {type:"string"}

WORKDIR = os.environ.get("DIPACO_NB_WORKDIR", WORKDIR)
REPO_URL = os.environ.get("DIPACO_NB_REPO_URL", REPO_URL)
CONFIG = os.environ.get("DIPACO_NB_CONFIG", CONFIG)
TRAIN_OVERRIDES = json.loads(os.environ.get("DIPACO_NB_TRAIN_OVERRIDES", TRAIN_OVERRIDES))
MAX_DOCS = int(os.environ.get("DIPACO_NB_MAX_DOCS", MAX_DOCS))  # Validation docs (0 = all).
OVERRIDES = json.loads(os.environ.get("DIPACO_NB_OVERRIDES", OVERRIDES))
EXPORT_DIR = os.environ.get("DIPACO_NB_EXPORT_DIR", EXPORT_DIR)"""
    % REPO_URL,
  ),
  (
    "code",
    """# Installs dipaco_jax from REPO_URL when it is not importable: a fresh Colab runtime.
# CI and a local Jupyter with the package installed skip it (nothing is downloaded).
# dipaco_jax needs Python >= 3.11 (pyproject.toml's requires-python; Colab's runtime has 3.12 in
# 2025): on an older runtime pip stops with "requires a different Python" - pick a newer runtime.
import subprocess
import sys

try:
  import dipaco_jax  # noqa: F401
except ImportError:
  if sys.version_info < (3, 11):
    raise RuntimeError(
      f"dipaco_jax needs Python >= 3.11; this runtime has {sys.version.split()[0]}."
    ) from None
  if "github.com/ORG/" in REPO_URL:
    raise ValueError(
      f"REPO_URL={REPO_URL} is a placeholder: set it to dipaco_jax's repository."
    ) from None
  print(f"installing dipaco_jax from {REPO_URL} (a few minutes)")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"git+{REPO_URL}"], check=True)
  import dipaco_jax  # noqa: F401
print("dipaco_jax is importable")""",
  ),
  (
    "code",
    """# A gs:// run: Colab signs in to Google Cloud (the account needs read access to the bucket).
if "google.colab" in sys.modules and WORKDIR.startswith("gs://"):
  from google.colab import auth

  auth.authenticate_user()""",
  ),
  (
    "code",
    """# Training, only when WORKDIR holds no run (no config.json): CONFIG with TRAIN_OVERRIDES, as
# `python -m dipaco_jax.main --config=CONFIG --workdir=WORKDIR --config.a.b=v` (its lines below).
import time

from dipaco_jax.io import files


def flag(key, value):
  value = tuple(value) if isinstance(value, list) else value  # JSON has no tuples.
  return f"--config.{key}={value!r}" if isinstance(value, tuple) else f"--config.{key}={value}"


if (files.path(WORKDIR) / "config.json").exists():
  print(f"{WORKDIR} holds a run (config.json): evaluating it, no training")
else:
  cmd = ["-m", "dipaco_jax.main", f"--config={CONFIG}", f"--workdir={WORKDIR}"]
  cmd += [flag(k, v) for k, v in TRAIN_OVERRIDES.items()]
  print("training: python", " ".join(cmd), flush=True)
  start = time.perf_counter()
  with subprocess.Popen(
    [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  ) as proc:
    for line in proc.stdout:  # Its progress lines as they come (every 10 s).
      print(line, end="", flush=True)
  if proc.returncode:
    raise RuntimeError(f"training failed (exit status {proc.returncode}): its lines are above")
  print(f"trained {WORKDIR} in {time.perf_counter() - start:.0f} s")""",
  ),
  (
    "code",
    """import jax
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from dipaco_jax import evaluate
from dipaco_jax.config import schema
from dipaco_jax.io import metrics
from dipaco_jax.runtime import early_stopping
from dipaco_jax.routing import report as router_report
from dipaco_jax.routing import specialisation

plt.rcParams["figure.dpi"] = 100
plt.rcParams["font.size"] = 9
if not (files.path(WORKDIR) / "config.json").exists():
  raise FileNotFoundError(
    f"{WORKDIR}/config.json not found: set WORKDIR to a run's --workdir (training writes it)."
  )
config = evaluate.config_from_workdir(WORKDIR)  # The run's own config, no source checkout.
for key, value in OVERRIDES.items():
  schema.check_name(key)  # A misspelt field is an error, as on the command line.
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = tuple(value) if isinstance(value, list) else value
# Before any backend starts (as dipaco_jax.main); GPU/TPU runtimes are unaffected.
if config.mesh.cpu_devices and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
run = evaluate.load_run(config, WORKDIR)
topo = run.exp.topo
P = topo.num_paths
PATHS = [f"path_{topo.path_label(p)}" for p in range(P)]  # TensorBoard's names.
WORKERS = [f"path_{label}" for label in topo.worker_labels()]
print(WORKDIR, "|", topo.describe(), f"| step {run.step} | routing phase {run.phase}")""",
  ),
  ("md", "## Training curves (from the run's `metrics.jsonl`)"),
  (
    "code",
    """records = metrics.read_records(WORKDIR)
curves = metrics.curves(records)
fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
if "train_loss" in curves:
  steps, loss_NxW = curves["train_loss"]
  for w, name in enumerate(WORKERS):
    ax[0].plot(steps, loss_NxW[:, w], lw=1, label=name)
  ax[0].legend(fontsize=8)
ax[0].set(xlabel="inner step", ylabel="loss", title="train loss per path")
names = topo.module_labels()
for level, (steps, norm_NxK) in curves.get("outer_delta_norm", {}).items():
  for k in range(norm_NxK.shape[1]):
    name = names[level][k] if level in names else f"module_{k}"
    ax[1].plot(steps, norm_NxK[:, k], "o-", ms=3, lw=1, label=f"{level}/{name}")
if "outer_delta_norm" in curves:
  ax[1].set_yscale("log")
  ax[1].legend(fontsize=8)
ax[1].set(xlabel="inner step", ylabel="norm", title="outer delta norm per module")
if "val_perplexity_routed_all_tokens" in curves:
  steps, ppl = curves["val_perplexity_routed_all_tokens"]
  ax[2].plot(steps, ppl, "o-", ms=3, c="k")
  ax[2].set_yscale("log")
ax[2].set(xlabel="inner step", ylabel="perplexity", title="routed val. perplexity, all tokens")
plt.tight_layout()
plt.show()
print(f"{len(records)} records in metrics.jsonl; curves of:", ", ".join(curves))""",
  ),
  ("md", "## Routed perplexity (once per sequence, every W tokens, oracles)"),
  (
    "code",
    """# `python -m dipaco_jax.evaluate` saves the re-routers it fits (per checkpoint step).
todo = evaluate.rerouters_to_fit(run, config.eval.rerouters)
where = evaluate.rerouter_dir(WORKDIR, run.step)
if todo:
  print(f"no saved {', '.join(todo)} re-router for step {run.step}: fitting it now, saved to "
        f"{where} (the linear one takes under a minute for the tiny run on a 2-core CPU, the "
        "transformer one minutes; the bars below show the ETA)")
elif config.eval.rerouters and topo.num_paths > 1:
  print(f"loading the saved re-routers ({', '.join(config.eval.rerouters)}) from {where}")
start = time.perf_counter()
# per_sequence: keep every path's loss on every sequence (the specialisation report reads them).
rep = evaluate.evaluate(run, max_docs=MAX_DOCS or None, per_sequence=True)
print(f"evaluated {rep['num_sequences']} sequences in {time.perf_counter() - start:.0f} s")
display(Markdown(evaluate.to_markdown(rep)))""",
  ),
  (
    "code",
    """fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
path_ppl = np.exp(rep["per_path"]["loss"])
ax[0].bar(PATHS, path_ppl, color="tab:blue", label="routed sequences, their path")
once = rep["ppl"]["once"]
ax[0].axhline(once, color="k", ls="--", label=f"routed, all: {once:.1f}")
ax[0].set(xlabel="path", ylabel="perplexity", title="per-path perplexity (prefix excluded)")
ax[0].legend(fontsize=8)
own = np.exp(rep["own_shard"]["loss"])
ax[1].bar(WORKERS[: len(own)], own, color="tab:orange")
ax[1].set(xlabel="worker", ylabel="perplexity", title="each worker on its own validation shard")
for a in ax:
  a.tick_params(axis="x", labelrotation=30)
plt.tight_layout()
plt.show()""",
  ),
  ("md", "## Re-routing every W tokens"),
  (
    "code",
    """ws = rep["windows"]
plt.figure(figsize=(6.5, 3.8))
for kind in rep["rerouters"]:
  plt.plot(ws, [rep["ppl"][f"{kind}/W={w}"] for w in ws], "o-", label=f"{kind} re-router")
if "oracle/once" in rep["ppl"]:
  plt.plot(ws, [rep["ppl"][f"oracle/W={w}"] for w in ws], "s:", c="gray", label="oracle per chunk")
plt.axhline(rep["ppl"]["once"], color="k", ls="--", label="once per sequence")
plt.xscale("log", base=2)
plt.xticks(ws, [str(w) for w in ws])
plt.xlabel("W (tokens between routing decisions)")
plt.ylabel("perplexity")
plt.legend(fontsize=8)
plt.title("re-routing curve")
plt.show()""",
  ),
  ("md", "## Shard sizes and domains (the domains never train anything)"),
  (
    "code",
    """sizes = run.shard_set.sizes("train")
docs = run.shard_set.num_docs("train")
fig, ax = plt.subplots(1, 2, figsize=(12, 3.6))
ax[0].bar(WORKERS[: len(sizes)], sizes)
ax[0].set(xlabel="worker", ylabel="tokens", title="train shard sizes (tokens)")
ax[1].bar(WORKERS[: len(docs)], docs, color="tab:green")
ax[1].set(xlabel="worker", ylabel="documents", title="train shard sizes (documents)")
for a in ax:
  a.tick_params(axis="x", labelrotation=30)
plt.tight_layout()
plt.show()""",
  ),
  (
    "code",
    """dom = evaluate.domain_report(rep, P)
display(Markdown(router_report.to_markdown(dom)))
share = dom.confusion / np.maximum(dom.confusion.sum(1, keepdims=True), 1)
plt.figure(figsize=(1.1 * len(dom.domain_names) + 2, 0.45 * P + 1.5))
plt.imshow(share, cmap="viridis", aspect="auto", vmin=0, vmax=1)
plt.colorbar(label="share of the path's sequences")
plt.xticks(range(len(dom.domain_names)), dom.domain_names, rotation=45, ha="right")
plt.yticks(range(P), PATHS)
plt.ylabel("path")
plt.title(f"validation: path x domain (purity {dom.purity:.3f}, NMI {dom.nmi:.3f})")
plt.show()""",
  ),
  (
    "md",
    """## Specialisation: every path on every path's held-out documents

Row p, column q: path p's loss on the validation documents of path q's shard. A specialised grid
has its diagonal below each row's mean. The heat map takes out each path's overall quality and
each shard's difficulty (row and column means): specialisation is a blue diagonal; with i.i.d.
shards no pattern beyond noise. See `docs/routing.md` (reading the specialisation report).""",
  ),
  (
    "code",
    """spec = evaluate.specialisation(run, rep)  # From the scores above: nothing is scored again.
display(Markdown(specialisation.to_markdown(spec, PATHS)))
grid = spec.centred_matrix
lim = max(float(np.nanmax(np.abs(grid))), 1e-6)
plt.figure(figsize=(0.9 * P + 3, 0.7 * P + 2))
plt.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim)
plt.colorbar(label="loss less row and column means")
plt.xticks(range(P), PATHS, rotation=45, ha="right")
plt.yticks(range(P), PATHS)
plt.xlabel("shard (held-out documents of path)")
plt.ylabel("path")
plt.title(f"specialisation (diagonal - off-diagonal: {spec.diagonal_gap:+.4f})")
plt.show()""",
  ),
  ("md", "## Per-path early stopping"),
  (
    "code",
    """meta = early_stopping.read_meta(WORKDIR)
if meta is None:
  print("no early-stopping set in this run (config.early_stopping.enabled=False)")
else:
  best = evaluate.evaluate(run, params="best", windows=(), oracle=False,
                             max_docs=MAX_DOCS or None)
  print("best step per worker:", meta["step"])
  print(f"routed ppl, once per sequence: final {rep['ppl']['once']:.3f}, "
        f"per-path early stopping {best['ppl']['once']:.3f}")""",
  ),
  (
    "md",
    """## Export a path to Hugging Face and load it with `transformers`

`python -m dipaco_jax.export` writes paths as Llama checkpoints (`config.json`,
`model.safetensors`, the SentencePiece tokenizer), the router beside them and a README on routing
an input. A run with Llama's architecture exports (RMSNorm, RoPE, SwiGLU); a GELU run is
refused in one line. `transformers` (Colab has it; locally the `hf` extra) then loads path 0,
and its logits on a text are the JAX path's.""",
  ),
  (
    "code",
    """out = os.path.join(EXPORT_DIR, f"step_{run.step}")
cmd = ["-m", "dipaco_jax.export", f"--workdir={WORKDIR}", "--path=0", f"--out={out}"]
if os.path.exists(os.path.join(out, "README.md")):
  print(f"{out} holds this step's export: loading it")
else:
  print("exporting: python", " ".join(cmd), flush=True)
  done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
  print((done.stdout + done.stderr).strip())
if os.path.exists(os.path.join(out, "README.md")):
  import torch
  import transformers

  from dipaco_jax.core import model as model_lib
  from dipaco_jax.core import path_params

  model = transformers.LlamaForCausalLM.from_pretrained(f"{out}/path_0", dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(f"{out}/path_0")
  ids = tok("It is a truth universally acknowledged, that", return_tensors="pt")["input_ids"]
  with torch.no_grad():
    theirs = model.eval()(ids).logits[0].numpy()
  params, _ = path_params.load(WORKDIR, config, 0)
  apply = model_lib.Transformer(run.exp.model_cfg).apply
  ours = np.asarray(apply({"params": params}, ids.numpy()))[0]
  print(f"transformers' LlamaForCausalLM logits vs the JAX path's: max |difference| "
        f"{np.abs(theirs - ours).max():.1e} over {theirs.size} logits")
  new = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
  print("transformers continues the text with:", repr(tok.decode(new)))""",
  ),
]


def build() -> nbformat.NotebookNode:
  """The notebook's cells, without outputs."""
  nb = v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["colab"] = {"provenance": []}  # Colab opens it as a notebook of its own.
  for kind, src in CELLS:
    nb.cells.append(v4.new_markdown_cell(src) if kind == "md" else v4.new_code_cell(src))
  for cell in nb.cells:
    if cell.source.startswith("#@title Parameters"):  # Papermill's and CI's parameters.
      cell.metadata["tags"] = ["parameters"]
  for i, cell in enumerate(nb.cells):  # Stable ids: regenerating changes nothing.
    cell.id = f"cell-{i}"
  return nb


def execute(nb: nbformat.NotebookNode, workdir: str, timeout_s: int) -> None:
  """Runs `nb` in a fresh Jupyter kernel on the run in `workdir` (as CI does); stderr is dropped.

  The kernel's working directory is a temporary folder outside the clone, as on Colab; it
  imports the dipaco_jax this script's clone holds (PYTHONPATH). An empty `workdir` is trained
  by the notebook's training cell. The kept outputs are stdout, markdown and PNG figures;
  stderr (progress lines, library warnings) differs from machine to machine and is not
  committed.
  """
  import nbclient  # pylint: disable=g-import-not-at-top

  os.environ["DIPACO_NB_WORKDIR"] = workdir
  os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as cwd:
    nbclient.NotebookClient(
      nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": cwd}}
    ).execute()
  for cell in nb.cells:
    if cell.cell_type == "code":
      cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
      cell.metadata.pop("execution", None)  # Timestamps: noise in a diff.
  print(f"executed in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--execute", action="store_true", help="Run it and keep the outputs.")
  parser.add_argument("--workdir", help="The trained (and evaluated) run --execute reads.")
  parser.add_argument("--timeout_s", type=int, default=900, help="Per cell, with --execute.")
  parser.add_argument("--out", default=NOTEBOOK, help="Where to write the notebook.")
  args = parser.parse_args()
  if args.execute and not args.workdir:
    parser.error("--execute needs --workdir=DIR, a trained run (configs/tiny.py) to run it on.")
  nb = build()
  if args.execute:
    execute(nb, args.workdir, args.timeout_s)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  nbformat.write(nb, args.out)
  print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e3:.0f} kB)", file=sys.stderr)


if __name__ == "__main__":
  main()
