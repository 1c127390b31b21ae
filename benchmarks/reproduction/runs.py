"""One arm's run: its config, training (resumed), evaluation at every checkpoint, its record."""

import json
import math
import os
import time

import numpy as np

from reproduction import arms
from reproduction import modes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_config(name: str, s: modes.Sizes, out: str, sqrt_paths: str, seed: int = 0, sqrt_cap=0.0):
  """configs/tiny.py with this mode's sizes and the model's overrides."""
  from dipaco_jax import config_check
  from dipaco_jax.data import vocab

  common = {
    "model.d_model": s.d_model,
    "model.num_layers": s.layers,
    "model.num_heads": s.heads,
    "model.head_dim": s.d_model // s.heads,
    "model.max_len": max(256, s.seq_len),
    "inner.lr": s.lr,
    "inner.warmup_steps": s.warmup,
    "dipaco.inner_steps": s.inner_steps,
    "data.seq_len": s.seq_len,
    "data.subsample": s.subsample,
    # A seed varies what a real rerun varies: data order and shards, init, router fits.
    "data.seed": seed,
    "seed": seed,
    "routing.seed": seed,
    "mesh.cpu_devices": modes.CPU_DEVICES,
    "log_every_steps": s.inner_steps,
    # Only the checkpoints evaluate_run reads (and the last): a synchronous save of every outer
    # step was a third of the small paths' wall time (py-spy on θ̄; docs/results/capacity.md).
    "ckpt.every_steps": s.eval_every * s.inner_steps,
    "ckpt.async_save": False,
    "eval.every_steps": s.inner_steps,
    "eval.batches": 2,
    "eval.rerouting_windows": s.windows,
    "eval.rerouters": ("linear", "transformer"),  # docs/results.md compares both.
    "eval.reroute_steps": s.reroute_steps,
    # k-means on a small validation split can leave a path without validation documents;
    # early stopping reads a held-out slice of each training shard (the default source), so
    # the validation split is used for the final numbers only.
    "data.empty_shard_policy": "allow_validation",
    "early_stopping.source": "heldout",
  }
  arm = arms.run_overrides(
    name,
    s,
    os.path.join(out, "runs", arms.pretrain_of(name, s)),
    os.path.join(out, "shards"),
    sqrt_paths,
    sqrt_cap,
  )
  # After the fork, the per-worker batch may grow (Sizes.fork_batch); θ̄ keeps `batch`.
  batch = s.fork_batch if s.fork_batch and arm.get("dipaco.init_from") else s.batch
  over = {
    **common,
    "data.batch_size": batch,
    "data.interleave": s.interleave or batch,  # 0: every row of a batch another document.
    **arm,
  }
  if s.vocab != vocab.DEFAULT_VOCAB_SIZE:  # The shipped tokenizer of that size (shards follow).
    over.update({"model.vocab_size": s.vocab, "data.vocab_path": vocab.shipped_path(s.vocab)})
  c = config_check.load(os.path.join(ROOT, "configs", "tiny.py"), **over)
  c.ckpt.max_to_keep = c.dipaco.outer_steps + 2  # Every outer step is evaluated afterwards.
  return c


def param_counts(config) -> dict:
  """Parameters of one path and of the whole store (unique parameters)."""
  import jax

  from dipaco_jax.core import experiment

  exp = experiment.Experiment(config)
  n = lambda t: int(sum(np.prod(x.shape) for x in jax.tree.leaves(t)))
  params_W = exp.abstract_state.params
  return {
    "path": n(params_W) // exp.topo.num_workers,
    "total": n(exp.abstract_state.store),
    "paths": exp.topo.num_paths,
    "workers": exp.topo.num_workers,
  }


