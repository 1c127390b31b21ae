"""Every config field and its default (`base()`, one comment each); `load()`.

A config file calls `base()` and overrides what differs; it may not add a
field. config_check.validate checks every field and the relations between
them. Paper numbers: shared/reference/dipaco-paper.md (Table 4, §3, §4).
"""

import dataclasses

import ml_collections


class ConfigError(ValueError):
  """A config that cannot run: the message names the field, the problem and the fix."""


def base() -> ml_collections.ConfigDict:
  """All sections with the paper's 150M-path defaults where it gives them."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Parameter init seed (θ̄ when not loaded from init_from).
  c.log_every_steps = 10  # Inner steps between metrics.jsonl records.
  # Checkpoint and exit after this inner step (time-boxed jobs); -1 = run to the end.
  c.stop_at_step = -1
  # "on": the loop reads step t's metrics (NaN guard, logs) while step t+1 runs; "off": after
  # each step; "auto": on for TPU/GPU, off on CPU (docs/performance.md).
  c.dispatch_ahead = "auto"

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 32_000  # Must match the tokenizer (8192 shipped; 32k T5 for C4).
  c.model.pad_vocab = False  # True: vocab_size may exceed the tokenizer's (rows never targeted).
  c.model.d_model = 896  # Hidden size (paper 150M path: 896).
  c.model.num_layers = 12  # Transformer blocks (paper: 12).
  c.model.num_heads = 16  # Attention heads (paper: 16).
  c.model.head_dim = 64  # Key/value size per head (paper: 64).
  # MLP hidden width F / d_model (paper silent; Chinchilla-style 4); with mlp="swiglu", F is
  # the width of each of its gate and up projections.
  c.model.mlp_ratio = 4.0
  c.model.max_len = 2048  # Longest position (learned positions only).
  c.model.positions = "rope"  # "rope" | "learned" (paper silent).
  c.model.tie_embeddings = True  # Paper silent; tied fits its 150M count.
  c.model.dtype = "float32"  # Compute dtype: "bfloat16" on TPU.
  # Backward-pass memory: "none" (keep all) | "full" (recompute blocks) | "save_matmuls"
  # (keep weight-matmul outputs).
  c.model.remat = "none"
  # "xla" (einsum + masked softmax) | "dot_product_attention" (jax.nn's; cuDNN flash on GPU).
  c.model.attention = "xla"
  # Sequence positions per cross-entropy chunk (never the full [B, T, V] logits); 0 = off.
  # Divides seq_len.
  c.model.loss_chunk = 0
  # "gelu" (up, GELU, down) | "swiglu" (Llama's gated SiLU: 1.5x the weights at one width; its
  # mlp_ratio 8/3 matches gelu's 4 in weights and FLOPs).
  c.model.mlp = "gelu"

  c.inner = ml_collections.ConfigDict()
  c.inner.lr = 4e-4  # Peak AdamW LR (paper 150M: 4e-4; 1.3B: 2e-4).
  c.inner.warmup_steps = 1000  # Linear warmup (paper: 1000).
  c.inner.total_steps = ml_collections.config_dict.placeholder(int)  # Cosine length; None = H*T.
  c.inner.final_lr_fraction = 0.05  # Cosine floor / peak (paper silent; [SL]: 5%).
  c.inner.b1 = 0.9  # Adam β1 (paper silent).
  c.inner.b2 = 0.99  # Adam β2 (paper silent; [SL] uses 0.99).
  c.inner.eps = 1e-8  # Adam ε.
  c.inner.weight_decay = 0.1  # Decoupled weight decay (paper: 0.1), matrices only.
  c.inner.clip_norm = 1.0  # Global-norm clip per path (paper silent; [SL]: 1.0); 0 disables.
  c.inner.decay_norms = False  # Weight-decay the norm scales too (default: matrices only).
  # Gradient accumulation steps inside one inner step (divides batch_size / mesh.data).
  c.inner.microbatches = 1

  c.outer = ml_collections.ConfigDict()
  c.outer.enabled = True  # False: no outer step (dense); store mirrors the path.
  c.outer.lr = 0.7  # Outer Nesterov LR (paper/DiLoCo: 0.7).
  c.outer.momentum = 0.9  # Outer momentum (paper/DiLoCo: 0.9).
  c.outer.nesterov = True  # Nesterov momentum (paper: yes).
  # α_p: "shard_size" (∝ |D_p|, DiLoCo non-iid) | "uniform" (Alg. 1).
  c.outer.weighting = "shard_size"
  # ×√P_{l,e} on Δ (paper §2.7; direction inferred) | "divide" | "none".
  c.outer.sqrt_paths = "multiply"
  # > 0: cap the √P_{l,e} factor at this (a bounded ×√P for modules shared by many paths).
  c.outer.sqrt_paths_cap = 0.0

  c.dipaco = ml_collections.ConfigDict()
  c.dipaco.level_groups = ("embed,head", "block_0-5", "block_6-11")  # Groups per level.
  c.dipaco.modules_per_level = (1, 2, 2)  # K_l per level (K=1: shared by all paths).
  c.dipaco.path_specific = ""  # Groups with one private copy per path, e.g. "embed,block_0".
  c.dipaco.paths = ()  # Explicit path subset ("0-1-0", ...); () = all ∏K_l paths.
  c.dipaco.replicas = 1  # Workers per path (DiLoCo: 1 path, P replicas).
  c.dipaco.inner_steps = 150  # H (paper's path scaling: τ = 150).
  c.dipaco.outer_steps = 427  # T (≈ 64k / 150 after 24k dense pretraining).
  c.dipaco.init = "shared"  # "shared": every module from one θ̄ (paper) | "independent".
  c.dipaco.init_from = ""  # Workdir of a dense run whose params are θ̄ ("" = random).
  # "spmd": all paths in one lock-step program | "elastic": Ray task pool (docs/elastic.md).
  c.dipaco.mode = "spmd"

  c.data = ml_collections.ConfigDict()
  c.data.task = "dipaco_embedded"  # seqio task: "dipaco_embedded" | "c4_en".
  c.data.tfds_data_dir = ml_collections.config_dict.placeholder(str)  # tfds dir (gs:// for C4).
  # The tfds dataset:version c4_en reads (3.0.1: the public prepared copy, docs/data.md).
  c.data.tfds_name = "c4/en:3.0.1"
  # SentencePiece model; None = shipped.
  c.data.vocab_path = ml_collections.config_dict.placeholder(str)
  c.data.seq_len = 1024  # Training sequence length (paper: 1024).
  c.data.batch_size = 512  # Sequences per path per inner step (paper: 512).
  c.data.seed = 0  # Shard assignment and batch order seed.
  c.data.subsample = 1  # Keep one document in N of every split (doc-id hash; quick runs). 1 = all.
  c.data.top_k = 1  # Shards per training document (paper 16x16: 2); eval never overlaps.
  c.data.shard_dir = ml_collections.config_dict.placeholder(str)  # None = <workdir>/shards.
  # Shards reused across workdirs by fingerprint (data/shard_cache.py): "auto" = the user's
  # cache dir ($DIPACO_CACHE_DIR or ~/.cache/dipaco_jax), "off", or a folder (local or gs://).
  c.data.shard_cache = "auto"
  # Empty shard: "error" | "allow_validation" (own-shard val loss NaN, no early stop) | "allow".
  c.data.empty_shard_policy = "error"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.path = -1  # Device groups on the 'path' axis (-1: gcd(workers, devices/model)).
  c.mesh.data = -1  # Data parallelism inside a path (-1: the devices left).
  c.mesh.model = 1  # Tensor parallelism inside a path.
  # Also split params and AdamW state over 'data' inside a path (FSDP); False = replicated.
  c.mesh.fsdp = False
  c.mesh.num_slices = 0  # TPU slices ('path' spans them over DCN); 0 = detect.
  c.mesh.cpu_devices = 0  # On CPU only: split the host into N devices (0 = JAX's default).

  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every_steps = 150  # Inner steps between checkpoints (mid-phase is fine).
  c.ckpt.max_to_keep = 2  # Checkpoints kept.
  c.ckpt.async_save = True  # Write in the background.

  c.routing = ml_collections.ConfigDict()  # docs/routing.md; paper §2.4, §2.6, §2.7.
  c.routing.router = "random"  # Phase-0 shards: "random" (i.i.d.) | "kmeans" | "product_kmeans".
  c.routing.prefix_len = 32  # Tokens the router reads (paper: 32); excluded from routed perplexity.
  c.routing.feature_batch_size = 64  # Documents per θ̄ feature batch (jit, over local devices).
  c.routing.kmeans_restarts = 4  # k-means++ restarts (best inertia kept).
  c.routing.kmeans_iters = 100  # Lloyd iterations per restart.
  # Balanced k-means: floor every path's share of the router split at this x 1/P with a
  # calibrated bias (0 = nearest centroid; router="kmeans" only).
  c.routing.kmeans_min_share = 0.0
  c.routing.seed = 0  # Seed of k-means and of the logistic regressions.
  # Replicas of a path: "hash" (i.i.d.) | "router" (one cluster per worker: DiLoCo non-i.i.d.).
  c.routing.replica_shards = "hash"
  c.routing.router_max_docs = 0  # Router-split documents scored per discriminative phase (0 = all).
  # The balanced routers' bias (kmeans_min_share, and every discriminative phase) is calibrated
  # on the first N training documents, weighted by tokens: shares hold in training tokens.
  # 0 = on the router split (its documents weighted by tokens).
  c.routing.balance_docs = 65536
  # Re-shard after this outer step (1..T-1); -1 = never.
  c.routing.discriminative_at_outer_step = -1
  c.routing.discriminative_phases = 1  # Number of discriminative re-shards (paper: 1).
  c.routing.discriminative_every = 1  # Outer steps between successive re-shards (phases > 1).
  c.routing.discriminative_target = "labels"  # Shard sizes the bias matches: "labels" | "uniform".
  # Floor of every path's target share, x 1/P (0 = none; 1 = uniform).
  c.routing.discriminative_min_share = 0.0
  # Restart the inner warmup+cosine at a re-shard (paper Fig. 10).
  c.routing.restart_schedule = True
  c.routing.score_len = 0  # Tokens per router document each path scores (0 = eval.seq_len).

  # Validation while training; routed evaluation (evaluate.py).
  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 150  # Inner steps between validation on each path's shard.
  c.eval.batches = 4  # Validation batches per path.
  c.eval.seq_len = 0  # Tokens per validation sequence (a document's start); 0 = data.seq_len.
  c.eval.max_docs = 0  # Validation documents evaluated (0 = all).
  c.eval.rerouting_windows = (16, 32, 64, 128)  # W: re-route every W tokens after the prefix.
  # Test-time routers fitted and evaluated. "transformer" (the paper's) fine-tunes θ̄ for
  # reroute_steps: minutes on a CPU, so it runs only when asked (linear,transformer).
  c.eval.rerouters = ("linear",)
  c.eval.reroute_label_window = 0  # Forward window L of re-router labels (0 = to the end; paper).
  c.eval.reroute_stride = 8  # Linear re-router: one training example every this many tokens.
  c.eval.reroute_steps = 300  # Transformer re-router: fine-tuning steps from θ̄ (paper: 2k).
  c.eval.reroute_lr = 1e-3  # Transformer re-router: AdamW peak LR (no warmup, as the paper).
  c.eval.reroute_batch_size = 16  # Transformer re-router: sequences per step.

  c.early_stopping = ml_collections.ConfigDict()  # Per-path early stopping (paper §2.7).
  # Keep each worker's best params by own-shard val loss (+1 params copy).
  c.early_stopping.enabled = True
  # The loss it reads: "heldout" (a slice of each worker's training shard, never trained on)
  # or "validation" (the worker's validation shard, which the final numbers also read).
  c.early_stopping.source = "heldout"
  c.early_stopping.heldout_docs = 64  # Held-out documents per worker's shard ...
  c.early_stopping.heldout_fraction = 0.1  # ... and at most this share of them.

  c.elastic = ml_collections.ConfigDict()  # dipaco.mode="elastic" only (docs/elastic.md).
  # "" = a local Ray cluster on 127.0.0.1 inside the command; "auto" or "HOST:PORT" joins one.
  c.elastic.address = ""
  # Worker actors; each runs one (phase, worker) task of H inner steps at a time.
  c.elastic.num_workers = 2
  c.elastic.num_executors = 1  # Outer executors; store groups are dealt to them round-robin.
  # JSON of Ray resources one worker actor needs, e.g. '{"TPU": 4}' ("" = 1 CPU).
  c.elastic.worker_resources = ""
  # On the command's own local cluster (address ""), worker actor i runs on its own share of this
  # machine's cores (CPU affinity, which XLA's CPU thread pool follows), not all of them each.
  c.elastic.pin_cpus = True
  # A task not reported after this long goes back on the queue (its worker restarts).
  c.elastic.task_timeout_s = 600.0
  # A task saves its progress (params, AdamW state, data position) every this many inner steps;
  # a retry after a kill or timeout resumes there instead of from the phase's start. 0 = off.
  c.elastic.progress_every_steps = 0
  # The actors' persistent JAX compilation cache (restarted actors load, not compile): "auto" =
  # $JAX_COMPILATION_CACHE_DIR, else jax_cache/ in data.shard_cache's "auto" dir; "off"; a folder.
  c.elastic.compile_cache = "auto"
  # Injected sleep per inner step of worker actor i (heterogeneity tests, benchmarks).
  c.elastic.step_delay_s = ()
  # Fault injection: SIGKILL a busy worker process this many times at random moments.
  c.elastic.chaos_worker_kills = 0
  # Fault injection: SIGKILL an outer executor process this many times.
  c.elastic.chaos_executor_kills = 0
  c.elastic.chaos_seed = 0  # Seed of the fault-injection schedule.
  # Driver exits after this many accepted task results (rerun resumes); -1 = never.
  c.elastic.stop_after_tasks = -1
  # Quorum (beyond the paper; docs/elastic.md): a module may take phase t's outer step once
  # this fraction of its α-weight has reported and grace_s has passed since; 1.0 = all (off).
  c.elastic.quorum = 1.0
  c.elastic.grace_s = 0.0  # Seconds a module waits for more reports after its quorum is reached.
  # Deltas that miss their module's quorum step: "next" = join its next step, "drop" = ignored.
  c.elastic.late_deltas = "next"

  c.guard = ml_collections.ConfigDict()  # Divergence guard (metrics.DivergenceGuard); 0 = rule off.
  c.guard.stuck_steps = 100  # Stop when the mean train loss of this many steps past warmup >= ln V.
  c.guard.max_param_norm_ratio = 100.0  # Stop when a group's param norm > this x its norm at start.
  return c


def paper(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The paper's data and hardware settings on top of `base()` (C4, TPU)."""
  c.data.task = "c4_en"  # C4 English through tfds (set tfds_data_dir, vocab_path).
  c.model.dtype = "bfloat16"  # TPU compute dtype.
  c.ckpt.every_steps = 1000
  c.eval.every_steps = 1000
  c.log_every_steps = 100
  return c


