"""notebooks/evaluate.ipynb: the tool's cells, the tiny run's outputs; it runs on a new run."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import nbclient
import nbformat
import pytest

from dipaco_jax import evaluate
from dipaco_jax import train
from dipaco_jax.routing import features
from dipaco_jax.routing import scoring

import helpers
import routing_testlib

NOTEBOOK = os.path.join(helpers.ROOT, "notebooks", "evaluate.ipynb")
_spec = importlib.util.spec_from_file_location(
  "make_evaluate_notebook", os.path.join(helpers.ROOT, "tools", "make_evaluate_notebook.py")
)
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def _outputs(nb) -> list:
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _shown(outputs) -> str:
  return "".join(o.get("data", {}).get("text/markdown", "") + o.get("text", "") for o in outputs)


def _code(nb, first_line: str) -> str:
  (src,) = [c.source for c in nb.cells if c.source.startswith(first_line)]
  return src


def test_the_committed_notebook_is_the_tools_cells_with_the_tiny_runs_outputs():
  committed = nbformat.read(NOTEBOOK, as_version=4)
  fix = "regenerate it: python tools/make_evaluate_notebook.py --execute --workdir=DIR"
  assert [(c.cell_type, c.source) for c in committed.cells] == [
    (c.cell_type, c.source) for c in make.build().cells
  ], fix
  assert os.path.getsize(NOTEBOOK) < 1_500_000
  code = [c for c in committed.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), fix  # Every cell ran, in order.
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
  outputs = _outputs(committed)
  assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
  assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 6
  shown = _shown(outputs)
  for line in (
    "loading the saved re-routers (linear)",
    "| once |",
    "| linear/W=16 |",
    "purity",
    "| own - other paths |",
  ):
    assert line in shown, line
  assert helpers.ROOT not in json.dumps(committed)  # No path of the checkout that made it.


def test_the_badge_and_the_install_cell_use_repo_url():
  nb = make.build()
  repo = make.REPO_URL.removeprefix("https://github.com/")
  colab = f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/evaluate.ipynb"
  assert (
    f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab})"
    in (nb.cells[0].source)
  )
  assert "set `REPO_URL` if you use a fork" in nb.cells[0].source
  assert f'REPO_URL = "{make.REPO_URL}"' in nb.cells[1].source
  assert ["parameters"] == [t for c in nb.cells for t in c.metadata.get("tags", [])]


def test_the_install_cell_installs_only_where_dipaco_jax_is_missing(monkeypatch, capsys):
  install = _code(make.build(), "# Installs dipaco_jax")
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
  exec(install, {})  # Importable (CI, a local Jupyter): nothing runs.
  assert calls == [] and "importable" in capsys.readouterr().out

  def pip(cmd, **kw):  # A fresh Colab runtime: pip makes it importable.
    calls.append(cmd)
    monkeypatch.delitem(sys.modules, "dipaco_jax")

  monkeypatch.setattr(subprocess, "run", pip)
  monkeypatch.setitem(sys.modules, "dipaco_jax", None)  # import dipaco_jax -> ImportError
  exec(install, {})
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", f"git+{make.REPO_URL}"]]
  monkeypatch.setitem(sys.modules, "dipaco_jax", None)
  monkeypatch.setattr(sys, "version_info", (3, 10, 12))
  with pytest.raises(RuntimeError, match="needs Python >= 3.11"):
    exec(install, {})
  assert len(calls) == 1


def test_colab_signs_in_only_for_a_gs_workdir(monkeypatch):
  auth_cell = _code(make.build(), "# A gs:// run")
  signed = []
  colab = types.ModuleType("google.colab")
  colab.auth = types.SimpleNamespace(authenticate_user=lambda: signed.append(True))
  for workdir, in_colab, want in [
    ("gs://b/run", True, 1),
    ("/content/tiny", True, 0),
    ("gs://b/run", False, 0),  # Local Jupyter: gcloud's own credentials.
  ]:
    signed.clear()
    if in_colab:
      monkeypatch.setitem(sys.modules, "google.colab", colab)
    else:
      monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(auth_cell, {"sys": sys, "WORKDIR": workdir})
    assert len(signed) == want, (workdir, in_colab)


# Trains a routed model, then runs the notebook in a Jupyter kernel: minutes, outside the fast
# suite (-m "not slow").
@pytest.mark.slow
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
  # Fit the re-router here, on this small router split, as `python -m dipaco_jax.evaluate`
  # would: the notebook loads it (its kernel would read the whole corpus).
  run = evaluate.load_run(cfg, workdir)
  scorer = scoring.PathScorer.from_store(run.exp, run.state.store, seq_len=32)
  evaluate.fit_rerouters(run, scorer, features.extractor_from_config(cfg), kinds=("linear",))
  monkeypatch.setenv("DIPACO_NB_WORKDIR", workdir)
  monkeypatch.setenv("DIPACO_NB_MAX_DOCS", "0")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(
    nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": helpers.ROOT}}
  ).execute()
  outputs = _outputs(nb)
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  # curves, per-path, re-routing curve, shard sizes, domain table, specialisation grid
  assert len(images) >= 6
  shown = _shown(outputs)
  for line in (
    "dipaco_jax is importable",  # The install cell did not install.
    "curves of: train_loss, val_loss, val_perplexity_routed_all_tokens, outer_delta_norm",
    "loading the saved re-routers (linear)",  # Not refitted.
    "| once |",
    "| linear/W=4 |",
    "| oracle/W=8 |",
    "purity",
    "| own - other paths |",
    "per-path early stopping",
  ):
    assert line in shown, line
