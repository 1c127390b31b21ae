"""`python -m dipaco_jax.aot`'s flags, its one-line failures and the printed report.

Usage and exit status: the package's __main__.py (what --help prints).
"""

import sys
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

from dipaco_jax import config_check
from dipaco_jax import errors
from dipaco_jax.aot import compile as compile_lib
from dipaco_jax.aot import report as report_lib
from dipaco_jax.io import files


def _g(x: float) -> str:
  return f"{x / compile_lib.GiB:.2f}"


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
    if "roofline_ceiling_s" in s:
      lines.append(
        f"[{step}] {s['flops']:.3e} flops, {s['bytes']:.3e} bytes per device "
        f"({s['cost_from'] if 'cost_from' in s else 'compiled step'}); roofline estimates: "
        f"ceiling {s['roofline_ceiling_s'] * 1e3:.1f} ms = max(compute {s['compute_s'] * 1e3:.1f}"
        f", memory {s['memory_s'] * 1e3:.1f}) ({s['bound']}-bound, perfect overlap), "
        f"floor {s['roofline_floor_s'] * 1e3:.1f} ms (their sum, no overlap)"
      )
    if s.get("cost_missing"):
      lines.append(f"[{step}] cost estimate incomplete: {s['cost_missing']}")
    if "mfu_ceiling" in s:
      lines.append(
        f"[{step}] estimated MFU, roofline ceiling / floor: {s['mfu_ceiling']:.1%} / "
        f"{s['mfu_floor']:.1%} causal convention (model flops {s['model_flops']:.3e}: 6 N + "
        f"6 L T H K per token), {s['mfu_full_ceiling']:.1%} / {s['mfu_full_floor']:.1%} full "
        f"({s['model_flops_full']:.3e}: 6 N + 12 L T H K, PaLM); tokens/s "
        f"{s['tokens_per_s_ceiling']:,.0f} / {s['tokens_per_s_floor']:,.0f}"
      )
      if s["bound"] == "compute":
        lines.append(
          f"[{step}] compute-bound: the ceiling's MFU is model FLOPs / compiled FLOPs "
          f"({s['flops_efficiency']:.1%}, compiled-FLOP efficiency), not a speed"
        )
    if step == "outer":
      held = s["held_module_bytes"]
      lines.append(
        f"[{step}] across 'path' {s['path_bytes'] / 2**20:.1f} MiB "
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
    if s.get("codec"):
      lines.append(codec_line(s["codec"], r))
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


def codec_line(k: dict[str, Any], r: dict[str, Any]) -> str:
  """The outer codec's HBM time against the DCN time it saves (aot/codec.py)."""
  return (
    f"[outer] codec {k['kind']}: encode + decode {k['bytes_per_value']:.1f} B a value "
    f"(XLA's count, compiled alone), twice (up, down) {k['hbm_s'] * 1e3:.1f} ms of HBM time, "
    f"against {k['saved_s'] * 1e3:.1f} ms of DCN saved at {r['dcn_gbps_per_chip']:g} Gb/s "
    f"(float32 {4 * k['sent_values'] / 2**20:.1f} MiB -> {k['wire_bytes'] / 2**20:.1f} MiB a way); "
    f"break-even {k['break_even_gbps']:,.0f} Gb/s; compression=auto picks {k['auto']} here"
  )


def ok(r: dict[str, Any]) -> bool:
  return all(s["fits"] and not s.get("cross_path") for s in r["steps"].values())


_FLAGS: dict[str, Any] = {}


def define_flags() -> None:
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
    f"with CHIP in {sorted(compile_lib.CHIPS)}, e.g. v5e:4x4 (a v5litepod-16) or v5p:2x2x4.",
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
    compile_lib.check_topology(_FLAGS["topology"].value, _FLAGS["slices"].value)
    if _FLAGS["out"].value:
      files.check_writable(_FLAGS["out"].value, f"--out={_FLAGS['out'].value}", file=True)
    report = report_lib.Report(
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


def run() -> None:
  """`python -m dipaco_jax.aot` (aot/__main__.py, after `define_flags`): parse, then `main`."""
  app.run(main, flags_parser=_parse_flags)
