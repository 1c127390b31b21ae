"""Writes notebooks/evaluate.ipynb (run it after editing the cells below)."""

import os

import nbformat
from nbformat import v4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = [
  (
    "md",
    """# Evaluate a dipaco_jax run

Loads a run's latest checkpoint, routes the validation set by each sequence's prefix, and shows
routed perplexity (prefix excluded), per-path losses, perplexity when re-routing every W tokens,
shard sizes, and how the learned shards line up with the document domains.

**Colab**: `!git clone <this repo> && cd dipaco_jax && pip install -q -e .`, train a run
(`!python -m dipaco_jax.main --config=configs/tiny.py --workdir=/content/run`), then set `WORKDIR`
below. Same numbers as `python -m dipaco_jax.evaluate` (see `docs/routing.md`).""",
  ),
  (
    "code",
    """# Parameters (CI sets them through the environment).
import json
import os

WORKDIR = os.environ.get("DIPACO_NB_WORKDIR", "/tmp/dipaco_tiny")  # A dipaco_jax run directory.
MAX_DOCS = int(os.environ.get("DIPACO_NB_MAX_DOCS", "0"))  # Validation docs (0 = all).
# e.g. {"routing.prefix_len": 32}
OVERRIDES = json.loads(os.environ.get("DIPACO_NB_OVERRIDES", "{}"))""",
  ),
  (
    "code",
    """import jax
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from dipaco_jax import config_check, early_stopping, evaluation
from dipaco_jax.routing import report as router_report

config = evaluation.config_from_workdir(WORKDIR)
for key, value in OVERRIDES.items():
  config_check.check_name(key)  # A misspelt field is an error, as on the command line.
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = tuple(value) if isinstance(value, list) else value
# Before any backend starts (as dipaco_jax.main); GPU/TPU runtimes are unaffected.
if config.mesh.cpu_devices and "device_count" not in os.environ.get("XLA_FLAGS", ""):
  jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
run = evaluation.load_run(config, WORKDIR)
topo = run.exp.topo
print(topo.describe(), f"| step {run.step} | routing phase {run.phase}")""",
  ),
  ("md", "## Routed perplexity (once per sequence, every W tokens, oracles)"),
  (
    "code",
    """rep = evaluation.evaluate(run, max_docs=MAX_DOCS or None)
display(Markdown(evaluation.to_markdown(rep)))""",
  ),
  (
    "code",
    """P = topo.num_paths
fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
path_ppl = np.exp(rep["per_path"]["loss"])
ax[0].bar(range(P), path_ppl, color="tab:blue", label="routed sequences, their path")
once = rep["ppl"]["once"]
ax[0].axhline(once, color="k", ls="--", label=f"routed, all: {once:.1f}")
ax[0].set(xlabel="path", ylabel="perplexity", title="per-path perplexity (prefix excluded)")
ax[0].legend(fontsize=8)
own = np.exp(rep["own_shard"]["loss"])
ax[1].bar(range(len(own)), own, color="tab:orange")
ax[1].set(xlabel="worker", ylabel="perplexity", title="each worker on its own validation shard")
plt.tight_layout()
plt.show()""",
  ),
  ("md", "## Re-routing every W tokens"),
  (
    "code",
    """ws = rep["windows"]
plt.figure(figsize=(6, 3.5))
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
fig, ax = plt.subplots(1, 2, figsize=(11, 3.2))
ax[0].bar(range(len(sizes)), sizes)
ax[0].set(xlabel="worker", ylabel="tokens", title="train shard sizes (tokens)")
ax[1].bar(range(len(docs)), docs, color="tab:green")
ax[1].set(xlabel="worker", ylabel="documents", title="train shard sizes (documents)")
plt.tight_layout()
plt.show()""",
  ),
  (
    "code",
    """dom = evaluation.domain_report(rep, P)
display(Markdown(router_report.to_markdown(dom)))
share = dom.confusion / np.maximum(dom.confusion.sum(1, keepdims=True), 1)
plt.figure(figsize=(1.1 * len(dom.domain_names) + 2, 0.45 * P + 1.5))
plt.imshow(share, cmap="viridis", aspect="auto", vmin=0, vmax=1)
plt.colorbar(label="share of the path's sequences")
plt.xticks(range(len(dom.domain_names)), dom.domain_names, rotation=45, ha="right")
plt.yticks(range(P), [topo.path_label(p) for p in range(P)])
plt.ylabel("path")
plt.title(f"validation: path x domain (purity {dom.purity:.3f}, NMI {dom.nmi:.3f})")
plt.show()""",
  ),
  ("md", "## Per-path early stopping"),
  (
    "code",
    """meta = early_stopping.read_meta(WORKDIR)
if meta is None:
  print("no early-stopping set in this run (config.early_stopping.enabled=False)")
else:
  best = evaluation.evaluate(run, params="best", windows=(), oracle=False,
                             max_docs=MAX_DOCS or None)
  print("best step per worker:", meta["step"])
  print(f"routed ppl, once per sequence: final {rep['ppl']['once']:.3f}, "
        f"per-path early stopping {best['ppl']['once']:.3f}")""",
  ),
]


def main():
  nb = v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  for kind, src in CELLS:
    nb.cells.append(v4.new_markdown_cell(src) if kind == "md" else v4.new_code_cell(src))
  nb.cells[1].metadata["tags"] = ["parameters"]
  os.makedirs(os.path.join(ROOT, "notebooks"), exist_ok=True)
  nbformat.write(nb, os.path.join(ROOT, "notebooks", "evaluate.ipynb"))


if __name__ == "__main__":
  main()
