"""Every config field, declared once: default, rule and help, section by section.

The paper's numbers are its 150M-path settings where it gives them (Table 4,
§3, §4); "paper silent" marks our choices. The choices a rule admits are named
here and read by the code that acts on them (model.py maps REMAT to policies,
...). `schema.base()` builds the ConfigDict a configs/*.py file starts from.
"""
# pylint: disable=invalid-name

import dataclasses
import re

from dipaco_jax.config import fields as f

# Choices, named once.
DISPATCH_AHEAD = ("auto", "on", "off")
POSITIONS = ("rope", "learned")
DTYPES = ("float32", "bfloat16")
# What a block keeps for its backward pass: everything; only its input (recomputes the rest);
# the outputs of its weight matmuls (recomputes the cheap rest); all of those but the MLP's
# input projection and gate (the widest, F per position). model.py maps them to policies.
REMAT = ("none", "full", "save_matmuls", "save_matmuls_except_mlp_in")
# The attention kernel (core/attention.py): auto picks splash on TPU, cuDNN on GPU where the
# shape allows, XLA otherwise.
ATTENTION = ("auto", "xla", "splash", "cudnn")
# How attention's projections are stored (model.Attention): per head, or as plain matrices.
ATTENTION_KERNELS = ("heads", "matrix")
MLPS = ("gelu", "swiglu")
WEIGHT_GRADS = ("auto", "autodiff", "input_first")
WEIGHTINGS = ("shard_size", "uniform")  # α_p ∝ |D_p|, or equal.
SQRT_MODES = ("multiply", "divide", "none")  # √P_{l,e} rescale of Δ (paper §2.7).
# Δ_w on the wire (core/compression.py); "auto": the kind of least codec + link time a value.
COMPRESSIONS = ("none", "bf16", "int8", "fp4", "topk2", "auto")
INITS = ("shared", "independent")  # Every module from one θ̄, or each its own.
MODES = ("spmd", "elastic")
TASKS = ("dipaco_embedded", "c4_en")  # data/tasks.py reads both (c4_en through seqio).
# The tfds dataset the c4_en task reads: the version of the public prepared copy
# (gs://allennlp-tensorflow-datasets/c4/en/3.0.1, docs/data.md).
C4_TFDS_NAME = "c4/en:3.0.1"
# name[/config]:major.minor.patch, the version pinned (tfds would otherwise pick its newest).
TFDS_NAME_PATTERN = r"^[a-z][a-z0-9_]*(/[A-Za-z0-9_.\-]+)?:\d+\.\d+\.\d+$"
# Empty shards: refused; a worker without validation documents allowed; any allowed.
EMPTY_POLICIES = ("error", "allow", "allow_validation")
PHASE0_ROUTERS = ("random", "kmeans", "product_kmeans")
REPLICA_SHARDS = ("hash", "router")
DISCRIMINATIVE_TARGETS = ("labels", "uniform")  # The bias matches label frequencies, or equal.
REROUTERS = ("linear", "transformer")
STOP_SOURCES = ("heldout", "validation")
# A delta that missed its quorum step: joins the next, dropped, or joins the next discounted.
LATE_DELTAS = ("next", "drop", "discount")
# Which idle actor takes which ready task: the lowest-numbered the oldest; or by measured speed.
LEASES = ("first", "speed")
# AdamW on every leaf, or Muon on the blocks' matrices and AdamW on the rest (MuLoCo).
INNER_OPTIMIZERS = ("adamw", "muon")

count, count0 = f.integer(1), f.integer(0)


@dataclasses.dataclass(frozen=True)
class RunConfig(f.Section):
  """The top level: seeds, logging, time boxes, the loop's dispatch."""

  SECTION = ""
  seed: int = f.field(0, count0, "Parameter init seed (θ̄ when not loaded from init_from).")
  log_every_steps: int = f.field(10, count, "Inner steps between metrics.jsonl records.")
  stop_at_step: int = f.field(
    -1,
    f.integer(1, unset=-1),
    "Checkpoint and exit after this inner step (time-boxed jobs); -1 = run to the end.",
  )
  dispatch_ahead: str = f.field(
    "auto",
    f.choice(DISPATCH_AHEAD),
    '"on": the loop reads step t\'s metrics (NaN guard, logs) while step t+1 runs; "off": '
    'after each step; "auto": on for TPU/GPU, off on CPU (docs/performance.md).',
  )


