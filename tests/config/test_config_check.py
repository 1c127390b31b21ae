"""config_check: every field has a rule, dataclasses take every field, the Python API refuses."""

import dataclasses
import json
import os

import pytest

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax import saved_config
from dipaco_jax import train
from dipaco_jax.config import schema
from dipaco_jax.config import sections
from dipaco_jax.runtime import dispatch
from dipaco_jax.runtime import faults

import helpers

ConfigError = errors.ConfigError
TINY = os.path.join(helpers.ROOT, "configs", "tiny.py")


def test_base_holds_exactly_the_declared_fields_with_their_defaults():
  flat = schema.flatten(schema.base())
  assert sorted(flat) == sorted(schema.field_names())
  for key, f in schema.declared().items():
    assert flat[key] == f.default, key
    assert f.metadata["help"] and f.metadata["rule"].need, key  # Each says what it is and needs.


def test_base_defaults_pass_their_own_rules():
  config_check.validate(schema.base(), for_run=False)


@pytest.mark.parametrize("cls", sections.SECTIONS)
def test_a_section_object_is_the_configs_section_and_checks_its_fields(cls):
  c = schema.base()
  got = cls.of(c)
  node = c[cls.SECTION] if cls.SECTION else c
  assert all(getattr(got, f.name) == node[f.name] for f in dataclasses.fields(cls))
  assert cls() == got  # The declared defaults are base()'s.
  f = dataclasses.fields(cls)[0]
  with pytest.raises(ConfigError, match=f"config.{cls.key(f.name)}=<object .* is invalid"):
    cls(**{f.name: object()})  # No rule admits an arbitrary object.
  if cls.SECTION:
    del node[f.name]
    with pytest.raises(ConfigError, match=f"config.{cls.key(f.name)} is missing"):
      cls.of(c)


def test_derived_values_replace_fields():
  inner_cfg = sections.InnerConfig.of(schema.base(), total_steps=7)
  assert inner_cfg.total_steps == 7 and inner_cfg.lr == schema.base().inner.lr


@pytest.mark.parametrize(
  "overrides,match",
  [
    (
      {"inner.lrr": 1e-3},
      r"config.inner.lrr is not a config field: did you mean "
      r"config.inner.lr\?",
    ),
    ({"inner.decay_normz": True}, r"did you mean config.inner.decay_norms\?"),
    ({"modle.d_model": 64}, r"did you mean config.model.d_model\?"),
    ({"routing.early_stopping": False}, r"it moved to config.early_stopping.enabled"),
    (
      {"dipaco.inner_steps": 2.5},
      r"config.dipaco.inner_steps=2.5 has the wrong type: it must be "
      r"an integer >= 1",
    ),
    (
      {"dipaco.modules_per_level": (1, 2.5, 2)},
      r"config.dipaco.modules_per_level=\(1, 2.5, 2\) "
      r"is invalid",
    ),
    ({"inner.lr": -1e-3}, r"config.inner.lr=-0.001 is invalid: it must be a number > 0"),
    (
      {"outer.momentum": 1.5},
      r"config.outer.momentum=1.5 is invalid: it must be a number >= 0 "
      r"and < 1",
    ),
    (
      {"model.positions": "alibi"},
      r"config.model.positions='alibi' is invalid: it must be one of "
      r"'rope', 'learned'",
    ),
    ({"dipaco.init": "zeros"}, r"config.dipaco.init='zeros' is invalid"),
    ({"data.batch_size": 0}, r"config.data.batch_size=0 is invalid: it must be an integer >= 1"),
    ({"data.shard_dir": "None"}, r"config.data.shard_dir='None' is invalid: it must be a path"),
    ({"data.top_k": 5}, r"config.data.top_k=5 exceeds the 4 paths"),
    (
      {"model.positions": "learned", "data.seq_len": 512},
      r"config.data.seq_len=512 exceeds "
      r"config.model.max_len=256",
    ),
    ({"ckpt.every_steps": True}, r"config.ckpt.every_steps=True is invalid"),
    (
      {"dispatch_ahead": "yes"},
      r"config.dispatch_ahead='yes' is invalid: it must be one of 'auto', 'on', 'off'",
    ),
    ({"elastic.quorum": 0.0}, r"config.elastic.quorum=0.0 is invalid: it must be a fraction in"),
    ({"elastic.quorum": 1.5}, r"config.elastic.quorum=1.5 is invalid: .* \(0, 1\]"),
    (
      {"elastic.grace_s": -1.0},
      r"config.elastic.grace_s=-1.0 is invalid: it must be a number >= 0",
    ),
    ({"elastic.late_deltas": "later"}, r"late_deltas='later' is invalid: .* 'next', 'drop'"),
    # Work in proportion to speed and late work (runtime/elastic/pacing.py), one line each.
    ({"elastic.late_discount": 0.0}, r"late_discount=0.0 is invalid: .* discount in \(0, 1\]"),
    ({"elastic.late_discount": 1.5}, r"late_discount=1.5 is invalid: .* discount in \(0, 1\]"),
    (
      {"dipaco.mode": "elastic", "elastic.pace_steps": True, "elastic.min_inner_steps": 500},
      r"min_inner_steps=500 exceeds dipaco.inner_steps=50: .* set min_inner_steps <= 50",
    ),
    (
      {"dipaco.mode": "elastic", "elastic.phase_budget_s": 30.0},
      r"phase_budget_s=30.0, min_inner_steps=1 act only with elastic.pace_steps=True",
    ),
    ({"elastic.phase_budget_s": -1.0}, r"phase_budget_s=-1.0 is invalid: it must be a number >= 0"),
    (
      {"elastic.pace_steps": True},
      r"config.elastic.pace_steps=True: the spmd mode runs every path in lock-step",
    ),
    ({"elastic.token_weights": True}, r"config.elastic.token_weights=True: the spmd mode runs"),
    ({"elastic.lease": "speed"}, r"config.elastic.lease='speed': the spmd mode runs every path"),
    (
      {"elastic.worker_resources": '{"TPU": "four"}'},
      r"worker_resources='\{\"TPU\": \"four\"\}' is invalid: it must be a JSON object of Ray",
    ),
    ({"elastic.worker_resources": "[4]"}, r"worker_resources='\[4\]' is invalid"),
    (
      {"inner.microbatches": 3},
      r"config.inner.microbatches=3 does not split config.data.batch_size=8 into equal "
      r"microbatches over the 'data' mesh axis \(1\)",
    ),
    ({"faults.worker_kills": 1}, r"config.faults.worker_kills is not a config field: fault inj"),
    (
      {"model.weight_grads": "input_first", "model.remat": "save_matmuls"},
      r"config.model.weight_grads='input_first' with config.model.remat='save_matmuls': .* "
      r"every matmul would be recomputed; use remat='save_matmuls_except_mlp_in'",
    ),
  ],
)
def test_load_refuses_unknown_keys_and_bad_values(overrides, match):
  with pytest.raises(ConfigError, match=match) as e:
    config_check.load(TINY, **overrides)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "value,backend,ahead",
  [
    ("auto", "tpu", True),
    ("auto", "gpu", True),
    ("auto", "cpu", False),
    ("on", "cpu", True),
    ("off", "tpu", False),
  ],
)
def test_dispatch_ahead_auto_is_on_for_accelerators_only(value, backend, ahead):
  assert dispatch.dispatch_ahead(config_check.load(TINY, dispatch_ahead=value), backend) is ahead


