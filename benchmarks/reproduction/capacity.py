"""The capacity comparison (`--capacity`): DiLoCo's saturation gate, the arms, the paper's levers.

Each seed trains θ̄, then the gate (DiLoCo P = 1, 2, 4, 8 at each of OUTER_LRS["diloco"]), the
arms (dense at the path's, the stores' and ~2x the path's size; DiPaCo 2x2 and 2x4, routed and
on i.i.d. shards, at each of OUTER_LRS["dipaco"]) and the levers on the better grid (its
embedding path-specific; per-path early stopping and re-routing every W tokens are read from
its routed run). Every finished arm's record lands in <results>/seed<S>/<arm>.json at once, so a
stopped comparison resumes arm by arm and its figures can be committed as they come; the page
(docs/results/capacity.md and .json) is written from those files alone.
"""

import json
import math
import os

import numpy as np

from reproduction import arms

# Where each method's outer-LR sweep starts (best of them per arm): DiPaCo's grid levels take
# x sqrt(P) on top (outer.sqrt_paths), so its range sits lower than DiLoCo's. Seed 0 then walks
# each arm's sweep one rung of LADDER past whichever edge holds its best (`swept`), so that no
# arm is read at its sweep's edge: DiLoCo's 1.4 and DiPaCo 2x2's 1.0 came so (P = 2, 4, 8 best
# at 1.0, the top of (0.7, 1.0); DiPaCo 2x2 best at 0.7, the top of (0.5, 0.7)).
OUTER_LRS = {"diloco": (0.7, 1.0, 1.4), "dipaco": (0.5, 0.7)}
LADDER = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0)  # x sqrt(2) a rung, as the arms' names round it.
DILOCO = {1: "diloco_iid_1", 2: "diloco_iid_2", 4: "diloco_iid", 8: "diloco_iid_8"}
GRIDS = {"2x2": ("dipaco_2x2", "dipaco_2x2_iid"), "2x4": ("dipaco_2x4", "dipaco_2x4_iid")}
DENSE = ("dense_path", "dense_store_2x2", "dense_store_2x4", "dense_wide")
GATE_GAIN = 0.02  # DiLoCo counts as saturated once P = 4 -> 8 gains at most this.


# Seed 0 sweeps every LR it walks to; a later seed runs, per arm, seed 0's best LR and each other
# that came within KEEP_WITHIN of it (relative perplexity): where seed 0 could not tell two LRs
# apart, both run again and each seed's best counts; an LR seed 0 found clearly worse is not
# trained again (DiLoCo at 1.4 ended 49-60% above its best for every P, P = 8 at 0.7 2.9%). The
# budget (the issue's ~12 h) is past: on seed 0's records this drops the second LR of P = 8 and
# of both routed grids, the dearest arms (~1 h each).
KEEP_WITHIN = 0.02


def lr_name(base: str, lr: float) -> str:
  return f"{base}_olr{lr:g}"


def swept(base: str, method: str, records: dict) -> list[float]:
  """The outer LRs seed 0 trains `base` at, in ascending order.

  OUTER_LRS[method], and, once every one of them has finished in `records`, one rung of LADDER
  past the edge that holds the best (above the top, below the bottom), again and again until the
  best is inside the sweep or at the ladder's end.
  """
  lrs = list(OUTER_LRS[method])
  while all(lr_name(base, lr) in records for lr in lrs):
    best = min(lrs, key=lambda lr: _ppl_or_inf(records[lr_name(base, lr)]))
    rung = LADDER.index(best)
    if best == lrs[-1] and rung + 1 < len(LADDER):
      lrs.append(LADDER[rung + 1])
    elif best == lrs[0] and rung > 0:
      lrs.insert(0, LADDER[rung - 1])
    else:
      break
  return lrs


