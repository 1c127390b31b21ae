r"""Compiles a run's steps for a TPU topology on any host: memory, roofline, collectives.

  python -m dipaco_jax.aot --config=configs/dipaco_2x4.py --topology=v5e:4x4 --slices=2 \
    [--config.mesh.data=4 ...] [--out=FILE.json]

libtpu (the `aot` extra) compiles for TPU devices that are described, not
present. The run's mesh is built over them exactly as the trainer builds it,
and the inner, outer and evaluation steps are the `Experiment`'s own jitted
functions, lowered with abstract inputs carrying the Experiment's shardings.
Per step it reports the per-chip memory (arguments, temporaries, outputs, and
the rest of the training state that stays resident) against the chip's HBM,
XLA's flops and bytes, a roofline time max(flops / peak, bytes / HBM
bandwidth), tokens/s and MFU, and the collectives with the mesh axes they span.
Exit status 1: a step does not fit in 90% of HBM, or an inner-step collective
spans 'path' (the report says which), or a bad input (one stderr line naming the
flag or field and the fix; --verbose_errors for its traceback). docs/tpu.md holds
the paper configs' numbers.
"""
# pylint: disable=invalid-name

import dataclasses
import math
import os
import re
import sys
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

# Compiling needs libtpu's client but no TPU: don't contend for the lock a
# running TPU job (or any jax process in this environment) holds.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # No local backend but the host's.

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from dipaco_jax import config_check  # pylint: disable=wrong-import-position
from dipaco_jax import data as data_lib  # pylint: disable=wrong-import-position
from dipaco_jax import errors  # pylint: disable=wrong-import-position
from dipaco_jax import hlo  # pylint: disable=wrong-import-position
from dipaco_jax.core import attention as attention_lib  # pylint: disable=wrong-import-position
from dipaco_jax.core import experiment as exp_lib  # pylint: disable=wrong-import-position
from dipaco_jax.core import flops as flops_lib  # pylint: disable=wrong-import-position
from dipaco_jax.core import inner as inner_lib  # pylint: disable=wrong-import-position
from dipaco_jax.core import model as model_lib  # pylint: disable=wrong-import-position
from dipaco_jax.core import sharding  # pylint: disable=wrong-import-position
from dipaco_jax.core import topology as topo_lib  # pylint: disable=wrong-import-position
from dipaco_jax.io import files  # pylint: disable=wrong-import-position

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
# "available HBM" when a program does not fit (v4: per TensorCore in its
# default chip config, where libtpu makes one device per TensorCore: the report
# divides a chip's peak and bandwidth among its devices).
CHIPS = {
  "v4": Chip(
    flops_lib.TPU_BF16_TFLOPS["v4"] * 1e12,
    32 * GiB,
    1200e9,
    15.25 * GiB,
    25.0,
    "no per-chip DCN figure published for v4: assumed as v5e's",
  ),
  "v5e": Chip(
    flops_lib.TPU_BF16_TFLOPS["v5e"] * 1e12,
    16 * GiB,
    819e9,
    15.75 * GiB,
    25.0,
    "cloud.google.com/tpu/docs/v6e table: v5e host 2 x 100 Gb/s NIC, 8 chips "
    "(6.4 Tb/s per 256-chip pod)",
  ),
  "v5p": Chip(
    flops_lib.TPU_BF16_TFLOPS["v5p"] * 1e12,
    95 * GiB,
    2765e9,
    95.74 * GiB,
    50.0,
    "cloud.google.com/tpu/docs/v5p: DCN bandwidth per chip 50 Gb/s",
  ),
  "v6e": Chip(
    flops_lib.TPU_BF16_TFLOPS["v6e"] * 1e12,
    32 * GiB,
    1640e9,
    31.25 * GiB,
    100.0,
    "cloud.google.com/tpu/docs/v6e: host 4 x 200 Gb/s NIC, 8 chips (25.6 Tb/s per 256-chip pod)",
  ),
}


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
      chip_config_name="default",
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
  """libtpu's devices per chip: 2 on v4 (one per TensorCore), else 1 (v5p's megacore too)."""
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


