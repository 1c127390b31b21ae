"""Export to Hugging Face Llama: transformers' logits equal the JAX path's; the router beside it."""

import functools
import itertools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from etils import epath

from dipaco_jax import errors
from dipaco_jax import export
from dipaco_jax import saved_config
from dipaco_jax import serve
from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import path_params
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab
from dipaco_jax.io import checkpoint
from dipaco_jax.io import hf_llama
from dipaco_jax.routing import portable

import helpers

SP = vocab.load(vocab.DEFAULT_VOCAB_PATH)
SP_PROTO = epath.Path(vocab.DEFAULT_VOCAB_PATH).read_bytes()
T = 64  # Tokens per scored sequence: [BOS, the document's first 63 pieces].


@functools.cache
def texts(split: str, n: int) -> tuple[str, ...]:
  """The first n documents' text of an embedded-corpus split (read once: the file is xz)."""
  return tuple(r["text"] for r in itertools.islice(corpus.read_records(split), n))


def corpus_inputs(n: int = 3) -> np.ndarray:
  """[n, T] model inputs from the embedded corpus' validation text, as training reads it."""
  return np.array(
    [[vocab.PAD_ID] + SP.encode(t)[: T - 1] for t in texts("validation", n)], np.int32
  )


def jax_logits(params, cfg: sections.ModelConfig, inputs_NxT) -> np.ndarray:
  return np.asarray(model_lib.Transformer(cfg).apply({"params": params}, inputs_NxT))


def hf_logits(folder: str, inputs_NxT) -> np.ndarray:
  model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor(inputs_NxT, dtype=torch.long)).logits.numpy()


def perturbed(params, seed: int):
  """Every leaf moved by N(0, 0.1²) noise: norm scales leave 1, each tensor's place shows."""
  leaves, tree = jax.tree.flatten(jax.device_get(params))
  rng = np.random.default_rng(seed)
  return tree.unflatten(
    [np.asarray(x, np.float32) + rng.normal(0, 0.1, x.shape).astype(np.float32) for x in leaves]
  )


# d_model 48 (3 heads of 16): the tied head's d^-0.5 is no power of two; 64 (4 x 16): it is.
CASES = [
  dict(d_model=48, num_heads=3, tie_embeddings=True, attention_kernels="heads"),
  dict(d_model=48, num_heads=3, tie_embeddings=False, attention_kernels="matrix"),
  dict(d_model=64, num_heads=4, tie_embeddings=True, attention_kernels="matrix"),
  dict(d_model=64, num_heads=4, tie_embeddings=False, attention_kernels="heads"),
]


def model_cfg(**fields) -> sections.ModelConfig:
  base = dict(vocab_size=SP.vocab_size(), num_layers=2, head_dim=16, mlp="swiglu", mlp_ratio=8 / 3)
  return sections.ModelConfig(**{**base, **fields})


@pytest.mark.parametrize(
  "fields",
  CASES,
  ids=lambda f: f"d{f['d_model']}-tied{f['tie_embeddings']}-{f['attention_kernels']}",
)
def test_transformers_logits_match_the_jax_path(fields, tmp_path):
  cfg = model_cfg(**fields)
  params = perturbed(model_lib.init_params(cfg, jax.random.key(0)), seed=1)
  hf_llama.write(str(tmp_path), params, cfg, SP_PROTO, max_positions=T)
  inputs = corpus_inputs()
  want, got = jax_logits(params, cfg, inputs), hf_logits(str(tmp_path), inputs)
  assert got.shape == want.shape == (3, T, SP.vocab_size())
  # float32 both sides, the same products in other orders: ~1e-6 apart at logits of O(10).
  assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
  assert np.abs(want).max() > 1.0  # Not a trivially small model output.
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["tie_word_embeddings"] == fields["tie_embeddings"]
  assert config["intermediate_size"] == cfg.mlp_dim == int(fields["d_model"] * 8 / 3)


