r"""Do a run's paths specialise? Every path scored on every path's held-out documents.

  python benchmarks/specialisation.py --workdir=RUN [--step=S] [--params=store|best] \
      [--max_docs=N] [--out=RUN/specialisation_step<S>.json]

From the run's checkpoint (its saved config.json), every path scores every validation
sequence, as `python -m dipaco_jax.evaluate` does for its oracle: the first
`routing.prefix_len` tokens are not scored. Path p's held-out documents are those of its
workers' validation shards. Printed (markdown) and written as JSON:

  - the loss grid M[p, q]: path p's mean per-token loss on path q's shard, with each path's
    own shard minus its other shards (row) and each shard under its own path minus the
    other paths (column); negative = specialised;
  - routed vs own shard's path vs random path (the loss averaged over the paths) vs oracle
    (each document's best path), and the share of documents whose routed path is their best;
  - per document domain (metadata; nothing trains on it): routed and oracle loss, the path
    most of its documents are routed to, and the path best on it.

How to read it: docs/routing.md, "Reading the specialisation report".
"""
# pylint: disable=g-import-not-at-top

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True, help="A run directory with checkpoints.")
  ap.add_argument("--step", type=int, default=None, help="Checkpoint step (default: latest).")
  ap.add_argument(
    "--params",
    default="store",
    choices=("store", "best"),
    help="The trained modules (store) or the per-path early-stopping set (best).",
  )
  ap.add_argument(
    "--max_docs",
    type=int,
    default=None,
    help="Validation documents, a fixed subset (default: the run's eval.max_docs; 0 = all).",
  )
  ap.add_argument("--out", default="", help="JSON path (default: in the workdir).")
  args = ap.parse_args(argv)
  if args.max_docs is not None and args.max_docs < 0:
    ap.error("--max_docs must be >= 0")
  from dipaco_jax import errors

  try:
    report(args)
  except Exception as e:  # pylint: disable=broad-except
    if not errors.is_user_error(e):
      raise
    errors.fail(e, verbose=False)  # One line: a one-path run, no held-out shards, no checkpoint.


def report(args) -> None:
  """Scores the run, prints the report and writes its JSON."""
  from dipaco_jax import evaluate
  from dipaco_jax.core import topology
  from dipaco_jax.io import native
  from dipaco_jax.routing import specialisation as spec_lib

  native.choose_platforms()  # As the CLIs: no libtpu start-up errors on a CPU host.
  config = evaluate.config_from_workdir(args.workdir)
  spec_lib.check_paths(topology.from_config(config), args.workdir)  # Before restoring.
  import jax

  if config.mesh.cpu_devices:
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  run = evaluate.load_run(config, args.workdir, args.step)
  spec = evaluate.specialisation(run, params=args.params, max_docs=args.max_docs)
  out = record(run, spec, args.params)
  path = write(out, args.out or default_path(args.workdir, run.step))
  print(f"{args.workdir}: step {run.step}, params {args.params}, {out['grid']}\n")
  print(spec_lib.to_markdown(spec, out["path_labels"]))
  print(f"wrote: {path}")


def default_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, f"specialisation_step{step}.json")


def write(out: dict, path: str) -> str:
  """The report's JSON at `path` (strict JSON: a NaN is an error, not a token); returns it."""
  with open(path, "w") as f:
    json.dump(out, f, indent=1, allow_nan=False)
  return path


def record(run, spec, params: str) -> dict:
  """The report's JSON: the run, the step, the grid and every number of `spec`."""
  topo = run.exp.topo
  return {
    "workdir": run.workdir,
    "step": run.step,
    "params": params,
    "phase": run.phase,
    "grid": topo.describe(),
    "path_labels": [topo.path_label(p) for p in range(topo.num_paths)],
    "prefix_len": run.config.routing.prefix_len,
    **spec.as_dict(),
  }


if __name__ == "__main__":
  main()