def read_json(path: str) -> dict:
  """A file this script wrote before, or {} (a fresh run)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def checkpoint_steps(workdir: str) -> list[int]:
  from dipaco_jax.io import checkpoint

  return checkpoint.steps(workdir)


def evaluate_run(
  config, workdir: str, s: modes.Sizes, *, final_full: bool, rerouting: bool = True
) -> tuple[dict, int]:
  """Routed ppl at every `eval_every`-th outer step, full report at the last (cached).

  The full report: oracle and specialisation, and re-routing every W tokens (s.windows) when
  `rerouting`; a cached last step without re-routing is computed again once it is asked for.
  Returns the reports by step and how many of them this call computed.
  """
  from dipaco_jax import evaluate
  from dipaco_jax.runtime import early_stopping

  cache_path = os.path.join(workdir, "reproduce_eval.json")
  cache = read_json(cache_path)
  computed = 0
  steps = checkpoint_steps(workdir)
  last = steps[-1]
  every = s.eval_every * s.inner_steps
  rerouted = lambda rep: any("/W=" in k for k in rep["store"]["ppl"])
  for step in steps:
    key = str(step)
    owed = (
      key in cache
      and step == last
      and rerouting
      and final_full
      and s.windows
      and not rerouted(cache[key])
    )
    if (key in cache and not owed) or (step % every and step != last):
      continue
    run = evaluate.load_run(config, workdir, step)
    # Re-routing and oracles at the last step of a run with several paths; else once only.
    full = step == last and final_full and run.exp.topo.num_paths > 1
    windows = full and rerouting
    kw = dict(windows=None if windows else [], rerouters=None if windows else (), oracle=full)
    rep = {"store": evaluate.evaluate(run, per_sequence=full, **kw)}
    if full:  # The specialisation report from the same scores (benchmarks/specialisation.py's).
      write_specialisation(run, evaluate.specialisation(run, rep["store"]))
    if step == last and early_stopping.read_meta(workdir) is not None:
      rep["best"] = evaluate.evaluate(run, params="best", **kw)
    cache[key] = {
      k: {
        f: r[f]
        for f in (
          "ppl",
          "loss",
          "phase",
          "router",
          "scored_tokens",
          "num_sequences",
          "per_path",
          "switches_per_sequence",
        )
      }
      for k, r in rep.items()
    }
    with open(cache_path + ".tmp", "w") as f:
      json.dump(cache, f, indent=1)
    os.replace(cache_path + ".tmp", cache_path)
    computed += 1
  return cache, computed


def write_specialisation(run, spec) -> None:
  """<workdir>/specialisation_step<S>.json, as benchmarks/specialisation.py writes it."""
  import specialisation  # pylint: disable=import-outside-toplevel  # Beside this script.

  specialisation.write(
    specialisation.record(run, spec, "store"), specialisation.default_path(run.workdir, run.step)
  )


def read_specialisation(workdir: str) -> dict | None:
  """The specialisation report of the run's last checkpoint, when written."""
  import specialisation  # pylint: disable=import-outside-toplevel

  steps = checkpoint_steps(workdir) if os.path.isdir(workdir) else []
  if not steps:
    return None
  return read_json(specialisation.default_path(workdir, steps[-1])) or None


# The specialisation report's numbers a summary carries (the matrices stay in the run's JSON).
SPEC_KEYS = ("loss", "routed_best_share", "diagonal_gap", "routed_gain_share", "loss_matrix")


def specialisation_summary(spec: dict | None) -> dict | None:
  return {k: spec[k] for k in SPEC_KEYS} if spec else None


def phase_report(config, workdir: str, phase: int) -> dict:
  """One phase's shard sizes and the router's share of documents moved off their argmin path.

  Tokens per training shard: min / median / max / mean, min over mean; the router's
  documents per path and the moved-off share are on the router split (router.json).
  """
  from dipaco_jax import data as data_lib
  from dipaco_jax import routing
  from dipaco_jax.routing import report as router_report

  shards = data_lib.ShardSet(routing.shard_dir(config, workdir, phase))
  directory = routing.router_dir(workdir, phase)
  info = routing.Router.load(directory).info if routing.Router.exists(directory) else {}
  return {
    "phase": phase,
    **router_report.token_stats(shards.sizes("train")),
    "moved_off_label": float(info.get("moved_off_label", 0.0)),
    # Router-split documents per path, routed and before balancing (argmin / best path).
    "router_docs": [info.get(k) for k in ("docs_min", "docs_median", "docs_max")],
    "router_argmin_docs": [info.get(f"argmin_docs_{k}") for k in ("min", "median", "max")],
  }


