"""The reproduction's arms: each model's name, what it is, and its config overrides."""

from reproduction import modes

# name -> (what it is, how it relates to the paper); the order of the table.
MODELS = {
  "dense_path": "dense, path size (Table 1 baseline, 16.23)",
  "dense_4x": "dense, ~4x path params, from scratch (the 1.3B dense, 11.41)",
  "diloco_iid": "DiLoCo, 4 replicas (the 2x2 grid's paths), i.i.d. shards (DiLoCo Table 3)",
  "diloco_iid_16": "DiLoCo, 16 replicas (the 4x4 grid's paths), i.i.d. shards",
  "diloco_kmeans": "DiLoCo, P replicas, k-means shards (non-i.i.d.)",
  "flat_moe": "flat MoE, P independent paths (Table 1)",
  "dipaco_2x2": "DiPaCo 2x2, k-means then discriminative (balanced)",
  "dipaco_2x2_kmeans": "DiPaCo 2x2, k-means only (control)",
  "dipaco_4x4": "DiPaCo 4x4, k-means then discriminative (balanced)",
  "dipaco_4x4_kmeans": "DiPaCo 4x4, k-means only (control)",
}


# The long comparison (`--models=long`): every arm 4 workers (DiLoCo P=2 asks whether DiLoCo
# is saturated), the controls that tell routing from averaging (the same grid on i.i.d.
# shards; oracle and random-path scores), DiLoCo at the paper's outer LR and a smaller one.
LONG_MODELS = (
  "dense_path",
  "diloco_iid",
  "diloco_iid_olr0.35",
  "diloco_iid_olr1.0",
  "diloco_iid_2",
  "dipaco_2x2",
  "dipaco_2x2_olr1.0",
  "dipaco_2x2_iid",
  "dipaco_2x2_muon",
)


# --long_b4's models (the appendix's comparison).
LONG_B4_MODELS = (
  "dense_path",
  "dense_4x",
  "diloco_iid",
  "diloco_iid_16",
  "dipaco_2x2",
  "dipaco_4x4",
  "dipaco_4x4_kmeans",
)


# The comparisons the summary reads (better model expected first, as in the paper's ordering).
PAIRS = (
  ("diloco_iid", "dense_path"),
  ("dipaco_2x2", "diloco_iid"),
  ("dipaco_2x2", "diloco_iid_olr0.35"),
  ("dipaco_2x2", "diloco_iid_olr1.0"),
  ("dipaco_2x2_olr1.0", "diloco_iid_olr1.0"),
  ("dipaco_2x2", "diloco_iid_2"),
  ("dipaco_2x2", "dipaco_2x2_iid"),
  ("diloco_iid", "diloco_iid_2"),
  ("dipaco_2x2_muon", "dipaco_2x2"),
  ("dipaco_2x2_pse", "dipaco_2x2_pse_iid"),
  ("dipaco_2x2_pse", "dipaco_2x2"),
  ("dipaco_2x2_emb", "dipaco_2x2_emb_iid"),
  ("dipaco_2x2_emb", "dipaco_2x2"),
  ("dipaco_2x2", "dipaco_2x2_int8"),
  ("dipaco_2x2", "dipaco_2x2_fp4"),
  ("dipaco_2x2_fp4", "dipaco_2x2_fp4_noef"),
  ("dipaco_2x2", "dipaco_2x2_topk2"),
  ("dipaco_2x2_fp4", "dipaco_2x2_stream"),
  ("dipaco_2x2_fp4", "dipaco_2x2_frag"),
  ("dipaco_2x2_frag", "dipaco_2x2_stream"),
  ("dipaco_4x4", "diloco_iid_16"),
  ("dipaco_4x4", "dipaco_4x4_iid"),
  ("dipaco_4x4", "dipaco_4x4_kmeans"),
  ("dipaco_4x4", "dipaco_2x2"),
  ("dense_4x", "dense_path"),
  ("dense_4x", "dipaco_4x4"),
)