def _cost(compiled) -> tuple[float, float]:
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


# The splash kernels' instruction names (splash_mha_fwd..., _dq..., _dkv...) and their kinds.
_KERNEL_RE = re.compile(r"splash_mha_(fwd|dq|dkv)")


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


def _compile(jitted, *args):
  try:
    return jitted.lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg:
      raise OutOfMemory(msg.strip().splitlines()[0]) from e
    raise


def _parse_oom(msg: str) -> tuple[float, float] | None:
  m = re.search(
    r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
    r"\(([\d.]+)([KMGT])\)",
    msg,
  )
  if not m:
    return None
  unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  return float(m.group(1)) * unit[m.group(2)], float(m.group(3)) * unit[m.group(4)]


class Report:
  """Compiles a config's steps over a topology and collects the numbers."""

  def __init__(
    self,
    config,
    topology: str,
    slices: int,
    dcn_gbps: float | None = None,
    hlo_dir: str | None = None,
  ):
    self.config = config
    self.hlo_dir = hlo_dir  # Where to write each step's compiled HLO text (STEP.hlo.txt).
    self.topology, self.slices = topology, slices
    self.chip_name, self.chip = chip_of(topology)
    self.dcn_gbps = self.chip.dcn_gbps if dcn_gbps is None else dcn_gbps
    self.dcn_bytes_per_s = self.dcn_gbps * 1e9 / 8
    devices = topology_devices(topology, slices)
    self.devices_per_chip = devices_per_chip(topology, slices, devices)
    self.peak = self.chip.peak_flops / self.devices_per_chip  # Per device.
    self.hbm_bw = self.chip.hbm_bw / self.devices_per_chip
    config.mesh.num_slices = slices
    workers = topo_lib.from_config(config).num_workers
    self.mesh = sharding.make_mesh(config.mesh, workers, devices=devices)
    self.exp = exp_lib.Experiment(config, mesh=self.mesh)
    self.n_devices = len(devices)
    self.result: dict[str, Any] = {
      "config": {
        "mesh": {a: int(self.mesh.shape[a]) for a in sharding.AXES},
        "fsdp": bool(config.mesh.get("fsdp", False)),
        "microbatches": int(config.inner.microbatches),
        "remat": config.model.remat,
        "loss_chunk": int(config.model.loss_chunk),
        "attention": config.model.attention,
        "attention_runs": attention_lib.resolve(
          self.exp.model_cfg, attention_lib.platform_of(self.mesh), int(config.data.seq_len)
        ),
        "dtype": config.model.dtype,
        "workers": int(self.exp.topo.num_workers),
        "batch_per_path": int(config.data.batch_size),
        "seq_len": int(config.data.seq_len),
        "inner_steps": int(config.dipaco.inner_steps),
        "outer_compression": config.outer.compression,
        "outer_compression_block": int(config.outer.compression_block),
        "outer_error_feedback": bool(self.exp.recipe.feedback),
        # One path's parameters (what a data-parallel gradient per inner step would carry).
        "path_params": int(
          sum(x.size // x.shape[0] for x in jax.tree.leaves(self.exp.abstract_state.params))
        ),
      },
      "topology": topology,
      "slices": slices,
      "chips": self.n_devices // self.devices_per_chip,
      "devices": self.n_devices,
      "devices_per_chip": self.devices_per_chip,
      "peak_flops_per_device": self.peak,
      "hbm_bw_per_device": self.hbm_bw,
      "dcn_gbps_per_chip": self.dcn_gbps,
      "chip": dict(name=self.chip_name, **dataclasses.asdict(self.chip)),
      "steps": {},
    }

  # Parts of the training state each step does not take as arguments but that
  # stay in HBM while it runs.
  def _resident(self, step: str) -> int:
    st = self.exp.abstract_state
    parts = {
      "store": st.store,
      "outer_opt": st.outer_opt,
      "inner_opt": st.inner_opt,
      "params": st.params,
    }
    args = {
      "inner": ("params", "inner_opt"),
      "outer": ("store", "outer_opt", "params"),
      "eval": ("params",),
    }[step]
    total = sum(per_device_bytes(v) for k, v in parts.items() if k not in args)
    if self.exp.recipe.feedback and step != "outer":
      total += per_device_bytes(st.ef)  # Error-feedback residuals (an outer-step argument).
    if self.exp.recipe.compressed and step != "outer":
      # The spmd loop's copy of each worker's params at its phase's start.
      total += per_device_bytes(st.params)
    if self.config.early_stopping.get("enabled", False):
      total += per_device_bytes(st.params)  # BestPaths' copy of the params.
    return total

  def _memory(self, compiled, step: str) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
      "arguments": int(m.argument_size_in_bytes),
      "temporaries": int(m.temp_size_in_bytes),
      "outputs": int(m.output_size_in_bytes - m.alias_size_in_bytes),
      "code": int(m.generated_code_size_in_bytes),
      "resident_state": self._resident(step),
    }
    out["total"] = sum(out.values())
    return out

  def _args(self, step: str):
    st, exp = self.exp.abstract_state, self.exp
    if step == "inner":
      return exp.inner_step, (st.params, st.inner_opt, abstract_batch(exp))
    if step == "outer":
      alpha = jax.ShapeDtypeStruct(
        (exp.topo.num_workers,),
        np.float32,
        sharding=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()),
      )
      args = (st.store, st.outer_opt, st.params, alpha)
      if exp.recipe.compressed:
        # A compressed outer step also takes the error-feedback residuals ({}
        # without feedback) and each worker's params at its phase's start.
        args += (getattr(st, "ef", {}) if exp.recipe.feedback else {}, st.params)
      return exp.outer_step, args
    return exp.eval_step, (st.params, abstract_batch(exp))

  def _inner_cost(self, compiled) -> tuple[float, float, str]:
    """Flops and bytes of the whole inner step, every loop iteration and kernel counted.

    XLA's cost analysis counts a loop body once. The microbatch scan holds
    the whole forward and backward pass, and the rest of the step runs once
    after it (the mean gradient, the optimizer update, the metrics:
    inner.finish_step): M x (the step) - (M - 1) x (that rest, compiled alone).
    Only the scan's setup (its float32 gradient sums zeroed) is still counted
    M times. Inside it, the chunked loss's loop counts one of its n chunks; the
    other n - 1 are added as XLA counts one chunk's value and gradient
    (`inner.chunk_loss`, forward and backward) compiled alone for one chip's
    rows (`_chunk_cost`). The Pallas attention
    kernels, 0 FLOPs to XLA, are added from their shapes (`kernel_flops`, every
    trip counted); their bytes are XLA's count of their operands and results.
    """
    flops, nbytes = _cost(compiled)
    how = ["compiled step"]
    c, shape = self.config, self.mesh.shape
    M = int(c.inner.microbatches)
    chunk = int(c.model.loss_chunk)
    if chunk and c.data.seq_len // chunk > 1:
      n = c.data.seq_len // chunk
      W = self.exp.topo.num_workers
      rows = W * c.data.batch_size // (M * shape["path"] * shape["data"])
      V = c.model.vocab_size // shape["model"]
      cflops, cbytes = self._chunk_cost(rows, chunk, V)
      flops += (n - 1) * cflops
      nbytes += (n - 1) * cbytes
      how.append(f"+ {n - 1} loss chunks")
    if M > 1:
      exp, st = self.exp, self.exp.abstract_state
      per_worker = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("path"))
      ps = exp.state_sharding.params
      finish = jax.jit(
        jax.vmap(exp.recipe.finish_step, spmd_axis_name="path"),
        in_shardings=(ps, exp.state_sharding.inner_opt, ps, per_worker, per_worker),
      )
      sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), st.params)
      scalar = jax.ShapeDtypeStruct((exp.topo.num_workers,), np.float32)
      oflops, obytes = _cost(_compile(finish, st.params, st.inner_opt, sums, scalar, scalar))
      flops, nbytes = M * flops - (M - 1) * oflops, M * nbytes - (M - 1) * obytes
      how = [f"{M} x (" + " ".join(how) + f") - {M - 1} x (the step after its scan)"]
    kflops, calls = kernel_flops(compiled.as_text(), self.exp.model_cfg, int(c.data.seq_len))
    if calls:
      flops += kflops
      how.append(f"+ {calls} attention kernel calls ({kflops:.3e} flops)")
    return flops, nbytes, " ".join(how)

  def _chunk_cost(self, rows: int, chunk: int, V: int) -> tuple[float, float]:
    """XLA's flops and bytes of one loss chunk's value and gradient on one chip, compiled alone.

    The forward and the backward compiled apart, as the step runs them (in the forward and the
    backward loop): one program would let XLA merge the backward's recomputed logits into the
    forward's.
    """
    dtype = jax.numpy.dtype(self.exp.model_cfg.dtype)
    one = jax.sharding.SingleDeviceSharding(self.mesh.devices.flat[0])
    arg = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
    D = int(self.config.model.d_model)
    args = [
      jax.ShapeDtypeStruct((rows, chunk, D), dtype),
      jax.ShapeDtypeStruct((D, V), dtype),
      jax.ShapeDtypeStruct((rows, chunk), np.int32),
      jax.ShapeDtypeStruct((rows, chunk), np.float32),
    ]
    fwd = jax.jit(lambda *a: jax.vjp(inner_lib.chunk_loss, *a))
    out, vjp_fn = jax.eval_shape(fwd, *args)
    bwd = jax.jit(lambda f, g: f(g))
    f1, b1 = _cost(_compile(fwd, *map(arg, args)))
    f2, b2 = _cost(_compile(bwd, jax.tree.map(arg, vjp_fn), arg(out)))
    return f1 + f2, b1 + b2

  def run(self, steps=("inner", "outer", "eval")) -> dict[str, Any]:
    for step in steps:
      jitted, args = self._args(step)
      try:
        compiled = _compile(jitted, *args)
      except OutOfMemory as e:
        self.result["steps"][step] = {
          "fits": False,
          "error": str(e),
          "advice": self.advice(step, str(e)),
        }
        continue
      mem = self._memory(compiled, step)
      text = compiled.as_text()
      if self.hlo_dir:
        files.write_text(os.path.join(self.hlo_dir, f"{step}.hlo.txt"), text)
      row: dict[str, Any] = {
        "memory": mem,
        "hbm_fraction": mem["total"] / self.chip.usable_hbm,
        "fits": mem["total"] <= FIT_FRACTION * self.chip.usable_hbm,
        "collectives": collective_table(text, self.mesh),
        "path_bytes": hlo.cross_axis_bytes(text, self.mesh, "path"),
        "dcn_bytes": hlo.dcn_bytes(text),
      }
      if step == "inner":
        flops, nbytes, how = self._inner_cost(compiled)
        W, B, T = self.exp.batch_shape
        t = max(flops / self.peak, nbytes / self.hbm_bw)
        per_device = W * B * T / self.n_devices
        model_flops = {
          conv: flops_lib.model_flops_per_token(self.exp.model_cfg, T, conv) * per_device
          for conv in flops_lib.CONVENTIONS
        }
        row.update(
          flops=flops,
          bytes=nbytes,
          cost_from=how,
          roofline_s=t,
          bound="compute" if flops / self.peak >= nbytes / self.hbm_bw else "memory",
          model_flops=model_flops["causal"],
          model_flops_full=model_flops["full"],
          tokens_per_s=W * B * T / t,
          mfu=model_flops["causal"] / (t * self.peak),
          mfu_full=model_flops["full"] / (t * self.peak),
          cross_path=[c for c in row["collectives"] if "path" in c["axes"]],
        )
      elif step == "outer":
        flops, nbytes = _cost(compiled)
        held = per_device_bytes(self.exp.abstract_state.params)
        levels = {s.level: s.num_modules for s in self.exp.topo.store_groups()}
        row.update(
          flops=flops,
          bytes=nbytes,
          roofline_s=max(flops / self.peak, nbytes / self.hbm_bw),
          # A chip's devices share its DCN link.
          dcn_s=row["dcn_bytes"] * self.devices_per_chip / self.dcn_bytes_per_s,
          # What a chip holds of its paths' modules; the outer step may move
          # twice that (out and back) plus the ‖Δ‖ metric, one float32 per module.
          held_module_bytes=held,
          path_bound=2 * held + 4 * sum(levels.values()),
        )
      if not row["fits"]:
        row["advice"] = self.advice(step, None, mem)
      self.result["steps"][step] = row
    return self.result

  def advice(self, step: str, error: str | None, mem: dict | None = None) -> str:
    """One line: what needs how much, and which switches would help."""
    c, shape = self.config, self.mesh.shape
    usable = self.chip.usable_hbm
    if error is not None:
      parsed = _parse_oom(error)
      need = (
        f"HLO temporaries need {parsed[0] / GiB:.1f} GiB per chip against "
        f"{parsed[1] / GiB:.2f} GiB usable"
        if parsed
        else error
      )
    else:
      need = (
        f"needs {mem['total'] / GiB:.2f} GiB per chip (temporaries "
        f"{mem['temporaries'] / GiB:.2f}, arguments {mem['arguments'] / GiB:.2f}, "
        f"resident state {mem['resident_state'] / GiB:.2f}) against "
        f"{FIT_FRACTION:.0%} of {usable / GiB:.2f} GiB"
      )
    helps = []
    M = int(c.inner.microbatches)
    rows = c.data.batch_size // (M * shape["data"])
    if rows > 1:
      helps.append(
        f"inner.microbatches (now {M}; activations scale with "
        f"{rows} sequences per chip per microbatch)"
      )
    if c.model.remat != "full":
      helps.append(f"model.remat=full (now {c.model.remat})")
    if not c.model.loss_chunk:
      logits = rows * c.data.seq_len * c.model.vocab_size * 4
      helps.append(
        f"model.loss_chunk (the float32 logits are {logits / GiB:.2f} GiB per chip per microbatch)"
      )
    if not c.mesh.get("fsdp", False) and shape["data"] > 1:
      st = self.exp.abstract_state
      state = sum(per_device_bytes(x) for x in (st.params, st.inner_opt, st.store, st.outer_opt))
      helps.append(
        f"mesh.fsdp=True (params + optimizer state {state / GiB:.2f} GiB "
        f"per chip, /{shape['data']})"
      )
    return (
      f"{step} step does not fit on {self.chip_name}: {need}; would help: "
      + ("; ".join(helps) if helps else "more chips per path (mesh.data)")
      + "."
    )


