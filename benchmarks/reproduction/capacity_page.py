"""docs/results/capacity.{md,json} and its plot, from the arms' JSON files alone."""

import json
import os

import numpy as np

from reproduction import arms
from reproduction import capacity
from reproduction import modes


def kind(name: str, s: modes.Sizes) -> dict:
  """The JSON's grid ("dense", "2x2", "2x4", "P=<n>") and shards ("routed", "iid", "none")."""
  base = (arms.outer_lr_variant(name) or (name, 0))[0]
  if base.startswith("dense") or base.startswith("pretrain"):
    return {"grid": "dense", "shards": "none"}
  grid, shards = arms.arm_kind(base, s)
  return {"grid": grid, "shards": shards}


def aggregate(seeds: dict[int, dict[str, dict]]) -> dict:
  """Per arm over the seeds that finished it: ppl, bits per char, early stop, oracle, curve."""
  out = {}
  names = arms.ordered({n for recs in seeds.values() for n in recs if n != "pretrain"})
  for name in ["pretrain", *names]:
    have = {seed: recs[name] for seed, recs in seeds.items() if name in recs}
    if not have:
      continue
    first = next(iter(have.values()))
    s = modes.Sizes(
      **{k: tuple(v) if isinstance(v, list) else v for k, v in first["sizes"].items()}
    )
    ppl = [capacity.ppl(r) for r in have.values()]
    cpt = [seeds[seed]["pretrain"]["chars_per_scored_token"] for seed in have]
    loss = [r["final"]["store"]["loss"]["once"] for r in have.values()]
    stop = [capacity.ppl(r, "best") for r in have.values()]
    store = [r["final"]["store"]["ppl"] for r in have.values()]
    rerouted = [{k: v for k, v in p.items() if "/W=" in k and "oracle" not in k} for p in store]
    out[name] = {
      **kind(name, s),
      "seeds": list(have),
      "ppl": ppl,
      **capacity.summary_stats(ppl),
      "bits_per_char": [capacity.bits_per_char(x, c) for x, c in zip(loss, cpt)],
      "early_stop_ppl": stop if None not in stop else None,
      "oracle_ppl": [p.get("oracle/once") for p in store] if "oracle/once" in store[0] else None,
      "random_path_ppl": [p.get("random/once") for p in store]
      if "random/once" in store[0]
      else None,
      "rerouting_ppl": rerouted if any(rerouted) else None,
      "params": first["params"]["total"],
      "params_path": first["params"]["path"],
      "workers": first["params"]["workers"],
      "specialisation": [r.get("specialisation") for r in have.values()],
      "curve": [r["curve"] for r in have.values()],
      "description": arms.describe(name),
      "epochs_per_shard": [epochs(r, s) for r in have.values()],
    }
  return out


def epochs(record: dict, s: modes.Sizes) -> float | None:
  """Passes over its shard of the worker reading the most of its own (after the fork)."""
  if not record["forked"]:
    return None
  read = s.steps * (s.fork_batch or s.batch) * s.seq_len
  return read / min(record["shards"]["train_tokens"])


def verdict(a: str, b: str, agg: dict) -> dict:
  """a expected better (the paper's order): the gap b - a against the larger seed range."""
  ra, rb = agg[a], agg[b]
  gap = rb["mean"] - ra["mean"]
  noise = max(ra["range"], rb["range"])
  seeds = min(len(ra["ppl"]), len(rb["ppl"]))
  return {
    "better_expected": a,
    "worse_expected": b,
    "gap": gap,
    "seed_range": noise,
    "seeds": seeds,
    "resolved": seeds > 1 and abs(gap) > noise,
    "needs_third_seed": seeds < 3 and abs(gap) <= 2 * noise,
    "paper_order_holds": gap > 0,
  }


def best_arm(agg: dict, base: str | None) -> str | None:
  """`base`'s outer-LR variant with the lowest mean perplexity over the seeds.

  Among the variants run on the most seeds: an LR that only seed 0 tried (a later seed keeps
  seed 0's best and those near it: KEEP_WITHIN) is not weighed, on one seed, against means over
  several.
  """
  have = capacity.variants(agg, base)
  most = max((len(agg[n]["ppl"]) for n in have), default=0)
  have = [n for n in have if len(agg[n]["ppl"]) == most]
  return min(have, key=lambda n: agg[n]["mean"]) if have else None


def questions(agg: dict) -> list[dict]:
  """The three questions per grid: vs DiLoCo at equal workers, vs the store-sized dense, routing."""
  out = []
  for grid, (routed, iid) in capacity.GRIDS.items():
    workers = int(np.prod([int(k) for k in grid.split("x")]))
    dipaco = best_arm(agg, routed)
    diloco = best_arm(agg, capacity.DILOCO.get(workers))
    plain = best_arm(agg, iid)
    pairs = {
      "dipaco_vs_diloco": (dipaco, diloco),
      "dipaco_vs_dense_store": (dipaco, f"dense_store_{grid}"),
      "routed_vs_iid": (dipaco, plain),
    }
    for q, (a, b) in pairs.items():
      if a in agg and b in agg:
        out.append({"question": q, "grid": grid, **verdict(a, b, agg)})
  return out


