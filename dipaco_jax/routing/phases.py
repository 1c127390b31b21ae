"""Routing phases: the phase-0 router, the discriminative schedule and its re-fit.

Phase 0 shards come from `config.routing.router`: "random" (i.i.d.), "kmeans"
or "product_kmeans" fitted on the router split's θ̄ features (routing/features.py).
Discriminative phase k (paper §2.4.2, Algorithm 1 line 2) runs after outer
step `discriminative_steps(config)[k - 1]`: every path scores the router split
(log-likelihood of the tokens after the prefix), label = best path, and a
linear router with a calibrated bias is fitted on the prefix features.
Routers live in `<workdir>/router/phase_<k>/` (router.npz + router.json);
phase k's shards in `<workdir>/shards_phase_<k>/` (phase 0: data.shard_dir or
`<workdir>/shards`). `shard_plan.ShardPlan` runs the schedule in the trainer.
"""
# pylint: disable=invalid-name

import itertools
import sys
import time

import jax
import numpy as np
from etils import epath

from dipaco_jax import data as data_lib
from dipaco_jax.config import sections
from dipaco_jax.core import topology as topo_lib
from dipaco_jax.data import shard_cache
from dipaco_jax.errors import ConfigError
from dipaco_jax.io import files
from dipaco_jax.io import lock
from dipaco_jax.io import progress
from dipaco_jax.routing import assignment as assign_lib
from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import report as report_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import scoring

ROUTER_DIR = "router"
REPORT_FILE = "report.md"  # route_run's phase-0 routing report, in router_dir(workdir, 0).


def router_dir(workdir: str, phase: int) -> str:
  return files.join(workdir, ROUTER_DIR, f"phase_{phase}")


def shard_dir(config, workdir: str, phase: int) -> str:
  """Phase 0: config.data.shard_dir or <workdir>/shards; phase k: <workdir>/shards_phase_<k>."""
  if phase == 0:
    return config.data.shard_dir or files.join(workdir, "shards")
  return files.join(workdir, f"shards_phase_{phase}")


def replicas_by_router(config, topo: topo_lib.Topology) -> bool:
  """Whether phase 0 routes documents to workers (config.routing.replica_shards="router")."""
  how = config.routing.replica_shards
  if how not in sections.REPLICA_SHARDS:
    raise ConfigError(
      f"config.routing.replica_shards={how!r}: choose one of {sections.REPLICA_SHARDS}."
    )
  if how == "hash" or topo.replicas == 1:
    return False
  if discriminative_steps(config):
    raise ConfigError(
      "config.routing.replica_shards='router' clusters documents per worker in "
      "phase 0 only; discriminative re-shards route paths. Set "
      "discriminative_at_outer_step=-1 or replica_shards='hash'."
    )
  return True


def phase0_grid(config, topo: topo_lib.Topology) -> tuple[int, ...]:
  """The configured phase-0 router's grid; refuses a router this topology cannot take.

  The check before any fitting (fit_phase0 and phase0_router call it).
  """
  kind = config.routing.router
  if kind not in sections.PHASE0_ROUTERS:
    raise ConfigError(f"config.routing.router={kind!r}: choose one of {sections.PHASE0_ROUTERS}.")
  if kind == "random":  # Nothing is fitted; shards and replicas follow a hash of the doc id.
    return assign_lib.router_grid(topo)
  grid = assign_lib.router_grid(topo, replicas_by_router(config, topo))
  if kind == "product_kmeans":
    if config.routing.kmeans_min_share > 0:
      raise ConfigError(
        f"config.routing.kmeans_min_share={config.routing.kmeans_min_share} balances "
        "router='kmeans' only (a bias per path does not factor over product k-means' "
        "levels): use router='kmeans' or kmeans_min_share=0."
      )
    if grid == (topo.num_paths,) and len(topo.modules_per_level) > 1:
      raise ConfigError(
        "product_kmeans needs the full grid of paths; this run lists an explicit "
        "path subset (config.dipaco.paths): use config.routing.router='kmeans'."
      )
    if grid == (topo.num_workers,) and topo.replicas > 1:
      raise ConfigError(
        "product_kmeans routes over the grid of paths; replica_shards='router' "
        "clusters per worker: use config.routing.router='kmeans'."
      )
  return grid