# The one discriminative re-shard of the τ = 150 paper runs (§4: "All instances of
# DiPaCo use one phase of discriminative routing"). The paper gives no step for its
# main runs; its one branch point (Fig. 10, flat MoE) is at 16k steps with the cosine
# restarted. Those runs fork from θ̄ at 24k, so we read the 16k as steps of path
# training: after outer step 107 (16,050 inner steps), leaving 320 outer steps
# (48,000 inner steps) on the discriminative shards. By then the paths have diverged
# enough for their scores to label documents.
DISCRIMINATIVE_AT_OUTER_STEP = 107

# Router-split documents every path scores at the re-shard. The c4_en router split is
# 1% of C4's train split (~3.66M documents; the paper holds out 0.005, ~1.8M). 2**18
# documents: at 256 paths (16x16), scoring them (≤ 1,024 tokens each, forward only) is
# about one outer step of training (2**18 x 256 x 1024 x 2 x 150M ≈ 2.1e19 FLOPs vs
# 256 x 150 x 512 x 1024 x 6 x 150M ≈ 1.8e19); the linear router is fitted full batch
# on one device (2**18 x 896 float32 = 0.94 GB of features, against 13 GB for the whole
# split); and even at 256 paths it leaves ~1,024 labelled documents per path for the
# 897 numbers each path's row of the regression holds.
ROUTER_MAX_DOCS = 2**18