@pytest.mark.parametrize("fields", CASES[:2])
def test_tensors_round_trip_to_the_same_params(fields):
  cfg = model_cfg(**fields)
  params = perturbed(model_lib.init_params(cfg, jax.random.key(0)), seed=2)
  back = hf_llama.from_tensors(hf_llama.to_tensors(params, cfg), cfg)
  from dipaco_jax.io import theta  # pylint: disable=g-import-not-at-top

  back = theta.kernels_like(back, params)  # "matrix" kernels come back per head: reshaped.
  for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    y = dict(jax.tree_util.tree_flatten_with_path(back)[0])[kp]
    # Exact but the tied norm, scaled by 48^-0.5 and back: one float32 rounding (2^-24 rel.).
    np.testing.assert_allclose(y, x, rtol=2**-23, atol=0)


def test_the_tokenizer_files_give_the_models_inputs(tmp_path):
  cfg = model_cfg(d_model=32, num_heads=2)
  hf_llama.write(
    str(tmp_path), model_lib.init_params(cfg, jax.random.key(0)), cfg, SP_PROTO, max_positions=T
  )
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for text in texts("router", 20):  # Corpus text: newlines, runs of spaces, byte pieces.
    assert tok(text)["input_ids"] == [vocab.PAD_ID] + SP.encode(text)
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (vocab.PAD_ID, vocab.EOS_ID)


@pytest.mark.parametrize(
  "fields, named",
  [
    (dict(mlp="gelu"), "config.model.mlp='gelu'"),
    (dict(positions="learned"), "config.model.positions='learned'"),
    (dict(d_model=40, num_heads=3), "config.model.num_heads=3 does not divide"),
  ],
)
def test_a_config_llama_cannot_hold_is_refused_naming_the_field(fields, named):
  with pytest.raises(errors.ConfigError, match="^" + named.replace("(", r"\(")):
    hf_llama.check_exportable(model_cfg(**{"d_model": 32, "num_heads": 2, **fields}))


def saved_run(workdir: str, **overrides):
  """A micro run's checkpoint at step 2 and its config.json, made without training."""
  fields = {
    "model.vocab_size": SP.vocab_size(),
    "model.mlp": "swiglu",
    "dipaco.init": "independent",
  }
  cfg = helpers.micro_config(**{**fields, **overrides})
  ck = checkpoint.Checkpointer(workdir, async_save=False)
  ck.save(2, experiment.Experiment(cfg).init_state(0), {"train": {}})
  ck.close()
  saved_config.write(epath.Path(workdir), cfg)
  return cfg


def test_export_writes_the_chosen_paths_and_the_router(tmp_path):
  cfg = saved_run(str(tmp_path / "run"))
  out = str(tmp_path / "out")
  done = export.export(cfg, str(tmp_path / "run"), out, [3, 1])
  assert done["paths"] == [1, 3] and done["router"] == "random"
  assert sorted(os.listdir(out)) == ["README.md", "path_1", "path_3", "router"]
  assert sorted(os.listdir(tmp_path)) == ["out", "run"]  # The staging folder is gone.
  inputs = corpus_inputs(2)
  mcfg = sections.ModelConfig.of(cfg)
  for p in (1, 3):
    params, _ = path_params.load(str(tmp_path / "run"), cfg, p)
    got = hf_logits(f"{out}/path_{p}", inputs)
    assert np.abs(got - jax_logits(params, mcfg, inputs)).max() < 1e-4
  meta = json.loads((tmp_path / "out/router/assignment.json").read_text())
  assert meta["kind"] == "random" and list(meta["paths"]) == ["1", "3"]
  assert meta["paths"]["3"]["modules"] == [0, 1, 1]  # Path 3 of the 1x2x2 grid, row-major.
  readme = (tmp_path / "out/README.md").read_text()
  assert "holds 2 of the grid's 4 paths" in readme
  # The README's routing function picks serve's path (random: the hash of the pieces).
  ns = {}
  exec(portable.route_code(readme), ns)
  server = serve.PathServer(cfg, str(tmp_path / "run"))
  some = [t[:200] for t in texts("router", 12)]
  picks = [server.route(t) for t in some]
  assert [ns["route"](t) for t in some] == picks and len(set(picks)) > 1


