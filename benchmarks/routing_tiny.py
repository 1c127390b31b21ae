"""Routed perplexity of configs/tiny.py under random, k-means and discriminative sharding.

  python benchmarks/routing_tiny.py --root=/tmp/dipaco_routing --out=routing_tiny.json

Runs the documented CLIs one after another (route, train, evaluate) for each sharding and
collects routed perplexity (once per sequence, every W tokens, oracles), early stopping, and
the router's domain purity on the router split (phase 0) and on validation.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from dipaco_jax.routing import report as router_report

RUNS = {  # name -> config overrides
  "random": [],
  "kmeans": ["--config.routing.router=kmeans"],
  "discriminative": [
    "--config.routing.router=kmeans",
    "--config.routing.discriminative_at_outer_step=5",
  ],
  # Control: the same re-shard without restarting the LR schedule.
  "discriminative_no_restart": [
    "--config.routing.router=kmeans",
    "--config.routing.discriminative_at_outer_step=5",
    "--config.routing.restart_schedule=False",
  ],
}


def _cli(module: str, workdir: str, extra: list[str]) -> float:
  cmd = [
    sys.executable,
    "-m",
    f"dipaco_jax.{module}",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *extra,
  ]
  print("$", " ".join(cmd[1:]), flush=True)
  t = time.perf_counter()
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
  return time.perf_counter() - t


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--root", default="/tmp/dipaco_routing")
  ap.add_argument("--out", default="routing_tiny.json")
  ap.add_argument("--runs", default=",".join(RUNS))
  ap.add_argument("--common", default="", help="Overrides for every run, space separated.")
  args = ap.parse_args()
  out = {}
  for name in args.runs.split(","):
    wd = os.path.join(args.root, name)
    extra = list(RUNS[name]) + args.common.split()
    if name.startswith("discriminative"):  # Same phase-0 k-means shards as the k-means run.
      extra.append(f"--config.data.shard_dir={os.path.join(args.root, 'kmeans', 'shards')}")
    secs = {
      "route": _cli("route", wd, extra),
      "train": _cli("main", wd, extra),
      "evaluate": _cli("evaluate", wd, extra),
    }
    evals = sorted(f for f in os.listdir(os.path.join(wd, "eval")) if f.endswith(".json"))
    reports = json.load(open(os.path.join(wd, "eval", evals[-1])))
    out[name] = {
      "seconds": secs,
      "route_report": open(os.path.join(wd, "router", "phase_0", "report.md")).read(),
      **{
        k: {
          f: r[f]
          for f in (
            "ppl",
            "switches_per_sequence",
            "per_path",
            "own_shard",
            "router",
            "phase",
            "scored_tokens",
            "num_sequences",
          )
        }
        for k, r in reports.items()
      },
    }
    for k, r in reports.items():  # Validation: once-routed path vs document domain.
      names = sorted(set(r["domains"]))
      dom = router_report.report(
        r["sequence_paths"],
        len(r["per_path"]["loss"]),
        [names.index(d) for d in r["domains"]],
        names,
      )
      out[name][k].update(purity=dom.purity, nmi=dom.nmi)
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  print(
    json.dumps(
      {k: {p: v[p]["ppl"] for p in ("store", "best") if p in v} for k, v in out.items()}, indent=1
    )
  )


if __name__ == "__main__":
  main()