# Not in the default comparison: controls for the investigations of docs/results.md.
INVESTIGATIONS = {
  "dense_path_scratch": "dense, path size, from scratch (no fork, one LR schedule)",
  "diloco_iid_sqrtp": "DiLoCo i.i.d. with the DiPaCo grids' x sqrt(P) on the outer gradient",
  "diloco_iid_2": "DiLoCo, 2 replicas, i.i.d. shards (is DiLoCo saturated at P=4?)",
  "diloco_iid_olr<LR>": "DiLoCo, 4 replicas, i.i.d., outer LR <LR> (the paper's is 0.7)",
  "dipaco_2x2_olr<LR>": "DiPaCo 2x2 as dipaco_2x2 at outer LR <LR> (the paper's is 0.7)",
  "dipaco_2x2_iid": "DiPaCo 2x2 on i.i.d. shards: averaging over modules, no routing",
  "dipaco_2x2_muon": "DiPaCo 2x2 as dipaco_2x2, inner Muon for the matrices (MuLoCo)",
  "dipaco_4x4_iid": "DiPaCo 4x4 on i.i.d. shards: averaging over modules, no routing",
  "dipaco_2x2_pse": "DiPaCo 2x2 as dipaco_2x2, each path its own (tied) embedding",
  "dipaco_2x2_pse_iid": "dipaco_2x2_pse on i.i.d. shards (its control)",
  "dipaco_2x2_emb": "DiPaCo 2x2 as dipaco_2x2, the (tied) embedding in the first routed level",
  "dipaco_2x2_emb_iid": "dipaco_2x2_emb on i.i.d. shards (its control)",
  "dipaco_2x2_int8": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as int8 with error feedback",
  "dipaco_2x2_fp4": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as fp4 with error feedback",
  "dipaco_2x2_fp4_noef": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as fp4, no error feedback",
  "dipaco_2x2_topk2": "DiPaCo 2x2 as dipaco_2x2, outer deltas sent as top-1 of 64, 2 bits, with EF",
  "dipaco_2x2_stream": "DiPaCo 2x2 as dipaco_2x2_fp4, synced in 3 fragments landing 4 steps late",
  "dipaco_2x2_frag": "DiPaCo 2x2 as dipaco_2x2_fp4, synced in 3 fragments, each landing at once",
}


# The capacity comparison's models beyond MODELS (--capacity; docs/results/capacity.md), each
# also as <name>_olr<LR>. Dense models bigger than a path fork from their own θ̄, pretrained as
# the path's was, so every arm has the same steps and tokens per step as one path.
CAPACITY = {
  "diloco_iid_1": "DiLoCo, 1 replica (a lookahead outer step on one worker), i.i.d.",
  "diloco_iid_2": INVESTIGATIONS["diloco_iid_2"],
  "diloco_iid": MODELS["diloco_iid"],
  "diloco_iid_8": "DiLoCo, 8 replicas (the 2x4 grid's paths), i.i.d. shards",
  "dense_store_2x2": "dense, the 2x2 store's size (the path's width, 2x its blocks)",
  "dense_store_2x4": "dense, the 2x4 store's size (the path's width, 3x its blocks)",
  "dense_wide": "dense, ~2x the path (big_d_model wide, the path's blocks)",
  "dipaco_2x2": MODELS["dipaco_2x2"],
  "dipaco_2x2_iid": INVESTIGATIONS["dipaco_2x2_iid"],
  "dipaco_2x4": "DiPaCo 2x4 (8 paths), k-means then discriminative (balanced)",
  "dipaco_2x4_iid": "DiPaCo 2x4 on i.i.d. shards: averaging over modules, no routing",
  "dipaco_2x2_pse": INVESTIGATIONS["dipaco_2x2_pse"],
  "dipaco_2x4_pse": "DiPaCo 2x4 as dipaco_2x4, each path its own (tied) embedding",
}
# Dense models bigger than the path: (d_model, blocks as a multiple of the path's, heads).
BIG_DENSE = {
  "dense_store_2x2": lambda s: (s.d_model, 2 * s.layers, s.heads),
  "dense_store_2x4": lambda s: (s.d_model, 3 * s.layers, s.heads),
  "dense_wide": lambda s: (s.big_d_model, s.layers, s.big_heads),
}


