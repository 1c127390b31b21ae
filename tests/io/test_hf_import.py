"""θ̄ from a Hugging Face Llama (dipaco.init_from): a random Llama made here, with its tokenizer."""

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from etils import epath
from sentencepiece import sentencepiece_model_pb2

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax import export
from dipaco_jax import saved_config
from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import model as model_lib
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab
from dipaco_jax.io import checkpoint
from dipaco_jax.io import hf_llama
from dipaco_jax.io import theta as theta_lib

import helpers

SP = vocab.load(vocab.DEFAULT_VOCAB_PATH)
SP_PROTO = epath.Path(vocab.DEFAULT_VOCAB_PATH).read_bytes()
# The Llama's shape and the config.model flags that describe it: d 64 (the tied head's
# 64^-0.5 = 1/8 is exact, so the round trip is bit for bit), 2 blocks, 4 heads of 16, SwiGLU
# of width 170 (= int(64 * 170/64)).
LLAMA = dict(hidden_size=64, intermediate_size=170, num_hidden_layers=2, num_attention_heads=4)
MODEL = {
  "model.vocab_size": 8192,
  "model.d_model": 64,
  "model.num_layers": 2,
  "model.num_heads": 4,
  "model.head_dim": 16,
  "model.mlp": "swiglu",
  "model.mlp_ratio": 170 / 64,
  "model.max_len": 64,
  "dipaco.level_groups": ("embed,head", "block_0", "block_1"),
}


def make_llama(folder, *, tied: bool = True, tokenizer: bytes | None = None, **fields) -> str:
  """A random LlamaForCausalLM saved by transformers, with the shipped SentencePiece model."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    tie_word_embeddings=tied,
    bos_token_id=vocab.PAD_ID,
    eos_token_id=vocab.EOS_ID,
    pad_token_id=vocab.PAD_ID,
    rms_norm_eps=1e-6,
    **{"vocab_size": SP.vocab_size(), **LLAMA, **fields},
  )
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # Norm weights off 1, so a misplaced one shows.
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(str(folder))
  (epath.Path(folder) / "tokenizer.model").write_bytes(tokenizer or SP_PROTO)
  return str(folder)


def run_config(src: str, **fields):
  return helpers.micro_config(**{**MODEL, "dipaco.init_from": src, **fields})


@functools.cache
def inputs() -> np.ndarray:
  """[2, 48] inputs from the embedded corpus' validation text: [BOS, first 47 pieces]."""
  docs = itertools.islice(corpus.read_records("validation"), 2)
  return np.array([[vocab.PAD_ID] + SP.encode(d["text"])[:47] for d in docs], np.int32)


@pytest.mark.parametrize("tied", [True, False])
def test_a_llama_is_theta_and_computes_its_logits(tied, tmp_path):
  src = make_llama(tmp_path / "llama", tied=tied)
  cfg = run_config(src, **{"model.tie_embeddings": tied})
  config_check.validate(cfg)  # The run's own check accepts the folder and its tokenizer.
  exp = experiment.Experiment(cfg)
  theta = theta_lib.initial(src, exp.recipe.abstract_params())
  got = np.asarray(model_lib.Transformer(exp.model_cfg).apply({"params": theta}, inputs()))
  model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
  with torch.no_grad():
    want = model(torch.tensor(inputs(), dtype=torch.long)).logits.numpy()
  assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
  # Forked: every module of the grid starts as the Llama (Algorithm 1's shared θ̄).
  state = jax.device_get(exp.init_state(0, theta))
  np.testing.assert_array_equal(
    state.store["block_1"]["mlp_in"]["kernel"][1], theta["block_1"]["mlp_in"]["kernel"]
  )


def test_export_of_the_import_is_the_llama_bit_for_bit(tmp_path):
  src = make_llama(tmp_path / "llama")
  cfg = run_config(src, **{"model.attention_kernels": "matrix"})  # Reshaped on the way in.
  exp = experiment.Experiment(cfg)
  run = str(tmp_path / "run")
  state = exp.init_state(0, theta_lib.initial(src, exp.recipe.abstract_params()))
  ck = checkpoint.Checkpointer(run, async_save=False)
  ck.save(0, state, {"train": {}})
  ck.close()
  saved_config.write(epath.Path(run), cfg)
  export.export(cfg, run, str(tmp_path / "out"), [3])
  back = safetensors.numpy.load_file(str(tmp_path / "out/path_3/model.safetensors"))
  orig = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
  assert sorted(back) == sorted(k for k in orig if k != "lm_head.weight")  # Tied: one table.
  for name, x in back.items():
    np.testing.assert_array_equal(x, orig[name], err_msg=name)
  assert (tmp_path / "out/path_3/tokenizer.model").read_bytes() == SP_PROTO


