"""The micro config: configs/tiny.py shrunk to a seconds-long model, as dotted overrides.

    config_check.load("configs/tiny.py", **micro.overrides(**{"dipaco.inner_steps": 10}))

One definition for the tests (tests/helpers.py), tools/config_sweep.py and the
elastic benchmarks: a 2-block d=32 model on the 2x2 grid with a shared embedding
(4 paths), H=2, T=2, sequences of 16 and batches of 2.
"""

_MICRO = {
  "model.d_model": 32,
  "model.num_layers": 2,
  "model.num_heads": 2,
  "model.head_dim": 16,
  "model.max_len": 64,
  "dipaco.level_groups": ("embed,head", "block_0", "block_1"),
  "dipaco.modules_per_level": (1, 2, 2),
  "dipaco.inner_steps": 2,
  "dipaco.outer_steps": 2,
  "inner.warmup_steps": 2,
  "data.seq_len": 16,
  "data.batch_size": 2,
  "ckpt.every_steps": 2,
  "eval.every_steps": 2,
  "eval.batches": 1,
}


def overrides(**changes) -> dict:
  """The micro config's dotted overrides of configs/tiny.py, with `changes` on top."""
  return {**_MICRO, **changes}