def pretrain_of(name: str, s: modes.Sizes) -> str:
  """The θ̄ run a model forks from: "pretrain" (the path's), or a bigger dense model's own."""
  base = (outer_lr_variant(name) or (name, 0))[0]
  return f"pretrain_{base}" if base in BIG_DENSE and s.fork_batch else "pretrain"


# <base>_olr<LR>: the base model at outer LR <LR>, e.g. diloco_iid_olr0.35; any base with an
# outer step (every DiLoCo and DiPaCo arm).
OUTER_LR_BASES = ("diloco_", "dipaco_", "flat_moe")


def outer_lr_variant(name: str) -> tuple[str, float] | None:
  """(base model, outer LR) of an outer-LR variant's name; None for any other name."""
  base, sep, lr_text = name.rpartition("_olr")
  if not sep or not base.startswith(OUTER_LR_BASES) or not known(base):
    return None
  try:
    lr = float(lr_text)
  except ValueError:
    return None
  return (base, lr) if lr > 0 else None


def describe(name: str) -> str:
  """One line on what a model is (its MODELS / INVESTIGATIONS / CAPACITY entry)."""
  variant = outer_lr_variant(name)
  if variant:
    return f"{describe(variant[0])}, at outer LR {variant[1]:g}"
  if name.startswith("pretrain_"):
    return f"dense pretraining of {name[len('pretrain_') :]} (its θ̄)"
  every = {**MODELS, **INVESTIGATIONS, **CAPACITY, "pretrain": "dense pretraining (θ̄)"}
  return every[name]


def known(name: str) -> bool:
  """A model this script can train: a MODELS, INVESTIGATIONS or CAPACITY name, or its _olr<LR>."""
  if name in MODELS or name in CAPACITY or name in INVESTIGATIONS and "<" not in name:
    return True
  return outer_lr_variant(name) is not None


def ordered(names) -> list[str]:
  """`names` in the table's order: MODELS, INVESTIGATIONS, CAPACITY, outer-LR variants by LR."""
  fixed = [n for n in dict.fromkeys([*MODELS, *INVESTIGATIONS, *CAPACITY]) if n in names]
  variants = [n for n in names if outer_lr_variant(n)]
  return fixed + sorted(variants, key=lambda n: (outer_lr_variant(n)[0], -outer_lr_variant(n)[1]))


def block_levels(layers: int) -> tuple[str, str]:
  """Blocks split in two levels: the first half and the second half."""
  h = layers // 2
  span = lambda a, b: f"block_{a}" if a == b else f"block_{a}-{b}"
  return span(0, h - 1), span(h, layers - 1)