@dataclasses.dataclass(frozen=True)
class ModelConfig(f.Section):
  """One path model: a decoder-only transformer whose top-level params are DiPaCo's groups."""

  SECTION = "model"
  vocab_size: int = f.field(
    32_000, count, "Must match the tokenizer (8192 shipped; 32k T5 for C4)."
  )
  pad_vocab: bool = f.field(
    False, f.boolean(), "True: vocab_size may exceed the tokenizer's (rows never targeted)."
  )
  d_model: int = f.field(896, count, "Hidden size (paper 150M path: 896).")
  num_layers: int = f.field(12, count, "Transformer blocks (paper: 12).")
  num_heads: int = f.field(16, count, "Attention heads (paper: 16).")
  head_dim: int = f.field(64, count, "Key/value size per head (paper: 64).")
  mlp_ratio: float = f.field(
    4.0,
    f.number(0),
    'MLP hidden width F / d_model (paper silent; Chinchilla-style 4); with mlp="swiglu", F is '
    "the width of each of its gate and up projections.",
  )
  max_len: int = f.field(2048, count, "Longest position (learned positions only).")
  positions: str = f.field("rope", f.choice(POSITIONS), '"rope" | "learned" (paper silent).')
  tie_embeddings: bool = f.field(True, f.boolean(), "Paper silent; tied fits its 150M count.")
  dtype: str = f.field("float32", f.choice(DTYPES), 'Compute dtype: "bfloat16" on TPU.')
  remat: str = f.field(
    "none",
    f.choice(REMAT),
    'Backward-pass memory: "none" (keep all) | "full" (recompute blocks) | "save_matmuls" '
    '(keep weight-matmul outputs) | "save_matmuls_except_mlp_in" (all but the MLP\'s widest, '
    "its input projection and gate: recomputed).",
  )
  attention: str = f.field(
    "auto",
    f.choice(ATTENTION),
    '"auto" (splash on TPU, cuDNN on GPU where the shape allows, XLA otherwise) | "xla" '
    '(scores in HBM) | "splash" (Pallas TPU kernel) | "cudnn" (GPU flash, bfloat16).',
  )
  attention_kernels: str = f.field(
    "heads",
    f.choice(ATTENTION_KERNELS),
    '"heads": query, key and value kernels [D, H, K], out [H, K, D] | "matrix": [D, H K] and '
    "[H K, D], the same values and products (viewed per head): an outer step over a 'path' axis "
    "that divides H K but no dim of [D, H, K] splits the module instead of summing the stack "
    "(dipaco_16x16); 0.5% more HBM bytes per inner step on v5e (docs/tpu.md).",
  )
  attention_block_q: int = f.field(
    512, count, "Splash attention's query block (cut to seq_len; divides it)."
  )
  attention_block_kv: int = f.field(
    512, count, "Splash attention's key/value block (cut to seq_len; divides it; 128 | it)."
  )
  loss_chunk: int = f.field(
    0,
    f.integer(0, what=" (0 = off)"),
    "Sequence positions per cross-entropy chunk (never the full [B, T, V] logits); 0 = off. "
    "Divides seq_len.",
  )
  weight_grads: str = f.field(
    "auto",
    f.choice(WEIGHT_GRADS),
    "The weight matmuls' gradient: \"autodiff\" (jax's transpose: dot(cotangent, input)) | "
    '"input_first" (dot(input, cotangent), the same values: XLA:CPU then lays out the narrow '
    'input instead of the wide cotangent; no remat="save_matmuls", whose policy would not see '
    'the matmuls) | "auto" (input_first on CPU, except with save_matmuls; autodiff elsewhere).',
  )
  mlp: str = f.field(
    "gelu",
    f.choice(MLPS),
    '"gelu" (up, GELU, down) | "swiglu" (Llama\'s gated SiLU: 1.5x the weights at one width; '
    "its mlp_ratio 8/3 matches gelu's 4 in weights and FLOPs).",
  )

  @property
  def mlp_dim(self) -> int:
    return int(self.d_model * self.mlp_ratio)

  @property
  def mlp_params(self) -> int:
    """Weights of one block's MLP: 2 D F (gelu) or 3 D F (swiglu)."""
    return (3 if self.mlp == "swiglu" else 2) * self.d_model * self.mlp_dim


