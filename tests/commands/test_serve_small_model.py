"""serve says, beside what a path generates, when that path is too small to write text."""

import json
import os

from etils import epath

from dipaco_jax import config_check
from dipaco_jax import saved_config
from dipaco_jax import serve
from dipaco_jax.core import experiment
from dipaco_jax.io import checkpoint

import helpers


def test_a_small_paths_generation_carries_the_note_and_scoring_does_not(tmp_path):
  cfg = helpers.micro_config()
  ck = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ck.save(2, experiment.Experiment(cfg).init_state(0), {"train": {}})
  ck.close()
  saved_config.write(epath.Path(tmp_path), cfg)
  text = "It is a truth universally acknowledged, that a single man in possession of a good " * 3
  kw = dict(max_new_tokens=3, path=1)
  # micro_config's path: vocab 256 x d 32 embedding (8,192) + 2 blocks of 4 x 32 x 32 attention
  # and 2 x 32 x 128 GELU MLP (12,352 with the norms) + the final norm (32): 32,928, 0.03M.
  out = json.loads(serve.serve(cfg, str(tmp_path), text, **kw))
  assert out["note"].startswith("this path has 0.03M parameters: a model under 10M continues")
  assert out["path"] == 1 and "text" in out
  many = json.loads(serve.serve(cfg, str(tmp_path), [text, text], **kw))
  assert many["note"] == out["note"] and len(many["results"]) == 2
  scored = json.loads(serve.serve(cfg, str(tmp_path), text, mode="score", path=1))
  assert "note" not in scored


def test_the_paper_paths_are_not_called_small():
  # configs/dense_150m.py: 149.8M parameters a path (README), counted from shapes only.
  cfg = config_check.load(os.path.join(helpers.ROOT, "configs", "dense_150m.py"))
  assert serve.small_model_note(cfg) is None
  # configs/tiny.py: 8192 x 128 table (1,048,576) + 4 blocks of 4 x 128 x 128 attention and
  # 2 x 128 x 512 GELU MLP with two norms (196,864 each) + the final norm (128): 1,836,160.
  tiny = config_check.load(os.path.join(helpers.ROOT, "configs", "tiny.py"))
  assert serve.small_model_note(tiny).startswith("this path has 1.84M parameters")