def calibration_sample(
  config, extractor: features_lib.FeatureExtractor
) -> tuple[np.ndarray, np.ndarray] | None:
  """(θ̄ features [M, D], tokens [M]) of the first routing.balance_docs training documents.

  The balanced routers calibrate their bias on these, weighted by tokens, so the floor
  holds in what the paths train on: the router split alone is small (591 documents in
  the embedded corpus, ~37 per path at 16 paths) and its document counts say little
  about training tokens. None when balance_docs is 0 (calibrate on the router split).
  C4's training split comes in random order; the embedded corpus's comes by domain,
  and its 20,315 training documents fit under the default cap, so all are used.
  """
  m = config.routing.balance_docs
  if m == 0:
    return None
  # θ̄ is the same for every phase of a run: one pass serves phase 0 and each re-shard.
  source = data_lib.document_source(config.data)
  key = (extractor.fingerprint, m, config.data.task, *sorted(source.items()))
  if key in _SAMPLE_CACHE:
    return _SAMPLE_CACHE[key]
  docs = itertools.islice(assign_lib.document_stream(config.data)("train"), m)
  sample = assign_lib.collect(extractor, docs, desc="balance sample features (training split)")
  if len(sample["doc_ids"]) == 0:
    raise ConfigError(
      "config.routing.balance_docs > 0 but the training split gave no document; "
      "check config.data, or set balance_docs=0 to calibrate on the router split."
    )
  _SAMPLE_CACHE.clear()  # One sample held at a time.
  _SAMPLE_CACHE[key] = _weighted(sample)
  return _SAMPLE_CACHE[key]


