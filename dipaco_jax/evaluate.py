"""Routed evaluation, one path per sequence (or per W-token chunk): prefix-excluded perplexity.

    python -m dipaco_jax.evaluate --workdir=DIR [--config.eval.rerouters=linear,transformer]

Every validation document gives one sequence, its first `eval.seq_len` tokens.
The run's active router (random, k-means or the last discriminative phase)
routes it by its prefix, the chosen path scores it, and perplexity counts
every target token except the first `prefix_len` (paper §4; dense and DiLoCo
too, whose router is trivial, so numbers compare). Re-routing every W tokens
uses the test-time routers of routing/rerouting.py; oracles (best path per sequence or
per chunk in hindsight) bound what any router could reach, and `random/once` (the loss
averaged over all paths: a uniformly random path's, in expectation) is what routing
without information gives.

Documents come from the run's validation shards (never overlapping), so each
one's own shard is known: `own_shard` is each worker's loss on its own shard.

The command's config is the run's saved <workdir>/config.json unless --config
is given; --config.a.b=v overrides apply on top (cli.py). The transformer
re-router (the paper's) fine-tunes θ̄ and takes minutes on a CPU: it runs only
when listed.
"""
# pylint: disable=invalid-name

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from absl import flags
from etils import epath

from dipaco_jax import cli
from dipaco_jax import data as data_lib
from dipaco_jax import errors
from dipaco_jax import routing
from dipaco_jax import saved_config
from dipaco_jax.config import sections
from dipaco_jax.core import experiment as exp_lib
from dipaco_jax.io import checkpoint as ckpt_lib
from dipaco_jax.io import files
from dipaco_jax.io import lock
from dipaco_jax.io import progress
from dipaco_jax.routing import report as report_lib
from dipaco_jax.routing import rerouting
from dipaco_jax.routing import specialisation as spec_lib

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")

EVAL_DIR = "eval"  # <workdir>/eval/step_<s>.{json,md}: evaluate_and_write's reports.


@dataclasses.dataclass
class Run:
  """A restored run: config, Experiment, state, phase and the phase's shard set."""

  config: Any
  workdir: str
  exp: exp_lib.Experiment
  state: Any
  step: int
  phase: int
  shard_set: Any


def _no_checkpoint(workdir: str) -> ckpt_lib.NoCheckpointError:
  return ckpt_lib.NoCheckpointError(
    f"no checkpoint in {ckpt_lib.directory(workdir)}: train the run first "
    "(python -m dipaco_jax.main --config=... --workdir=...)."
  )


def load_run(config, workdir: str, step: int | None = None) -> Run:
  """Restores the latest (or given) checkpoint of `workdir` on this host's mesh."""
  saved_config.check_readable(workdir, config)
  saved = ckpt_lib.steps(workdir)
  if not saved:  # Before the checkpointer, which would make an empty checkpoints/ folder.
    raise _no_checkpoint(workdir)
  if step is not None and step not in saved:
    raise ckpt_lib.NoCheckpointError(
      f"--step={step}: no checkpoint step {step} in {ckpt_lib.directory(workdir)} (saved steps: "
      f"{', '.join(map(str, saved))}): give one of them, or leave --step out for the latest."
    )
  exp = exp_lib.Experiment(config)
  ckpt = ckpt_lib.Checkpointer(workdir, async_save=False)
  restored = ckpt.restore(exp.abstract_state, step)
  ckpt.close()
  if restored is None:
    raise _no_checkpoint(workdir)
  state, data_state = restored
  phase = ckpt_lib.routing_phase(data_state)
  shard_dir = routing.shard_dir(config, workdir, phase)
  if not epath.Path(shard_dir).exists():  # Before ShardSet's message, which is for writers.
    where = "config.data.shard_dir, or <workdir>/shards" if phase == 0 else "the re-shard's folder"
    raise FileNotFoundError(
      f"{workdir}: step {int(jax.device_get(state.step))} reads the held-out (validation) shards "
      f"of routing phase {phase} from {shard_dir} ({where}), which does not exist: restore that "
      "folder from where the run wrote it (evaluation scores their validation split)."
    )
  return Run(
    config,
    str(workdir),
    exp,
    state,
    int(jax.device_get(state.step)),
    phase,
    data_lib.ShardSet(shard_dir),
  )