@dataclasses.dataclass(frozen=True)
class InnerConfig(f.Section):
  """The inner optimizer: clipped AdamW (or Muon + AdamW) with warmup and cosine, per path."""

  SECTION = "inner"
  optimizer: str = f.field(
    "adamw",
    f.choice(INNER_OPTIMIZERS),
    '"adamw" (paper) | "muon": optax\'s Muon on the blocks\' matrices, AdamW on the embedding, '
    "head, norm scales and vectors (MuLoCo); one clip before both.",
  )
  lr: float = f.field(4e-4, f.number(0), "Peak AdamW LR (paper 150M: 4e-4; 1.3B: 2e-4).")
  warmup_steps: int = f.field(1000, count0, "Linear warmup (paper: 1000).")
  total_steps: int | None = f.field(
    None,
    f.custom(lambda v: v is None or f.integer(1).ok(v), "an integer >= 1, or unset for H*T"),
    "Cosine length; None = H*T.",
  )
  final_lr_fraction: float = f.field(
    0.05, f.fraction(), "Cosine floor / peak (paper silent; [SL]: 5%)."
  )
  b1: float = f.field(0.9, f.number(0, above=False, hi=1), "Adam β1 (paper silent).")
  b2: float = f.field(
    0.99, f.number(0, above=False, hi=1), "Adam β2 (paper silent; [SL] uses 0.99)."
  )
  eps: float = f.field(1e-8, f.number(0), "Adam ε.")
  weight_decay: float = f.field(
    0.1,
    f.number(0, above=False),
    "Decoupled weight decay (paper: 0.1), matrices only; scaled by each part's LR (Muon's: "
    "θ -= muon_lr(t)·weight_decay·θ).",
  )
  clip_norm: float = f.field(
    1.0,
    f.number(0, above=False),
    "Global-norm clip per path (paper silent; [SL]: 1.0); 0 disables.",
  )
  decay_norms: bool = f.field(
    False, f.boolean(), "Weight-decay the norm scales too (default: matrices only)."
  )
  microbatches: int = f.field(
    1, count, "Gradient accumulation steps inside one inner step (divides batch_size / mesh.data)."
  )
  muon_lr: float = f.field(
    0.02,
    f.number(0),
    'optimizer="muon": peak LR of the Muon matrices (Muon\'s usual 0.02; the warmup-cosine of lr).',
  )
  muon_beta: float = f.field(
    0.95, f.number(0, above=False, hi=1), 'optimizer="muon": Muon\'s Nesterov momentum.'
  )