def lr_arms(
  base: str, method: str, reference: dict | None = None, own: dict | None = None
) -> list[str]:
  """`base` at each outer LR its seed trains it at.

  Seed 0 (no `reference`): every LR of its sweep, walked on its own finished records `own`. A
  later seed: seed 0's sweep (`reference`: seed 0's records), or once seed 0 holds `base` at
  every one of them, its best and those within KEEP_WITHIN of it.
  """
  if not reference:
    return [lr_name(base, lr) for lr in swept(base, method, own or {})]
  names = [lr_name(base, lr) for lr in swept(base, method, reference)]
  if not all(n in reference for n in names):
    return names
  best = min(_ppl_or_inf(reference[n]) for n in names)
  return [n for n in names if _ppl_or_inf(reference[n]) <= best * (1 + KEEP_WITHIN)]


def gate_models(reference: dict | None = None, own: dict | None = None) -> list[str]:
  return [m for p in DILOCO for m in lr_arms(DILOCO[p], "diloco", reference, own)]


def arm_models(reference: dict | None = None, own: dict | None = None) -> list[str]:
  grids = [
    m for pair in GRIDS.values() for base in pair for m in lr_arms(base, "dipaco", reference, own)
  ]
  return [*DENSE, *grids]


def lever_models(records: dict) -> list[str]:
  """The better grid's embedding path-specific, at its routed arm's best outer LR."""
  grid, name = better_grid(records)
  if name is None:
    return []
  return [lr_name(f"{GRIDS[grid][0]}_pse", arms.outer_lr_variant(name)[1])]


def ppl(record: dict, params: str = "store") -> float | None:
  rep = record["final"].get(params)
  return None if rep is None else rep["ppl"]["once"]


def _ppl_or_inf(record: dict) -> float:
  """An arm's perplexity to rank it by: a diverged one (NaN) or none ranks last."""
  x = ppl(record)
  return math.inf if x is None or not math.isfinite(x) else x


def variants(records: dict, base: str) -> list[str]:
  """The finished arms that are `base` at some outer LR (`base` itself included)."""
  return [n for n in records if (arms.outer_lr_variant(n) or (n, 0))[0] == base]


def best_of(records: dict, base: str) -> str | None:
  """`base`'s outer-LR variant with the lowest final routed perplexity (None when none ran)."""
  have = variants(records, base)
  return min(have, key=lambda n: _ppl_or_inf(records[n])) if have else None


def better_grid(records: dict) -> tuple[str, str | None]:
  """(grid, its best routed arm) of the grid whose routed arm reaches the lower perplexity."""
  best = {g: best_of(records, pair[0]) for g, pair in GRIDS.items()}
  done = {g: n for g, n in best.items() if n}
  if not done:
    return "2x2", None
  grid = min(done, key=lambda g: ppl(records[done[g]]))
  return grid, done[grid]


def saturation(records: dict) -> dict:
  """DiLoCo's best-of-LRs perplexity per P and the gain of each doubling (1 - next / this)."""
  curve = {}
  for p, base in DILOCO.items():
    name = best_of(records, base)
    if name:
      curve[p] = {"arm": name, "ppl": ppl(records[name])}
  gains = {
    f"{p}_to_{2 * p}": 1 - curve[2 * p]["ppl"] / curve[p]["ppl"] for p in curve if 2 * p in curve
  }
  return {"curve": curve, "gains": gains, "met": gains.get("4_to_8", 1.0) <= GATE_GAIN}


def describe_gate(sat: dict) -> str:
  """One line on the gate: each P's perplexity and whether 4 -> 8 gains at most GATE_GAIN."""
  pts = ", ".join(f"P={p} {v['ppl']:.2f}" for p, v in sat["curve"].items())
  gain = sat["gains"].get("4_to_8")
  if gain is None:
    return f"DiLoCo saturation: {pts or 'no arm finished'}; P = 4 -> 8 not measured yet."
  verdict = "met" if sat["met"] else "NOT met (the closest reached)"
  return (
    f"DiLoCo saturation: {pts}; P = 4 -> 8 gains {100 * gain:.1f}% (gate <= "
    f"{100 * GATE_GAIN:.0f}%: {verdict})."
  )


def arm_path(results: str, seed: int, name: str) -> str:
  return os.path.join(results, f"seed{seed}", f"{name}.json")


def write_arm(results: str, seed: int, name: str, record: dict) -> str:
  """One finished arm's record (atomically: a stopped write leaves the old file or none)."""
  path = arm_path(results, seed, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=1)
  os.replace(path + ".tmp", path)
  return path


