"""Compiling for a TPU topology that is described, not present: chips, devices, costs.

libtpu (the `aot` extra) describes the devices of a topology; the run's mesh is
built over them and each step compiled (`compile_step`) with abstract inputs.
What is read off a compiled program: XLA's flops and bytes (`cost`), the
collectives by mesh axis (`collective_table`) and the Pallas kernels' flops,
which XLA counts as 0 (`kernel_flops`).
"""
# pylint: disable=invalid-name

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

from dipaco_jax import data as data_lib
from dipaco_jax import hlo
from dipaco_jax.core import attention as attention_lib
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import flops as flops_lib
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import sharding

GiB = 2**30
FIT_FRACTION = 0.9  # A step "fits" when its per-chip peak is <= 90% of usable HBM.


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip: public peak bf16 FLOP/s, HBM size and bandwidth, DCN bandwidth."""

  peak_flops: float  # bf16 FLOP/s per chip.
  hbm_bytes: float  # HBM per chip (public spec).
  hbm_bw: float  # HBM bytes/s per chip.
  usable_hbm: float  # HBM the compiler may use per device (libtpu 0.0.42's "available HBM").
  dcn_gbps: float  # Data-center network Gb/s per chip (the outer step's cross-slice link).
  dcn_source: str  # Where dcn_gbps comes from.


# Public per-chip specs from Google Cloud's TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, read 2026-11): peak bf16
# TFLOP/s, HBM GiB, HBM GB/s, DCN. usable_hbm is what libtpu 0.0.42 reports as
# "available HBM" when a program does not fit (v4 in its megacore chip config,
# one device per chip as v4 VMs run it: `topology_devices`).
CHIPS = {
  "v4": Chip(
    flops_lib.TPU_BF16_TFLOPS["v4"] * 1e12,
    32 * GiB,
    flops_lib.TPU_HBM_GBPS["v4"] * 1e9,
    30.75 * GiB,
    25.0,
    "no per-chip DCN figure published for v4: assumed as v5e's",
  ),
  "v5e": Chip(
    flops_lib.TPU_BF16_TFLOPS["v5e"] * 1e12,
    16 * GiB,
    flops_lib.TPU_HBM_GBPS["v5e"] * 1e9,
    15.75 * GiB,
    25.0,
    "cloud.google.com/tpu/docs/v6e table: v5e host 2 x 100 Gb/s NIC, 8 chips "
    "(6.4 Tb/s per 256-chip pod)",
  ),
  "v5p": Chip(
    flops_lib.TPU_BF16_TFLOPS["v5p"] * 1e12,
    95 * GiB,
    flops_lib.TPU_HBM_GBPS["v5p"] * 1e9,
    95.74 * GiB,
    50.0,
    "cloud.google.com/tpu/docs/v5p: DCN bandwidth per chip 50 Gb/s",
  ),
  "v6e": Chip(
    flops_lib.TPU_BF16_TFLOPS["v6e"] * 1e12,
    32 * GiB,
    flops_lib.TPU_HBM_GBPS["v6e"] * 1e9,
    31.25 * GiB,
    100.0,
    "cloud.google.com/tpu/docs/v6e: host 4 x 200 Gb/s NIC, 8 chips (25.6 Tb/s per 256-chip pod)",
  ),
}


MEGACORE = {"v4": "megacore"}  # libtpu's chip config of one device per chip, where not default.


class AotError(ValueError):
  """Bad input to the AOT tool (topology, mesh, batch split)."""


def chip_of(topology: str) -> tuple[str, Chip]:
  name = topology.split(":", 1)[0]
  if name not in CHIPS:
    raise AotError(
      f"--topology={topology}: unknown chip {name!r}; use one of "
      f"{sorted(CHIPS)} as CHIP:AxB[xC], e.g. v5e:4x4."
    )
  return name, CHIPS[name]


def check_topology(topology: str, slices: int) -> list[int]:
  """The chip grid's sides of a CHIP:AxB[xC] topology, before libtpu starts (AotError)."""
  chip_of(topology)
  m = re.fullmatch(r"[a-z0-9]+:(\d+(?:x\d+){1,2})", topology)
  if m is None:
    raise AotError(
      f"--topology={topology}: write CHIP:AxB or CHIP:AxBxC, e.g. v5e:4x4 or v5p:2x2x4."
    )
  if slices < 1:
    raise AotError(f"--slices={slices}: must be >= 1.")
  return [int(x) for x in m.group(1).split("x")]


