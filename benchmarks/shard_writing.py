r"""Shard writing: documents/s and tokens/s per process with N processes; the C4 estimate.

  python benchmarks/shard_writing.py --processes 1,2 \
      --out benchmarks/results/shard_writing_cpu_2core.json

For each N, runs the documented offline job, N OS processes of
`python -m dipaco_jax.route --config=configs/tiny.py --num_processes=N --process_id=i`
on the embedded corpus (tokenize with the shipped 8k SentencePiece model, assign i.i.d. to
the tiny config's 4 paths, write ArrayRecord parts), and reads each part's done-marker: the
documents it read and the seconds its writing took (process 0's routing report is not counted).
The C4 estimate divides --c4_tokens by (train tokens/s per process x processes) for each pool.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from etils import epath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, processes): the training job's processes on a TPU pod slice, or an offline CPU job.
POOLS = (
  ("v4-128 training job: 16 hosts x 1 process (jax.process_count() = 16)", 16),
  ("v4-128 hosts as an offline job: 16 hosts x 32 processes", 512),
  ("offline CPU job: 8 VMs x 32 processes (e.g. n2-highcpu-32)", 256),
)


def run_job(workdir: str, num_processes: int, extra: list[str]) -> float:
  """Runs the N processes of the offline job at once; returns its wall-clock seconds."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  start = time.perf_counter()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "dipaco_jax.route",
        f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
        f"--workdir={workdir}",
        f"--num_processes={num_processes}",
        f"--process_id={i}",
        *extra,
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(num_processes)
  ]
  for i, p in enumerate(procs):
    _, err = p.communicate()
    if p.returncode:
      raise SystemExit(f"process {i} of {num_processes} failed:\n{err[-3000:]}")
  return time.perf_counter() - start


def part_rates(shard_dir: str, num_processes: int) -> list[dict]:
  """Per process: documents, train tokens and seconds of its train and validation parts."""
  out = []
  for i in range(num_processes):
    row = {"process": i, "docs": 0, "tokens": 0, "seconds": 0.0}
    for split in ("train", "validation"):
      name = f"part-{i:05d}-of-{num_processes:05d}.json"
      marker = json.loads((epath.Path(shard_dir) / split / "parts" / name).read_text())
      row["docs"] += marker["source_docs"]
      row["tokens"] += sum(marker["tokens"])  # top_k = 1: each document's tokens once
      row["seconds"] += marker["seconds"]
    row["docs_per_s"] = round(row["docs"] / row["seconds"], 1)
    row["tokens_per_s"] = round(row["tokens"] / row["seconds"])
    row["seconds"] = round(row["seconds"], 2)
    out.append(row)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", default="1,2", help="job sizes N to run, comma-separated")
  parser.add_argument("--subsample", type=int, default=1, help="data.subsample (1 = all)")
  parser.add_argument("--c4_tokens", type=float, default=156e9, help="C4 en train tokens (T5 32k)")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  args = parser.parse_args()
  from dipaco_jax.data import tfds_builder  # pylint: disable=g-import-not-at-top

  tfds_builder.prepare()  # Once, before N processes would race to prepare it.
  extra = [f"--config.data.subsample={args.subsample}"]
  results = {
    "device": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "load_before": [round(x, 2) for x in os.getloadavg()],
    "subsample": args.subsample,
    "runs": [],
  }
  for n in (int(x) for x in args.processes.split(",")):
    with tempfile.TemporaryDirectory() as tmp:
      workdir = os.path.join(tmp, "run")
      wall_s = run_job(workdir, n, extra)
      rows = part_rates(os.path.join(workdir, "shards"), n)
    run = {
      "processes": n,
      "wall_s": round(wall_s, 1),
      "load_after": [round(x, 2) for x in os.getloadavg()],
      "per_process": rows,
      "docs_per_s_per_process": round(sum(r["docs_per_s"] for r in rows) / n, 1),
      "tokens_per_s_per_process": round(sum(r["tokens_per_s"] for r in rows) / n),
      "docs_per_s_total": round(sum(r["docs"] for r in rows) / max(r["seconds"] for r in rows), 1),
    }
    results["runs"].append(run)
    print(json.dumps({k: v for k, v in run.items() if k != "per_process"}), flush=True)
  rate = results["runs"][0]["tokens_per_s_per_process"]  # the least contended run
  results["c4_estimate"] = {
    "c4_tokens": args.c4_tokens,
    "tokens_per_s_per_process": rate,
    "pools": [
      {"pool": name, "processes": p, "hours": round(args.c4_tokens / (rate * p) / 3600, 2)}
      for name, p in POOLS
    ],
  }
  for pool in results["c4_estimate"]["pools"]:
    print(f"C4 ({args.c4_tokens:.3g} tokens) on {pool['pool']}: {pool['hours']} h")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