def config_from_workdir(workdir: str):
  """The config a run was trained with (<workdir>/config.json, written by the trainer)."""
  return saved_config.load(workdir)


def validation_sequences(run: Run, max_docs: int = 0) -> dict[str, np.ndarray]:
  """Validation documents (from the shards) with their worker; a fixed hash-order subset."""
  docs, workers = [], []
  for w in range(run.shard_set.num_workers):
    n = int(run.shard_set.num_docs("validation")[w])
    shard = run.shard_set.documents(w, "validation")
    for d in shard.read_many(range(n)) if n else []:
      docs.append(d)
      workers.append(w)
  order = np.argsort(routing.hash_ids(np.array([d.doc_id for d in docs], np.int64)), kind="stable")
  if max_docs:
    order = order[:max_docs]
  T = routing.eval_seq_len(run.config)
  tokens, lengths = routing.pad_rows([docs[i].tokens for i in order], T)
  return {
    "doc_ids": np.array([docs[i].doc_id for i in order], np.int64),
    "domains": np.array([docs[i].domain for i in order]),
    "workers": np.array(workers, np.int64)[order],
    "tokens": tokens,
    "lengths": lengths,
  }


def rerouter_dir(workdir: str, step: int) -> str:
  return files.join(workdir, routing.ROUTER_DIR, f"rerouters_step{step}")


def rerouters_to_fit(run: Run, kinds) -> list[str]:
  """The re-routers among `kinds` not saved for the run's step, which fit_rerouters would fit.

  `python -m dipaco_jax.evaluate` saves them under rerouter_dir; a dense run needs none.
  """
  for kind in kinds:
    if kind not in sections.REROUTERS:
      raise ValueError(f"unknown re-router {kind!r}: choose from {sections.REROUTERS}.")
  if run.exp.topo.num_paths == 1:
    return []
  directory = rerouter_dir(run.workdir, run.step)
  saved = {
    "linear": routing.Router.exists,
    "transformer": lambda sub: (files.path(sub) / rerouting.PARAMS_FILE).exists(),
  }
  return [k for k in kinds if not saved[k](files.join(directory, k))]


def fit_rerouters(run: Run, scorer: routing.PathScorer, extractor, *, kinds) -> dict[str, Any]:
  """Fits (or loads) a step's test-time routers on the router split, labelled by `scorer`.

  They are fitted once per checkpoint step, with the store's paths, and serve the
  early-stopping set of that step too.
  """
  cfg, ev, topo = run.config.routing, run.config.eval, run.exp.topo
  directory = rerouter_dir(run.workdir, run.step)
  todo = rerouters_to_fit(run, kinds)
  if topo.num_paths == 1:  # Dense / DiLoCo: every router picks path 0.
    return dict.fromkeys(kinds)
  out = {}
  for kind in (k for k in kinds if k not in todo):
    sub = files.join(directory, kind)
    if kind == "linear":
      out[kind] = routing.Router.load(sub, grid=routing.router_grid(topo))
    else:
      out[kind] = rerouting.load_transformer(sub)
  if not todo:
    return out
  L, T = extractor.prefix_len, scorer.seq_len
  docs = []
  for d in routing.document_stream(run.config.data)("router"):
    if len(d.tokens) > L:
      docs.append(d.tokens[:T])
    if cfg.router_max_docs and len(docs) >= cfg.router_max_docs:
      break
  tokens, lengths = routing.pad_rows(docs, T)
  s_NxTxP = scorer.score_all_paths(list(docs), desc="re-router labels: every path scores")
  labels = rerouting.window_labels(s_NxTxP, lengths, ev.reroute_label_window)
  if "linear" in todo:
    r = rerouting.fit_linear(
      extractor.running_means(tokens, desc="linear re-router features"),
      labels,
      lengths,
      prefix_len=L,
      stride=ev.reroute_stride,
      grid=routing.router_grid(topo),
      seed=cfg.seed,
    )
    r.info["features"] = extractor.fingerprint
    r.save(files.join(directory, "linear"), overwrite=True)
    out["linear"] = r
  if "transformer" in todo:
    mask = (np.arange(T)[None] >= L) & (np.arange(T)[None] < lengths[:, None])
    tr = rerouting.TransformerRerouter(run.exp.model_cfg, topo.num_paths)
    params = tr.fit(
      extractor.params,
      tokens,
      labels,
      mask,
      steps=ev.reroute_steps,
      lr=ev.reroute_lr,
      batch_size=ev.reroute_batch_size,
      seed=cfg.seed,
    )
    rerouting.save_transformer(params, files.join(directory, "transformer"))
    out["transformer"] = params
  return out


