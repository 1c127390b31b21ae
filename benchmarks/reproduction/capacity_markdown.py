"""docs/results/capacity.md: the capacity comparison's page, rendered from its JSON."""

from reproduction import capacity
from reproduction import modes

COMMANDS = """\
    python tools/train_tokenizer.py --vocab_size=1024 --check     # the shipped 1k tokenizer
    python benchmarks/reproduce.py --capacity --seed=0 --out=runs/cap_s0   # then --seed=1 ...
    python benchmarks/reproduce.py --capacity_page                # this page, from the JSONs
"""


# The paper's regime and --long's (docs/results/comparison.md), beside this one's.
PAPER = {
  "tokens_per_param_theta": "24k x 524k / 150M ≈ 84",
  "tokens_per_param_path": "64k x 524k / 150M ≈ 224",
  "batch_over_noise_scale": "not reported",
  "epochs_per_shard": "not given (C4: well under 1)",
  "inner_steps": "150 (DiLoCo 500)",
  "outer_steps": "~427",
  "diloco_gain": "P = 8 -> 64: 0.4% (saturated)",
}
LONG = {
  "tokens_per_param_theta": "1.0",
  "tokens_per_param_path": "1.0",
  "batch_over_noise_scale": "0.88 / 1.02 at θ̄",
  "epochs_per_shard": "0.21",
  "inner_steps": "15",
  "outer_steps": "16",
  "diloco_gain": "P = 2 -> 4: 7.9% (not saturated)",
}


def sentence(q: dict, agg: dict) -> str:
  """One sentence for one question, with both means, the gap and the seed range."""
  a, b = q["better_expected"], q["worse_expected"]
  what = {
    "dipaco_vs_diloco": "DiPaCo against DiLoCo at equal workers",
    "dipaco_vs_dense_store": "DiPaCo against the dense model of its store's size at equal steps",
    "routed_vs_iid": "the routed grid against the same grid on i.i.d. shards",
  }[q["question"]]
  order = "the paper's order" if q["paper_order_holds"] else "the reverse of the paper's order"
  if q["resolved"]:
    reading = f"{order}, beyond the seed range"
  elif q["seeds"] < 2:
    reading = f"{order}, one seed so far: no range yet, so not a result either way"
  else:
    reading = f"{order} but within the seed range: not a result either way"
  return (
    f"{q['grid']}, {what}: `{a}` {agg[a]['mean']:.2f} vs `{b}` {agg[b]['mean']:.2f} "
    f"(gap {q['gap']:+.2f}, larger seed range {q['seed_range']:.2f}): {reading}."
  )


def _fmt(v, spec=".2f") -> str:
  return "–" if v is None else format(v, spec)


def regime_table(reg: dict) -> list[str]:
  paper, long = PAPER, LONG
  per_seed = lambda xs, spec: ", ".join(format(x, spec) for x in xs) if xs else "–"
  gain = reg.get("diloco_gain_4_to_8")
  rows = [
    (
      "tokens per parameter, θ̄",
      "tokens_per_param_theta",
      _fmt(reg.get("tokens_per_param_theta"), ".0f"),
    ),
    (
      "tokens per parameter per path after the fork",
      "tokens_per_param_path",
      _fmt(reg.get("tokens_per_param_path"), ".0f"),
    ),
    (
      "per-worker batch / noise scale at θ̄ (per seed)",
      "batch_over_noise_scale",
      f"{reg.get('batch_tokens', 0):,} tokens / "
      f"{per_seed(reg.get('noise_scale_tokens_at_theta'), ',.0f')} = "
      f"{per_seed(reg.get('batch_over_noise_scale_per_seed'), '.2f')}",
    ),
    (
      "epochs per shard (the most-read worker)",
      "epochs_per_shard",
      _fmt(reg.get("epochs_per_shard_max")),
    ),
    ("H", "inner_steps", str(reg.get("inner_steps", "–"))),
    ("outer steps after the fork", "outer_steps", str(reg.get("outer_steps", "–"))),
    (
      "DiLoCo's gain from more workers",
      "diloco_gain",
      f"P = 4 -> 8: {_fmt(None if gain is None else 100 * gain)}% (per seed "
      f"{per_seed([100 * g for g in reg.get('diloco_gain_4_to_8_per_seed', [])], '.1f')}%)",
    ),
  ]
  out = ["| | the paper (150M paths, C4) | `--long` | here (`--capacity`) |", "|---|---|---|---|"]
  out += [f"| {label} | {paper[key]} | {long[key]} | {here} |" for label, key, here in rows]
  return out


