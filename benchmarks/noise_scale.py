r"""The gradient noise scale of a run: the batch (tokens) past which more data per step pays less.

  python benchmarks/noise_scale.py --workdir=RUN [--step=S] [--batch=32] [--groups=8] \
      [--repeats=6] [--path=0] [--interleave=N] [--out=RUN/noise_scale_step<S>.json]

The simple noise scale of McCandlish et al. (2018, "An empirical model of large-batch
training", App. A.1), B_simple = tr(Σ) / |G|²: Σ the per-token gradient covariance, G the
true gradient. Both come from gradient norms at two batch sizes, here a per-worker batch of
`--batch` sequences (B_small tokens) and the average of `--groups` such batches (B_big =
groups x B_small tokens), as a per-worker gradient and the workers' average would be:

  |G|²   ≈ (B_big |g_big|² - B_small |g_small|²) / (B_big - B_small)
  tr(Σ)  ≈ (|g_small|² - |g_big|²) / (1/B_small - 1/B_big)

with |g_small|² the mean squared norm of the groups' gradients and |g_big|² the squared
norm of their mean. Each estimate is unbiased but noisy; the ratio of two noisy numbers is
biased, so (as the paper advises) the two are averaged over `--repeats` independent draws
first and divided once. The run's own training shard of path `--path` feeds the batches,
each from a stream of its own (a document order of this tool's seed), laid out as the run
lays out its batches (`data.interleave` documents side by side, unless --interleave); the
parameters are that path's at the checkpoint (its modules in the store).

The batch unit is tokens, but tokens of one document are not independent samples: a batch
of 32 rows of 96 tokens from one-document-after-another holds about three 1,265-token
documents, and its gradient is as noisy as those few documents make it. The estimate is
therefore that of the batch layout measured (B_small = the run's per-worker batch by
default), not a property of the model alone.

Printed and written as JSON: |G|², tr(Σ), B_simple in tokens and in sequences, each
repeat's estimates, and the run's own per-worker batch as a fraction of B_simple (the
regime: well under 1, whoever averages more workers into a parameter wins; the paper's
runs sit near or above it).
"""
# pylint: disable=invalid-name,g-import-not-at-top

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def estimate(sq_small: float, sq_big: float, b_small: float, b_big: float) -> tuple[float, float]:
  """(|G|², tr Σ) from the squared gradient norms at batch sizes b_small < b_big (tokens)."""
  if not 0 < b_small < b_big:
    raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
  g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
  trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
  return float(g2), float(trace)


def from_gradients(grads: np.ndarray, tokens: np.ndarray) -> tuple[float, float, float, float]:
  """(|G|², tr Σ, B_small, B_big) from `groups` gradients [N, D] of batches of `tokens` [N].

  The small batch is one group (its mean size); the big one their token-weighted mean.
  """
  grads = np.asarray(grads, np.float64)
  tokens = np.asarray(tokens, np.float64)
  if grads.ndim != 2 or len(grads) < 2 or len(tokens) != len(grads):
    raise ValueError(f"need [N>=2, D] gradients and N token counts, got {grads.shape}")
  sq_small = float(np.mean(np.sum(grads**2, axis=1)))
  mean = np.average(grads, axis=0, weights=tokens)
  sq_big = float(np.sum(mean**2))
  b_small = float(np.mean(tokens))
  g2, trace = estimate(sq_small, sq_big, b_small, b_small * len(grads))
  return g2, trace, b_small, b_small * len(grads)


