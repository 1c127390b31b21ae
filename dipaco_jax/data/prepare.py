"""prepare_shards: write a run's train and validation shards once, reuse them, refuse a mismatch."""

import json

from etils import epath

from dipaco_jax.data import assign as assign_lib
from dipaco_jax.data import shards
from dipaco_jax.data import vocab

# Fields of the shard dir's meta.json that must match the run's config for the dir to be reused.
MATCH_FIELDS = ("task", "num_workers", "assignment", "top_k", "seed", "vocab", "subsample")
_MATCH_DEFAULTS = {"subsample": 1}  # Dirs written before a field existed hold its default.
PENDING = "pending.json"  # the config of a prepare_shards call that has not finished yet


EMPTY_POLICIES = (*shards.EMPTY_POLICIES, "allow_validation")


def split_policy(policy: str, split: str) -> str:
  """write_shards' policy for one split: "allow_validation" lets only validation be empty."""
  if policy not in EMPTY_POLICIES:
    raise ValueError(f"config.data.empty_shard_policy={policy!r}: choose one of {EMPTY_POLICIES}.")
  if policy == "allow_validation":
    return "error" if split == "train" else "allow"
  return policy


def shard_config(data_cfg, num_workers: int, assign: assign_lib.Assignment) -> dict:
  """What a shard dir is built from, as recorded in its meta.json."""
  description = getattr(assign, "description", None)
  if not description:
    raise ValueError(
      "The assignment has no .description; wrap it with "
      "assign.with_description(fn, 'what it is') so shard dirs can be matched."
    )
  task = data_cfg.task
  return {
    "task": task,
    "num_workers": num_workers,
    "assignment": description,
    "top_k": data_cfg.top_k,
    "seed": data_cfg.seed,
    "subsample": data_cfg.subsample,
    "vocab": vocab.fingerprint(vocab.resolve(task, data_cfg.vocab_path)),
  }


def prepare_shards(data_cfg, num_workers: int, shard_dir: str, *, assign=None) -> shards.ShardSet:
  """Returns the run's ShardSet, writing train + validation shards first if shard_dir is new."""
  if assign is None:
    assign = assign_lib.random_assignment(num_workers, seed=data_cfg.seed, top_k=data_cfg.top_k)
  want = shard_config(data_cfg, num_workers, assign)
  root = epath.Path(shard_dir)
  _check_match(root / shards.META, want, shard_dir)
  if (root / shards.META).exists():
    return shards.ShardSet(shard_dir)
  # An interrupted earlier call left PENDING: finished splits are kept if it had the same config.
  _check_match(root / PENDING, want, shard_dir)
  root.mkdir(parents=True, exist_ok=True)
  (root / PENDING).write_text(json.dumps(want, indent=1) + "\n")
  from dipaco_jax.data.tasks import iter_documents  # pylint: disable=g-import-not-at-top

  sizes = {}
  for split, split_assign in (("train", assign), ("validation", assign_lib.first_only(assign))):
    if (root / split / shards.META).exists():
      sizes[split] = shards.read_json(root / split / shards.META, shard_dir)["tokens"]
      continue
    docs = iter_documents(
      data_cfg.task,
      split,
      data_dir=data_cfg.tfds_data_dir,
      vocab_path=data_cfg.vocab_path,
      subsample=data_cfg.subsample,
    )
    sizes[split] = shards.write_shards(
      shard_dir,
      split,
      docs,
      split_assign,
      num_workers,
      empty_policy=split_policy(data_cfg.empty_shard_policy, split),
    ).tolist()
  meta = {
    "format": shards.FORMAT,
    **want,
    "splits": ["train", "validation"],
    "tokens": sizes,
    "tfds_data_dir": data_cfg.tfds_data_dir,
  }
  (root / shards.META).write_text(json.dumps(meta, indent=1) + "\n")  # last: the dir is complete
  (root / PENDING).unlink()
  return shards.ShardSet(shard_dir)


def _check_match(meta_path: epath.Path, want: dict, shard_dir: str) -> None:
  if not meta_path.exists():
    return
  have = shards.read_json(meta_path, shard_dir)
  diff = {
    k: (have.get(k, _MATCH_DEFAULTS.get(k)), want[k])
    for k in MATCH_FIELDS
    if have.get(k, _MATCH_DEFAULTS.get(k)) != want[k]
  }
  if diff:
    raise ValueError(
      f"Shard dir {shard_dir} was written for another config (field: (on disk, wanted)): "
      f"{diff}. Point the run at a new shard dir; this one is never overwritten."
    )
