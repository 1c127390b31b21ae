"""The reproduction's command line (benchmarks/reproduce.py): one seed's arms, or a summary."""

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

from reproduction import arms
from reproduction import modes
from reproduction import report
from reproduction import runs

DESCRIPTION = (
  "The paper's comparison at small scale on the embedded corpus: one command, table and plots."
)


def main(argv=None):
  ap = argparse.ArgumentParser(description=DESCRIPTION)
  ap.add_argument("--out", default="/tmp/dipaco_repro", help="Output directory (resumable).")
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument(
    "--quick", action="store_true", help="Smaller model, 1/4 of the data: ~10 CPU-minutes."
  )
  mode.add_argument("--smoke", action="store_true", help="Seconds-long sizes (CI).")
  mode.add_argument(
    "--capacity",
    action="store_true",
    help="The capacity comparison (docs/results/capacity.md): θ̄, DiLoCo's saturation gate, "
    "the arms and the levers, one --seed per --out; each finished arm's JSON goes to --results.",
  )
  mode.add_argument(
    "--capacity_smoke",
    action="store_true",
    help="--capacity's plumbing at tiny sizes (CI); no number of it is a result.",
  )
  mode.add_argument(
    "--capacity_page",
    action="store_true",
    help="Write docs/results/capacity.{md,json} from the arm JSONs under --results.",
  )
  mode.add_argument(
    "--long",
    action="store_true",
    help="The long comparison, per-worker batch near the gradient noise scale: the quick model "
    "at batch 32 x 96, 240 + 240 steps, all data; runs the --models=long list unless --models "
    "is given. One --seed per --out.",
  )
  mode.add_argument(
    "--long_b4",
    action="store_true",
    help="The long comparison as first run (batch 4 x 96, ~0.04x the noise scale; 480 + 480 "
    "steps): the results page's appendix.",
  )
  ap.add_argument(
    "--models",
    default="",
    help=f"Comma list of models to run (pretraining always runs first); also "
    f"{', '.join(arms.INVESTIGATIONS)}; 'long' is the long comparison: "
    f"{','.join(arms.LONG_MODELS)}.",
  )
  ap.add_argument(
    "--summarize",
    default="",
    metavar="DIR1,DIR2,...",
    help="Only summarize: mean and range per model over these runs' results.json (one per "
    "seed), written to --out as summary.json and summary.md.",
  )
  ap.add_argument(
    "--arms_json",
    default="",
    help='With --summarize: where to write the arms per seed ({"arms": {name: {ppl, grid, '
    "shards, ...}}}; docs/results/specialisation.json); default <out>/specialisation.json.",
  )
  ap.add_argument(
    "--size",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="Override one field of the mode's sizes, e.g. --size steps=480 "
    "(investigations; repeatable).",
  )
  ap.add_argument(
    "--seed",
    type=int,
    default=0,
    help="data.seed of every run: batch order and the i.i.d. shards (noise checks).",
  )
  ap.add_argument(
    "--sqrt_paths_cap",
    type=float,
    default=0.0,
    help="outer.sqrt_paths_cap of the DiPaCo grids: the ×√P factor at most this (0 = none).",
  )
  ap.add_argument(
    "--sqrt_paths",
    default="multiply",
    choices=("multiply", "divide", "none"),
    help="outer.sqrt_paths of the DiPaCo grids (DiLoCo uses none, flat MoE has "
    "one path per module).",
  )
  ap.add_argument(
    "--stage",
    default="all",
    choices=("gate", "all"),
    help="--capacity: the gate only (θ̄ and DiLoCo P = 1..8), or everything.",
  )
  ap.add_argument(
    "--results",
    default=os.path.join(runs.ROOT, "benchmarks", "results", "capacity"),
    help="--capacity: where each finished arm's JSON lands (<results>/seed<S>/<arm>.json).",
  )
  ap.add_argument(
    "--page",
    default=os.path.join(runs.ROOT, "docs", "results", "capacity.md"),
    help="--capacity_page: the page to write (its JSON beside it, .json).",
  )
  args = ap.parse_args(argv)
  if args.capacity_page:
    from reproduction import capacity_page

    command = " ".join(["python", "benchmarks/reproduce.py", *(argv or sys.argv[1:])])
    capacity_page.write(
      args.results, args.page, os.path.splitext(args.page)[0] + ".json", [command]
    )
    print(f"wrote {args.page} and its .json from {args.results}")
    return
  if args.summarize:
    summary = report.summarize([d for d in args.summarize.split(",") if d])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    md = report.summary_markdown(summary)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
      f.write(md)
    arms_path = args.arms_json or os.path.join(args.out, "specialisation.json")
    command = " ".join(["python", "benchmarks/reproduce.py", *(argv or sys.argv[1:])])
    with open(arms_path, "w") as f:
      json.dump(report.arms_json(summary, command), f, indent=1)
    print(md)
    print(f"\nwrote: {args.out}/summary.{{json,md}} and {arms_path} (the arms per seed)")
    return
  name = "smoke" if args.smoke else "quick" if args.quick else "long" if args.long else "full"
  name = "long_b4" if args.long_b4 else name
  name = "capacity" if args.capacity else "capacity_smoke" if args.capacity_smoke else name
  capacity_mode = name.startswith("capacity")
  if capacity_mode and not args.models:
    args.models = ""  # The mode's own plan (capacity.plan).
  if not args.models and not capacity_mode:
    args.models = "long" if name.startswith("long") else ",".join(arms.MODELS)
  s = modes.MODES[name]
  fields = {f.name: f.type for f in dataclasses.fields(modes.Sizes)}
  for item in args.size:
    key, _, value = item.partition("=")
    if key not in fields or not value:
      ap.error(f"--size {item!r}: use FIELD=VALUE with FIELD one of {sorted(fields)}")
    cast = float if fields[key] is float else int
    if "tuple" in str(fields[key]):
      s = dataclasses.replace(s, **{key: tuple(int(v) for v in value.split(","))})
    else:
      s = dataclasses.replace(s, **{key: cast(value)})
  if capacity_mode:
    models = []
  elif args.models == "long":
    models = list(arms.LONG_B4_MODELS if name == "long_b4" else arms.LONG_MODELS)
  else:
    models = [m for m in args.models.split(",") if m]
  unknown = sorted(m for m in models or args.models.split(",") if m and not arms.known(m))
  if unknown:
    ap.error(f"unknown models {unknown}; choose from {[*arms.MODELS, *arms.INVESTIGATIONS]}")
  from dipaco_jax.io import hugepages

  hugepages.maybe_reexec()  # As the CLIs: huge-page malloc for XLA:CPU (docs/performance.md).
  print(modes.REGIME[name], flush=True)  # First: whether this mode can answer the paper's question.
  from dipaco_jax.io import native

  native.choose_platforms()  # As the CLIs: no libtpu start-up errors on a CPU host.
  import jax

  jax.config.update("jax_num_cpu_devices", modes.CPU_DEVICES)
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  if capacity_mode:
    from reproduction import capacity

    capacity.run(s, args)
    return
  os.makedirs(args.out, exist_ok=True)
  started = time.time()
  results = {}
  for m in ["pretrain", *models]:
    print(f"== {m}", flush=True)
    results[m] = runs.train_run(m, s, args.out, args.sqrt_paths, args.seed, args.sqrt_paths_cap)
    r = results[m]
    print(
      f"   ppl {r['final']['store']['ppl']['once']:.2f}  train {r['seconds']['train']:.0f}s "
      f"evaluate {r['seconds']['evaluate']:.0f}s",
      flush=True,
    )
  files = report.plot(results, s, args.out)
  record = {
    "mode": name,
    "sizes": dataclasses.asdict(s),
    "sqrt_paths": args.sqrt_paths,
    "sqrt_paths_cap": args.sqrt_paths_cap,
    "seed": args.seed,
    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    "machine": {
      "cpus": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "fake_cpu_devices": modes.CPU_DEVICES,
      "load_average": os.getloadavg(),
    },
    "wall_seconds": time.time() - started,
    "model_seconds": sum(sum(r["seconds"].values()) for r in results.values()),
    "models": results,
    "plots": files,
  }
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(record, f, indent=1)
  md = (
    f"# Reproduction ({name} mode, seed {args.seed})\n\n{report.table(results, s)}\n"
    f"## Shards per phase (training tokens per worker)\n\n{report.shard_table(results)}\n"
    f"## Outer delta norm per level\n\n{report.outer_table(results)}\n"
    f"## Re-routing\n\n{report.window_table(results)}\n"
    f"Training + evaluation: {record['model_seconds'] / 60:.1f} min "
    f"(this call: {record['wall_seconds'] / 60:.1f} min).\n"
  )
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(md)
  print(md)
  bad = [m for m, r in results.items() if not math.isfinite(r["final"]["store"]["ppl"]["once"])]
  if bad:
    raise SystemExit(f"non-finite perplexity for {bad}")