def _deciders(rerouters: dict, run: Run, block: dict, running, transformer) -> dict[str, Callable]:
  """kind -> decide(rows, b): paths for the chunk starting at target b."""
  out = {}
  if run.exp.topo.num_paths == 1:
    return {k: (lambda rows, b: np.zeros(len(rows), np.int64)) for k in rerouters}
  for kind, r in rerouters.items():
    if kind == "linear":
      out[kind] = lambda rows, b, r=r: r.route(running[rows, b])[:, 0]
    else:
      logits = transformer.logits(r, block["tokens"])
      out[kind] = lambda rows, b, lg=logits: lg[rows, b].argmax(-1)
  return out


def evaluate(
  run: Run,
  *,
  params: str = "store",
  windows=None,
  rerouters=None,
  oracle: bool = True,
  max_docs: int | None = None,
  block: int = 128,
  per_sequence: bool = False,
) -> dict:
  """The prefix-excluded perplexity, routed once per sequence and per W; per-path, own-shard losses.

  per_sequence (needs oracle, which scores every path on every sequence): the report also
  holds `per_sequence`, numpy arrays in sequence order: `nll` [N, P] (each path's summed
  loss on the sequence's scored tokens), `tokens` [N] and `shard_paths` [N] (the path whose
  validation shard holds the document); `specialisation` reads them.
  """
  config, topo = run.config, run.exp.topo
  cfg = config.routing
  L = routing.check_prefix_len(cfg.prefix_len)
  windows = [
    rerouting.check_window(w)
    for w in (config.eval.rerouting_windows if windows is None else windows)
  ]
  kinds = tuple(config.eval.rerouters if rerouters is None else rerouters)
  if per_sequence and not oracle:
    raise ValueError("per_sequence=True needs oracle=True: every path must score every sequence.")
  T = routing.eval_seq_len(config)
  if T <= L:
    raise errors.ConfigError(
      f"evaluation scores the tokens after the {L}-token routing prefix but its sequences have "
      f"{T} (config.eval.seq_len, 0 = data.seq_len): set --config.eval.seq_len above {L} or "
      "lower config.routing.prefix_len."
    )
  store_scorer = routing.PathScorer.from_store(run.exp, run.state.store, seq_len=T)
  if params == "store":
    scorer = store_scorer
  elif params == "best":
    ckpt = ckpt_lib.Checkpointer(run.workdir, async_save=False)
    best = ckpt.restore_best(run.exp.abstract_state.params, run.step)
    ckpt.close()
    if best is None:
      raise ckpt_lib.NoCheckpointError(
        f"no early-stopping set in checkpoint step {run.step} of {run.workdir}: train with "
        "config.early_stopping.enabled=True."
      )
    scorer = routing.PathScorer(run.exp, best[0], seq_len=T)
  else:
    raise ValueError(
      f"params={params!r}: use 'store' (the global modules) or 'best' (per-path early stopping)."
    )
  extractor = routing.extractor_from_config(config)
  router = routing.load_phase_router(config, run.workdir, topo, run.phase, extractor)
  rr = fit_rerouters(run, store_scorer, extractor, kinds=kinds) if windows else {}
  seqs = validation_sequences(run, config.eval.max_docs if max_docs is None else max_docs)
  P = topo.num_paths
  names = ["once"] + [f"{k}/W={w}" for k in rr for w in windows]
  if oracle:
    names += ["oracle/once", "random/once"] + [f"oracle/W={w}" for w in windows]
  nll = dict.fromkeys(names, 0.0)
  switches = dict.fromkeys(names, 0)
  path_nll, path_tok, shard_nll, shard_tok = (
    np.zeros(P),
    np.zeros(P),
    np.zeros(topo.num_workers),
    np.zeros(topo.num_workers),
  )
  first_all, tokens_total, agree = [], 0, 0
  seq_nll, seq_tok, seq_shard = [], [], []  # per_sequence's arrays.
  transformer = rerouting.TransformerRerouter(run.exp.model_cfg, P)  # One jit for all blocks.
  bar = progress.bar(total=len(seqs["doc_ids"]), desc=f"evaluate ({params})", unit="seq")
  for s in range(0, len(seqs["doc_ids"]), block):
    b = {k: v[s : s + block] for k, v in seqs.items()}
    n, lens = len(b["doc_ids"]), b["lengths"]
    running = (
      extractor.running_means(b["tokens"]) if router.needs_features or "linear" in rr else None
    )
    pre = running[np.arange(n), np.minimum(L, lens)] if router.needs_features else None
    first = router.paths(b["doc_ids"], pre)[:, 0]
    shard_path = topo.path_of_worker[b["workers"]]
    first_all.append(first)
    agree += int((first == shard_path).sum())
    deciders = _deciders(rr, run, b, running, transformer)
    assign = {"once": rerouting.chunk_paths(first, lens, L, 10**9, None)}
    for k, dec in deciders.items():
      for w in windows:
        assign[f"{k}/W={w}"] = rerouting.chunk_paths(first, lens, L, w, dec)
    units = {
      (i, int(p))
      for a in list(assign.values()) + [shard_path[:, None]]
      for i in range(n)
      for p in np.unique(a[i, : max(lens[i], 1)])
    }
    if oracle:
      units |= {(i, p) for i in range(n) for p in range(P)}
    units = sorted(units)
    lp = dict(
      zip(units, scorer.score([b["tokens"][i, : lens[i]] for i, _ in units], [p for _, p in units]))
    )
    for i in range(n):
      m = slice(L, lens[i])
      k = max(lens[i] - L, 0)
      tokens_total += k
      used = sorted(p for (j, p) in units if j == i)
      s_TxU = np.stack([lp[i, p][m] for p in used], -1)  # [k, paths scored for sequence i]
      for name, a in assign.items():
        col = np.searchsorted(used, a[i, m])
        nll[name] -= s_TxU[np.arange(k), col].sum()
        switches[name] += int((np.diff(a[i, m]) != 0).sum())
      p0, w = int(first[i]), int(b["workers"][i])
      path_nll[p0] -= lp[i, p0][m].sum()
      path_tok[p0] += k
      shard_nll[w] -= lp[i, int(shard_path[i])][m].sum()
      shard_tok[w] += k
      if per_sequence:  # oracle: the columns of s_TxU are paths 0..P-1.
        seq_nll.append(-s_TxU.sum(0, dtype=np.float64))
        seq_tok.append(k)
        seq_shard.append(int(shard_path[i]))
      if oracle and k:
        nll["oracle/once"] -= s_TxU.sum(0).max()  # All P paths were scored.
        nll["random/once"] -= s_TxU.sum(0).mean()
        for w_ in windows:
          nll[f"oracle/W={w_}"] -= sum(s_TxU[c : c + w_].sum(0).max() for c in range(0, k, w_))
    bar.update(n)
  bar.close()
  if tokens_total == 0:
    raise errors.ConfigError(
      f"no validation sequence is longer than the {L}-token prefix; lower "
      "config.routing.prefix_len or raise config.eval.seq_len."
    )
  seqs_n = max(len(seqs["doc_ids"]), 1)
  out = {
    "step": run.step,
    "params": params,
    "phase": run.phase,
    "router": router.kind,
    "prefix_len": L,
    "seq_len": T,
    "num_sequences": len(seqs["doc_ids"]),
    "scored_tokens": int(tokens_total),
    "windows": windows,
    "rerouters": list(rr),
    "ppl": {k: float(np.exp(v / tokens_total)) for k, v in nll.items()},
    "loss": {k: float(v / tokens_total) for k, v in nll.items()},
    "switches_per_sequence": {k: v / seqs_n for k, v in switches.items()},
    "per_path": {
      "tokens": path_tok.astype(int).tolist(),
      "loss": (path_nll / np.maximum(path_tok, 1)).tolist(),
    },
    "own_shard": {
      "tokens": shard_tok.astype(int).tolist(),
      "loss": (shard_nll / np.maximum(shard_tok, 1)).tolist(),
    },
    "route_agreement_with_shards": agree / seqs_n,
    "sequence_paths": np.concatenate(first_all).tolist() if first_all else [],
    "domains": seqs["domains"].tolist(),
  }
  if per_sequence:
    out["per_sequence"] = {
      "nll": np.array(seq_nll, np.float64).reshape(-1, P),
      "tokens": np.array(seq_tok, np.int64),
      "shard_paths": np.array(seq_shard, np.int64),
    }
  return out


