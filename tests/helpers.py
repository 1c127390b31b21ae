"""Shared test helpers: a tiny config and synthetic packed batches."""

import contextlib
import os
import subprocess
import sys

import jax
import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors as tb_errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

from dipaco_jax import config_check
from dipaco_jax import data as data_lib
from dipaco_jax import serve
from dipaco_jax.config import micro
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import paths
from dipaco_jax.io import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A seconds-long run of the tiny config (the shipped tokenizer), checkpointed every 2 steps: the
# flags after --config=configs/tiny.py of the tests that run the CLI.
SMALL_RUN = (
  "--config.model.d_model=32",
  "--config.model.num_heads=2",
  "--config.model.head_dim=16",
  "--config.data.seq_len=16",
  "--config.data.batch_size=2",
  "--config.inner.warmup_steps=2",
  "--config.dipaco.inner_steps=2",
  "--config.dipaco.outer_steps=3",
  "--config.ckpt.every_steps=2",
  "--config.eval.every_steps=2",
  "--config.eval.batches=1",
)


def train_tiny(workdir, *flags) -> None:
  """The README's main command (configs/tiny.py) into `workdir`, with `flags` added."""
  subprocess.run(
    [
      sys.executable,
      "-m",
      "dipaco_jax.main",
      "--config=configs/tiny.py",
      f"--workdir={workdir}",
      *flags,
    ],
    cwd=ROOT,
    check=True,
    capture_output=True,
  )


def train_small_run(workdir, *flags) -> None:
  """configs/tiny.py at SMALL_RUN's sizes on a sixteenth of the corpus, as a user runs it."""
  train_tiny(workdir, *SMALL_RUN, "--config.data.subsample=16", *flags)


def micro_config(**overrides):
  """configs/tiny.py shrunk to a seconds-long model (config/micro.py's, vocab 256)."""
  base = micro.overrides(**{"model.vocab_size": 256, "ckpt.async_save": False})
  base.update(overrides)
  return config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **base)


def elastic_config(**overrides):
  """micro_config in elastic mode (the shipped tokenizer's vocabulary, no early stopping)."""
  over = {"model.vocab_size": 8192, "early_stopping.enabled": False, "dipaco.mode": "elastic"}
  return micro_config(**{**over, **overrides})


def synthetic_batch(rng: np.random.Generator, W: int, B: int, T: int, V: int):
  """Random tokens, one segment per row, in the trainer's batch layout."""
  return data_lib.synthetic_batch(rng, W, B, T, V)


def path_params(store, topo, path: int):
  """Params of one path (no leading axis): its first worker's row of the assembled params."""
  worker = int(np.flatnonzero(topo.path_of_worker == path)[0])
  return jax.tree.map(lambda x: x[worker], paths.assemble(store, topo))


def tree_bytes(root) -> dict[str, bytes]:
  """Every file under root (relative path -> contents): to show nothing was changed."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def truncate(path, keep: float = 0.5) -> None:
  """Cuts a file to `keep` of its size, as a crash or a full disk would."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(int(size * keep))


@contextlib.contextmanager
def compile_cache(directory: str):
  """A persistent compilation cache, so runs of one config in one test compile once."""
  cache = {
    "jax_compilation_cache_dir": str(directory),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  old = {k: getattr(jax.config, k) for k in cache}
  for k, v in cache.items():
    jax.config.update(k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      jax.config.update(k, v)


def model_config(**fields) -> model_lib.ModelConfig:
  """A ModelConfig of base()'s model section with `fields` changed."""
  return model_lib.ModelConfig(**fields)  # Its declared defaults; a bad value raises.


def events(logdir) -> list:
  """Every Event of logdir's event files, in file-name order, read by TensorBoard's reader."""
  out = []
  for name in sorted(os.listdir(logdir)):
    if "tfevents" not in name:
      continue
    reader = pywrap_tensorflow.PyRecordReader_New(os.path.join(logdir, name))
    while True:
      try:
        reader.GetNext()
      except tb_errors.OutOfRangeError:
        break
      out.append(event_pb2.Event.FromString(reader.record()))
  return out


def checkpoint_reads(cfg, exp, workdir, path: int):
  """Every reader of a checkpoint: the trainer's resume (and evaluation's), serving, init_from."""

  def resume():  # evaluate.load_run and its best set read through the same two calls.
    ck = checkpoint.Checkpointer(workdir, async_save=False)
    try:
      state, data = ck.restore(exp.abstract_state)
      best = ck.restore_best(exp.abstract_state.params)
    finally:
      ck.close()
    return {"state": state, "data": data, "best": best[0], "records": best[1]}

  return {
    "resume": resume,
    "serve_store": lambda: serve.load_path_params(workdir, cfg, path)[0],
    "serve_best": lambda: serve.load_path_params(workdir, cfg, path, source="best")[0],
    "serve_phase": lambda: checkpoint.read_data_state(workdir, 4),
    "init_from": lambda: checkpoint.restore_worker_params(workdir, worker=path),
  }