def topology_devices(topology: str, slices: int) -> list:
  """The described devices of `slices` slices of `topology` (libtpu, no TPU needed)."""
  dims = check_topology(topology, slices)
  # Hosts hold up to 2x2 chips (the compiler only needs a consistent split).
  bounds = tuple(min(2, d) for d in dims) + (1,) * (3 - len(dims))
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(
      platform="tpu",
      topology_name=topology,
      # v4's default config makes a device of each TensorCore; v4 VMs run megacore, one
      # device per chip (its two cores one device), as v5p does by default.
      chip_config_name=MEGACORE.get(chip_of(topology)[0], "default"),
      chips_per_host_bounds=bounds,
      num_slices=slices,
    )
  except Exception as e:  # pylint: disable=broad-except
    raise AotError(
      f"--topology={topology}: libtpu cannot build it ({str(e).strip()[:200]}). "
      "Names are CHIP:AxB[xC] of a real slice shape, e.g. v5e:2x2, "
      "v5e:4x4, v4:2x2x2, v5p:2x2x4, v6e:4x4."
    ) from e
  return list(desc.devices)


def devices_per_chip(topology: str, slices: int, devices: list) -> int:
  """libtpu's devices per chip: 1 on every chip `topology_devices` describes (megacore)."""
  chips = math.prod(check_topology(topology, slices)) * slices
  return max(1, len(devices) // chips)


def abstract_batch(exp: exp_lib.Experiment) -> dict[str, jax.ShapeDtypeStruct]:
  """The trainer's [W, B, T] batch as shapes with the Experiment's sharding."""
  dtypes = {
    k: v.dtype for k, v in data_lib.synthetic_batch(np.random.default_rng(0), 1, 1, 2, 4).items()
  }
  return {
    k: jax.ShapeDtypeStruct(exp.batch_shape, d, sharding=exp.batch_sharding)
    for k, d in dtypes.items()
  }


def per_device_bytes(tree) -> int:
  """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs."""
  total = 0
  for x in jax.tree.leaves(tree):
    shard = x.sharding.shard_shape(x.shape)
    total += math.prod(shard) * np.dtype(x.dtype).itemsize
  return int(total)


def cost(compiled) -> tuple[float, float]:
  """XLA's flops and bytes accessed of a compiled program (its loop bodies counted once)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _span(c: hlo.Collective, mesh) -> list[str]:
  return [a for a in sharding.AXES if mesh.shape[a] > 1 and hlo.spans(c, mesh, a)]


def collective_table(hlo_text: str, mesh) -> list[dict[str, Any]]:
  """Collectives grouped by op, group size and spanned axes: count and bytes/device."""
  rows: dict[tuple, dict[str, Any]] = {}
  for c in hlo.collectives(hlo_text):  # Each counted once per loop trip.
    axes = _span(c, mesh)
    size = len(c.groups[0]) if c.groups else int(np.asarray(mesh.devices).size)
    key = (c.op, size, tuple(axes))
    row = rows.setdefault(
      key,
      {
        "op": c.op,
        "group_size": size,
        "axes": axes,
        "count": 0,
        "bytes": 0,
        "example_group": list(c.groups[0]) if c.groups else [],
      },
    )
    row["count"] += c.trips
    row["bytes"] += c.nbytes * c.trips
  return sorted(rows.values(), key=lambda r: -r["bytes"])


# The splash kernels' instruction names (splash_mha_fwd..., _dkv...: the backward is fused).
_KERNEL_RE = re.compile(r"splash_mha_(fwd|dkv)")


def kernel_flops(hlo_text: str, cfg: model_lib.ModelConfig, seq_len: int) -> tuple[float, int]:
  """FLOPs of the Pallas attention kernels a compiled program runs, and how many calls.

  XLA's cost analysis counts a custom call as 0 FLOPs. Each splash call's first 4-d result is
  [B, H, T, .] (its output, dq, or dk) for this device; its FLOPs follow from that shape, the
  head_dim and the blocks it computes (attention.attention_flops), once per loop trip.
  """
  blocks = attention_lib.splash_blocks(cfg, seq_len)
  total, calls = 0.0, 0
  for c in hlo.custom_calls(hlo_text, "splash_mha_"):
    m = _KERNEL_RE.match(c.name)
    shape = next((d for _, d in c.results if len(d) == 4), None)
    if m is None or shape is None:
      continue
    B, H, T = shape[:3]
    total += c.trips * attention_lib.attention_flops(
      m.group(1), (B, H, T, cfg.head_dim), blocks if T == seq_len else None
    )
    calls += c.trips
  return total, calls


class OutOfMemory(Exception):
  """The TPU compiler refused a step: it needs more HBM than the chip has."""


def compile_step(jitted, *args):
  """`jitted` lowered and compiled for `args`; OutOfMemory where the chip's HBM is too small."""
  try:
    return jitted.lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg:
      raise OutOfMemory(msg.strip().splitlines()[0]) from e
    raise


def parse_oom(msg: str) -> tuple[float, float] | None:
  """(HLO temporaries, available HBM) in bytes from the compiler's refusal, None if not given."""
  m = re.search(
    r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
    r"\(([\d.]+)([KMGT])\)",
    msg,
  )
  if not m:
    return None
  unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  return float(m.group(1)) * unit[m.group(2)], float(m.group(3)) * unit[m.group(4)]
