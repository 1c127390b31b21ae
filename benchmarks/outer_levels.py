r"""The outer step's bytes per level, compiled for a TPU topology (libtpu; no TPU runs it).

  python benchmarks/outer_levels.py --config=configs/dipaco_16x16.py --topology=v5p:8x8x4 \
    --slices=4 --set outer.compression=fp4 --levels=level_1,level_2 --out=/tmp/levels.json

One program per level, the outer step over that level's store groups alone (the
fragment program of `outer.fragments`, `Experiment.outer_fragment`), and the whole step:
each one's bytes across 'path' and over the DCN per chip (`hlo.cross_axis_bytes`,
`hlo.dcn_bytes`), which level's exchange crosses the slices and which stays inside one
(core/slices.py). Every program also sends the ‖Δ‖ metric's ΣK float32 over every axis.
"""
# pylint: disable=invalid-name

import argparse
import json
import sys
import time

from dipaco_jax import aot
from dipaco_jax import config_check
from dipaco_jax import hlo
from dipaco_jax.aot import compile as compile_lib
from dipaco_jax.core import slices

from timing import field_overrides  # Beside us.

MiB = 2**20


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="a config file, e.g. configs/dipaco_16x16.py")
  p.add_argument("--topology", required=True, help="e.g. v5p:8x8x4")
  p.add_argument("--slices", type=int, default=1, help="slices of that topology")
  p.add_argument("--set", action="append", default=[], help="field=value override (repeatable)")
  p.add_argument("--levels", default="", help="comma list of levels (and 'all'); default every")
  p.add_argument("--out", default="", help="JSON file to write")
  return p.parse_args(argv)


def main(argv) -> dict:
  a = parse_args(argv)
  cfg = config_check.load(a.config, **field_overrides(a.set))
  rep = aot.Report(cfg, a.topology, slices=a.slices)
  exp, mesh = rep.exp, rep.mesh
  args = rep._args("outer")[1]  # pylint: disable=protected-access
  S = slices.mesh_slices(mesh)
  levels = {}
  for s in exp.topo.store_groups():
    levels.setdefault(s.level, []).append(s)
  rows, todo = {}, [*levels.items(), ("all", None)]
  if a.levels:
    want = a.levels.split(",")
    unknown = sorted(set(want) - {name for name, _ in todo})
    if unknown:
      raise SystemExit(f"--levels: unknown {unknown}; the config's are {[n for n, _ in todo]}.")
    todo = [(name, g) for name, g in todo if name in want]
  for level, groups in todo:
    names = None if groups is None else frozenset(s.name for s in groups)
    start = time.time()
    text = compile_lib.compile_step(exp.outer_fragment(names), *args).as_text()
    local = groups is not None and all(slices.is_local(s, mesh.shape["path"], S) for s in groups)
    rows[level] = {
      "groups": sorted(names) if names else "all",
      "slice_local": local,
      "path_bytes": hlo.cross_axis_bytes(text, mesh, "path"),
      "dcn_bytes": hlo.dcn_bytes(text),
      "compile_s": round(time.time() - start, 1),
    }
    r = rows[level]
    print(
      f"{level:>8}: across 'path' {r['path_bytes'] / MiB:9.1f} MiB, over DCN "
      f"{r['dcn_bytes'] / MiB:9.1f} MiB a chip{' (slice-local)' if local else ''}",
      flush=True,
    )
  out = {
    "config": a.config,
    "topology": a.topology,
    "slices": a.slices,
    "set": a.set,
    "mesh": dict(mesh.shape),
    "levels": rows,
  }
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