@dataclasses.dataclass(frozen=True)
class OuterConfig(f.Section):
  """The outer step: per-module averaged deltas, then Nesterov (paper §3.3, §3.5)."""

  SECTION = "outer"
  enabled: bool = f.field(
    True, f.boolean(), "False: no outer step (dense); store mirrors the path."
  )
  lr: float = f.field(0.7, f.number(0), "Outer Nesterov LR (paper/DiLoCo: 0.7).")
  momentum: float = f.field(
    0.9, f.number(0, above=False, hi=1), "Outer momentum (paper/DiLoCo: 0.9)."
  )
  nesterov: bool = f.field(True, f.boolean(), "Nesterov momentum (paper: yes).")
  weighting: str = f.field(
    "shard_size",
    f.choice(WEIGHTINGS),
    'α_p: "shard_size" (∝ |D_p|, DiLoCo non-iid) | "uniform" (Alg. 1).',
  )
  sqrt_paths: str = f.field(
    "multiply",
    f.choice(SQRT_MODES),
    '×√P_{l,e} on Δ (paper §2.7; direction inferred) | "divide" | "none".',
  )
  sqrt_paths_cap: float = f.field(
    0.0,
    f.custom(
      lambda v: f.number(0, above=False).ok(v) and (v == 0 or v >= 1),
      "a number >= 1 (the cap), or 0 (no cap)",
    ),
    "> 0: cap the √P_{l,e} factor at this (a bounded ×√P for modules shared by many paths).",
  )
  compression: str = f.field(
    "none",
    f.choice(COMPRESSIONS),
    'Δ_w on the wire: "none" (float32) | "bf16" | "int8" | "fp4" | "topk2" | "auto": of none, '
    "bf16, int8 and fp4 the one whose codec (HBM) plus link time is least (communication.md).",
  )
  link_gbps: float = f.field(
    25.0,
    f.number(0),
    'Gb/s per chip of the link the outer exchange crosses (DCN; v5e 25, v5p 50): "auto" reads it.',
  )
  hbm_gbs: float = f.field(
    819.0,
    f.number(0),
    'GB/s per chip of the memory the codec reads and writes (v5e HBM 819): "auto" reads it.',
  )
  compression_block: int = f.field(
    64,
    f.integer(1),
    "Values per scale (int8, fp4, topk2) along a leaf's last axis; short rows padded.",
  )
  compression_keep: int = f.field(
    1, f.integer(1), "topk2: values kept a block, the largest |x| (1 of 64: 1.56%), 2 bits each."
  )
  error_feedback: bool = f.field(
    True, f.boolean(), "With compression: each worker adds what its codes dropped to its next Δ."
  )
  fragments: int = f.field(
    1,
    f.integer(1),
    "F: the store's groups in F fragments synced H/F steps apart (streamed; 1: all at once).",
  )
  overlap: int = f.field(
    0,
    f.integer(0),
    "τ: inner steps a fragment's exchange is in flight: its update lands τ late (0: at once).",
  )


@dataclasses.dataclass(frozen=True)
class DipacoConfig(f.Section):
  """The grid, the two loops' lengths, θ̄, and the runtime."""

  SECTION = "dipaco"
  level_groups: tuple = f.field(
    ("embed,head", "block_0-5", "block_6-11"),
    f.tuple_of(f.string(), "a tuple of strings, one per level", nonempty=True),
    "Groups per level.",
  )
  modules_per_level: tuple = f.field(
    (1, 2, 2),
    f.tuple_of(f.integer(1), "a tuple of integers >= 1 (K per level)", nonempty=True),
    "K_l per level (K=1: shared by all paths).",
  )
  path_specific: str = f.field(
    "", f.string(), 'Groups with one private copy per path, e.g. "embed,block_0".'
  )
  paths: tuple = f.field(
    (),
    f.tuple_of(f.string(), "a tuple of paths such as '0-1-0'"),
    'Explicit path subset ("0-1-0", ...); () = all ∏K_l paths.',
  )
  replicas: int = f.field(1, count, "Workers per path (DiLoCo: 1 path, P replicas).")
  inner_steps: int = f.field(150, count, "H (paper's path scaling: τ = 150).")
  outer_steps: int = f.field(427, count, "T (≈ 64k / 150 after 24k dense pretraining).")
  init: str = f.field(
    "shared", f.choice(INITS), '"shared": every module from one θ̄ (paper) | "independent".'
  )
  # None: required at run time (config/paper.py check_init_from), set by paper.fork.
  init_from: str | None = f.field(
    "",
    f.custom(
      lambda v: v is None or v == "" or f.names_a_folder(v),
      "a dense run's workdir, or '' for a random θ̄",
    ),
    'Workdir of a dense run whose params are θ̄ ("" = random).',
  )
  mode: str = f.field(
    "spmd",
    f.choice(MODES),
    '"spmd": all paths in one lock-step program | "elastic": Ray task pool (docs/elastic.md).',
  )