def run_overrides(
  name: str,
  s: modes.Sizes,
  pretrain_dir: str,
  shared_shards: str,
  sqrt_paths: str,
  sqrt_cap: float = 0.0,
) -> dict:
  """Config overrides (on configs/tiny.py) of one model; shared_shards: a shard dir prefix."""
  variant = outer_lr_variant(name)
  if variant:
    base, lr = variant
    return {
      **run_overrides(base, s, pretrain_dir, shared_shards, sqrt_paths, sqrt_cap),
      "outer.lr": lr,
    }
  everything = f"embed,block_0-{s.layers - 1},head"
  fork = {
    "dipaco.init_from": pretrain_dir,
    "inner.warmup_steps": s.fork_warmup,
    "dipaco.outer_steps": s.steps // s.inner_steps,
  }
  kmeans = {"routing.router": "kmeans", "routing.kmeans_min_share": s.min_share}
  disc = {
    **kmeans,
    "routing.discriminative_at_outer_step": s.disc_at,
    "routing.discriminative_min_share": s.min_share,
    "routing.restart_schedule": False,
  }
  grid = lambda k, k2=None: {
    "dipaco.level_groups": ("embed,head", *block_levels(s.layers)),
    "dipaco.modules_per_level": (1, k, k2 or k),
    "outer.sqrt_paths": sqrt_paths,
    "outer.sqrt_paths_cap": sqrt_cap,
  }
  dense = {
    "dipaco.level_groups": (everything,),
    "dipaco.modules_per_level": (1,),
    "outer.enabled": False,
    "data.shard_dir": shared_shards + "_dense",
  }
  if name == "pretrain":
    return {**dense, "dipaco.outer_steps": s.pretrain // s.inner_steps}
  big = name[len("pretrain_") :] if name.startswith("pretrain_") else name
  if big in BIG_DENSE:  # Its own θ̄ (pretrain_<name>) where the fork changes the batch.
    d, layers, heads = BIG_DENSE[big](s)
    dims = {
      **dense,
      "model.d_model": d,
      "model.num_layers": layers,
      "model.num_heads": heads,
      "model.head_dim": d // heads,
      "dipaco.level_groups": (f"embed,block_0-{layers - 1},head",),
      "inner.lr": s.big_lr,
    }
    if name != big:
      return {**dims, "dipaco.outer_steps": s.pretrain // s.inner_steps}
    if s.fork_batch:
      return {**dims, **fork}
    return {**dims, "dipaco.outer_steps": (s.pretrain + s.steps) // s.inner_steps}
  if name == "dense_path":
    return {**dense, **fork}
  if name == "dense_path_scratch":
    return {**dense, "dipaco.outer_steps": (s.pretrain + s.steps) // s.inner_steps}
  if name == "dense_4x":
    return {
      **dense,
      "model.d_model": s.big_d_model,
      "model.num_layers": s.big_layers,
      "model.num_heads": s.big_heads,
      "model.head_dim": s.big_d_model // s.big_heads,
      "dipaco.level_groups": (f"embed,block_0-{s.big_layers - 1},head",),
      "inner.lr": s.big_lr,
      "dipaco.outer_steps": (s.pretrain + s.steps) // s.inner_steps,
    }
  diloco = {
    "dipaco.level_groups": (everything,),
    "dipaco.modules_per_level": (1,),
    "dipaco.replicas": s.paths,
    "outer.sqrt_paths": "none",
    **fork,
  }
  if name == "diloco_iid":
    return diloco
  if name == "diloco_iid_16":  # Equal workers with dipaco_4x4.
    return {**diloco, "dipaco.replicas": 16}
  if name in ("diloco_iid_1", "diloco_iid_2", "diloco_iid_8"):
    return {**diloco, "dipaco.replicas": int(name[-1])}
  if name == "diloco_iid_sqrtp":
    return {**diloco, "outer.sqrt_paths": sqrt_paths}
  if name == "diloco_kmeans":
    return {**diloco, **kmeans, "routing.replica_shards": "router"}
  if name == "flat_moe":
    return {
      "dipaco.level_groups": (everything,),
      "dipaco.modules_per_level": (s.paths,),
      **fork,
      **disc,
    }
  if name == "dipaco_2x2":  # Same phase-0 shards as its control (same θ̄, seed, grid).
    return {**grid(2), **fork, **disc, "data.shard_dir": shared_shards + "_2x2"}
  if name == "dipaco_2x2_iid":  # No router: i.i.d. shards from the fork to the end.
    return {**grid(2), **fork, "routing.router": "random"}
  if name == "dipaco_2x2_muon":
    return {
      **grid(2),
      **fork,
      **disc,
      "data.shard_dir": shared_shards + "_2x2",
      "inner.optimizer": "muon",
    }
  if name == "dipaco_2x4":  # Same phase-0 shards as its pse arm.
    return {**grid(2, 4), **fork, **disc, "data.shard_dir": shared_shards + "_2x4"}
  if name == "dipaco_2x4_iid":
    return {**grid(2, 4), **fork, "routing.router": "random"}
  if name == "dipaco_4x4_iid":
    return {**grid(4), **fork, "routing.router": "random"}
  compressed = {
    "dipaco_2x2_int8": {"outer.compression": "int8"},
    "dipaco_2x2_fp4": {"outer.compression": "fp4"},
    "dipaco_2x2_fp4_noef": {"outer.compression": "fp4", "outer.error_feedback": False},
    "dipaco_2x2_topk2": {"outer.compression": "topk2"},
    # Streamed: fp4 in 3 fragments synced H/3 apart, each update landing 4 steps late.
    "dipaco_2x2_stream": {"outer.compression": "fp4", "outer.fragments": 3, "outer.overlap": 4},
    "dipaco_2x2_frag": {"outer.compression": "fp4", "outer.fragments": 3},  # Its τ = 0 ablation.
  }
  if name in compressed:  # The same run as dipaco_2x2 but for the wire format of its deltas.
    return {
      **run_overrides("dipaco_2x2", s, pretrain_dir, shared_shards, sqrt_paths, sqrt_cap),
      **compressed[name],
    }
  # Where the capacity sits: the quick model's tied embedding holds ~73% of a path's
  # parameters; these put it in the routed part (same phase-0 shards as dipaco_2x2).
  first, second = block_levels(s.layers)
  pse = {**grid(2), "dipaco.path_specific": "embed", "dipaco.level_groups": ("head", first, second)}
  emb = {**grid(2), "dipaco.level_groups": ("head", f"embed,{first}", second)}
  pse8 = {**pse, **grid(2, 4), "dipaco.level_groups": ("head", first, second)}
  capacity = {"dipaco_2x2_pse": pse, "dipaco_2x2_emb": emb, "dipaco_2x4_pse": pse8}
  if name in capacity:
    shards = shared_shards + ("_2x4" if "2x4" in name else "_2x2")
    return {**capacity[name], **fork, **disc, "data.shard_dir": shards}
  if name.endswith("_iid") and name[: -len("_iid")] in capacity:
    return {**capacity[name[: -len("_iid")]], **fork, "routing.router": "random"}
  if name == "dipaco_2x2_kmeans":
    return {**grid(2), **fork, **kmeans, "data.shard_dir": shared_shards + "_2x2"}
  if name == "dipaco_4x4":  # Same phase-0 shards as its control.
    return {**grid(4), **fork, **disc, "data.shard_dir": shared_shards + "_4x4"}
  if name == "dipaco_4x4_kmeans":
    return {**grid(4), **fork, **kmeans, "data.shard_dir": shared_shards + "_4x4"}
  raise ValueError(
    f"unknown model {name!r}; choose from {['pretrain', *MODELS, *INVESTIGATIONS, *CAPACITY]}."
  )


# The routing question's arms (the `grid` values of the arms JSON); the others are references.
ARM_GRIDS = ("2x2", "4x4", "P=4", "P=16")


def arm_kind(name: str, s: modes.Sizes) -> tuple[str, str]:
  """(grid, shards) of a model: "2x2" / "4x4" / "P=<replicas>", "routed" / "iid"."""
  o = run_overrides(name, s, "THETA", "SHARDS", "none")
  ks = tuple(o.get("dipaco.modules_per_level", (1,)))
  routed_ks = [k for k in ks if k > 1]
  grid = "x".join(map(str, routed_ks)) if routed_ks else f"P={o.get('dipaco.replicas', 1)}"
  return grid, "iid" if o.get("routing.router", "random") == "random" else "routed"