def _g(x: float) -> str:
  return f"{x / GiB:.2f}"


def format_report(r: dict[str, Any]) -> str:
  """The printed report."""
  c = r["config"]
  per_chip = r["devices_per_chip"]
  lines = [
    f"{r['topology']} x {r['slices']} slice(s) = {r['chips']} chips "
    f"({r['chip']['name']}: {r['chip']['peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
    f"{_g(r['chip']['usable_hbm'])} GiB usable HBM per device, "
    f"{r['chip']['hbm_bw'] / 1e9:.0f} GB/s, DCN {r['dcn_gbps_per_chip']:g} Gb/s per chip: "
    f"{r['chip']['dcn_source']})"
    + (
      f"; {per_chip} devices per chip (one per TensorCore): per device "
      f"{r['peak_flops_per_device'] / 1e12:.1f} TFLOP/s, {r['hbm_bw_per_device'] / 1e9:.0f} GB/s"
      if per_chip > 1
      else ""
    ),
    "mesh "
    + " x ".join(f"{a}={n}" for a, n in c["mesh"].items())
    + f"; {c['workers']} workers x {c['batch_per_path']} x {c['seq_len']} tokens; "
    f"microbatches {c['microbatches']}, remat {c['remat']}, fsdp {c['fsdp']}, "
    f"loss_chunk {c['loss_chunk']}, attention {c['attention']} (runs "
    f"{c['attention_runs']}), {c['dtype']}; outer deltas {c['outer_compression']}"
    + (
      f" (blocks of {c['outer_compression_block']}, error feedback {c['outer_error_feedback']})"
      if c["outer_compression"] in ("int8", "fp4")
      else ""
    ),
  ]
  for step, s in r["steps"].items():
    if "memory" not in s:
      lines.append(f"[{step}] DOES NOT FIT: {s['advice']}")
      continue
    m = s["memory"]
    lines.append(
      f"[{step}] per device: arguments {_g(m['arguments'])} + temporaries "
      f"{_g(m['temporaries'])} + outputs {_g(m['outputs'])} + code {_g(m['code'])} "
      f"+ resident state {_g(m['resident_state'])} = {_g(m['total'])} GiB "
      f"({s['hbm_fraction']:.0%} of HBM){'' if s['fits'] else '  DOES NOT FIT'}"
    )
    if "roofline_s" in s and step == "inner":
      lines.append(
        f"[{step}] {s['flops']:.3e} flops, {s['bytes']:.3e} bytes per device "
        f"({s['cost_from']}); roofline {s['roofline_s'] * 1e3:.1f} ms "
        f"({s['bound']}-bound), {s['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {s['mfu']:.1%} causal convention (model flops {s['model_flops']:.3e}: 6 N + "
        f"6 L T H K per token), {s['mfu_full']:.1%} full convention ({s['model_flops_full']:.3e}:"
        " 6 N + 12 L T H K, PaLM)"
      )
    if step == "outer":
      held = s["held_module_bytes"]
      lines.append(
        f"[{step}] {s['flops']:.3e} flops, {s['bytes']:.3e} bytes per device; roofline "
        f"{s['roofline_s'] * 1e3:.1f} ms; across 'path' {s['path_bytes'] / 2**20:.1f} MiB "
        f"per device, of which over DCN {s['dcn_bytes'] / 2**20:.1f} MiB = "
        f"{s['dcn_s'] * 1e3:.0f} ms at {r['dcn_gbps_per_chip']:g} Gb/s per chip"
      )
      lines.append(
        f"[{step}] module bytes of the paths a chip holds: {held / 2**20:.1f} MiB; across "
        f"'path' {s['path_bytes'] / max(held, 1):.2f} x that, over DCN "
        f"{s['dcn_bytes'] / max(held, 1):.2f} x; bound 2 x (+ the ‖Δ‖ metric) = "
        f"{s['path_bound'] / 2**20:.1f} MiB: "
        + ("within" if s["path_bytes"] <= s["path_bound"] else "OVER THE BOUND")
      )
    for col in s["collectives"]:
      lines.append(
        f"    {col['op']:<26} x{col['count']:<4} {col['bytes'] / 2**20:10.2f} MiB"
        f"  groups of {col['group_size']} over {','.join(col['axes']) or '-'}"
        f"  e.g. {col['example_group'][:8]}"
      )
    if step == "inner" and s.get("cross_path"):
      lines.append(
        f"[inner] ERROR: {len(s['cross_path'])} collective kinds span 'path': "
        "paths must not talk during the inner phase."
      )
    if not s["fits"]:
      lines.append(f"[{step}] {s['advice']}")
  return "\n".join(lines)