def arms_table(agg: dict) -> list[str]:
  out = [
    "| arm | grid | shards | workers | params (store) | ppl mean | min – max (range) | per seed | "
    "bits/char | early stop | oracle | random path |",
    "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|",
  ]
  mean = lambda xs: None if not xs or None in xs else sum(xs) / len(xs)
  for name, a in agg.items():
    per = ", ".join(f"{x:.2f}" for x in a["ppl"])
    out.append(
      f"| `{name}` | {a['grid']} | {a['shards']} | {a['workers']} | {a['params']:,} | "
      f"{a['mean']:.2f} | {a['min']:.2f} – {a['max']:.2f} ({a['range']:.2f}) | {per} | "
      f"{mean(a['bits_per_char']):.3f} | {_fmt(mean(a['early_stop_ppl'] or [None]))} | "
      f"{_fmt(mean(a['oracle_ppl'] or [None]))} | {_fmt(mean(a['random_path_ppl'] or [None]))} |"
    )
  return out


def _lrs(method: str) -> str:
  lrs = capacity.LADDER if method == "ladder" else capacity.OUTER_LRS[method]
  return "(" + ", ".join(f"{lr:g}" for lr in lrs) + ")"


def status_lines(seeds: dict) -> list[str]:
  """Which arms of the full plan each seed has finished: a page of a run in progress says so."""
  out = []
  for seed, recs in seeds.items():
    reference = seeds.get(0) if seed != 0 else None
    planned = capacity.plan(modes.MODES["capacity"], "all", None, reference, recs)
    left = [n for n in planned if n not in recs]
    tail = f"; still to run: {', '.join(f'`{n}`' for n in left)}" if left else ": complete"
    out.append(f"- seed {seed}: {len(planned) - len(left)} of {len(planned)} arms finished{tail}.")
  return out


# What the comparison does where the gate is not met (the issue: report the closest reached and
# say so before spending the rest of the budget).
GATE_NOT_MET = (
  "Where the gate is not met, the arms still run in this regime, and each answer below is read "
  "with DiLoCo short of saturation (more workers still help it, which favours DiLoCo against "
  "DiPaCo at equal workers). The levers left each cost more than the budget holds: a per-worker "
  "batch of 512 rows doubles every arm's tokens (256 rows is already several times the noise "
  "scale: the regime table); a smaller path reads more epochs of the same corpus (the table's "
  "epochs per shard); a larger corpus is not embedded."
)


def gate_lines(seeds: dict) -> list[str]:
  sats = {seed: capacity.saturation(recs) for seed, recs in seeds.items()}
  lines = [f"- seed {seed}: {capacity.describe_gate(sat)}" for seed, sat in sats.items()]
  if any("4_to_8" in s["gains"] and not s["met"] for s in sats.values()):
    lines += ["", GATE_NOT_MET]
  return lines


def specialisation_lines(agg: dict) -> list[str]:
  out = [
    "| arm | seed | routed path best for (share of documents) | own shard below others (nats) | "
    "share of the oracle's gain over a random path |",
    "|---|---:|---:|---:|---:|",
  ]
  for name, a in agg.items():
    for seed, spec in zip(a["seeds"], a["specialisation"]):
      if spec:
        out.append(
          f"| `{name}` | {seed} | {spec['routed_best_share']:.3f} | {spec['diagonal_gap']:.4f} | "
          f"{_fmt(spec.get('routed_gain_share'), '.3f')} |"
        )
  return out