def to_markdown(rep: dict) -> str:
  """The report's perplexities and per-path losses as markdown tables."""
  lines = [
    f"step {rep['step']}, params {rep['params']}, router {rep['router']} (phase "
    f"{rep['phase']}), {rep['num_sequences']} sequences of <= {rep['seq_len']} tokens, "
    f"{rep['scored_tokens']} scored tokens (first {rep['prefix_len']} excluded)",
    "",
    "| routing | prefix-excluded ppl | loss | path switches / seq |",
    "|---|---:|---:|---:|",
  ]
  for k, v in rep["ppl"].items():
    lines.append(
      f"| {k} | {v:.3f} | {rep['loss'][k]:.4f} | {rep['switches_per_sequence'][k]:.2f} |"
    )
  lines += ["", "| path | routed tokens | routed loss |", "|---:|---:|---:|"]
  for p, (t, l) in enumerate(zip(rep["per_path"]["tokens"], rep["per_path"]["loss"])):
    lines.append(f"| {p} | {t} | {l:.4f} |")
  lines += ["", "| worker | own-shard tokens | own-shard loss |", "|---:|---:|---:|"]
  for w, (t, l) in enumerate(zip(rep["own_shard"]["tokens"], rep["own_shard"]["loss"])):
    lines.append(f"| {w} | {t} | {l:.4f} |")
  return "\n".join(lines) + "\n"