@dataclasses.dataclass(frozen=True)
class DataConfig(f.Section):
  """Text, tokenizer, shards and batches."""

  SECTION = "data"
  task: str = f.field(
    "dipaco_embedded", f.choice(TASKS), 'seqio task: "dipaco_embedded" | "c4_en".'
  )
  tfds_data_dir: str | None = f.field(
    None, f.path("tfds's default directory"), "tfds dir (gs:// for C4)."
  )
  tfds_name: str = f.field(
    C4_TFDS_NAME,
    f.custom(
      lambda v: isinstance(v, str) and re.match(TFDS_NAME_PATTERN, v) is not None,
      f"a tfds name with its version pinned, such as {C4_TFDS_NAME!r}",
    ),
    "The tfds dataset:version c4_en reads (3.0.1: the public prepared copy, docs/data.md).",
  )
  vocab_path: str | None = f.field(
    None, f.path("the task's shipped tokenizer"), "SentencePiece model; None = shipped."
  )
  seq_len: int = f.field(1024, count, "Training sequence length (paper: 1024).")
  batch_size: int = f.field(512, count, "Sequences per path per inner step (paper: 512).")
  seed: int = f.field(0, count0, "Shard assignment and batch order seed.")
  interleave: int = f.field(
    1,
    count,
    "Training rows from this many of a worker's documents side by side: row r of a batch "
    "from lane r mod N (N = batch_size: every row another document, as a shuffle buffer of "
    "packed examples; data/batcher.py). 1 = one document after another, filling rows.",
  )
  subsample: int = f.field(
    1, count, "Keep one document in N of every split (doc-id hash; quick runs). 1 = all."
  )
  top_k: int = f.field(
    1, count, "Shards per training document (paper 16x16: 2); eval never overlaps."
  )
  shard_dir: str | None = f.field(None, f.path("<workdir>/shards"), "None = <workdir>/shards.")
  shard_cache: str = f.field(
    "auto",
    f.custom(
      f.names_a_folder, "'auto' (the user's cache dir), 'off', or a cache folder (local or gs://)"
    ),
    'Shards reused across workdirs by fingerprint (data/shard_cache.py): "auto" = the user\'s '
    'cache dir ($DIPACO_CACHE_DIR or ~/.cache/dipaco_jax), "off", or a folder (local or gs://).',
  )
  empty_shard_policy: str = f.field(
    "error",
    f.choice(EMPTY_POLICIES),
    'Empty shard: "error" | "allow_validation" (own-shard val loss NaN, no early stop) | "allow".',
  )


@dataclasses.dataclass(frozen=True)
class MeshConfig(f.Section):
  """The device mesh ('path', 'data', 'model')."""

  SECTION = "mesh"
  path: int = f.field(
    -1,
    f.integer(1, unset=-1),
    "Device groups on the 'path' axis (-1: gcd(workers, devices/model)).",
  )
  data: int = f.field(
    -1, f.integer(1, unset=-1), "Data parallelism inside a path (-1: the devices left)."
  )
  model: int = f.field(1, count, "Tensor parallelism inside a path.")
  fsdp: bool = f.field(
    False,
    f.boolean(),
    "Also split params and AdamW state over 'data' inside a path (FSDP); False = replicated.",
  )
  num_slices: int = f.field(0, count0, "TPU slices ('path' spans them over DCN); 0 = detect.")
  cpu_devices: int = f.field(
    0, count0, "On CPU only: split the host into N devices (0 = JAX's default)."
  )


@dataclasses.dataclass(frozen=True)
class CkptConfig(f.Section):
  """Checkpoints (orbax)."""

  SECTION = "ckpt"
  every_steps: int = f.field(150, count, "Inner steps between checkpoints (mid-phase is fine).")
  max_to_keep: int = f.field(2, count, "Checkpoints kept.")
  async_save: bool = f.field(True, f.boolean(), "Write in the background.")