def renamed_piece_tokenizer() -> bytes:
  """The shipped SentencePiece model with one piece renamed: another vocabulary, same size."""
  m = sentencepiece_model_pb2.ModelProto()
  m.ParseFromString(SP_PROTO)
  m.pieces[500].piece = "▁zzzzqq"
  return m.SerializeToString()


def refusal(cfg) -> str:
  with pytest.raises(errors.ConfigError) as e:
    config_check.validate(cfg)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_a_folder_that_is_not_a_llama_is_refused_in_one_line(tmp_path):
  (tmp_path / "gpt2").mkdir()
  (tmp_path / "gpt2/config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
  msg = refusal(run_config(str(tmp_path / "gpt2")))
  assert "describes model_type='gpt2', not a Llama" in msg, msg
  (tmp_path / "empty").mkdir()
  msg = refusal(run_config(str(tmp_path / "empty")))
  assert "holds no finished checkpoint" in msg and "no Hugging Face config.json" in msg, msg
  gqa = make_llama(tmp_path / "gqa", num_key_value_heads=2)
  msg = refusal(run_config(gqa))
  assert "has num_key_value_heads=2, which dipaco_jax's model cannot hold" in msg, msg


def test_another_vocabulary_or_shape_is_refused_naming_the_fix(tmp_path):
  src = make_llama(tmp_path / "llama", tokenizer=renamed_piece_tokenizer())
  msg = refusal(run_config(src))
  assert "its tokenizer.model (8192 pieces) is not the run's tokenizer" in msg, msg
  assert "they differ from id 500" in msg, msg
  assert msg.endswith(f"--config.data.vocab_path={src}/tokenizer.model."), msg
  other = make_llama(tmp_path / "wide", vocab_size=8200)  # Rows the tokenizer never names.
  msg = refusal(run_config(other))
  assert "is a Llama of another shape than config.model (vocab_size 8192 here, 8200 there)" in msg
  assert msg.endswith("set --config.model.vocab_size=8200."), msg
  msg = refusal(run_config(make_llama(tmp_path / "deep", num_hidden_layers=3)))
  assert "set --config.model.num_layers=3." in msg, msg
  shutil.copytree(src, tmp_path / "notok")
  os.remove(tmp_path / "notok/tokenizer.model")
  msg = refusal(run_config(str(tmp_path / "notok")))
  assert "has no tokenizer.model: dipaco_jax tokenizes with SentencePiece" in msg, msg


@pytest.mark.cli
def test_the_trainer_refuses_before_writing_anything(tmp_path):
  # configs/tiny.py's model (d 128, 4 blocks, 4 heads of 32) with SwiGLU of width 512.
  shape = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4)
  src = make_llama(tmp_path / "llama", tokenizer=renamed_piece_tokenizer(), **shape)
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "dipaco_jax.main",
      "--config=configs/tiny.py",
      f"--workdir={tmp_path}/run",
      f"--config.dipaco.init_from={src}",
      "--config.model.mlp=swiglu",
    ],
    capture_output=True,
    text=True,
    cwd=helpers.ROOT,
  )
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert "is not the run's tokenizer" in r.stderr, r.stderr
  assert not (tmp_path / "run").exists()


def test_model_fields_read_a_llama_config():
  fields = hf_llama.model_fields({**LLAMA, "vocab_size": 8192, "tie_word_embeddings": True})
  cfg = sections.ModelConfig(**fields)
  assert (cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim) == (64, 4, 16, 170)
  # 11008 / 4096 (Llama 7B): the float ratio gives back the width exactly.
  big = hf_llama.model_fields(
    {
      "hidden_size": 4096,
      "intermediate_size": 11008,
      "num_hidden_layers": 32,
      "num_attention_heads": 32,
      "vocab_size": 32000,
    }
  )
  assert int(4096 * big["mlp_ratio"]) == 11008 and big["head_dim"] == 128