# The dense pretraining that makes θ̄ (§3.1): dense_150m for 24k steps.
PRETRAIN_COMMAND = (
  "python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=DENSE_WORKDIR "
  "--config.dipaco.outer_steps=24 --config.data.tfds_data_dir=gs://BUCKET/tfds "
  "--config.data.vocab_path=gs://BUCKET/t5_32k.model"
)


def paper_fork(
  c: ml_collections.ConfigDict, *, router: str, discriminative: bool = True
) -> ml_collections.ConfigDict:
  """A run forked from θ̄ with the paper's routing (§2.4): phase-0 `router`, one re-shard.

  `init_from` becomes required (check_init_from): every DiLoCo / DiPaCo run of
  the paper starts from the 24k-step dense model, whose features also route.
  discriminative=False (DiLoCo) keeps the phase-0 shards to the end.
  """
  c.dipaco.init_from = ml_collections.config_dict.placeholder(str)  # Required: check_init_from.
  c.routing.router = router  # Phase-0 shards from θ̄'s prefix features (§2.2, §2.3).
  if discriminative:
    c.routing.discriminative_at_outer_step = DISCRIMINATIVE_AT_OUTER_STEP
    c.routing.discriminative_phases = 1
    c.routing.restart_schedule = True  # Fig. 10: the cosine restarts at the branch point.
    c.routing.router_max_docs = ROUTER_MAX_DOCS
    # The restarted cosine spans the steps after the re-shard, so the run ends at the
    # LR floor like every 88k-step run of the paper (phase 0 uses the same length).
    # A reference: it follows --config overrides of H, T and the re-shard step.
    c.inner.total_steps = c.dipaco.get_ref("inner_steps") * (
      c.dipaco.get_ref("outer_steps") - c.routing.get_ref("discriminative_at_outer_step")
    )
  return c