@dataclasses.dataclass(frozen=True)
class RoutingConfig(f.Section):
  """Offline routing (docs/routing.md; paper §2.4, §2.6, §2.7)."""

  SECTION = "routing"
  router: str = f.field(
    "random",
    f.choice(PHASE0_ROUTERS),
    'Phase-0 shards: "random" (i.i.d.) | "kmeans" | "product_kmeans".',
  )
  prefix_len: int = f.field(
    32,
    count,
    "Tokens the router reads (paper: 32); left out of evaluate's prefix-excluded perplexity.",
  )
  feature_batch_size: int = f.field(
    64, count, "Documents per θ̄ feature batch (jit, over local devices)."
  )
  kmeans_restarts: int = f.field(4, count, "k-means++ restarts (best inertia kept).")
  kmeans_iters: int = f.field(100, count, "Lloyd iterations per restart.")
  kmeans_min_share: float = f.field(
    0.0,
    f.fraction(),
    "Balanced k-means: floor every path's share of the router split at this x 1/P with a "
    'calibrated bias (0 = nearest centroid; router="kmeans" only).',
  )
  seed: int = f.field(0, count0, "Seed of k-means and of the logistic regressions.")
  replica_shards: str = f.field(
    "hash",
    f.choice(REPLICA_SHARDS),
    'Replicas of a path: "hash" (i.i.d.) | "router" (one cluster per worker: DiLoCo non-i.i.d.).',
  )
  router_max_docs: int = f.field(
    0,
    f.integer(0, what=" (0 = all)"),
    "Router-split documents scored per discriminative phase (0 = all).",
  )
  balance_docs: int = f.field(
    65536,
    f.integer(0, what=" (0 = calibrate on the router split)"),
    "The balanced routers' bias (kmeans_min_share, and every discriminative phase) is "
    "calibrated on the first N training documents, weighted by tokens: shares hold in training "
    "tokens. 0 = on the router split (its documents weighted by tokens).",
  )
  discriminative_at_outer_step: int = f.field(
    -1, f.integer(1, unset=-1), "Re-shard after this outer step (1..T-1); -1 = never."
  )
  discriminative_phases: int = f.field(1, count, "Number of discriminative re-shards (paper: 1).")
  discriminative_every: int = f.field(
    1, count, "Outer steps between successive re-shards (phases > 1)."
  )
  discriminative_target: str = f.field(
    "labels",
    f.choice(DISCRIMINATIVE_TARGETS),
    'Shard sizes the bias matches: "labels" | "uniform".',
  )
  discriminative_min_share: float = f.field(
    0.0, f.fraction(), "Floor of every path's target share, x 1/P (0 = none; 1 = uniform)."
  )
  restart_schedule: bool = f.field(
    True, f.boolean(), "Restart the inner warmup+cosine at a re-shard (paper Fig. 10)."
  )
  score_len: int = f.field(
    0,
    f.integer(0, what=" (0 = eval.seq_len)"),
    "Tokens per router document each path scores (0 = eval.seq_len).",
  )