def rerouting_lines(agg: dict) -> list[str]:
  out = []
  for name, a in agg.items():
    for seed, rr in zip(a["seeds"], a["rerouting_ppl"] or []):
      if rr:
        cells = ", ".join(f"{k} {v:.2f}" for k, v in sorted(rr.items()))
        out.append(f"- `{name}`, seed {seed}: once {a['ppl'][a['seeds'].index(seed)]:.2f}; {cells}")
  return out or ["- not measured yet"]


def third_seed(questions: list[dict]) -> str:
  """The gaps within twice the seed range (a third seed would tell), as one sentence."""
  if not questions:
    return ""
  pairs = ", ".join(f"`{q['better_expected']}` vs `{q['worse_expected']}`" for q in questions)
  return f" Gaps within twice the range, which want a third seed: {pairs}."


def render(doc: dict, agg: dict, seeds: dict, png: str) -> str:
  reg = doc["regime"]
  sentences = [sentence(q, agg) for q in doc["questions"]]
  third = [q for q in doc["questions"] if q["needs_third_seed"]]
  lines = [
    "# The paper's claim where capacity is what limits: results",
    "",
    "- **What**: DiPaCo against DiLoCo, against dense models of its store's size and ~2x a "
    "path's, and routed against i.i.d. shards, in a regime where one path is capacity-limited "
    "and DiLoCo is (or is measured against being) saturated; every arm at equal steps and "
    "tokens per step per worker, forked from its seed's θ̄.",
    "- **Machine**: this project's shared 2-core x86 CPU VM (no accelerator), 4 fake CPU devices.",
    "- **Written by** `benchmarks/reproduce.py --capacity_page` from `benchmarks/results/capacity/"
    "seed*/*.json` (one file per finished arm); the JSON beside this page is `capacity.json`.",
    "- **Resumed** arm by arm: an arm whose JSON is there is not trained again; on a machine "
    "that lost the run directory, a θ̄ an arm left forks from is trained again and must land on "
    "its JSON's curve (training is deterministic there: seed 0's came back bit for bit), or the "
    "run stops.",
    "",
    "    " + COMMANDS.strip().replace("\n", "\n"),
    "",
    "## Status",
    "",
    *status_lines(seeds),
    "",
    f"Outer LRs: seed 0 starts each arm at {_lrs('diloco')} (DiLoCo) or {_lrs('dipaco')} "
    "(DiPaCo), and where the best of them sits at an edge of its sweep it trains one more, a "
    f"rung of {_lrs('ladder')} past that edge, until the best is inside (or at the ladder's "
    "end); a later seed runs each arm at its best LR in seed 0 and at each other that came "
    f"within {capacity.KEEP_WITHIN:.0%} of it there (an LR clearly worse at seed 0 is not trained "
    "again: the budget). DiPaCo's modules take x√P_e on top, P_e the paths sharing module e "
    "(`outer.sqrt_paths=multiply`, the paper's §3.5 rescaling; DiLoCo takes the plain mean): "
    "on a 2x2 grid its 0.5 and 0.7 act as 0.71 and 0.99 on a routed module and as 1.0 and 1.4 "
    "on the embedding and head all paths share; on a 2x4 grid the factor is x1.41, x2 and x2.83 "
    "where 2, 4 and 8 paths share.",
    "",
    "## The regime",
    "",
    *regime_table(reg),
    "",
    "## The gate: DiLoCo's saturation (best of the outer LRs per P)",
    "",
    *gate_lines(seeds),
    "",
    "## The three questions",
    "",
    *([f"- {t}" for t in sentences] or ["- not answered yet: they need the gate and the arms."]),
    "",
    "Resolved means the gap between means exceeds the larger of the two arms' seed ranges."
    + third_seed(third),
    "",
    "## Every arm",
    "",
    "Routed validation perplexity at the last step (prefix excluded), per seed; bits per "
    "character from the loss and the scored tokens' characters (they compare across "
    "vocabularies, perplexities do not).",
    "",
    *arms_table(agg),
    "",
    f"![perplexity vs steps]({png})",
    "",
    "## Specialisation of the grids",
    "",
    *specialisation_lines(agg),
    "",
    "## Re-routing every W tokens (the better grid's routed arm)",
    "",
    *rerouting_lines(agg),
    "",
  ]
  return "\n".join(lines)
