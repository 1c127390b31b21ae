"""notebooks/evaluate.ipynb: the tool's cells, the tiny run's outputs; it runs on a new run."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import nbclient
import nbformat
import pytest

import helpers

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
    "holds a run (config.json): evaluating it, no training",  # Made from a trained run.
    "loading the saved re-routers (linear)",
    "| once |",
    "| linear/W=16 |",
    "purity",
    "| own - other paths |",
    "transformers' LlamaForCausalLM logits vs the JAX path's: max |difference| ",
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
  params = _code(nb, "#@title Parameters")
  assert f'REPO_URL = "{make.REPO_URL}"  #@param {{type:"string"}}' in params
  for name in ("WORKDIR", "CONFIG", "TRAIN_OVERRIDES", "OVERRIDES"):
    assert f'{name} = "' in params and f'os.environ.get("DIPACO_NB_{name}", ' in params, name
  assert ["parameters"] == [t for c in nb.cells for t in c.metadata.get("tags", [])]
  assert make.REPO_URL not in "".join(c.source for c in nb.cells[2:])  # Stated once.


def test_the_parameters_cell_is_a_colab_form_the_environment_overrides(monkeypatch):
  params = _code(make.build(), "#@title Parameters")
  form = {}
  exec(params, form)
  assert (form["WORKDIR"], form["CONFIG"], form["TRAIN_OVERRIDES"]) == (
    "/tmp/dipaco_tiny",
    "configs/tiny.py",
    {"model.mlp": "swiglu"},  # Llama's MLP: the export cell can write the run.
  )
  monkeypatch.setenv("DIPACO_NB_WORKDIR", "/content/run")
  monkeypatch.setenv("DIPACO_NB_TRAIN_OVERRIDES", '{"dipaco.outer_steps": 2}')
  monkeypatch.setenv("DIPACO_NB_MAX_DOCS", "40")
  env = {}
  exec(params, env)
  assert (env["WORKDIR"], env["TRAIN_OVERRIDES"], env["MAX_DOCS"]) == (
    "/content/run",
    {"dipaco.outer_steps": 2},
    40,
  )


def test_the_install_cell_installs_only_where_dipaco_jax_is_missing(monkeypatch, capsys):
  install = _code(make.build(), "# Installs dipaco_jax")
  fork = "https://github.com/someone/dipaco_jax"
  calls = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
  exec(install, {"REPO_URL": fork})  # Importable (CI, a local Jupyter): nothing runs.
  assert calls == [] and "importable" in capsys.readouterr().out

  def pip(cmd, **kw):  # A fresh Colab runtime: pip makes it importable.
    calls.append(cmd)
    monkeypatch.delitem(sys.modules, "dipaco_jax")

  monkeypatch.setattr(subprocess, "run", pip)
  monkeypatch.setitem(sys.modules, "dipaco_jax", None)  # import dipaco_jax -> ImportError
  exec(install, {"REPO_URL": fork})
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", f"git+{fork}"]]
  monkeypatch.setitem(sys.modules, "dipaco_jax", None)
  with pytest.raises(ValueError, match="is a placeholder"):
    exec(install, {"REPO_URL": "https://github.com/ORG/dipaco_jax"})
  monkeypatch.setattr(sys, "version_info", (3, 10, 12))
  with pytest.raises(RuntimeError, match="needs Python >= 3.11"):
    exec(install, {"REPO_URL": fork})
  assert len(calls) == 1


def test_the_training_cell_trains_only_an_empty_workdir(monkeypatch, tmp_path, capsys):
  train_cell = _code(make.build(), "# Training, only when WORKDIR")
  started = []

  class Popen:  # The trainer's process: two lines, then exit status 0.
    def __init__(self, cmd, **kw):
      started.append(cmd)
      self.stdout, self.returncode = iter(["line 1\n", "line 2\n"]), 0

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

  monkeypatch.setattr(subprocess, "Popen", Popen)
  overrides = {"dipaco.outer_steps": 2, "eval.rerouting_windows": [4, 8]}
  env = {"subprocess": subprocess, "sys": sys, "TRAIN_OVERRIDES": overrides}
  exec(train_cell, {**env, "WORKDIR": str(tmp_path), "CONFIG": "configs/tiny.py"})
  assert started == [
    [
      sys.executable,
      "-m",
      "dipaco_jax.main",
      "--config=configs/tiny.py",
      f"--workdir={tmp_path}",
      "--config.dipaco.outer_steps=2",
      "--config.eval.rerouting_windows=(4, 8)",
    ]
  ]
  assert "line 1\nline 2\ntrained " in capsys.readouterr().out
  (tmp_path / "config.json").write_text("{}")
  exec(train_cell, {**env, "WORKDIR": str(tmp_path), "CONFIG": "configs/tiny.py"})
  assert len(started) == 1 and "no training" in capsys.readouterr().out


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


# A fresh kernel outside the clone trains a short routed run into an empty WORKDIR (the
# notebook's training cell), then evaluates it: minutes, outside the fast suite (-m "not slow").
# Colab's default trains configs/tiny.py for minutes; this run's overrides make it seconds.
SHORT_RUN = {
  "model.mlp": "swiglu",  # Llama's MLP: the export cell writes path 0 and reloads it.
  "model.d_model": 32,
  "model.num_heads": 2,
  "model.head_dim": 16,
  "data.seq_len": 16,
  "data.batch_size": 2,
  "data.subsample": 16,
  "inner.warmup_steps": 2,
  "dipaco.inner_steps": 2,
  "dipaco.outer_steps": 2,
  "ckpt.every_steps": 2,
  "eval.every_steps": 2,
  "eval.batches": 1,
  "eval.seq_len": 32,
  "eval.rerouting_windows": [4, 8],
  "routing.router": "kmeans",
  "routing.prefix_len": 8,
  "routing.kmeans_restarts": 2,
  "routing.kmeans_iters": 20,
}


@pytest.mark.cli
@pytest.mark.slow
def test_evaluate_notebook_trains_and_evaluates_from_a_fresh_kernel_outside_the_clone(
  tmp_path, monkeypatch
):
  workdir = tmp_path / "run"  # Empty: the notebook trains it.
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.setenv("DIPACO_NB_WORKDIR", str(workdir))
  monkeypatch.setenv("DIPACO_NB_TRAIN_OVERRIDES", json.dumps(SHORT_RUN))
  monkeypatch.setenv("DIPACO_NB_MAX_DOCS", "60")
  monkeypatch.setenv("DIPACO_NB_EXPORT_DIR", str(tmp_path / "hf"))
  # The kernel imports this checkout's dipaco_jax (where the installed one is another tree),
  # nothing else from it: its working directory is outside the clone.
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join(filter(None, [helpers.ROOT, os.environ.get("PYTHONPATH")]))
  )
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(
    nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
  ).execute()
  assert (workdir / "config.json").exists() and list(cwd.iterdir()) == []
  outputs = _outputs(nb)
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  # curves, per-path, re-routing curve, shard sizes, domain table, specialisation grid
  assert len(images) >= 6
  shown = _shown(outputs)
  for line in (
    "dipaco_jax is importable",  # The install cell did not install.
    "training: python -m dipaco_jax.main --config=configs/tiny.py --workdir=",
    f"trained {workdir} in ",
    "| step 4 | routing phase 0",
    "curves of: train_loss, val_loss, val_perplexity_routed_all_tokens, outer_delta_norm",
    "no saved linear re-router for step 4: fitting it now",
    "purity",
    "| own - other paths |",
    "per-path early stopping",
    "exporting: python -m dipaco_jax.export --workdir=",
    "wrote 1 path(s) of step 4 as Llama checkpoints to ",
  ):
    assert line in shown, line
  diff = re.search(
    r"transformers' LlamaForCausalLM logits vs the JAX path's: max \|difference\| (\S+)", shown
  )
  assert diff and float(diff[1]) < 1e-4, shown  # float32 both sides.
  # The evaluation's numbers: routed perplexity once per sequence, re-routed, oracle.
  for row in ("once", "linear/W=4", "oracle/W=8"):
    assert re.search(rf"^\| {re.escape(row)} \| \d+\.\d+ \| \d+\.\d+ \|", shown, re.M), row