def check_init_from(config) -> None:
  """Refuses a run whose config requires θ̄ (`dipaco.init_from` is None) but got none."""
  if config.dipaco.init_from is None:
    raise ConfigError(
      "config.dipaco.init_from is required by this config (the paper forks its DiLoCo and "
      "DiPaCo runs from θ̄, a dense model pretrained for 24k steps, and routes with its "
      f"features): train θ̄ first with `{PRETRAIN_COMMAND}`, then pass "
      "--config.dipaco.init_from=DENSE_WORKDIR (or --config.dipaco.init_from='' to start "
      "from random parameters instead)."
    )


def paper_grid(
  k1: int, k2: int, *, path_specific: str = "", top_k: int = 1
) -> ml_collections.ConfigDict:
  """The paper's two-level grids of 150M paths (levels inferred, see README).

  Embedding + final norm shared by all paths (K=1); blocks 0-5 form level 1
  with k1 modules, blocks 6-11 level 2 with k2; τ = 150 inner steps for
  (88k − 24k) / 150 ≈ 427 outer steps after 24k dense steps. Forked from θ̄:
  product k-means shards (§7.3, Table 5), one discriminative re-shard.
  """
  c = paper(base())
  c.dipaco.level_groups = ("embed,head", "block_0-5", "block_6-11")
  c.dipaco.modules_per_level = (1, k1, k2)
  c.dipaco.path_specific = path_specific
  c.dipaco.inner_steps = 150  # τ (paper Fig. 9)
  c.dipaco.outer_steps = 427
  c.data.top_k = top_k
  return paper_fork(c, router="product_kmeans")


