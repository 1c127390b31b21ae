r"""The training start's import time and peak RSS, and whether it imports TensorFlow.

  python benchmarks/startup.py [--repeats 5] [--out /tmp/startup.json]

Each repeat is a fresh Python process that imports what `python -m dipaco_jax.main` imports
before its first step (main, cli, train) and opens the run's metrics writer in a temporary
workdir: the fixed cost every run pays before any data or compilation. Reports the median
wall seconds (imports; imports + metrics writer), CPU seconds (user + system, steadier than wall
time on a loaded machine) and peak RSS, and the figures of every repeat.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the child: the clock starts before the first project import.
_CHILD = r"""
import time
t0 = time.perf_counter()
import json, resource, sys, tempfile
from dipaco_jax import cli, main, train
from dipaco_jax.io import metrics
t_import = time.perf_counter() - t0
with tempfile.TemporaryDirectory() as d:
  log = metrics.MetricsLogger(d)
  log.close()
print(json.dumps({
  "import_s": t_import,
  "start_s": time.perf_counter() - t0,
  "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  "tensorflow_imported": "tensorflow" in sys.modules,
}))
"""


def measure(repeats: int) -> dict:
  """Median of `repeats` fresh processes, and each one's figures."""
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
  runs = []
  for _ in range(repeats):
    out = subprocess.run(
      [sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  return {
    "import_s": statistics.median(r["import_s"] for r in runs),
    "start_s": statistics.median(r["start_s"] for r in runs),
    "cpu_s": statistics.median(r["cpu_s"] for r in runs),
    "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
    "tensorflow_imported": any(r["tensorflow_imported"] for r in runs),
    "runs": runs,
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=5, help="fresh processes measured")
  ap.add_argument("--out", default="", help="JSON file for the figures (default: stdout only)")
  args = ap.parse_args()
  result = {"machine": f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f} at start"}
  result.update(measure(args.repeats))
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