def read_arms(results: str) -> dict[int, dict[str, dict]]:
  """{seed: {arm: record}} of every arm JSON under `results`."""
  out = {}
  if not os.path.isdir(results):
    return out
  for entry in sorted(os.listdir(results)):
    if not entry.startswith("seed") or not entry[4:].isdigit():
      continue
    folder = os.path.join(results, entry)
    out[int(entry[4:])] = {
      f[: -len(".json")]: json.load(open(os.path.join(folder, f)))  # noqa: SIM115
      for f in sorted(os.listdir(folder))
      if f.endswith(".json")
    }
  return out


def chars_per_scored_token(config, workdir: str) -> float:
  """Characters per scored validation token (the routing prefix excluded), for bits per char.

  The tokens `evaluate` scores: tokens prefix_len .. eval_seq_len of each validation document
  (log p of token j given those before it), decoded with the run's tokenizer.
  """
  from dipaco_jax import data as data_lib
  from dipaco_jax import routing
  from dipaco_jax.data import vocab

  sp = vocab.load(vocab.resolve(config.data.task, config.data.vocab_path))
  shards = data_lib.ShardSet(routing.shard_dir(config, workdir, 0))
  T, L = routing.eval_seq_len(config), config.routing.prefix_len
  chars = tokens = 0
  for w, n in enumerate(shards.num_docs("validation")):
    for d in shards.documents(w, "validation").read_many(range(int(n))):
      scored = [int(t) for t in d.tokens[L:T]]
      chars += len(sp.decode(scored))
      tokens += len(scored)
  return chars / tokens


def bits_per_char(nats_per_token: float, chars_per_token: float) -> float:
  return nats_per_token / math.log(2) / chars_per_token


def summary_stats(values: list[float]) -> dict:
  return {
    "mean": float(np.mean(values)),
    "min": float(np.min(values)),
    "max": float(np.max(values)),
    "range": float(np.max(values) - np.min(values)),
  }


def routed_share(config) -> float:
  """The share of a path's parameters in its transformer blocks (the grid's routed levels)."""
  import jax

  from dipaco_jax.core import experiment

  params = experiment.Experiment(config).recipe.abstract_params()
  size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
  blocks = sum(size(v) for k, v in params.items() if k.startswith("block_"))
  return blocks / size(params)


def plan(
  s, stage: str, models: list[str] | None, reference: dict | None = None, own: dict | None = None
) -> list[str]:
  """The arms of a stage in training order (each bigger dense model after its own θ̄).

  `reference`: seed 0's records, for a later seed (its outer LRs: see KEEP_WITHIN); `own`: this
  seed's finished records (seed 0's sweeps walk on them: see `swept`).
  """
  if models is None:
    models = gate_models(reference, own)
    models += arm_models(reference, own) if stage != "gate" else []
  order = ["pretrain"]
  for m in models:
    order += [p for p in (arms.pretrain_of(m, s), m) if p not in order]
  return order


def rerouted(record: dict) -> bool:
  """Whether an arm's record holds the read re-routed every W tokens (`runs.evaluate_run`)."""
  return any("/W=" in k for k in record["final"]["store"]["ppl"])


def mismatch(committed: dict, fresh: dict) -> str | None:
  """How a retrained arm differs from its committed record; None where its curve is the same.

  Training is deterministic on one machine type (same code, data, seed): a θ̄ whose checkpoints
  were lost is trained again and must land on the perplexities its JSON holds, or the arms left
  would fork from another θ̄ than the arms already committed.
  """
  if [list(p) for p in committed["curve"]] == [list(p) for p in fresh["curve"]]:
    return None
  a, b = committed["curve"][-1], fresh["curve"][-1]
  return f"perplexity at step {a[0]}: committed {a[1]:.4f}, trained again {b[1]:.4f}"


def to_train(names: list[str], s, own: dict, has_checkpoint) -> list[str]:
  """The arms of `names` this run trains, in order.

  Every arm without a finished record in `own`, and a finished one only where an arm left forks
  from it (its θ̄) and its checkpoints are gone (`has_checkpoint(name)` false): a new machine
  keeps the committed JSONs but not the run directory.
  """
  left = [n for n in names if n not in own]
  forks = {arms.pretrain_of(n, s) for n in left if n != arms.pretrain_of(n, s)}
  return [n for n in names if n in left or (n in forks and not has_checkpoint(n))]