@dataclasses.dataclass(frozen=True)
class EvalConfig(f.Section):
  """Validation while training; routed evaluation (evaluate.py)."""

  SECTION = "eval"
  every_steps: int = f.field(150, count, "Inner steps between validation on each path's shard.")
  batches: int = f.field(4, count, "Validation batches per path.")
  seq_len: int = f.field(
    0,
    f.integer(0, what=" (0 = data.seq_len)"),
    "Tokens per validation sequence (a document's start); 0 = data.seq_len.",
  )
  max_docs: int = f.field(
    0, f.integer(0, what=" (0 = all)"), "Validation documents evaluated (0 = all)."
  )
  rerouting_windows: tuple = f.field(
    (16, 32, 64, 128),
    f.tuple_of(count, "a tuple of integers >= 1"),
    "W: re-route every W tokens after the prefix.",
  )
  rerouters: tuple = f.field(
    ("linear",),
    f.tuple_of(
      f.choice(REROUTERS),
      f"a tuple of any of {', '.join(repr(k) for k in REROUTERS)}, written as a Python tuple: "
      "--config.eval.rerouters=\"('linear','transformer')\"",
    ),
    'Test-time routers fitted and evaluated. "transformer" (the paper\'s) fine-tunes θ̄ for '
    "reroute_steps: minutes on a CPU, so it runs only when asked (linear,transformer).",
  )
  reroute_label_window: int = f.field(
    0,
    f.integer(0, what=" (0 = to the end)"),
    "Forward window L of re-router labels (0 = to the end; paper).",
  )
  reroute_stride: int = f.field(
    8, count, "Linear re-router: one training example every this many tokens."
  )
  reroute_steps: int = f.field(
    300, count, "Transformer re-router: fine-tuning steps from θ̄ (paper: 2k)."
  )
  reroute_lr: float = f.field(
    1e-3, f.number(0), "Transformer re-router: AdamW peak LR (no warmup, as the paper)."
  )
  reroute_batch_size: int = f.field(16, count, "Transformer re-router: sequences per step.")


@dataclasses.dataclass(frozen=True)
class EarlyStoppingConfig(f.Section):
  """Per-path early stopping (paper §2.7)."""

  SECTION = "early_stopping"
  enabled: bool = f.field(
    True, f.boolean(), "Keep each worker's best params by own-shard val loss (+1 params copy)."
  )
  source: str = f.field(
    "heldout",
    f.choice(STOP_SOURCES),
    'The loss it reads: "heldout" (a slice of each worker\'s training shard, never trained on) '
    'or "validation" (the worker\'s validation shard, which the final numbers also read).',
  )
  heldout_docs: int = f.field(64, count, "Held-out documents per worker's shard ...")
  heldout_fraction: float = f.field(
    0.1, f.number(0, above=False, hi=1), "... and at most this share of them."
  )