def test_a_config_file_may_not_add_a_field(tmp_path):
  path = tmp_path / "typo.py"
  path.write_text(
    "from dipaco_jax.config import schema\n\ndef get_config():\n"
    "  c = schema.base()\n  c.inner.warmup = 10\n  return c\n"
  )
  with pytest.raises(
    ConfigError,
    match=r"config.inner.warmup is not a config field: did you "
    r"mean config.inner.warmup_steps\?",
  ):
    config_check.load(str(path))
  with pytest.raises(ConfigError, match="no config file at"):
    config_check.load(str(tmp_path / "missing.py"))


def test_load_locks_the_config():
  c = config_check.load(TINY)
  c.inner.lr = 1e-3  # A known field stays settable.
  with pytest.raises(AttributeError, match="lrr"):
    c.inner.lrr = 1e-3


def test_the_run_checks_read_the_tokenizer_and_init_from(tmp_path):
  ok = config_check.load(TINY)
  config_check.validate(ok)  # 8192 = the shipped tokenizer.
  cases = [
    (
      {"model.vocab_size": 9000},
      r"vocab_size=9000 but the tokenizer .* has 8192 tokens: "
      r"set model.vocab_size=8192 \(or model.pad_vocab=True",
    ),
    ({"model.vocab_size": 4096}, r"vocab_size=4096 but the tokenizer .* has 8192 tokens"),
    (
      {"data.vocab_path": str(tmp_path / "no.model")},
      r"config.data.vocab_path=.* does "
      r"not exist",
    ),
    ({"data.task": "c4_en"}, r"config.data.vocab_path is unset but data.task='c4_en'"),
    ({"dipaco.init_from": str(tmp_path / "none")}, r"init_from=.* does not exist"),
  ]
  for overrides, match in cases:
    c = config_check.load(TINY, **overrides)  # Loads: these need files, checked per run.
    with pytest.raises(ConfigError, match=match):
      config_check.validate(c)
  config_check.validate(
    config_check.load(TINY, **{"model.vocab_size": 8192 + 64, "model.pad_vocab": True})
  )


def test_the_trainer_validates_before_it_touches_the_workdir(tmp_path):
  workdir = tmp_path / "run"
  for overrides in ({"model.vocab_size": 9000}, {"data.vocab_path": str(tmp_path / "x.model")}):
    with pytest.raises(ConfigError):
      train.train_and_evaluate(config_check.load(TINY, **overrides), str(workdir))
    assert not workdir.exists()
  c = config_check.load(TINY)
  c.outer.momentum = 1.0  # Set after load: the trainer's own pass still refuses it.
  with pytest.raises(ConfigError, match="config.outer.momentum=1.0"):
    train.train_and_evaluate(c, str(workdir))
  assert not workdir.exists()


def test_a_saved_config_json_with_the_old_faults_section_still_reads(tmp_path):
  # Runs started before fault injection left the config wrote a "faults" section in their
  # config.json: evaluate, serve and a resume read it as before, without that section.
  saved = json.loads(schema.base().to_json_best_effort())
  saved["faults"] = {"worker_kills": 0, "executor_kills": 0, "seed": 0, "step_delay_s": []}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert saved_config.load(str(tmp_path)).to_dict() == schema.base().to_dict()


def test_faults_are_the_elastic_pools_test_hook(tmp_path):
  with pytest.raises(ValueError, match="faults= injects into the elastic pool"):
    train.train_and_evaluate(helpers.micro_config(), str(tmp_path), faults.Faults(seed=1))
  assert not os.listdir(tmp_path)
  over, got = faults.from_overrides({"faults.worker_kills": 2, "inner.lr": 0.1})
  assert over == {"inner.lr": 0.1} and got == faults.Faults(worker_kills=2)
  assert faults.from_overrides({"inner.lr": 0.1}) == ({"inner.lr": 0.1}, None)