def regime(seeds: dict[int, dict[str, dict]], agg: dict) -> dict:
  """The regime's numbers: tokens per parameter, batch / noise scale, epochs, H, P-gain."""
  pre = {seed: recs["pretrain"] for seed, recs in seeds.items() if "pretrain" in recs}
  if not pre:
    return {}
  rec = next(iter(pre.values()))
  s = modes.Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in rec["sizes"].items()})
  path = rec["params"]["path"]
  fork = s.fork_batch or s.batch
  noise = [r["noise_scale"]["noise_scale_tokens"] for r in pre.values() if r.get("noise_scale")]
  sats = [capacity.saturation(recs) for recs in seeds.values()]
  gains = [x["gains"]["4_to_8"] for x in sats if "4_to_8" in x["gains"]]
  eps = [e for name, a in agg.items() for e in a["epochs_per_shard"] if e is not None]
  return {
    "tokens_per_param_theta": s.pretrain * s.batch * s.seq_len / path,
    "tokens_per_param_path": s.steps * fork * s.seq_len / path,
    "batch_tokens": fork * s.seq_len,
    "noise_scale_tokens_at_theta": noise,
    "batch_over_noise_scale_per_seed": [fork * s.seq_len / n for n in noise],
    "epochs_per_shard_max": max(eps) if eps else None,
    "inner_steps": s.inner_steps,
    "outer_steps": s.steps // s.inner_steps,
    "diloco_gain_4_to_8": float(np.mean(gains)) if gains else None,
    "diloco_gain_4_to_8_per_seed": gains,
    "diloco_saturation_per_seed": sats,
    "path_params": path,
    "routed_share_of_path": routed_share(rec),
    "sizes": rec["sizes"],
  }


def routed_share(pretrain: dict) -> float | None:
  return pretrain.get("routed_share")


def page_json(seeds: dict, commands: list[str]) -> dict:
  agg = aggregate(seeds)
  reg = regime(seeds, agg)
  return {
    "regime": {
      "tokens_per_param_path": reg.get("tokens_per_param_path"),
      "diloco_gain_4_to_8": reg.get("diloco_gain_4_to_8"),
      "batch_over_noise_scale": float(np.mean(reg["batch_over_noise_scale_per_seed"]))
      if reg.get("batch_over_noise_scale_per_seed")
      else None,
      **{k: v for k, v in reg.items() if k not in ("sizes",)},
    },
    "arms": {
      n: {k: a[k] for k in ("ppl", "grid", "shards", "params", "seeds", "bits_per_char", "mean")}
      | {"range": a["range"], "early_stop_ppl": a["early_stop_ppl"], "workers": a["workers"]}
      for n, a in agg.items()
      if n != "pretrain"
    },
    "questions": questions(agg),
    "sizes": reg.get("sizes"),
    "commands": commands,
  }


def write(results: str, md_path: str, json_path: str, commands: list[str]) -> dict:
  """Writes the page, its JSON and its plot (beside the page) from `results`' arm files."""
  from reproduction import capacity_markdown

  seeds = capacity.read_arms(results)
  if not seeds:
    raise SystemExit(f"--capacity_page: no arm JSON under {results}; run --capacity first.")
  vocabs = {r["sizes"]["vocab"] for recs in seeds.values() for r in recs.values()}
  if len(vocabs) > 1:
    raise SystemExit(
      f"--capacity_page: {results} holds runs of vocabularies {sorted(vocabs)}; perplexities "
      "do not compare across vocabularies: keep one vocabulary's runs there."
    )
  doc = page_json(seeds, commands)
  os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
  png = os.path.splitext(md_path)[0] + "_ppl_vs_steps.png"
  agg = aggregate(seeds)
  plot(agg, png)
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  with open(md_path, "w") as f:
    f.write(capacity_markdown.render(doc, agg, seeds, os.path.basename(png)))
  return doc


def plot(agg: dict, path: str) -> None:
  """Routed perplexity vs steps, the mean over seeds: the gate's arms, then the others."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  gate = [n for n in agg if n.startswith("diloco_")]
  rest = [n for n in agg if n not in gate and n != "pretrain"]
  fig, axes = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
  for ax, names, title in ((axes[0], gate, "DiLoCo P = 1, 2, 4, 8"), (axes[1], rest, "arms")):
    for name in names:
      curves = agg[name]["curve"]
      n = min(len(c) for c in curves)
      xs = [c[0] for c in curves[0][:n]]
      ys = np.mean([[c[1] for c in cur[:n]] for cur in curves], axis=0)
      ax.plot(xs, ys, marker="o", ms=2, lw=1, label=name, ls="--" if "dense" in name else "-")
    ax.set(title=title, xlabel="weight-update steps (θ̄'s included)", yscale="log")
    ax.grid(alpha=0.3)
    if names:
      ax.legend(fontsize=6, ncol=2)
  axes[0].set_ylabel("routed validation perplexity (prefix excluded), mean over seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
