"""outer.compression="auto" by hand: the kind of least codec + link time a value."""

import pytest

from dipaco_jax.config import sections
from dipaco_jax.core import compression as comp
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.errors import ConfigError

import helpers

# Round codec bytes a value, so every time below is derived by hand.
BYTES = {"none": 0.0, "bf16": 8.0, "int8": 16.0, "fp4": 32.0}


@pytest.fixture
def round_bytes(monkeypatch):
  monkeypatch.setattr(comp, "CODEC_BYTES", BYTES)


@pytest.mark.parametrize(
  "link_gbps, want",
  [
    # ns a value at HBM 800 GB/s, blocks of 64 (wire bits a value: none 32, bf16 16, int8
    # 8 + 32/64 = 8.5, fp4 4 + 0.5 = 4.5), link L Gb/s: codec bytes / 800 + wire bits / L.
    # L = 100: none 0.32; bf16 0.01 + 0.16 = 0.17; int8 0.02 + 0.085 = 0.105;
    # fp4 0.04 + 0.045 = 0.085: fp4.
    (100.0, "fp4"),
    # L = 400: none 0.08; bf16 0.01 + 0.04 = 0.05; int8 0.02 + 0.02125 = 0.04125;
    # fp4 0.04 + 0.01125 = 0.05125: int8.
    (400.0, "int8"),
    # L = 1000: none 0.032; bf16 0.01 + 0.016 = 0.026; int8 0.02 + 0.0085 = 0.0285;
    # fp4 0.04 + 0.0045 = 0.0445: bf16.
    (1000.0, "bf16"),
    # L = 3200: none 0.01; bf16 0.01 + 0.005 = 0.015: float32 (no codec beats the link).
    (3200.0, "none"),
  ],
)
def test_auto_picks_the_least_codec_plus_link_time(round_bytes, link_gbps, want):
  assert comp.choose(64, link_gbps, 800.0) == want
  cfg = comp.resolved(sections.OuterConfig(compression="auto", link_gbps=link_gbps, hbm_gbs=800))
  assert cfg.compression == want and cfg.link_gbps == link_gbps


def test_break_even_by_hand(round_bytes):
  # fp4 saves 4 − 0.5625 = 3.4375 bytes a value for 32 bytes of codec: equal times where
  # 3.4375 · 8 / L = 32 / 800, L = 27.5 · 800 / 32 = 687.5 Gb/s.
  assert comp.break_even_gbps("fp4", 64, 800.0) == pytest.approx(687.5)
  t = lambda kind, link: comp.value_seconds(kind, 64, link, 800.0)
  assert t("fp4", 687.0) < t("none", 687.0) and t("fp4", 688.0) > t("none", 688.0)


def test_the_shipped_table_compresses_on_a_dcn_and_not_on_a_memory_bus():
  """The measured table: fp4 on the chips' DCN links (v5e 25, v6e 100 Gb/s), none at 100 Tb/s."""
  assert comp.choose(64, 25.0, 819.0) == "fp4" and comp.choose(64, 100.0, 1640.0) == "fp4"
  assert comp.choose(64, 1e5, 819.0) == "none"
  assert 25.0 < comp.break_even_gbps("fp4", 64, 819.0) < 1e5


def test_a_run_resolves_auto_from_its_fields_alone():
  """Recipe.from_config (both runtimes build theirs so) holds the chosen kind, never "auto"."""
  slow = helpers.micro_config(**{"outer.compression": "auto", "outer.link_gbps": 1.0})
  r = recipe_lib.Recipe.from_config(slow)
  assert r.outer_cfg.compression == "fp4" and r.compressed and r.feedback
  fast = helpers.micro_config(**{"outer.compression": "auto", "outer.link_gbps": 1e6})
  r = recipe_lib.Recipe.from_config(fast)
  assert r.outer_cfg.compression == "none" and not r.compressed and not r.feedback


@pytest.mark.parametrize("field", ["link_gbps", "hbm_gbs"])
@pytest.mark.parametrize("value", [0, -25.0, "fast", float("nan"), True])
def test_a_bad_bandwidth_is_one_line(field, value):
  with pytest.raises(ConfigError) as e:
    sections.OuterConfig(compression="auto", **{field: value})
  msg = str(e.value)
  assert f"config.outer.{field}={value!r} is invalid: it must be a number > 0" in msg, msg
  assert "\n" not in msg
  with pytest.raises(ConfigError) as e:
    helpers.micro_config(**{f"outer.{field}": 0.0})
  assert f"config.outer.{field}=0.0 is invalid" in str(e.value) and "\n" not in str(e.value)
