"""Both runtimes run the recipe alike: every field of config.model, inner, outer and guard.

For each field (fields that act apart share a run, see RUNS), one outer phase (H = 2
inner steps, then the outer step; two for the streamed fields) of a micro 2x2 grid runs in
both runtimes, in this
process and without Ray: the spmd loop as `train.train_and_evaluate` runs it, and the
elastic pieces a Ray pool runs (the driver's preparation, every worker's task, the outer
executor, the final state the driver checkpoints), from the same shards. With the field
changed, both runtimes' states change from the base run alike (to 1e-6: one device's
program against the 4-device spmd program), and a guard that trips stops both at the
same step on the same paths with the same rule. The list of fields is the sections' own,
so a new field fails here until it has a case.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from dipaco_jax import config_check
from dipaco_jax import train
from dipaco_jax.config import sections
from dipaco_jax.core import experiment
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.io import checkpoint
from dipaco_jax.runtime.elastic import driver
from dipaco_jax.runtime.elastic import executor as exec_lib
from dipaco_jax.runtime.elastic import grid as grid_lib
from dipaco_jax.runtime.elastic import worker as worker_lib

import helpers

BASE = {
  "model.vocab_size": 8192,  # The shipped tokenizer's: the shards are real.
  # One block (compiles in half the time of two): the embedding and head shared by all four
  # workers (one psum), block_0's two modules split over 'path' (all_to_all).
  "model.num_layers": 1,
  "dipaco.level_groups": ("embed,head", "block_0"),
  "dipaco.modules_per_level": (1, 2),
  "dipaco.replicas": 2,
  "dipaco.outer_steps": 1,
  "early_stopping.enabled": False,
  "eval.every_steps": 2,
}
# Each field's other value, with what it needs to act (or to be allowed) in a 2-step run.
CASES = {
  "model.vocab_size": {"model.vocab_size": 8256, "model.pad_vocab": True},
  "model.pad_vocab": {"model.vocab_size": 8200, "model.pad_vocab": True},
  "model.d_model": {"model.d_model": 48},
  "model.num_layers": {"model.num_layers": 2, "dipaco.level_groups": ("embed,head", "block_0-1")},
  "model.num_heads": {"model.num_heads": 4, "model.head_dim": 8},
  "model.head_dim": {"model.head_dim": 8},
  "model.mlp_ratio": {"model.mlp_ratio": 2.0},
  "model.max_len": {"model.positions": "learned", "model.max_len": 40},
  "model.positions": {"model.positions": "learned"},
  "model.tie_embeddings": {"model.tie_embeddings": False},
  "model.dtype": {"model.dtype": "bfloat16"},
  "model.remat": {"model.remat": "full"},
  "model.attention": {"model.attention": "xla"},
  "model.attention_kernels": {"model.attention_kernels": "matrix"},
  "model.attention_block_q": {"model.attention_block_q": 256},
  "model.attention_block_kv": {"model.attention_block_kv": 256},
  "model.loss_chunk": {"model.loss_chunk": 8},
  "model.mlp": {"model.mlp": "swiglu"},
  # auto is input_first on this CPU: the same values, another program.
  "model.weight_grads": {"model.weight_grads": "autodiff"},
  "inner.lr": {"inner.lr": 1e-2},
  "inner.warmup_steps": {"inner.warmup_steps": 0},
  "inner.total_steps": {"inner.total_steps": 3, "inner.warmup_steps": 0},
  "inner.final_lr_fraction": {"inner.final_lr_fraction": 0.5, "inner.warmup_steps": 0},
  "inner.b1": {"inner.b1": 0.5},
  "inner.b2": {"inner.b2": 0.5},
  "inner.eps": {"inner.eps": 1e-3},
  "inner.weight_decay": {"inner.weight_decay": 0.9},
  "inner.clip_norm": {"inner.clip_norm": 0.01},
  "inner.decay_norms": {"inner.decay_norms": True},
  "inner.microbatches": {"inner.microbatches": 2},
  "inner.optimizer": {"inner.optimizer": "muon"},
  "inner.muon_lr": {"inner.optimizer": "muon", "inner.muon_lr": 0.05},
  "inner.muon_beta": {"inner.optimizer": "muon", "inner.muon_beta": 0.5},
  # No outer step: allowed in elastic where no two workers share a module.
  "outer.enabled": {
    "outer.enabled": False,
    "dipaco.level_groups": ("embed,head,block_0",),
    "dipaco.modules_per_level": (4,),
    "dipaco.replicas": 1,
  },
  "outer.lr": {"outer.lr": 0.3},
  "outer.momentum": {"outer.momentum": 0.5},
  "outer.nesterov": {"outer.nesterov": False},
  "outer.weighting": {"outer.weighting": "uniform"},
  "outer.sqrt_paths": {"outer.sqrt_paths": "divide"},
  "outer.sqrt_paths_cap": {"outer.sqrt_paths_cap": 1.2},
  "outer.compression": {"outer.compression": "int8"},
  # fp4 with blocks of 8: the d_model rows (32) split into 4 blocks, head_dim's (16) into 2.
  "outer.compression_block": {"outer.compression": "fp4", "outer.compression_block": 8},
  # topk2 keeping 2 of each block of 8.
  "outer.compression_keep": {
    "outer.compression": "topk2",
    "outer.compression_block": 8,
    "outer.compression_keep": 2,
  },
  # auto over a 1 Gb/s link: fp4 (blocks of 64: one per d_model row, two per head_dim's 16 x 2).
  "outer.link_gbps": {"outer.compression": "auto", "outer.link_gbps": 1.0},
  # auto at 1000 Gb/s against 1000 GB/s of HBM: bf16 (compression.CODEC_BYTES, AUTO below).
  "outer.hbm_gbs": {
    "outer.compression": "auto",
    "outer.link_gbps": 1000.0,
    "outer.hbm_gbs": 1000.0,
  },
  "outer.error_feedback": {
    "outer.compression": "fp4",
    "outer.compression_block": 8,
    "outer.error_feedback": False,
  },
  # Streamed outer sync, two phases (STREAMED): embed syncs after steps 1, 3 and 4 (the flush),
  # block_0 and head after steps 2 and 4: the elastic tasks are the 4 units between them.
  "outer.fragments": {"outer.fragments": 2, "dipaco.outer_steps": 2},
  # Two phases: the first phase's update lands after step 3 (the last step's at once); the
  # elastic units are steps 1, 2, 3, 4, the third landing the update the second's end sent.
  "outer.overlap": {"outer.overlap": 1, "dipaco.outer_steps": 2},
  # Guards that trip: a loss driven above ln V, a norm ratio the first steps exceed.
  "guard.stuck_steps": {"guard.stuck_steps": 1, "inner.warmup_steps": 0, "inner.lr": 1.0},
  "guard.max_param_norm_ratio": {"guard.max_param_norm_ratio": 1.001, "inner.lr": 0.05},
}
# More values of a field than its case: each runs as a case of its own.
MORE = {
  "outer.compression=bf16": {"outer.compression": "bf16"},
  # A block (24) that divides no row: every row padded.
  "outer.compression=fp4": {"outer.compression": "fp4", "outer.compression_block": 24},
  "outer.compression=topk2": {"outer.compression": "topk2"},  # 1 of 64 (of 32 a short row).
  # Streamed and compressed: fragments with fp4 and error feedback (each worker's residual kept
  # for the groups a unit does not send), overlap with int8.
  "outer.fragments+fp4": {
    **CASES["outer.fragments"],
    **CASES["outer.compression_block"],
  },
  "outer.overlap+int8": {**CASES["outer.overlap"], "outer.compression": "int8"},
  # Not a recipe field, but both runtimes build their own training batchers from it.
  "data.interleave": {"data.interleave": 2},
}
# Together: microbatches, remat and a guard that trips in one run.
COMBINED = {
  **CASES["inner.microbatches"],
  **CASES["model.remat"],
  "guard.max_param_norm_ratio": 1.001,
}
SECTIONS = (sections.ModelConfig, sections.InnerConfig, sections.OuterConfig, sections.GuardConfig)
# The cases run in these groups, one phase each (a field either runtime ignored would leave its
# group's states apart). Alone: the fields that change the grid or the vocabulary with another
# field of their group, that leave the numbers alone (remat, weight_grads: their programs are
# compared), that stop the run (the guards) or that change the wire form (compression).
RUNS = (
  ("model.d_model", "model.mlp_ratio", "model.tie_embeddings", "model.loss_chunk", "model.mlp"),
  ("model.num_heads", "model.head_dim", "model.max_len", "model.positions", "model.pad_vocab"),
  ("model.num_layers", "model.dtype", "model.vocab_size", "model.attention_kernels"),
  ("model.remat",),
  ("model.weight_grads",),
  *((k,) for k in ("model.attention", "model.attention_block_q", "model.attention_block_kv")),
  ("inner.lr", "inner.b1", "inner.b2", "inner.eps", "inner.weight_decay", "inner.clip_norm"),
  # Muon steps the blocks' matrices, AdamW (and decay_norms) the rest, both on the schedule.
  (
    "inner.warmup_steps",
    "inner.total_steps",
    "inner.final_lr_fraction",
    "inner.decay_norms",
    "inner.optimizer",
    "inner.muon_lr",
    "inner.muon_beta",
  ),
  ("inner.microbatches",),
  ("outer.enabled",),
  ("outer.lr", "outer.momentum", "outer.nesterov", "outer.weighting", "outer.sqrt_paths"),
  ("outer.sqrt_paths_cap",),
  ("outer.compression",),
  ("outer.compression_block", "outer.error_feedback"),
  ("outer.compression_keep",),
  ("outer.link_gbps",),
  ("outer.hbm_gbs",),
  ("outer.fragments",),
  ("outer.overlap",),
  ("guard.stuck_steps",),
  ("guard.max_param_norm_ratio",),
)
# Fields whose every value runs the same program on CPU: the attention kernel (auto is XLA here;
# splash needs a TPU, cuDNN a GPU) and splash's blocks. Both runtimes must still build their
# model from the recipe's config with them: checked on the recipes, without running a phase.
ACCELERATOR_ONLY = ("model.attention", "model.attention_block_q", "model.attention_block_kv")
# Fields whose case also sets dipaco.outer_steps: each must change the spmd state from the same
# run's without the field (the base run has one phase, so differing from it says nothing).
STREAMED = ("outer.fragments", "outer.overlap")
# Work in proportion to speed (runtime/elastic/pacing.py): the spmd loop trains every path H
# steps in lock-step, so no path could train less, wait less or weigh less; it refuses these in
# one line, and the elastic mode runs them (an equal-speed phase: spmd's state, as with them off).
SPMD_REFUSES = {"elastic.pace_steps": True, "elastic.token_weights": True, "elastic.lease": "speed"}


def test_every_field_of_the_recipes_sections_has_a_case():
  fields = {s.key(f.name) for s in SECTIONS for f in dataclasses.fields(s)}
  assert set(CASES) == fields


# What outer.compression="auto" picks in the two cases that set it.
AUTO = {"outer.link_gbps": "fp4", "outer.hbm_gbs": "bf16"}


@pytest.mark.parametrize("case", sorted(AUTO))
def test_both_runtimes_resolve_auto_to_the_same_kind(case):
  """The spmd Experiment's recipe and the elastic Grid's (every worker's and executor's)."""
  cfg = lambda mode: helpers.micro_config(**{**BASE, **CASES[case], "dipaco.mode": mode})
  spmd = experiment.Experiment(cfg("spmd")).recipe.outer_cfg.compression
  assert spmd == grid_lib.Grid(cfg("elastic")).recipe.outer_cfg.compression == AUTO[case]


def test_every_case_runs_once_and_a_groups_cases_agree_on_what_they_set():
  assert sorted(k for run in RUNS for k in run) == sorted(CASES)
  for run in RUNS:
    merged = {}
    for k in run:
      for field, value in CASES[k].items():
        assert merged.setdefault(field, value) == value, (run, field)


def _overrides(case: str) -> dict:
  """The fields one parametrised run sets: a group of RUNS (its cases joined by ','), or MORE's."""
  if case in MORE:
    return MORE[case]
  if case == "microbatches+remat+guard":
    return COMBINED
  return {f: v for k in case.split(",") for f, v in CASES[k].items()}