@dataclasses.dataclass(frozen=True)
class ElasticConfig(f.Section):
  """dipaco.mode="elastic" only (docs/elastic.md)."""

  SECTION = "elastic"
  address: str = f.field(
    "",
    f.string(),
    '"" = a local Ray cluster on 127.0.0.1 inside the command; "auto" or "HOST:PORT" joins one.',
  )
  num_workers: int = f.field(
    2, count, "Worker actors; each runs one (phase, worker) task of H inner steps at a time."
  )
  num_executors: int = f.field(
    1, count, "Outer executors; store groups are dealt to them round-robin."
  )
  worker_resources: str = f.field(
    "",
    f.custom(f.ray_resources, 'a JSON object of Ray resources, e.g. {"TPU": 4}, or ""'),
    'JSON of Ray resources one worker actor needs, e.g. \'{"TPU": 4}\' ("" = 1 CPU); what the '
    "local cluster lacks is refused, a joined cluster's actors wait for nodes.",
  )
  pin_cpus: bool = f.field(
    True,
    f.boolean(),
    'On the command\'s own local cluster (address ""), worker actor i runs on its own share of '
    "this machine's cores (CPU affinity, which XLA's CPU thread pool follows).",
  )
  task_timeout_s: float = f.field(
    600.0,
    f.number(0),
    "A task not reported after this long goes back on the queue (its worker restarts); the same "
    "task cut twice while stepping (or 3 times) stops the run with the time it needs.",
  )
  progress_every_steps: int = f.field(
    0,
    f.integer(0, what=" (0 = off)"),
    "A task saves its progress (params, AdamW state, data position) every this many inner "
    "steps; a retry after a kill or timeout resumes there instead of from the phase's start. "
    "0 = off.",
  )
  compile_cache: str = f.field(
    "auto",
    f.custom(
      f.names_a_folder,
      "'auto' ($JAX_COMPILATION_CACHE_DIR or the user's cache dir), 'off', or a folder",
    ),
    'The actors\' persistent JAX compilation cache (restarted actors load, not compile): "auto" '
    '= $JAX_COMPILATION_CACHE_DIR, else jax_cache/ in data.shard_cache\'s "auto" dir; "off"; a '
    "folder.",
  )
  quorum: float = f.field(
    1.0,
    f.custom(
      lambda v: f.number(0).ok(v) and v <= 1,
      "a fraction in (0, 1] of a module's α-weight (1.0 = wait for every report)",
    ),
    "Quorum (beyond the paper; docs/elastic.md): a module may take phase t's outer step once "
    "this fraction of its α-weight has reported and grace_s has passed since; 1.0 = all (off).",
  )
  grace_s: float = f.field(
    0.0, f.number(0, above=False), "Seconds a module waits for more reports after its quorum."
  )
  late_deltas: str = f.field(
    "next",
    f.choice(LATE_DELTAS),
    'Deltas that miss their module\'s quorum step: "next" = join its next step, "drop" = ignored, '
    '"discount" = join its next step with its weight x late_discount per phase late.',
  )
  late_discount: float = f.field(
    0.5,
    f.custom(
      lambda v: f.number(0).ok(v) and v <= 1, 'a staleness discount in (0, 1] (1 = as "next")'
    ),
    'late_deltas="discount": a late delta\'s weight is α x late_discount^(phases late).',
  )
  pace_steps: bool = f.field(
    False,
    f.boolean(),
    "Work in proportion to speed (docs/elastic.md): a task's inner steps from its actor's measured "
    "step time within phase_budget_s (at most H, at least min_inner_steps); an actor not "
    "measured yet (phase 0) stops at that budget's wall deadline instead.",
  )
  phase_budget_s: float = f.field(
    0.0,
    f.number(0, above=False),
    "pace_steps: the wall budget of a phase's steps; 0 = H x the fastest actor's step time.",
  )
  min_inner_steps: int = f.field(
    1, count, "pace_steps: the fewest inner steps a task runs, however slow its actor."
  )
  token_weights: bool = f.field(
    False,
    f.boolean(),
    "A delta's outer-step weight is α x (inner steps its task trained / H) (docs/elastic.md).",
  )
  lease: str = f.field(
    "first",
    f.choice(LEASES),
    '"first" = an idle actor takes the most lagging ready task, lowest-numbered actor first; '
    '"speed" = fastest idle actor first, a slow one the least lagging task, and nothing when '
    "the faster actors would finish every ready task sooner (docs/elastic.md).",
  )


@dataclasses.dataclass(frozen=True)
class ProfileConfig(f.Section):
  """A jax.profiler trace of a window of inner steps (TensorBoard's profile tab); off by default."""

  SECTION = "profile"
  start_step: int = f.field(
    1, count, "First inner step traced (a resumed run traces the window's steps it runs)."
  )
  num_steps: int = f.field(
    0,
    f.integer(0, what=" (0 = off)"),
    "Inner steps traced from start_step into <workdir> (elastic: <workdir>/profile/w<w>); 0 = off.",
  )


@dataclasses.dataclass(frozen=True)
class GuardConfig(f.Section):
  """The divergence guard (core/guard.py); 0 turns a rule off."""

  SECTION = "guard"
  stuck_steps: int = f.field(
    100,
    f.integer(0, what=" (0 = rule off)"),
    "Stop when the mean train loss of this many steps past warmup >= ln V.",
  )
  max_param_norm_ratio: float = f.field(
    100.0,
    f.custom(
      lambda v: f.number(0, above=False).ok(v) and (v == 0 or v > 1),
      "a number > 1, or 0 (rule off)",
    ),
    "Stop when a group's param norm > this x its norm at start (init or resume).",
  )


# Every section, in the order a config lists them.
SECTIONS = (
  RunConfig,
  ModelConfig,
  InnerConfig,
  OuterConfig,
  DipacoConfig,
  DataConfig,
  MeshConfig,
  CkptConfig,
  RoutingConfig,
  EvalConfig,
  EarlyStoppingConfig,
  ElasticConfig,
  GuardConfig,
  ProfileConfig,
)
