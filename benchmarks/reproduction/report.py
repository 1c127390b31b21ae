"""The reproduction's tables, plots and the summary over seeds."""

import json
import os

import numpy as np

from reproduction import arms
from reproduction import modes
from reproduction import runs


def table(results: dict, s: modes.Sizes) -> str:
  """The results table (markdown): final routed ppl, early stopping, best re-routing."""
  lines = [
    "| model | paths | workers (replicas x paths) | params / path | params total | steps | "
    "ppl (once) | ppl (early stop) | best re-routing | oracle (once) | random path |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
  ]
  for name in arms.ordered(results):
    if name not in results:
      continue
    r = results[name]
    store, best = r["final"]["store"], r["final"].get("best")
    rr = {k: v for k, v in store["ppl"].items() if "/W=" in k and not k.startswith("oracle")}
    rr_text = f"{min(rr.values()):.2f} ({min(rr, key=rr.get)})" if rr else "–"
    fmt = lambda rep, k: "–" if rep is None or k not in rep["ppl"] else f"{rep['ppl'][k]:.2f}"
    lines.append(
      f"| {name} | {r['params']['paths']} | {r['params']['workers']} | "
      f"{r['params']['path'] / 1e6:.2f}M | {r['params']['total'] / 1e6:.2f}M | {r['steps']} | "
      f"{fmt(store, 'once')} | {fmt(best, 'once')} | {rr_text} | {fmt(store, 'oracle/once')} | "
      f"{fmt(store, 'random/once')} |"
    )
  pre = results.get("pretrain")
  if pre:
    lines.append(
      f"\nθ̄ (dense pretraining, {s.pretrain} steps): routed ppl "
      f"{pre['final']['store']['ppl']['once']:.2f}."
    )
  for name in runs.NOISE_SCALE_AT:
    ns = (results.get(name) or {}).get("noise_scale")
    if ns:
      lines.append(
        f"\nGradient noise scale at {name}'s end (step {ns['step']}, loss {ns['loss']:.3f}): "
        f"{ns['noise_scale_tokens']:,.0f} tokens; the per-worker batch "
        f"({ns['run_batch_tokens']:,.0f} tokens) is {ns['run_batch_over_noise_scale']:.2f}x it."
      )
  return "\n".join(lines) + "\n"