def _spmd(cfg, workdir):
  """The spmd loop's state after the phase, or its guard error."""
  try:
    train.train_and_evaluate(cfg, workdir)
  except guard_lib.DivergenceError as e:
    return e
  return checkpoint.restore_numpy(workdir)


def _elastic(cfg, workdir):
  """The elastic pieces' state after the run (the driver's final state), or the guard's stop.

  Every worker's task of each unit runs (one per phase; streamed, the schedule's units),
  then the executor takes their reports; a guard error is (its class, its message's step
  and rule, the workers it stopped), as one spmd error over all workers reads.
  """
  grid = grid_lib.Grid(cfg)
  exp, _, alpha = driver._prepare(cfg, workdir, grid)  # pylint: disable=protected-access
  w = worker_lib.PathWorker(cfg, workdir, 0)
  ex = exec_lib.OuterExecutor(cfg, workdir, 0, [s.name for s in grid.groups], alpha)
  for unit in range(grid.U):
    stops = {}
    for worker in range(grid.W):
      try:
        w.run(unit, worker)
      except guard_lib.DivergenceError as e:
        stops[worker] = e
    if stops:
      return stops
    for worker in range(grid.W):
      ex.report(unit, worker)
  state, _ = driver._final_state(cfg, workdir, exp, grid)  # pylint: disable=protected-access
  return jax.device_get(state)


