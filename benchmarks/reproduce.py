r"""The paper's comparison at small scale on the embedded corpus: one command, table and plots.

  python benchmarks/reproduce.py --out=/tmp/dipaco_repro           # full: <= 60 min, 2 cores
  python benchmarks/reproduce.py --quick --out=/tmp/dipaco_repro_q  # ~10 CPU-minutes
  python benchmarks/reproduce.py --smoke --out=/tmp/dipaco_repro_s  # CI: tiny sizes, 1/40 data

The long comparison, in the regime that can answer the paper's question (per-worker batch
32 x 96 tokens with every row from another document, about 1x the gradient noise scale
measured at θ̄; benchmarks/noise_scale.py runs on θ̄ and on the dense run's end): θ̄ 240
steps, then 240 more; every arm 4 workers (DiLoCo P=4 at outer LR 0.7, 0.35 and 1.0, DiPaCo 2x2
routed at outer LR 0.7 and 1.0, the same grid on i.i.d. shards, DiPaCo 2x2 with inner Muon)
and DiLoCo P=2. One output dir per seed, then the summary over seeds (mean and range per
model, oracle and random-path means, gaps within the seed range flagged):

  python benchmarks/reproduce.py --long --seed=0 --out=/tmp/long_s0   # then --seed=1 --out=..._s1
  python benchmarks/reproduce.py --summarize=/tmp/long_s0,/tmp/long_s1 --out=/tmp/long_sum

The summary also writes the arms per seed as JSON (`--arms_json`, default
<out>/specialisation.json: {"arms": {name: {"ppl": [per seed], "grid", "shards", ...}}}, with
each multi-path run's specialisation report: diagonal gap, routed-is-best share), the form
docs/results/specialisation.md reads. The routing levers beside --long's arms (add them with
--models=...): the embedding routed (dipaco_2x2_pse: each path its own; dipaco_2x2_emb: in the
first routed level; each with its _iid control), the 4x4 grid (dipaco_4x4, dipaco_4x4_iid,
diloco_iid_16), `--size min_share=0`; and the outer deltas compressed (dipaco_2x2_int8,
dipaco_2x2_fp4, dipaco_2x2_fp4_noef, dipaco_2x2_topk2) or streamed (dipaco_2x2_stream, and
dipaco_2x2_frag without its overlap).

`--long_b4` is the first long comparison (batch 4 x 96, one document after another: ~0.04x
the noise scale), kept for the results page's appendix.

A seed changes everything a real rerun changes: data.seed (batch order, i.i.d. shards,
held-out documents), the model init (config.seed) and the k-means / router seed
(routing.seed). So each seed trains its own θ̄; sharing one θ̄ would leave its noise
out of the seed range.

Every model uses the shipped 8k SentencePiece tokenizer, the same batch (B x T
per path) and the same number of weight-update steps, as in the paper's
Table 1 / Fig. 8 (the DiPaCo paper, §5):

  pretrain      dense path-size model, `pretrain` steps: θ̄, the fork point.
  dense_path    θ̄ + `steps` more steps (the paper's 150M baseline protocol).
  dense_4x      a dense model with ~4x the path's parameters, trained from
                scratch for pretrain + steps (the paper's 1.3B baseline).
  diloco_iid    DiLoCo: one path, P = 4 replicas on i.i.d. shards, forked from θ̄: as
                many workers as the 2x2 grid (and the flat MoE) has paths.
  diloco_iid_16 DiLoCo with as many replicas as the 4x4 grid has paths (16): the
                comparison at equal workers (the paper's Table 1 pairs DiLoCo P=8
                with DiPaCo 2x4, 8 paths each).
  diloco_kmeans DiLoCo on non-i.i.d. shards: k-means with one cluster per replica.
  flat_moe      P independent paths (one level, K=P), k-means then one
                discriminative re-shard.
  dipaco_2x2    P = 4 paths, blocks split in two levels of 2 modules; embedding
                and head shared; k-means, then one discriminative re-shard.
  dipaco_2x2_kmeans  the same run without the re-shard (k-means throughout).
  dipaco_4x4    16 paths, 4 modules per level; k-means, then discriminative.
  dipaco_4x4_kmeans  the same run without the re-shard (k-means throughout).

Every routing is balanced (`min_share` of the sizes, default 0.5): the k-means shards
(routing.kmeans_min_share) and the discriminative re-shard (discriminative_min_share)
floor each path's share of the router split at half the uniform share, so no path
starves (the goal: no training shard under 25% of the mean, in tokens). The k-means
controls share their grid's balanced phase-0 shards, so each pair differs by the
re-shard alone. `--size min_share=0` gives the unbalanced routing. The results record,
per phase, each run's training tokens per shard (min / median / max, min over mean) and
the share of router documents moved off their argmin path; for the grids also the outer
delta norm per level and outer step (the ×√P rescale's stability).

All forks re-warm the inner LR and anneal it over `steps`; the re-shard does
not restart the schedule (routing.restart_schedule=False), so k-means and
discriminative runs share one LR curve. Every checkpoint (each `eval_every`
outer steps) gets the same routed evaluation: each validation document's
first 32 tokens pick one path (the run's router at that step; trivial for
dense and DiLoCo), that path scores the rest, perplexity excludes the prefix.
The last checkpoint also gets per-path early stopping and, for models with
several paths, re-routing every W tokens (linear and transformer re-routers)
with oracles.

Writes <out>/results.json, results.md, ppl_vs_steps.png, ppl_vs_window.png;
<out>/runs/<model>/ are ordinary run directories (python -m dipaco_jax.evaluate
works on them). Rerunning resumes: finished training and evaluations are reused.
Scale figures (memory and step time vs paths, outer time vs modules) are
benchmarks/scale.py's.
"""
# pylint: disable=g-import-not-at-top,wrong-import-position

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reproduction/, noise_scale.py
from reproduction import command

if __name__ == "__main__":
  command.main()