def _weighted(sample: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """(features, tokens per document as weights >= 1) of an assign_lib.collect sample."""
  return sample["features"], np.maximum(sample["tokens"], 1).astype(np.float64)


_SAMPLE_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def fit_phase0(
  config,
  topo: topo_lib.Topology,
  feats_NxD: np.ndarray,
  calibration: tuple[np.ndarray, np.ndarray | None] | None = None,
) -> router_lib.Router:
  """k-means or product k-means with one cluster per path (or worker), on router features.

  calibration: the documents a balanced k-means router (kmeans_min_share > 0) floors
  the shares on, as (features, tokens); None: the router split's documents.
  """
  r = config.routing
  kw = dict(restarts=r.kmeans_restarts, iters=r.kmeans_iters, seed=r.seed)
  grid = phase0_grid(config, topo)
  if r.router == "kmeans":
    return router_lib.fit_kmeans_router(
      feats_NxD, grid, min_share=r.kmeans_min_share, calibration=calibration, **kw
    )
  if r.router == "product_kmeans":
    return router_lib.fit_product_kmeans_router(feats_NxD, grid, **kw)
  raise ValueError(
    f"config.routing.router={r.router!r}: phase 0 fits 'kmeans' or "
    "'product_kmeans' ('random' needs no fit)."
  )


def phase0_router(
  config,
  workdir: str,
  topo: topo_lib.Topology,
  extractor: features_lib.FeatureExtractor | None,
  *,
  save: bool = True,
) -> assign_lib.PathRouter:
  """The configured phase-0 router: loaded from the workdir, else fitted and saved.

  `save=False`: a fitted router is left to the caller to save (route_run, once the shard dir
  is known to fit it).
  """
  kind = config.routing.router
  grid = phase0_grid(config, topo)
  if kind == "random":
    return assign_lib.PathRouter(topo, None, seed=config.data.seed)
  by_worker = replicas_by_router(config, topo)
  directory = router_dir(workdir, 0)
  if router_lib.Router.exists(directory):
    router = router_lib.Router.load(directory, grid=grid, feature_dim=extractor.dim)
    if router.kind != kind or router.info.get("features") != extractor.fingerprint:
      raise ConfigError(
        f"{directory} holds a {router.kind} router on features "
        f"{router.info.get('features')}, but the config asks for {kind} on "
        f"{extractor.fingerprint}; use a new --workdir (nothing was changed)."
      )
    min_share = config.routing.kmeans_min_share if kind == "kmeans" else 0.0
    if router.info.get("min_share", 0.0) != min_share:
      raise ConfigError(
        f"{directory} holds a k-means router fitted with min_share="
        f"{router.info.get('min_share', 0.0)}, but config.routing.kmeans_min_share="
        f"{min_share}; use a new --workdir (nothing was changed)."
      )
    balance_docs = config.routing.balance_docs
    if min_share > 0 and router.info.get("balance_docs") != balance_docs:
      raise ConfigError(
        f"{directory} holds a balanced k-means router calibrated with balance_docs="
        f"{router.info.get('balance_docs')}, but config.routing.balance_docs="
        f"{balance_docs}; use a new --workdir (nothing was changed)."
      )
  else:
    split = assign_lib.collect(
      extractor, assign_lib.document_stream(config.data)("router"), desc="router split features"
    )
    calibration = None
    if kind == "kmeans" and config.routing.kmeans_min_share > 0:
      calibration = calibration_sample(config, extractor) or _weighted(split)
    router = fit_phase0(config, topo, split["features"], calibration)
    router.info["features"] = extractor.fingerprint
    if calibration is not None:
      router.info["balance_docs"] = config.routing.balance_docs
    if save and jax.process_index() == 0:  # Every process fits the same router; one writes it.
      router.save(directory)
  return assign_lib.PathRouter(
    topo, router, seed=config.data.seed, feature_id=extractor.fingerprint, by_worker=by_worker
  )


def load_phase_router(
  config,
  workdir: str,
  topo: topo_lib.Topology,
  phase: int,
  extractor: features_lib.FeatureExtractor | None,
) -> assign_lib.PathRouter:
  """The router that wrote phase `phase`'s shards (0: configured; >0: discriminative)."""
  if phase == 0:
    return phase0_router(config, workdir, topo, extractor)
  router = router_lib.Router.load(router_dir(workdir, phase), grid=assign_lib.router_grid(topo))
  return assign_lib.PathRouter(
    topo, router, seed=config.data.seed, feature_id=router.info.get("features", "")
  )


def discriminative_steps(config) -> list[int]:
  """Outer steps after which a discriminative re-shard runs (empty: never)."""
  r = config.routing
  at, phases, every = (
    r.discriminative_at_outer_step,
    r.discriminative_phases,
    r.discriminative_every,
  )
  if at < 0 or phases < 1:
    return []
  if phases > 1 and every < 1:
    raise ConfigError(
      f"config.routing.discriminative_every={every}: successive phases need >= 1 "
      "outer step between them."
    )
  steps = [at + k * every for k in range(phases)]
  T = config.dipaco.outer_steps
  if not 1 <= at or steps[-1] >= T:
    raise ConfigError(
      f"discriminative re-shards at outer steps {steps} do not fit in 1..{T - 1}: "
      "set config.routing.discriminative_at_outer_step (and _every) so that "
      "training continues after each re-shard."
    )
  return steps


def score_documents(scorer: scoring.PathScorer, docs, prefix_len: int) -> np.ndarray:
  """Every path's log-likelihood of each document's tokens after the prefix -> [N, P]."""
  toks = [d.tokens[: scorer.seq_len] for d in docs]
  s_NxTxP = scorer.score_all_paths(toks)
  return s_NxTxP[:, prefix_len:].sum(1)


def router_split_blocks(config, prefix_len: int, block: int = 256):
  """The router split's documents that a discriminative fit labels, in blocks of `block`.

  Documents longer than the prefix (nothing after it: no label), at most
  routing.router_max_docs of them; the same list, in the same order, wherever
  it is read (the fit, and elastic mode's scoring tasks on the pool).
  """
  limit = config.routing.router_max_docs
  batch, n = [], 0
  for doc in assign_lib.document_stream(config.data)("router"):
    if limit and n >= limit:
      break
    if len(doc.tokens) <= prefix_len:
      continue
    batch.append(doc)
    n += 1
    if len(batch) == block:
      yield batch
      batch = []
  if batch:
    yield batch


def score_router_split(config, score_units, prefix_len: int, *, block: int = 256) -> np.ndarray:
  """One path's log-likelihood of each labelled router document after its prefix -> [N].

  `score_units(tokens)`: per-token log p of each token array under the path
  (scoring.PathScorer.score's contract for one path). Elastic mode's scoring
  tasks run this on the pool, one path each; the fit takes their columns.
  """
  T, out = score_len(config), []
  for docs in router_split_blocks(config, prefix_len, block):
    logp = score_units([d.tokens[:T] for d in docs])
    s_NxT = np.zeros((len(docs), T), np.float32)
    for i, lp in enumerate(logp):
      s_NxT[i, : len(lp)] = lp
    out.append(s_NxT[:, prefix_len:].sum(1))
  return np.concatenate(out) if out else np.zeros((0,), np.float32)


def fit_discriminative_router(
  config,
  scorer: scoring.PathScorer | None,
  extractor: features_lib.FeatureExtractor,
  *,
  block: int = 256,
  scores_NxP: np.ndarray | None = None,
  topo: topo_lib.Topology | None = None,
) -> router_lib.Router:
  """Scores the router split with every path, labels = best path, fits the linear router.

  `scores_NxP`: the paths' scores already computed (`score_router_split` per
  path, elastic mode's pool), in place of `scorer` (then `topo` names the grid).
  """
  L = extractor.prefix_len
  feats, scores, tokens = [], [], []
  total = config.routing.router_max_docs or None
  if scores_NxP is not None:
    total = len(scores_NxP)
  bar = progress.bar(
    total=total,
    desc="discriminative router: "
    + ("every path scores the router split" if scores_NxP is None else "prefix features"),
    unit="doc",
  )
  with bar:
    for docs in router_split_blocks(config, L, block):
      feats.append(extractor.prefix_features([d.tokens for d in docs]))
      if scores_NxP is None:
        scores.append(score_documents(scorer, docs, L))
      tokens.extend(len(d.tokens) for d in docs)
      bar.update(len(docs))
  if not feats:
    raise ValueError(
      f"the router split has no document longer than the {L}-token prefix; nothing to label."
    )
  x_NxD = np.concatenate(feats)
  if scores_NxP is None:
    s_NxP = np.concatenate(scores)
  else:
    s_NxP = np.asarray(scores_NxP)
    if s_NxP.shape[0] != len(x_NxD):
      raise ValueError(
        f"{s_NxP.shape[0]} documents scored but the router split has {len(x_NxD)} to label: "
        "the scores were computed with another data or routing config; rerun with the config "
        "that wrote them, or delete them to score again."
      )
  router = router_lib.fit_linear_router(
    x_NxD,
    s_NxP,
    assign_lib.router_grid(scorer.topo if scorer is not None else topo),
    target=config.routing.discriminative_target,
    min_share=config.routing.discriminative_min_share,
    seed=config.routing.seed,
    weights_N=np.asarray(tokens, np.float64),
    calibration=calibration_sample(config, extractor),
  )
  router.info["features"] = extractor.fingerprint
  router.info["balance_docs"] = config.routing.balance_docs
  return router


def _wait_for(path: epath.Path, what: str, poll_s: float = 10.0) -> None:
  if not path.exists():
    print(f"waiting for {what} ({path})", file=sys.stderr, flush=True)
  while not path.exists():
    time.sleep(poll_s)


def score_len(config) -> int:
  """Tokens per router document each path scores (routing.score_len, else the eval length)."""
  return config.routing.score_len or scoring.eval_seq_len(config)


def route_run(config, workdir: str, *, process_index: int = 0, num_processes: int = 1) -> str:
  """Fits (or loads) the phase-0 router, writes the shards, returns and saves its report.

  In an offline job of `num_processes` processes, each writes the shards of its 1/N of
  the documents; process 0 fits the router first (the others wait for it), then joins
  the parts once all are done and writes the report. Process 0 holds the workdir's lock
  (io/lock.py): not while a trainer or another command writes it.
  """
  with lock.workdir(workdir, "route", enabled=process_index == 0):
    return _route_run(config, workdir, process_index, num_processes)


def _route_run(config, workdir: str, process_index: int, num_processes: int) -> str:
  topo = topo_lib.from_config(config)
  kind = config.routing.router
  extractor = features_lib.extractor_from_config(config) if kind != "random" else None
  directory = shard_dir(config, workdir, 0)
  # Before minutes of fitting and tokenizing: where the router and the shards go.
  files.check_writable(router_dir(workdir, 0), f"the router's folder {router_dir(workdir, 0)}")
  files.check_writable(directory, f"the shards' folder {directory}")
  if process_index > 0 and kind != "random":
    _wait_for(epath.Path(router_dir(workdir, 0)) / router_lib.META_FILE, "process 0's router")
  fitted = kind != "random" and not router_lib.Router.exists(router_dir(workdir, 0))
  pr = phase0_router(config, workdir, topo, extractor, save=False)
  assign = assign_lib.make_assignment(config, pr, extractor)
  # Shards of another assignment are refused before the new router is saved beside them.
  data_lib.check_shard_dir(config.data, topo.num_workers, directory, assign)
  if fitted and process_index == 0:
    pr.router.save(router_dir(workdir, 0))
  with data_lib.one_writer(directory, num_processes):  # A shard dir shared with another run.
    # One process: the shard cache as in training (data/shard_cache.py); a job of N shares none.
    cache = config.data.shard_cache if num_processes == 1 else shard_cache.OFF
    shard_cache.fetch(cache, config.data, topo.num_workers, directory, assign)
    data_lib.write_shard_part(
      config.data,
      topo.num_workers,
      directory,
      assign=assign,
      part=process_index,
      num_parts=num_processes,
    )
    if process_index > 0:
      return (
        f"process {process_index} of {num_processes}: its part of {directory} is written; "
        "process 0 joins the parts and writes the report."
      )
    data_lib.wait_for_parts(directory, num_processes)
    shard_set = data_lib.finish_shards(
      config.data, topo.num_workers, directory, assign=assign, num_parts=num_processes
    )
    shard_cache.store(cache, config.data, topo.num_workers, directory, assign)
  if not files.is_remote(directory):  # Shards written before: each file opens with its count.
    for split in shard_set.splits:
      for w in range(shard_set.num_workers):
        shard_set.documents(w, split)
  lines = [
    f"# Phase-0 routing: {pr.description}",
    "",
    f"train shards (tokens per worker): {shard_set.sizes('train').tolist()}",
    f"train shards (documents per worker): {shard_set.num_docs('train').tolist()}",
    "",
  ]
  for split in ("router", "validation"):
    rep = report_lib.quality(
      pr,
      assign_lib.collect(
        extractor if pr.needs_features else None,
        assign_lib.document_stream(config.data)(split),
        desc=f"{split} split report",
      ),
    )
    lines += [
      f"## {split} split (top-1 path per document vs its domain)",
      "",
      report_lib.to_markdown(rep),
    ]
  text = "\n".join(lines)
  files.write_text(files.join(router_dir(workdir, 0), REPORT_FILE), text)
  return text
