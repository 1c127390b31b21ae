"""Tokens/s of WorkerBatcher on one worker's shard of the embedded corpus (no TensorFlow).

  python benchmarks/data_pipeline.py --out /tmp/data_pipeline.json

Writes (or reuses) train shards for --num_workers workers, then times next_batch() on worker 0
for each
(seq_len, batch_size) in --shapes. The trainer's tiny config consumes ~30k tokens/s per process,
so the target is >= 300k tokens/s.
"""

import argparse
import json
import os
import platform
import tempfile
import time

from dipaco_jax import data
from dipaco_jax.config import schema


def time_batcher(shard_set, seq_len: int, batch_size: int, seconds: float) -> dict:
  """Batches and tokens per second of next_batch() on path 0 (after one warm-up batch)."""
  batcher = data.WorkerBatcher(
    shard_set, "train", [0], seq_len=seq_len, batch_size=batch_size, seed=0
  )
  batcher.next_batch()
  n, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    batcher.next_batch()
    n += 1
  elapsed = time.perf_counter() - start
  return {
    "seq_len": seq_len,
    "batch_size": batch_size,
    "batches": n,
    "batches_per_s": round(n / elapsed, 1),
    "tokens_per_s": round(n * seq_len * batch_size / elapsed),
    "epochs_read": batcher.get_state()["workers_position"][0][0],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shard_dir", default=None, help="default: a temp dir")
  parser.add_argument("--num_workers", type=int, default=4)
  parser.add_argument("--shapes", default="128x8,256x8,1024x8", help="seq_len x batch_size, ...")
  parser.add_argument("--seconds", type=float, default=5.0, help="per shape")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  args = parser.parse_args()
  shard_dir = args.shard_dir or os.path.join(tempfile.mkdtemp(), "shards")
  cfg = schema.base().data  # The embedded corpus, its tokenizer, seed 0, top-1.
  start = time.perf_counter()
  shard_set = data.prepare_shards(cfg, args.num_workers, shard_dir)
  prepare_s = time.perf_counter() - start
  sizes = shard_set.sizes("train")
  results = {
    "device": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "num_workers": args.num_workers,
    "path0_tokens": int(sizes[0]),
    "path0_docs": int(shard_set.num_docs("train")[0]),
    "prepare_shards_s": round(prepare_s, 1),
    "runs": [],
  }
  for shape in args.shapes.split(","):
    seq_len, batch_size = (int(x) for x in shape.split("x"))
    results["runs"].append(time_batcher(shard_set, seq_len, batch_size, args.seconds))
    print(json.dumps(results["runs"][-1]), flush=True)
  print(
    f"prepare_shards ({args.num_workers} workers, train+validation): {prepare_s:.1f} s; "
    f"path 0 holds {sizes[0]:,} tokens"
  )
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