def domain_report(rep: dict, num_paths: int) -> report_lib.RouterReport:
  """Paths (once per sequence) x document domains of the evaluated sequences."""
  ids, names = report_lib.domain_index(rep["domains"])
  return report_lib.report(np.asarray(rep["sequence_paths"]), num_paths, ids, names)


def specialisation(
  run: Run, rep: dict | None = None, *, params: str = "store", max_docs: int | None = None
) -> spec_lib.Specialisation:
  """Every path on every path's validation shard, routed vs random vs oracle, per domain.

  From `rep`, an `evaluate(run, per_sequence=True)` report of this run, when given; else
  it scores (every path on every validation sequence, no re-routing) with `params`.
  A run with one path, or whose shards hold no held-out documents, is refused in one line
  (routing/specialisation.py, which holds the report).
  """
  spec_lib.check_paths(run.exp.topo, run.workdir)
  spec_lib.check_held_out(run.shard_set, run.workdir)
  if rep is None:
    rep = evaluate(
      run, params=params, windows=(), oracle=True, max_docs=max_docs, per_sequence=True
    )
  return spec_lib.from_evaluation(rep, run.exp.topo.num_paths)


def evaluate_and_write(config, workdir: str, step: int | None = None) -> str:
  """Evaluates the store (and the early-stopping set when saved); writes <workdir>/eval/.

  Holds the workdir's lock (io/lock.py): not while a trainer or route writes it.
  """
  with lock.workdir(workdir, "evaluate"):
    return _evaluate_and_write(config, workdir, step)


def _evaluate_and_write(config, workdir: str, step: int | None) -> str:
  out = files.path(workdir) / EVAL_DIR
  files.check_writable(out, "evaluate's reports")  # Before minutes of evaluation.
  run = load_run(config, workdir, step)
  reports = {"store": evaluate(run, params="store")}
  if ckpt_lib.read_best_records(workdir, run.step) is not None:
    reports["best"] = evaluate(run, params="best")
  P = run.exp.topo.num_paths
  text = "\n".join(
    f"## params: {k}\n\n{to_markdown(r)}\n### domains (validation)\n\n"
    f"{report_lib.to_markdown(domain_report(r, P))}"
    for k, r in reports.items()
  )
  files.write_json(out / f"step_{run.step}.json", reports, indent=1, sort_keys=False)
  files.write_text(out / f"step_{run.step}.md", text)
  return text


def main(argv):
  config, workdir = cli.start(argv, writes=False)  # Its reports' folder is checked on its own.
  print(evaluate_and_write(config, workdir, step=_STEP.value))
  step = _STEP.value if _STEP.value is not None else ckpt_lib.latest_step(workdir)
  out = files.join(workdir, EVAL_DIR, f"step_{step}")
  print(f"\nwrote: {out}.md (this report) and {out}.json (every number).")


if __name__ == "__main__":
  cli.run(main, saved_config=True)