def shard_report(config, workdir: str) -> dict:
  """Every phase's shard sizes; the last phase's tokens per worker, validation purity and NMI."""
  from dipaco_jax import data as data_lib
  from dipaco_jax import routing
  from dipaco_jax.routing import report as router_report

  phase = 0
  while os.path.isdir(routing.shard_dir(config, workdir, phase + 1)):
    phase += 1
  phases = [phase_report(config, workdir, k) for k in range(phase + 1)]
  shards = data_lib.ShardSet(routing.shard_dir(config, workdir, phase))
  workers, domains = [], []
  for w, n in enumerate(shards.num_docs("validation")):
    for d in shards.documents(w, "validation").read_many(range(int(n))):
      workers.append(w)
      domains.append(d.domain)
  ids, names = router_report.domain_index(domains)
  rep = router_report.report(np.asarray(workers), len(shards.num_docs("validation")), ids, names)
  return {
    "phase": phase,
    "phases": phases,
    "min_over_mean": min(p["min_over_mean"] for p in phases),
    "train_tokens": shards.sizes("train").tolist(),
    "validation_docs": shards.num_docs("validation").tolist(),
    "validation_domain_purity": float(rep.purity),
    "validation_domain_nmi": float(rep.nmi),
  }


def outer_norms(config, workdir: str) -> dict | None:
  """The outer delta norm per level and outer step (×√P's stability); None without outer steps.

  Per level: P (paths through each module), the norm of each outer step (the root of the
  modules' summed squares) and per module (that over √K), the first, the peak and the last.
  With several levels, `shared_over_modules` is, per outer step, the shared level's
  per-module norm over the mean per-module norm of the others (the ×√P rescale gives the
  shared level √P_shared / √P_level times their factor). `stable` is a coarse reading:
  every level's norm has turned down by the last outer step (below its peak), as the inner
  LR anneals; a ×√P step too large for its level keeps growing instead. None with fewer
  than 4 outer steps (the first ones fall in the inner warmup, where norms grow anyway).
  """
  from dipaco_jax.io import metrics

  if not config.outer.enabled:
    return None
  records = [r for r in metrics.read_records(workdir) if "outer_delta_norm" in r]
  if not records:
    return None
  workers = math.prod(config.dipaco.modules_per_level) * config.dipaco.replicas
  levels = {}
  # Streamed (outer.fragments > 1): a sync's record holds its fragment's levels only.
  names = list(dict.fromkeys(level for r in records for level in r["outer_delta_norm"]))
  for level in names:
    mine = [r for r in records if level in r["outer_delta_norm"]]
    k = len(mine[0]["outer_delta_norm"][level])
    norms = [float(np.sqrt(np.sum(np.square(r["outer_delta_norm"][level])))) for r in mine]
    peak = max(norms)
    levels[level] = {
      "modules": k,
      "paths_per_module": workers // k,
      "steps": [int(r["step"]) for r in mine],
      "norm": norms,
      "per_module": [n / math.sqrt(k) for n in norms],
      "first": norms[0],
      "peak": peak,
      "last": norms[-1],
      "max_over_first": peak / norms[0] if norms[0] > 0 else float("nan"),
      "last_over_peak": norms[-1] / peak if peak > 0 else float("nan"),
    }
  out = {"levels": levels, "sqrt_paths_cap": config.outer.sqrt_paths_cap}
  aligned = len({tuple(v["steps"]) for v in levels.values()}) == 1
  if len(names) > 1 and aligned:  # Per outer step: the levels synced at the same steps.
    shared, rest = levels[names[0]]["per_module"], [levels[n]["per_module"] for n in names[1:]]
    out["shared_over_modules"] = [
      s / float(np.mean(o)) if np.mean(o) > 0 else float("nan") for s, *o in zip(shared, *rest)
    ]
  enough = len(records) >= 4
  out["stable"] = all(v["last"] < v["peak"] for v in levels.values()) if enough else None
  return out