def shard_table(results: dict) -> str:
  """Training tokens per shard at every phase, and the share moved off the argmin path."""
  lines = [
    "| model | phase | tokens min | median | max | min / mean | moved off argmin |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name in arms.ordered(results):
    r = results.get(name)
    if not r or r["params"]["workers"] == 1:
      continue
    for p in r["shards"]["phases"]:
      low = " (under 25%)" if p["min_over_mean"] < modes.GOAL_MIN_OVER_MEAN else ""
      lines.append(
        f"| {name} | {p['phase']} | {p['tokens_min']:,.0f} | {p['tokens_median']:,.0f} | "
        f"{p['tokens_max']:,.0f} | {p['min_over_mean']:.2f}{low} | {p['moved_off_label']:.3f} |"
      )
  return "\n".join(lines) + "\n"


def outer_table(results: dict) -> str:
  """The outer delta norm per level: P per module, first / last norm, max over first."""
  lines = [
    "| model | level | modules | paths / module | first | peak | last | last / peak | "
    "shared / module (first → last) | stable |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for name in arms.ordered(results):
    o = (results.get(name) or {}).get("outer")
    if not o:
      continue
    ratio = o.get("shared_over_modules")
    ratio = f"{ratio[0]:.2f} → {ratio[-1]:.2f}" if ratio else "–"
    stable = {True: "yes", False: "no", None: "too few outer steps"}[o["stable"]]
    for level, v in o["levels"].items():
      lines.append(
        f"| {name} | {level} | {v['modules']} | {v['paths_per_module']} | {v['first']:.3g} | "
        f"{v['peak']:.3g} | {v['last']:.3g} | {v['last_over_peak']:.2f} | {ratio} | {stable} |"
      )
  return "\n".join(lines) + "\n"


def window_table(results: dict) -> str:
  """Routed ppl vs re-routing window W for the models with several paths."""
  lines = []
  for name in arms.ordered(results):
    r = results.get(name)
    if not r or r["params"]["paths"] == 1:
      continue
    for params in ("store", "best"):
      if params not in r["final"]:
        continue
      p = r["final"][params]["ppl"]
      cells = ", ".join(f"{k} {v:.2f}" for k, v in p.items())
      lines.append(f"- {name} ({params}): {cells}")
  return "\n".join(lines) + "\n"


def plot(results: dict, s: modes.Sizes, out: str) -> list[str]:
  """ppl_vs_steps.png (every model) and ppl_vs_window.png (models with several paths)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  fig, ax = plt.subplots(figsize=(8, 5))
  for name in ["pretrain", *arms.ordered(results)]:
    if name not in results:
      continue
    xs, ys = zip(*results[name]["curve"])
    if results[name]["forked"] and "pretrain" in results:
      px, py = results["pretrain"]["curve"][-1]
      xs, ys = (px, *xs), (py, *ys)
    ax.plot(
      xs,
      ys,
      marker="o",
      ms=3,
      label=name,
      ls="--" if name.startswith("dense") else "-",
      color="black" if name == "pretrain" else None,
    )
  ax.axvline(s.pretrain, color="grey", lw=0.5)
  ax.text(s.pretrain, ax.get_ylim()[1], " fork from θ̄", va="top", fontsize=8, color="grey")
  ax.set(
    xlabel="weight-update steps",
    ylabel="routed validation perplexity (prefix excluded)",
    yscale="log",
    title="Validation perplexity vs steps (embedded corpus)",
  )
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  files.append(os.path.join(out, "ppl_vs_steps.png"))
  fig.savefig(files[-1], dpi=120, bbox_inches="tight")
  plt.close(fig)

  multi = [n for n in arms.ordered(results) if results[n]["params"]["paths"] > 1]
  fig, axes = plt.subplots(
    1, max(len(multi), 1), figsize=(3.2 * max(len(multi), 1), 3.6), squeeze=False
  )
  for ax, name in zip(axes[0], multi):
    ppl = results[name]["final"]["store"]["ppl"]
    labels = [*(str(w) for w in s.windows), "once"]
    for kind, style in (("linear", "o-"), ("transformer", "s-"), ("oracle", "^--")):
      if not s.windows or f"{kind}/W={s.windows[0]}" not in ppl:
        continue
      once = ppl["oracle/once" if kind == "oracle" else "once"]
      ax.plot(labels, [*(ppl[f"{kind}/W={w}"] for w in s.windows), once], style, ms=4, label=kind)
    ax.set(title=name, xlabel="re-route every W tokens")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("routed validation perplexity")
  axes[0][0].legend(fontsize=8)
  fig.suptitle("Perplexity vs re-routing frequency (global modules)")
  fig.tight_layout()
  files.append(os.path.join(out, "ppl_vs_window.png"))
  fig.savefig(files[-1], dpi=120, bbox_inches="tight")
  plt.close(fig)
  return files


def final_ppl(r: dict, params: str = "store") -> float | None:
  rep = r["final"].get(params)
  return None if rep is None else rep["ppl"]["once"]


def summarize(dirs: list[str]) -> dict:
  """Mean and range per model over the seeds' results.json; which gaps exceed the seed range.

  A gap between two models' means counts as resolved only when it is larger than the
  seed range (max - min) of each of the two; otherwise it is flagged as within noise.
  """
  records = []
  for d in dirs:
    path = os.path.join(d, "results.json")
    if not os.path.exists(path):
      raise SystemExit(f"--summarize: {path} does not exist; run reproduce.py --out={d} first.")
    records.append(runs.read_json(path))
  vocabs = sorted({r["sizes"].get("vocab", 8192) for r in records})
  if len(vocabs) > 1:
    raise SystemExit(
      f"--summarize: {dirs} were run with vocabularies of {vocabs} pieces; perplexities do not "
      "compare across vocabularies: summarize runs of one vocabulary."
    )
  sizes = {json.dumps(r["sizes"], sort_keys=True) for r in records}
  if len(sizes) > 1:
    raise SystemExit(f"--summarize: {dirs} were run at different sizes; summarize one size.")
  models = {}
  for name in ["pretrain", *arms.ordered({n for r in records for n in r["models"]})]:
    have = [r for r in records if name in r["models"]]
    if not have:
      continue
    vals = [final_ppl(r["models"][name]) for r in have]
    best = [final_ppl(r["models"][name], "best") for r in have]
    m0 = have[0]["models"][name]
    # Oracle (best path per document in hindsight) and a random path (the loss averaged over
    # paths), for models with several paths.
    other = {
      k: [r["models"][name]["final"]["store"]["ppl"].get(f"{k}/once") for r in have]
      for k in ("oracle", "random")
    }
    noise = [r["models"][name].get("noise_scale") for r in have]
    specs = [r["models"][name].get("specialisation") for r in have]
    models[name] = {
      "seeds": [r["seed"] for r in have],
      "ppl": vals,
      "mean": float(np.mean(vals)),
      "min": float(np.min(vals)),
      "max": float(np.max(vals)),
      "range": float(np.max(vals) - np.min(vals)),
      "early_stop_mean": float(np.mean(best)) if None not in best else None,
      **{f"{k}_mean": float(np.mean(v)) if None not in v else None for k, v in other.items()},
      **{f"{k}_ppl": v if None not in v else None for k, v in other.items()},
      "noise_scale_tokens": [n["noise_scale_tokens"] for n in noise] if all(noise) else None,
      "batch_over_noise_scale": [n["run_batch_over_noise_scale"] for n in noise]
      if all(noise)
      else None,
      # The specialisation report per seed (models with several paths, when written).
      **{k: [sp[k] for sp in specs] if all(specs) else None for k in runs.SPEC_KEYS[1:4]},
      "description": m0.get("description"),
      "paths": m0["params"]["paths"],
      "workers": m0["params"]["workers"],
      "shard_min_over_mean": min(r["models"][name]["shards"]["min_over_mean"] for r in have),
      "seconds": float(np.mean([sum(r["models"][name]["seconds"].values()) for r in have])),
    }
  gaps = []
  for a, b in arms.PAIRS:
    if a in models and b in models:
      gap = models[b]["mean"] - models[a]["mean"]  # > 0: a is better, as the paper orders.
      noise = max(models[a]["range"], models[b]["range"])
      seeds = min(len(models[a]["ppl"]), len(models[b]["ppl"]))  # A range needs two.
      gaps.append(
        {
          "better_expected": a,
          "worse_expected": b,
          "gap": gap,
          "seed_range": noise,
          "resolved": abs(gap) > noise and seeds > 1,
          "one_seed": seeds < 2,
          "paper_order_holds": gap > 0,
        }
      )
  return {
    "dirs": dirs,
    "sizes": records[0]["sizes"],
    "mode": records[0].get("mode"),
    "commands": [command_for(r.get("command"), d) for r, d in zip(records, dirs)],
    "models": models,
    "gaps": gaps,
  }


def command_for(command: str | None, out: str) -> str | None:
  """A run's recorded command, its --out spelled as the summary was given the directory."""
  if not command:
    return command
  words = ["python", *command.split()[1:]]
  return " ".join(f"--out={out}" if w.startswith("--out=") else w for w in words)


def arms_json(summary: dict, command: str) -> dict:
  """The routing question's machine-readable result: one record per arm, ppl per seed.

  `arms` holds the grids and DiLoCo at the grids' worker counts (ARM_GRIDS); `references`
  the rest (dense, DiLoCo P=2) in the same form. Gaps are the summary's (mean difference
  against the larger seed range of the two).
  """
  s = modes.Sizes(**summary["sizes"])
  out = {"arms": {}, "references": {}}
  for name, m in summary["models"].items():
    if name == "pretrain":
      continue
    grid, shards = arms.arm_kind(name, s)
    record = {
      "ppl": m["ppl"],
      "grid": grid,
      "shards": shards,
      "seeds": m["seeds"],
      "mean": m["mean"],
      "range": m["range"],
      "oracle_ppl": m["oracle_ppl"],
      "random_path_ppl": m["random_ppl"],
      **{k: m.get(k) for k in runs.SPEC_KEYS[1:4]},
      "workers": m["workers"],
      "description": m.get("description"),
    }
    out["arms" if grid in arms.ARM_GRIDS else "references"][name] = record
  pre = summary["models"].get("pretrain", {})
  out["regime"] = {
    "mode": summary.get("mode"),
    "sizes": summary["sizes"],
    "noise_scale_tokens_at_theta": pre.get("noise_scale_tokens"),
    "batch_over_noise_scale_at_theta": pre.get("batch_over_noise_scale"),
  }
  out["gaps"] = summary["gaps"]
  out["commands"] = [*summary["commands"], command]
  return out


def summary_markdown(summary: dict) -> str:
  """The summary's table (mean and range per model) and its gaps."""
  lines = [
    f"# Over {len({s for m in summary['models'].values() for s in m['seeds']})} seeds "
    f"({', '.join(summary['dirs'])})",
    "",
    "| model | paths | workers | ppl mean | min – max (range) | oracle mean | random path mean | "
    "early stop mean | seeds | smallest shard / mean |",
    "|---|---:|---:|---:|---|---:|---:|---:|---|---:|",
  ]
  fmt = lambda v: "–" if v is None else f"{v:.2f}"
  for name, m in summary["models"].items():
    lines.append(
      f"| {name} | {m['paths']} | {m['workers']} | {m['mean']:.2f} | {m['min']:.2f} – "
      f"{m['max']:.2f} ({m['range']:.2f}) | {fmt(m.get('oracle_mean'))} | "
      f"{fmt(m.get('random_mean'))} | {fmt(m['early_stop_mean'])} | "
      f"{','.join(map(str, m['seeds']))} | {m['shard_min_over_mean']:.2f} |"
    )
  for name, m in summary["models"].items():
    if m.get("noise_scale_tokens"):
      lines.append(
        f"\nGradient noise scale at {name}'s end, per seed: "
        f"{', '.join(f'{t:,.0f}' for t in m['noise_scale_tokens'])} tokens; the per-worker "
        f"batch is {', '.join(f'{x:.2f}' for x in m['batch_over_noise_scale'])}x it."
      )
  lines += ["", "| expected better | expected worse | gap (ppl) | seed range | reading |"]
  lines.append("|---|---|---:|---:|---|")
  for g in summary["gaps"]:
    order = "paper's order" if g["paper_order_holds"] else "reversed"
    noise = (
      "exceeds the seed range"
      if g["resolved"]
      else "one seed: no range (not a result)"
      if g.get("one_seed")
      else "within the seed range (not a result)"
    )
    lines.append(
      f"| {g['better_expected']} | {g['worse_expected']} | {g['gap']:+.2f} | "
      f"{g['seed_range']:.2f} | {order}, {noise} |"
    )
  return "\n".join(lines) + "\n"