def run(s, args) -> dict[str, dict]:
  """One seed's capacity comparison, resumed arm by arm; every finished arm's JSON written.

  An arm whose JSON is already under --results for this seed is not trained again, save a θ̄
  an arm left forks from (its checkpoints lost with a machine: trained again, checked against
  its JSON by `mismatch`) and the re-routing read's arm (trained again the same way when its
  checkpoints are gone).
  """
  import dataclasses

  from reproduction import runs

  models = [m for m in args.models.split(",") if m] if args.models else None
  finished = read_arms(args.results)
  reference = finished.get(0) if args.seed != 0 else None
  own = finished.get(args.seed, {})  # This seed's finished arms: where its sweeps walk.
  committed = dict(own)  # Those finished before this run: their JSONs stand.
  names = plan(s, args.stage, models, reference, own)
  from dipaco_jax import errors

  # Every arm's config and mesh first: a bad size stops here, in one line, nothing written.
  for name in names:
    try:
      runs.param_counts(runs.make_config(name, s, args.out, args.sqrt_paths, args.seed))
    except (errors.ConfigError, errors.UserError) as e:
      raise SystemExit(f"--capacity: arm {name}: {e}") from None
  workdir = lambda name: os.path.join(args.out, "runs", name)
  has_checkpoint = lambda name: bool(runs.checkpoint_steps(workdir(name)))

  def arm(name: str, rerouting: bool = False) -> None:
    print(f"== {name}", flush=True)
    r = runs.train_run(
      name, s, args.out, args.sqrt_paths, args.seed, args.sqrt_paths_cap, rerouting=rerouting
    )
    r.update(sizes=dataclasses.asdict(s), seed=args.seed)
    if name in committed:
      why = mismatch(committed[name], r)
      if why:
        raise SystemExit(
          f"--capacity: {name} trained again for seed {args.seed} is not its committed run "
          f"({why}): the arms left would fork from another model. Resume with the --out that "
          f"holds its checkpoints, or remove {os.path.join(args.results, f'seed{args.seed}')} "
          f"to train seed {args.seed} whole; its JSON is left as it was."
        )
      if not rerouting:  # Else the re-routing read, owed by the committed record.
        print(f"   {name}: the same curve as its committed JSON (kept)", flush=True)
        return
      r["seconds"] = committed[name]["seconds"]  # The training it took when it first ran.
    if name == "pretrain":
      config = runs.make_config(name, s, args.out, args.sqrt_paths, args.seed)
      r.update(chars_per_scored_token=chars_per_scored_token(config, workdir(name)))
      r.update(routed_share=routed_share(config))
    own[name] = r
    path = write_arm(args.results, args.seed, name, r)
    print(f"   ppl {ppl(r):.2f}  (train {r['seconds']['train']:.0f}s) -> {path}", flush=True)

  # Planned again after each arm: a finished sweep may walk one more outer LR (`swept`). An arm
  # trained lands in `own`, a θ̄ trained again has its checkpoints: neither is planned again.
  while todo := to_train(plan(s, args.stage, models, reference, own), s, own, has_checkpoint):
    arm(todo[0])
    gate = gate_models(reference, own)
    if todo[0] in gate and all(m in own for m in gate):
      print(describe_gate(saturation(own)), flush=True)

  def forked(name: str, rerouting: bool = False) -> None:  # Its θ̄ first where that is gone.
    if not has_checkpoint(arms.pretrain_of(name, s)):
      arm(arms.pretrain_of(name, s))
    arm(name, rerouting)

  if args.stage == "all" and models is None:
    for name in lever_models(own):
      if name not in own:
        forked(name)
    grid, best = better_grid(own)
    if best and not rerouted(own[best]):  # Early stopping is in every record.
      print(f"levers on {grid}: re-routing {best}", flush=True)
      forked(best, rerouting=True)
  print(describe_gate(saturation(own)), flush=True)
  return own