def test_bad_exports_are_one_line_and_write_nothing(tmp_path):
  run = str(tmp_path / "run")
  cfg = saved_run(run)
  before = helpers.tree_bytes(tmp_path)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("mine")
  cases = [
    (lambda: export.export(cfg, run, str(tmp_path / "o1"), [4]), "--path=4 is not a path of"),
    (lambda: export.export(cfg, run, str(tmp_path / "full"), [0]), "already holds files"),
    (lambda: export.export(cfg, run, str(tmp_path / "o2"), [0], step=5), "--step=5: no checkpoint"),
    (lambda: export.export(cfg, str(tmp_path / "none"), str(tmp_path / "o3"), [0]), "no finished"),
  ]
  for call, msg in cases:
    with pytest.raises(errors.UserError, match=msg.replace("(", r"\(")):
      call()
  assert helpers.tree_bytes(tmp_path) == {**before, "full/keep.txt": b"mine"}
  assert sorted(os.listdir(tmp_path)) == ["full", "run"]


@pytest.mark.cli
def test_a_gelu_run_is_refused_in_one_line_by_the_command(tmp_path):
  run = str(tmp_path / "run")
  saved_run(run, **{"model.mlp": "gelu"})
  before = helpers.tree_bytes(tmp_path)
  r = subprocess.run(
    [sys.executable, "-m", "dipaco_jax.export", f"--workdir={run}", "--all", f"--out={tmp_path}/o"],
    capture_output=True,
    text=True,
    cwd=helpers.ROOT,
  )
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("ConfigError: config.model.mlp='gelu': a Llama checkpoint holds")
  assert helpers.tree_bytes(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["run"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A trained small run (SwiGLU, k-means router) exported whole by the command."""
  root = tmp_path_factory.mktemp("trained")
  run, out = str(root / "run"), str(root / "out")
  helpers.train_small_run(run, "--config.model.mlp=swiglu", "--config.routing.router=kmeans")
  r = subprocess.run(
    [sys.executable, "-m", "dipaco_jax.export", f"--workdir={run}", "--all", f"--out={out}"],
    capture_output=True,
    text=True,
    cwd=helpers.ROOT,
    check=True,
  )
  assert r.stdout.startswith(f"wrote 4 path(s) of step 6 as Llama checkpoints to {out}"), r.stdout
  return run, out


@pytest.mark.slow  # Trains a small run (~2 min on 2 cores) and exports it with the command.
@pytest.mark.cli
def test_a_trained_runs_paths_load_with_transformers_and_route_as_serve_does(trained):
  run, out = trained
  cfg = saved_config.load(run)
  inputs = corpus_inputs()
  for p in range(4):
    params, _ = path_params.load(run, cfg, p)
    want = jax_logits(params, sections.ModelConfig.of(cfg), inputs)
    assert np.abs(hf_logits(f"{out}/path_{p}", inputs) - want).max() < 1e-4
  assert json.loads((epath.Path(out) / "router/router.json").read_text())["kind"] == "kmeans"
  ns = {}
  exec(portable.route_code((epath.Path(out) / "README.md").read_text()), ns)
  server = serve.PathServer(cfg, run)
  some = [t[:300] for t in texts("validation", 10)]
  # The README's θ̄ features (torch) and the router's arrays pick the path serve picks (JAX).
  assert [ns["route"](t) for t in some] == [server.route(t) for t in some]


@pytest.mark.cli
def test_the_command_lists_its_flags_and_wants_one_of_path_or_all(tmp_path):
  run = lambda *a: subprocess.run(
    [sys.executable, "-m", "dipaco_jax.export", *a],
    capture_output=True,
    text=True,
    cwd=helpers.ROOT,
  )
  shown = run("--help").stdout
  for flag in ("--path", "--[no]all", "--out", "--step", "--workdir", "--config"):
    assert f"  {flag}" in shown, flag
  args = ["--config=configs/tiny.py", f"--workdir={tmp_path}", f"--out={tmp_path}/o"]
  r = run(*args, "--all", "--path=1")
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert "give --path=P (repeatable) or --all, one of the two" in r.stderr
  assert sorted(os.listdir(tmp_path)) == []