def measure(
  config,
  workdir: str,
  *,
  step=None,
  path=0,
  batch=None,
  groups=8,
  repeats=6,
  seed=1234,
  interleave=None,
):
  """Restores `workdir` at `step` and measures; returns the report (a dict)."""
  import jax

  from dipaco_jax import data as data_lib
  from dipaco_jax import evaluate
  from dipaco_jax.core import inner as inner_lib
  from dipaco_jax.core import paths as paths_lib

  run = evaluate.load_run(config, workdir, step)
  exp = run.exp
  if not 0 <= path < exp.topo.num_workers:
    raise SystemExit(
      f"--path={path}: this run has {exp.topo.num_workers} workers; give one of "
      f"0..{exp.topo.num_workers - 1}."
    )
  params_W = jax.device_get(paths_lib.assemble(run.state.store, exp.topo))
  params = jax.tree.map(lambda x: np.asarray(x[path]), params_W)
  model = exp.recipe.model
  T = config.data.seq_len
  batch = config.data.batch_size if batch is None else batch

  def loss(p, b):
    return inner_lib.loss_fn(p, b, model)

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  flat = lambda tree: np.concatenate(
    [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)]
  )
  interleave = config.data.interleave if interleave is None else interleave
  rows, t0 = [], time.perf_counter()
  for i in range(repeats):
    grads, tokens, losses = [], [], []
    for g in range(groups):
      # Each batch from a stream of its own (its own document order), as independent as two
      # workers' batches: one stream's consecutive batches share the documents they split.
      batcher = data_lib.WorkerBatcher(
        run.shard_set,
        "train",
        [path],
        seq_len=T,
        batch_size=batch,
        seed=seed * 1_000_003 + i * groups + g,
        interleave=interleave,
      )
      b = {k: v[0] for k, v in batcher.next_batch().items()}
      (l, w), g = grad_fn(params, b)
      grads.append(flat(g))
      tokens.append(float(w))
      losses.append(float(l))
    g2, trace, b_small, b_big = from_gradients(np.stack(grads), np.array(tokens))
    rows.append(
      {"g2": g2, "trace": trace, "b_small": b_small, "b_big": b_big, "loss": float(np.mean(losses))}
    )
  g2 = float(np.mean([r["g2"] for r in rows]))
  trace = float(np.mean([r["trace"] for r in rows]))
  b_noise = trace / g2 if g2 > 0 else float("inf")
  tokens_per_seq = float(np.mean([r["b_small"] for r in rows])) / batch
  per_worker = config.data.batch_size * tokens_per_seq
  # Per-repeat ratios: a rough spread (each one is the biased small-sample ratio).
  per_repeat = [r["trace"] / r["g2"] if r["g2"] > 0 else float("inf") for r in rows]
  return {
    "workdir": str(workdir),
    "step": run.step,
    "path": path,
    "batch_sequences": batch,
    "seq_len": T,
    "interleave": interleave,
    "groups": groups,
    "repeats": repeats,
    "tokens_small": float(np.mean([r["b_small"] for r in rows])),
    "tokens_big": float(np.mean([r["b_big"] for r in rows])),
    "loss": float(np.mean([r["loss"] for r in rows])),
    "g2": g2,
    "trace_sigma": trace,
    "noise_scale_tokens": b_noise,
    "noise_scale_sequences": b_noise / tokens_per_seq,
    "per_repeat_noise_scale_tokens": per_repeat,
    "run_batch_tokens": per_worker,
    "run_batch_over_noise_scale": per_worker / b_noise,
    "repeats_detail": rows,
    "seconds": time.perf_counter() - t0,
  }


def describe(rep: dict) -> str:
  """Three lines: the estimate, its spread, the run's batch against it."""
  spread = rep["per_repeat_noise_scale_tokens"]
  finite = [x for x in spread if np.isfinite(x) and x > 0]
  lo, hi = (min(finite), max(finite)) if finite else (float("nan"), float("nan"))
  return (
    f"noise scale at step {rep['step']} (loss {rep['loss']:.3f}): B_simple = "
    f"{rep['noise_scale_tokens']:,.0f} tokens ({rep['noise_scale_sequences']:.1f} sequences of "
    f"{rep['seq_len']})\n"
    f"  |G|² {rep['g2']:.4g}, tr Σ {rep['trace_sigma']:.4g}; {rep['repeats']} repeats of "
    f"{rep['groups']} x {rep['batch_sequences']} sequences, per repeat {lo:,.0f} – {hi:,.0f}\n"
    f"  the run's per-worker batch: {rep['run_batch_tokens']:,.0f} tokens = "
    f"{rep['run_batch_over_noise_scale']:.2f}x the noise scale"
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True, help="A run directory with checkpoints.")
  ap.add_argument("--step", type=int, default=None, help="Checkpoint step (default: latest).")
  ap.add_argument("--path", type=int, default=0, help="Which worker's path and shard.")
  ap.add_argument(
    "--batch", type=int, default=None, help="Sequences per small batch (default: the run's)."
  )
  ap.add_argument(
    "--interleave",
    type=int,
    default=None,
    help="Documents read side by side into a batch's rows (default: the run's data.interleave).",
  )
  ap.add_argument("--groups", type=int, default=8, help="Small batches averaged into a big one.")
  ap.add_argument("--repeats", type=int, default=6, help="Independent draws averaged.")
  ap.add_argument("--seed", type=int, default=1234, help="This tool's batch order.")
  ap.add_argument("--out", default="", help="JSON path (default: in the workdir).")
  args = ap.parse_args(argv)
  if args.groups < 2 or args.repeats < 1 or (args.batch or 1) < 1 or (args.interleave or 1) < 1:
    ap.error("--groups must be >= 2; --repeats, --batch and --interleave >= 1")
  from dipaco_jax import evaluate
  from dipaco_jax.io import native

  native.choose_platforms()  # As the CLIs: no libtpu start-up errors on a CPU host.
  config = evaluate.config_from_workdir(args.workdir)
  import jax

  if config.mesh.cpu_devices:
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  rep = measure(
    config,
    args.workdir,
    step=args.step,
    path=args.path,
    batch=args.batch,
    groups=args.groups,
    repeats=args.repeats,
    seed=args.seed,
    interleave=args.interleave,
  )
  out = args.out or os.path.join(args.workdir, f"noise_scale_step{rep['step']}.json")
  with open(out, "w") as f:
    json.dump(rep, f, indent=1)
  print(describe(rep))
  print(f"wrote: {out}")


if __name__ == "__main__":
  main()
