"""notebooks/evaluate.ipynb runs top to bottom on a tiny checkpoint made here (CPU)."""

import os

import nbclient
import nbformat
import pytest

from dipaco_jax import evaluation
from dipaco_jax import train
from dipaco_jax.routing import features
from dipaco_jax.routing import scoring

import helpers
import routing_testlib

NOTEBOOK = os.path.join(helpers.ROOT, "notebooks", "evaluate.ipynb")

# Trains a routed model, then runs the notebook in a Jupyter kernel: minutes, outside the fast
# suite (-m "not slow").
pytestmark = pytest.mark.slow


def test_evaluate_notebook_executes(tmp_path, monkeypatch):
  routing_testlib.small_corpus(monkeypatch, 120)
  workdir = str(tmp_path / "run")
  cfg = routing_testlib.routed_config(
    **{
      "routing.router": "kmeans",
      "dipaco.inner_steps": 2,
      "dipaco.outer_steps": 2,
      "eval.rerouters": ("linear",),
    }
  )
  train.train_and_evaluate(cfg, workdir)
  # Fit the re-router here, on this small router split (the kernel reads the real corpus).
  run = evaluation.load_run(cfg, workdir)
  scorer = scoring.PathScorer.from_store(run.exp, run.state.store, seq_len=32)
  evaluation.fit_rerouters(run, scorer, features.extractor_from_config(cfg), kinds=("linear",))
  monkeypatch.setenv("DIPACO_NB_WORKDIR", workdir)
  monkeypatch.setenv("DIPACO_NB_MAX_DOCS", "0")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(
    nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": helpers.ROOT}}
  ).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 4  # per-path, re-routing curve, shard sizes, domain table
  shown = "".join(o.get("data", {}).get("text/markdown", "") + o.get("text", "") for o in outputs)
  for line in ("| once |", "| linear/W=4 |", "| oracle/W=8 |", "purity", "per-path early stopping"):
    assert line in shown, line
