"""The AOT report: a config's steps compiled for a topology, and the numbers they give.

Per step: the per-chip memory (arguments, temporaries, outputs, and the rest of
the training state that stays resident) against the chip's HBM, XLA's flops and
bytes, two roofline estimates of its time (`roofline`: the ceiling's
max(flops / peak, bytes / HBM bandwidth), perfect overlap, and the floor's sum,
no overlap), tokens/s and MFU at both, and the collectives with the mesh axes
they span (`Report.run`, printed by `format_report`; `ok` is the command's exit
status).
"""
# pylint: disable=invalid-name

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from dipaco_jax import hlo
from dipaco_jax.aot import codec as codec_lib
from dipaco_jax.aot import compile as compile_lib
from dipaco_jax.aot.compile import FIT_FRACTION
from dipaco_jax.aot.compile import GiB
from dipaco_jax.core import attention as attention_lib
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.core import flops as flops_lib
from dipaco_jax.core import inner as inner_lib
from dipaco_jax.core import sharding
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.io import files


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
    self.chip_name, self.chip = compile_lib.chip_of(topology)
    self.dcn_gbps = self.chip.dcn_gbps if dcn_gbps is None else dcn_gbps
    self.dcn_bytes_per_s = self.dcn_gbps * 1e9 / 8
    devices = compile_lib.topology_devices(topology, slices)
    self.devices_per_chip = compile_lib.devices_per_chip(topology, slices, devices)
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
        "outer_compression": self.exp.recipe.outer_cfg.compression,  # "auto" chosen.
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
    total = sum(compile_lib.per_device_bytes(v) for k, v in parts.items() if k not in args)
    if self.exp.recipe.feedback and step != "outer":
      # Error-feedback residuals (an outer-step argument).
      total += compile_lib.per_device_bytes(st.ef)
    if self.exp.recipe.compressed and step != "outer":
      # The spmd loop's copy of each worker's params at its phase's start.
      total += compile_lib.per_device_bytes(st.params)
    if self.config.early_stopping.get("enabled", False):
      total += compile_lib.per_device_bytes(st.params)  # BestPaths' copy of the params.
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
      return exp.inner_step, (st.params, st.inner_opt, compile_lib.abstract_batch(exp))
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
    return exp.eval_step, (st.params, compile_lib.abstract_batch(exp))

  def _inner_cost(self, compiled) -> tuple[float, float, str, str | None]:
    """Flops, bytes, how they were counted, and what is missing (None) of the whole inner step.

    XLA's cost analysis counts a loop body once. The microbatch scan holds
    the whole forward and backward pass, and the rest of the step runs once
    after it (the mean gradient, the optimizer update, the metrics:
    inner.finish_step): M x (the step) - (M - 1) x (that rest, compiled alone,
    `finish_compiled`; where even that does not fit, the fourth value says so in one line).
    Only the scan's setup (its float32 gradient sums zeroed) is still counted
    M times. Inside it, the chunked loss's loop counts one of its n chunks; the
    other n - 1 are added as XLA counts one chunk's value and gradient
    (`inner.chunk_loss`, forward and backward) compiled alone for one chip's
    rows (`_chunk_cost`). The Pallas attention
    kernels, 0 FLOPs to XLA, are added from their shapes (`kernel_flops`, every
    trip counted); their bytes are XLA's count of their operands and results.
    """
    flops, nbytes = compile_lib.cost(compiled)
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
    missing = None
    if M > 1:
      flops, nbytes = M * flops, M * nbytes
      how = [f"{M} x (" + " ".join(how) + ")"]
      try:
        oflops, obytes = compile_lib.cost(self.finish_compiled())
        flops, nbytes = flops - (M - 1) * oflops, nbytes - (M - 1) * obytes
        how.append(f"- {M - 1} x (the step after its scan)")
      except compile_lib.OutOfMemory as e:
        # Not subtracted: the optimizer update counted M times, not once. An upper bound on
        # the step's flops and bytes (a lower bound on its MFU), named as such.
        missing = (
          f"the step after its scan (mean gradient, optimizer update) compiled alone does "
          f"not fit ({self.oom_need(str(e))}), so it is counted {M} times, not once: flops and "
          f"bytes are upper bounds, the MFU and tokens/s lower bounds"
        )
    kflops, calls = compile_lib.kernel_flops(
      compiled.as_text(), self.exp.model_cfg, int(c.data.seq_len)
    )
    if calls:
      flops += kflops
      how.append(f"+ {calls} attention kernel calls ({kflops:.3e} flops)")
    return flops, nbytes, " ".join(how), missing

  def finish_compiled(self):
    """The inner step's part after its microbatch scan (recipe.finish_step), compiled alone.

    Params and optimizer state donated, as the step donates them (experiment.inner_step), so
    its outputs alias them and it needs no more HBM than the step: dense_1b's on v6e:2x4 takes
    19.0 GiB so, and asked 33.2 GiB of 31.25 undonated (libtpu 0.0.42).
    """
    exp, st = self.exp, self.exp.abstract_state
    per_worker = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("path"))
    ps, opt = exp.state_sharding.params, exp.state_sharding.inner_opt
    finish = jax.jit(
      jax.vmap(exp.recipe.finish_step, spmd_axis_name="path"),
      in_shardings=(ps, opt, ps, per_worker, per_worker),
      out_shardings=(ps, opt, per_worker),
      donate_argnums=(0, 1),
    )
    sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), st.params)
    scalar = jax.ShapeDtypeStruct((exp.topo.num_workers,), np.float32)
    return compile_lib.compile_step(finish, st.params, st.inner_opt, sums, scalar, scalar)

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
    f1, b1 = compile_lib.cost(compile_lib.compile_step(fwd, *map(arg, args)))
    f2, b2 = compile_lib.cost(compile_lib.compile_step(bwd, jax.tree.map(arg, vjp_fn), arg(out)))
    return f1 + f2, b1 + b2

  def run(self, steps=("inner", "outer", "eval")) -> dict[str, Any]:
    for step in steps:
      jitted, args = self._args(step)
      try:
        compiled = compile_lib.compile_step(jitted, *args)
      except compile_lib.OutOfMemory as e:
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
        "collectives": compile_lib.collective_table(text, self.mesh),
        "path_bytes": hlo.cross_axis_bytes(text, self.mesh, "path"),
        "dcn_bytes": hlo.dcn_bytes(text),
      }
      if step == "inner":
        row.update(self._inner_row(compiled, row["collectives"]))
      elif step == "outer":
        row.update(self._outer_row(compiled, row["dcn_bytes"]))
      else:
        row.update(self._eval_row(compiled))
      if not row["fits"]:
        row["advice"] = self.advice(step, None, mem)
      self.result["steps"][step] = row
    return self.result

  def roofline(self, flops: float, nbytes: float) -> dict[str, Any]:
    """Two roofline estimates of a step's time from XLA's counts, neither a timing.

    ceiling: max(flops / peak, bytes / HBM bandwidth), compute and memory traffic
    overlapped perfectly; floor: their sum, no overlap. Both take the MXU at peak,
    XLA's static byte count and no time for collectives.
    """
    r = flops_lib.roofline(flops, nbytes, self.peak, self.hbm_bw)
    return dict(
      flops=flops,
      bytes=nbytes,
      compute_s=r["compute_s"],
      memory_s=r["memory_s"],
      roofline_ceiling_s=r["step_s_overlap"],
      roofline_floor_s=r["step_s_serial"],
      bound=r["bound"],
    )

  def _inner_row(self, compiled, collectives: list[dict]) -> dict[str, Any]:
    """The inner step's roofline estimates, tokens/s and MFU at each, its collectives over 'path'.

    At the ceiling of a compute-bound step the MFU is model FLOPs / compiled FLOPs: how much
    of what the compiled program computes the model needs (`flops_efficiency`), not a speed.
    """
    flops, nbytes, how, missing = self._inner_cost(compiled)
    W, B, T = self.exp.batch_shape
    row = self.roofline(flops, nbytes)
    per_device = W * B * T / self.n_devices
    model_flops = {
      conv: flops_lib.model_flops_per_token(self.exp.model_cfg, T, conv) * per_device
      for conv in flops_lib.CONVENTIONS
    }
    for end in ("ceiling", "floor"):
      t = row[f"roofline_{end}_s"]
      row[f"tokens_per_s_{end}"] = W * B * T / t
      row[f"mfu_{end}"] = model_flops["causal"] / (t * self.peak)
      row[f"mfu_full_{end}"] = model_flops["full"] / (t * self.peak)
    if missing:
      row["cost_missing"] = missing  # One line: which part of the estimate is off, and why.
    return dict(
      row,
      cost_from=how,
      model_flops=model_flops["causal"],
      model_flops_full=model_flops["full"],
      flops_efficiency=model_flops["causal"] / flops,
      cross_path=[c for c in collectives if "path" in c["axes"]],
    )

  def _eval_row(self, compiled) -> dict[str, Any]:
    """The evaluation step's roofline estimates: XLA's count of its microbatch scan M times."""
    flops, nbytes = compile_lib.cost(compiled)
    M = int(self.config.inner.microbatches)
    how = "compiled step" if M == 1 else f"{M} x (compiled step)"
    chunk = int(self.config.model.loss_chunk)
    if chunk and self.config.data.seq_len // chunk > 1:
      how += " (its loss-chunk loop's body counted once: a lower bound)"
    return dict(self.roofline(M * flops, M * nbytes), cost_from=how)

  def _outer_row(self, compiled, dcn_bytes: int) -> dict[str, Any]:
    """The outer step's cost and roofline, its DCN time, and the bound on what crosses 'path'."""
    flops, nbytes = compile_lib.cost(compiled)
    held = compile_lib.per_device_bytes(self.exp.abstract_state.params)
    levels = {s.level: s.num_modules for s in self.exp.topo.store_groups()}
    return dict(
      self.roofline(flops, nbytes),
      # A chip's devices share its DCN link.
      dcn_s=dcn_bytes * self.devices_per_chip / self.dcn_bytes_per_s,
      # What a chip holds of its paths' modules; the outer step may move
      # twice that (out and back) plus the ‖Δ‖ metric, one float32 per module.
      held_module_bytes=held,
      path_bound=2 * held + 4 * sum(levels.values()),
      codec=codec_lib.codec_row(self),  # The codec's HBM time against the DCN time it saves.
    )

  @staticmethod
  def oom_need(error: str) -> str:
    """What a compile that ran out of HBM asked for, from libtpu's message."""
    parsed = compile_lib.parse_oom(error)
    if not parsed:
      return error
    return (
      f"HLO temporaries need {parsed[0] / GiB:.1f} GiB per chip against "
      f"{parsed[1] / GiB:.2f} GiB usable"
    )

  def advice(self, step: str, error: str | None, mem: dict | None = None) -> str:
    """One line: what needs how much, and which switches would help."""
    c, shape = self.config, self.mesh.shape
    usable = self.chip.usable_hbm
    if error is not None:
      need = self.oom_need(error)
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
      state = sum(
        compile_lib.per_device_bytes(x) for x in (st.params, st.inner_opt, st.store, st.outer_opt)
      )
      helps.append(
        f"mesh.fsdp=True (params + optimizer state {state / GiB:.2f} GiB "
        f"per chip, /{shape['data']})"
      )
    return (
      f"{step} step does not fit on {self.chip_name}: {need}; would help: "
      + ("; ".join(helps) if helps else "more chips per path (mesh.data)")
      + "."
    )