NOISE_SCALE_AT = ("pretrain", "dense_path")  # Dense runs: one path, the whole corpus.


def noise_report(config, workdir: str, s: modes.Sizes) -> dict:
  """benchmarks/noise_scale.py at the run's last checkpoint (cached in the workdir)."""
  import noise_scale  # pylint: disable=import-outside-toplevel  # Beside this script.

  step = checkpoint_steps(workdir)[-1]
  path = os.path.join(workdir, f"noise_scale_step{step}.json")
  rep = read_json(path)
  if not rep:
    smoke = s.pretrain < 20  # A handful of gradients: the plumbing only.
    rep = noise_scale.measure(
      config,
      workdir,
      step=step,
      batch=s.batch,
      groups=2 if smoke else 8,
      repeats=1 if smoke else 6,
    )
    with open(path, "w") as f:
      json.dump(rep, f, indent=1)
  print("   " + noise_scale.describe(rep).replace("\n", "\n   "), flush=True)
  return {
    k: rep[k]
    for k in (
      "step",
      "loss",
      "noise_scale_tokens",
      "noise_scale_sequences",
      "per_repeat_noise_scale_tokens",
      "run_batch_tokens",
      "run_batch_over_noise_scale",
      "groups",
      "repeats",
      "batch_sequences",
    )
  }


def train_run(
  name: str,
  s: modes.Sizes,
  out: str,
  sqrt_paths: str,
  seed: int = 0,
  sqrt_cap: float = 0.0,
  rerouting: bool = True,
) -> dict:
  """Trains (or resumes) one model and evaluates its checkpoints; returns its record.

  rerouting: its last checkpoint also re-routed every W tokens (s.windows), for several paths.
  """
  from dipaco_jax import train

  config = make_config(name, s, out, sqrt_paths, seed, sqrt_cap)
  workdir = os.path.join(out, "runs", name)
  # Seconds of the call that did the work (a rerun that resumes finished work keeps them).
  timing_path = os.path.join(workdir, "reproduce_seconds.json")
  seconds = read_json(timing_path)
  before = (checkpoint_steps(workdir) or [0])[-1]
  t0 = time.perf_counter()
  train.train_and_evaluate(config, workdir)
  t1 = time.perf_counter()
  full = not name.startswith("pretrain")
  evals, computed = evaluate_run(config, workdir, s, final_full=full, rerouting=rerouting)
  t2 = time.perf_counter()
  if checkpoint_steps(workdir)[-1] > before or "train" not in seconds:
    seconds["train"] = t1 - t0
  if computed or "evaluate" not in seconds:
    seconds["evaluate"] = t2 - t1
  with open(timing_path, "w") as f:
    json.dump(seconds, f)
  forked = bool(config.dipaco.init_from)
  first = s.pretrain if forked else 0
  curve = [
    (first + int(k), v["store"]["ppl"]["once"])
    for k, v in sorted(evals.items(), key=lambda kv: int(kv[0]))
  ]
  final = evals[str(max(int(k) for k in evals))]
  return {
    "name": name,
    "description": arms.describe(name),
    # The regime: the per-worker batch against the gradient noise scale, at θ̄ and at the end
    # of the dense run (the noise scale grows as the loss falls).
    "noise_scale": noise_report(config, workdir, s) if name in NOISE_SCALE_AT else None,
    "shards": shard_report(config, workdir),
    "outer": outer_norms(config, workdir),
    "specialisation": specialisation_summary(read_specialisation(workdir)),
    "params": param_counts(config),
    "curve": curve,
    "forked": forked,
    "final": final,
    "steps": curve[-1][0],
    "seconds": seconds,
  }