_KINDS = ("non-finite training loss", "parameter norm", "training loss stayed")


def _stop(msg: str):
  """(rule, step, paths) of a guard's message."""
  kind = next(k for k in _KINDS if msg.startswith(k))
  step = re.search(r"(?:at step |over steps \d+-)(\d+)", msg).group(1)
  paths = re.search(r"on paths \[([^\]]*)\]", msg).group(1)
  return kind, int(step), {p.strip(" '") for p in paths.split(",")}


def _same_stop(spmd_error, elastic_stops):
  """The spmd guard's stop (all workers at once) is the first of the elastic workers' stops."""
  kind, step, paths = _stop(str(spmd_error))
  per_worker = [(type(e), *_stop(str(e))) for e in elastic_stops.values()]
  first = [s for s in per_worker if s[2] == min(s[2] for s in per_worker)]
  assert {(c, k, s) for c, k, s, _ in first} == {(type(spmd_error), kind, step)}, (
    spmd_error,
    elastic_stops,
  )
  assert set().union(*(p for *_, p in first)) == paths


def _leaves(state):
  get = (lambda k: state[k]) if isinstance(state, dict) else (lambda k: getattr(state, k))
  return {
    k: [np.asarray(x, np.float64) for x in jax.tree.leaves(get(k))]
    for k in ("store", "outer_opt", "params", "inner_opt", "ef")
    if k != "ef" or (state.get("ef") if isinstance(state, dict) else getattr(state, "ef", None))
  }


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  return str(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
  """One persistent compilation cache: a program a field leaves alone compiles once."""
  with helpers.compile_cache(tmp_path_factory.mktemp("jax_cache")):
    yield


@pytest.fixture(scope="module")
def base(shards, tmp_path_factory):
  """The base config's spmd state after the phase."""
  cfg = helpers.micro_config(**{**BASE, "data.shard_dir": shards})
  return _leaves(_spmd(cfg, str(tmp_path_factory.mktemp("base"))))


@pytest.mark.slow  # ~4 s a case: the spmd loop and the elastic pieces each compile their steps.
# ids=str: each case's id is its fields, also past pytest's 100 characters (-k by a field's name).
@pytest.mark.parametrize(
  "case", [*(",".join(r) for r in RUNS), *MORE, "microbatches+remat+guard"], ids=str
)
def test_a_field_changes_both_runtimes_alike(case, shards, base, tmp_path):
  over = _overrides(case)
  cfg = lambda mode: helpers.micro_config(
    **{**BASE, "data.shard_dir": shards, **over, "dipaco.mode": mode}
  )
  if case in ACCELERATOR_ONLY:
    _same_model_in_both_recipes(cfg("spmd"), cfg("elastic"), case)
    return
  spmd = _spmd(cfg("spmd"), str(tmp_path / "spmd"))
  if case in STREAMED:  # Against the same run without the field (its other fields set alike).
    ref = helpers.micro_config(
      **{**BASE, "data.shard_dir": shards, **{k: v for k, v in over.items() if k != case}}
    )
    a, b = _leaves(spmd), _leaves(_spmd(ref, str(tmp_path / "ref")))
    assert any(not np.array_equal(x, y) for x, y in zip(a["params"], b["params"])), case
  elastic = _elastic(cfg("elastic"), str(tmp_path / "elastic"))
  if isinstance(spmd, guard_lib.DivergenceError) or isinstance(elastic, dict):
    assert isinstance(elastic, dict), (spmd, elastic)
    assert case.startswith("guard.") or "guard" in case, spmd  # Only the guards' cases stop.
    _same_stop(spmd, elastic)
    return
  a, b = _leaves(spmd), _leaves(elastic)
  assert set(a) == set(b), case
  coded = cfg("spmd").outer.compression != "none"  # bf16 rounds to a code too (auto: fp4, bf16).
  for k in a:
    for x, y in zip(a[k], b[k], strict=True):
      if coded:  # The runtimes' inner steps differ by float32 ulps (1e-9 here), which can round
        # a rare value to the neighbouring code: at most 1 in 1000 values one code step apart.
        off = np.abs(x - y) > 1e-6
        assert off.sum() <= max(1, off.size // 1000), (case, k, off.sum())
        x, y = x[~off], y[~off]
        np.testing.assert_allclose(np.abs(x - y).max(initial=0), 0, atol=1e-6, err_msg=case)
        continue
      np.testing.assert_allclose(x, y, rtol=0, atol=1e-6, err_msg=f"{case}: {k}")
  changed = len(a["store"]) != len(base["store"]) or any(
    x.shape != y.shape or not np.array_equal(x, y)
    for k in base
    for x, y in zip(a[k], base[k], strict=False)
  )
  if not changed:  # A field that leaves the numbers alone (remat, attention): its programs.
    got, want = _inner_programs(cfg("spmd")), _inner_programs(helpers.micro_config(**BASE))
    assert got[0] != want[0] and got[1] != want[1], f"{case}: no runtime's inner step changed"


def _same_model_in_both_recipes(spmd_cfg, elastic_cfg, key):
  """Both runtimes' models carry the field's new value (the spmd one with its mesh)."""
  spmd = experiment.Experiment(spmd_cfg).recipe.model
  worker = grid_lib.Grid(elastic_cfg).recipe.model
  name, want = key.split(".")[1], CASES[key][key]
  assert getattr(spmd.cfg, name) == getattr(worker.cfg, name) == want
  assert spmd.mesh is not None and worker.mesh is None  # The worker's program is one device's.


def _inner_programs(cfg) -> tuple[str, str]:
  """The inner step each runtime compiles for `cfg`, as lowered text: (spmd, elastic worker)."""
  exp = experiment.Experiment(cfg)
  st, batch = exp.abstract_state, jax.ShapeDtypeStruct(exp.batch_shape, np.int32)
  batch = {k: batch for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["weights"] = jax.ShapeDtypeStruct(exp.batch_shape, np.float32)
  spmd = exp.inner_step.lower(st.params, st.inner_opt, batch).as_text()
  grid = grid_lib.Grid(cfg)
  step = worker_lib.programs(grid.recipe)["step"]
  one = {k: jax.ShapeDtypeStruct((1,) + v.shape[1:], v.dtype) for k, v in batch.items()}
  return spmd, step.lower(grid.params_template(), grid.inner_opt_template(), one).as_text()


@pytest.mark.parametrize("field", SPMD_REFUSES)
def test_the_spmd_mode_refuses_the_speed_fields_in_one_line(field):
  over = {**BASE, field: SPMD_REFUSES[field]}
  with pytest.raises(config_check.ConfigError) as e:
    helpers.micro_config(**over)
  assert field in str(e.value) and "lock-step" in str(e.value) and "\n" not in str(e.value)
  helpers.micro_config(**over, **{"dipaco.mode": "elastic"})  # Allowed there.


@pytest.mark.slow  # ~4 s: the elastic pieces compile their steps.
def test_elastic_with_the_speed_fields_on_equal_speeds_gives_the_spmd_state(shards, base, tmp_path):
  # Every worker's task trains H steps (nothing paces the in-process pieces): token weights
  # are α × 1, which leaves the outer step's bits alone, so the state is spmd's, to 1e-6.
  over = {**BASE, "data.shard_dir": shards, "dipaco.mode": "elastic", **SPMD_REFUSES}
  got = _leaves(_elastic(helpers.micro_config(**over), str(tmp_path / "elastic")))
  for k in base:
    for x, y in zip(got[k], base[k], strict=True):
      np.testing.assert_allclose(x, y, rtol=0, atol=1e-6, err_msg=k)