def load(path: str, **overrides) -> ml_collections.ConfigDict:
  """Loads `configs/NAME.py`, applies dotted overrides, checks and locks it.

  An unknown field is an error. The checks a run adds (θ̄ given, the tokenizer's
  size, init_from exists) wait for the trainer and the CLIs, which call
  config_check.validate(config) before they touch the workdir.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top

  from dipaco_jax import config_check  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location("dipaco_config", path)
  if spec is None or spec.loader is None or not path.endswith(".py"):
    raise ConfigError(f"no config file at {path}: give a configs/NAME.py path.")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except FileNotFoundError as e:
    raise ConfigError(f"no config file at {path}: give a configs/NAME.py path.") from e
  c = module.get_config()
  for key, value in overrides.items():
    config_check.check_name(key)
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    try:
      node[leaf] = value
    except TypeError as e:
      raise ConfigError(
        f"config.{key}={value!r} has the wrong type: {config_check.requirement(key)}"
      ) from e
  config_check.validate(c, for_run=False)
  c.lock()
  return c


def from_section(cls, section, **given):
  """`cls(**fields)` with every dataclass field taken from `given` or the config section."""
  kw = {}
  for f in dataclasses.fields(cls):
    if f.name not in given and f.name not in section:
      raise ConfigError(
        f"the config section has no field {f.name!r} ({cls.__name__}): build "
        "configs on config_defaults.base()."
      )
    kw[f.name] = given[f.name] if f.name in given else section[f.name]
  return cls(**kw)