def ok(r: dict[str, Any]) -> bool:
  return all(s["fits"] and not s.get("cross_path") for s in r["steps"].values())


_FLAGS: dict[str, Any] = {}


def _define_flags() -> None:
  """The command's flags: defined only when it runs, so importing aot adds none."""
  _FLAGS["config"] = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file (configs/*.py); override fields with --config.section.field=value.",
    lock_config=True,
  )
  _FLAGS["topology"] = flags.DEFINE_string(
    "topology",
    None,
    "TPU topology of one slice as libtpu names it, CHIP:AxB[xC] "
    f"with CHIP in {sorted(CHIPS)}, e.g. v5e:4x4 (a v5litepod-16) or v5p:2x2x4.",
  )
  _FLAGS["slices"] = flags.DEFINE_integer("slices", 1, "Slices (multislice over DCN).")
  _FLAGS["out"] = flags.DEFINE_string("out", None, "Also write the report here as JSON.")
  _FLAGS["steps"] = flags.DEFINE_list(
    "steps", ["inner", "outer", "eval"], "Steps to compile: inner, outer, eval."
  )
  _FLAGS["dcn_gbps"] = flags.DEFINE_float(
    "dcn_gbps",
    None,
    "DCN Gb/s per chip for the outer step's time estimate (default: the chip's, aot.CHIPS: "
    "v5e 25, v5p 50, v6e 100).",
  )
  _FLAGS["hlo_dir"] = flags.DEFINE_string(
    "hlo_dir", None, "Also write each step's compiled TPU HLO text here (STEP.hlo.txt)."
  )
  _FLAGS["verbose_errors"] = errors.VERBOSE_ERRORS
  flags.declare_key_flag("verbose_errors")  # errors.py's: --help lists it.
  flags.register_validator(
    "dcn_gbps",
    lambda v: v is None or v > 0,
    "the outer step's DCN time needs a bandwidth: give --dcn_gbps > 0",
  )
  flags.mark_flags_as_required(["config", "topology"])


def _fail(e: BaseException, verbose: bool) -> None:
  """A bad input: its one line on stderr and exit status 1 (with `verbose`, the traceback)."""
  if verbose:
    raise e
  print(errors.one_line(e), file=sys.stderr, flush=True)
  sys.exit(1)


def main(argv):
  verbose = _FLAGS["verbose_errors"].value
  try:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag=value.")
    unknown = set(_FLAGS["steps"].value) - {"inner", "outer", "eval"}
    if unknown:
      raise app.UsageError(f"--steps: unknown {sorted(unknown)}; use inner, outer, eval.")
    config = _FLAGS["config"].value
    # What can be checked without libtpu, before it starts: the config, topology and --out.
    config_check.validate(config, for_run=False)
    check_topology(_FLAGS["topology"].value, _FLAGS["slices"].value)
    if _FLAGS["out"].value:
      files.check_writable(_FLAGS["out"].value, f"--out={_FLAGS['out'].value}", file=True)
    report = Report(
      config,
      _FLAGS["topology"].value,
      _FLAGS["slices"].value,
      _FLAGS["dcn_gbps"].value,
      hlo_dir=_FLAGS["hlo_dir"].value,
    )
    result = report.run(_FLAGS["steps"].value)
  # ValueError: AotError, ConfigError (MeshError) and what only the mesh and the model show.
  except (ValueError, errors.UserError, app.UsageError) as e:
    _fail(e, verbose)
  print(format_report(result))
  if _FLAGS["out"].value:
    files.write_json(_FLAGS["out"].value, result, indent=1, sort_keys=False)
  sys.exit(0 if ok(result) else 1)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing: a misspelt --config.a.b, a bad config file or flag is one line, status 1."""
  verbose = "--verbose_errors" in argv
  try:
    config_check.check_config_args(argv)
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(config_check.flag_error(e), verbose)
  except (errors.ConfigError, errors.UserError) as e:
    _fail(e, verbose)


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=_parse_flags)
