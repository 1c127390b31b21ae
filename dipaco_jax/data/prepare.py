"""prepare_shards: write a run's train and validation shards once, reuse them, refuse a mismatch.

One process: `prepare_shards`. N processes (a multi-host job, or an offline CPU job):
every process calls `write_shard_part(..., part=i, num_parts=N)`, then process 0 calls
`finish_shards(..., num_parts=N)` once every part is done (a barrier, or `wait_for_parts`).
"""

import contextlib
import hashlib
import os
import sys
import time

from etils import epath

from dipaco_jax.config import sections
from dipaco_jax.data import assign as assign_lib
from dipaco_jax.data import corpus
from dipaco_jax.data import shard_writer
from dipaco_jax.data import shards
from dipaco_jax.data import vocab
from dipaco_jax.errors import ConfigError
from dipaco_jax.io import files
from dipaco_jax.io import lock

# Fields of the shard dir's meta.json that must match the run's config for the dir to be reused.
MATCH_FIELDS = (
  "task",
  "source",
  "num_workers",
  "assignment",
  "top_k",
  "seed",
  "vocab",
  "subsample",
)
PENDING = "pending.json"  # the config of a prepare_shards call that has not finished yet
SPLITS = ("train", "validation")  # what a run's shard dir holds


def split_policy(policy: str, split: str) -> str:
  """write_shards' policy for one split: "allow_validation" lets only validation be empty."""
  if policy not in sections.EMPTY_POLICIES:
    raise ValueError(
      f"config.data.empty_shard_policy={policy!r}: choose one of {sections.EMPTY_POLICIES}."
    )
  if policy == "allow_validation":
    return "error" if split == "train" else "allow"
  return policy


# How the embedded corpus is read (data/embedded.py): SentencePiece's own ids, which break ties
# between equal-scoring pieces of a run of repeated characters otherwise than tf_text's
# (seqio's, before): shards of the two never pass for each other.
EMBEDDED_READER = "spm"


def source_name(data_cfg) -> str:
  """The documents' source: C4's tfds name and version, or the embedded corpus's manifest hash."""
  if data_cfg.task == "c4_en":
    return data_cfg.tfds_name
  with open(corpus.MANIFEST_PATH, "rb") as f:
    return f"{data_cfg.task}:{hashlib.sha256(f.read()).hexdigest()[:12]}:{EMBEDDED_READER}"


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
    "source": source_name(data_cfg),
    "num_workers": num_workers,
    "assignment": description,
    "top_k": data_cfg.top_k,
    "seed": data_cfg.seed,
    "subsample": data_cfg.subsample,
    "vocab": vocab.fingerprint(vocab.resolve(task, data_cfg.vocab_path)),
  }


def _split_assignments(assign) -> dict:
  return {"train": assign, "validation": assign_lib.first_only(assign)}


def _start(data_cfg, num_workers: int, shard_dir: str, assign):
  """(assignment, wanted config, complete?) after refusing a dir written for another config."""
  if assign is None:
    assign = assign_lib.random_assignment(num_workers, seed=data_cfg.seed, top_k=data_cfg.top_k)
  want = shard_config(data_cfg, num_workers, assign)
  root = epath.Path(shard_dir)
  _check_match(root / shards.META, want, shard_dir)
  if (root / shards.META).exists():
    return assign, want, True
  # An interrupted earlier call left PENDING: finished parts are kept if it had the same config.
  _check_match(root / PENDING, want, shard_dir)
  return assign, want, False


def check_shard_dir(data_cfg, num_workers: int, shard_dir: str, assign) -> None:
  """Refuses (ConfigError) a shard dir, finished or begun, written for another config."""
  _start(data_cfg, num_workers, shard_dir, assign)


def write_shard_part(
  data_cfg,
  num_workers: int,
  shard_dir: str,
  *,
  assign=None,
  part: int = 0,
  num_parts: int = 1,
  chunk_bytes: int | None = None,
) -> None:
  """This process's part of the train and validation shards (kept if already done)."""
  assign, want, complete = _start(data_cfg, num_workers, shard_dir, assign)
  if complete:
    return
  root = epath.Path(shard_dir)
  root.mkdir(parents=True, exist_ok=True)
  if not (root / PENDING).exists():
    files.write_json(root / PENDING, want)  # Whole: other processes read it concurrently.
  from dipaco_jax.data import tasks  # pylint: disable=g-import-not-at-top

  for split, split_assign in _split_assignments(assign).items():
    if (root / split / shards.META).exists():
      continue
    kw = dict(data_dir=data_cfg.tfds_data_dir, tfds_name=data_cfg.tfds_name)
    kw.update(part=part, num_parts=num_parts)
    total = -(-tasks.part_size(data_cfg.task, split, **kw) // data_cfg.subsample)
    shard_writer.write_part(
      shard_dir,
      split,
      tasks.iter_documents(
        data_cfg.task, split, vocab_path=data_cfg.vocab_path, subsample=data_cfg.subsample, **kw
      ),
      split_assign,
      num_workers,
      part=part,
      num_parts=num_parts,
      resume=True,  # PENDING matched: a finished part holds these very documents.
      chunk_bytes=chunk_bytes,
      total=total,
    )


def wait_for_parts(shard_dir: str, num_parts: int, *, poll_s: float = 30.0) -> None:
  """Blocks until every part of the train and validation splits has its done-marker."""
  root, last = epath.Path(shard_dir), None
  while True:
    if (root / shards.META).exists():
      return
    missing = {
      s: shard_writer.missing_parts(shard_dir, s, num_parts)
      for s in SPLITS
      if not (root / s / shards.META).exists()
    }
    missing = {s: m for s, m in missing.items() if m}
    if not missing:
      return
    if missing != last:  # Says which processes it waits for, each time that changes.
      print(
        f"waiting for {sum(map(len, missing.values()))} part(s) of {shard_dir}: "
        + ", ".join(
          f"{s} {', '.join(m[:4])}{' ...' if len(m) > 4 else ''}" for s, m in missing.items()
        ),
        file=sys.stderr,
        flush=True,
      )
      last = missing
    time.sleep(poll_s)


def finish_shards(
  data_cfg, num_workers: int, shard_dir: str, *, assign=None, num_parts: int = 1
) -> shards.ShardSet:
  """Joins the parts of every split into the shard dir's metadata (process 0); opens it."""
  assign, want, complete = _start(data_cfg, num_workers, shard_dir, assign)
  if complete:
    return shards.ShardSet(shard_dir)
  root = epath.Path(shard_dir)
  sizes = {}
  for split, split_assign in _split_assignments(assign).items():
    if (root / split / shards.META).exists():
      meta = shards.check_format(shards.read_json(root / split / shards.META, shard_dir), shard_dir)
      sizes[split] = meta["tokens"]
      continue
    sizes[split] = shard_writer.finish_split(
      shard_dir,
      split,
      num_parts,
      num_workers=num_workers,
      assignment=split_assign.description,
      empty_policy=split_policy(data_cfg.empty_shard_policy, split),
    ).tolist()
  meta = {
    "format": shards.FORMAT,
    **want,
    "splits": list(SPLITS),
    "tokens": sizes,
    "tfds_data_dir": data_cfg.tfds_data_dir,
  }
  files.write_json(root / shards.META, meta)  # last: the dir is complete
  (root / PENDING).unlink()
  return shards.ShardSet(shard_dir)


@contextlib.contextmanager
def one_writer(shard_dir: str, num_parts: int = 1):
  """While one process fills a shard dir, another filling the same one waits (io/lock.py).

  Two runs sharing a data.shard_dir (or a route and a run) would write the same part
  files at once; the second finds the dir complete once the first lets go. A job of
  N processes writes its parts together by design, and gs:// has no locks: no lock.
  """
  if num_parts > 1 or files.is_remote(shard_dir):
    yield
    return
  folder, name = os.path.split(os.path.abspath(shard_dir))
  with lock.exclusive(os.path.join(folder, f".{name}.lock"), f"writing the shards {shard_dir}"):
    yield


def prepare_shards(data_cfg, num_workers: int, shard_dir: str, *, assign=None) -> shards.ShardSet:
  """Returns the run's ShardSet, writing train + validation shards first if shard_dir is new."""
  write_shard_part(data_cfg, num_workers, shard_dir, assign=assign)
  return finish_shards(data_cfg, num_workers, shard_dir, assign=assign)


def _check_match(meta_path: epath.Path, want: dict, shard_dir: str) -> None:
  if not meta_path.exists():
    return
  have = shards.read_json(meta_path, shard_dir)
  if meta_path.name == shards.META:
    shards.check_format(have, shard_dir)
  diff = {k: (have.get(k), want[k]) for k in MATCH_FIELDS if have.get(k) != want[k]}
  if diff:
    raise ConfigError(
      f"shard dir {shard_dir} was written for another config (field: (on disk, wanted)): "
      f"{diff}; point the run at a new one (--config.data.shard_dir) or remove this one: it is "
      "never overwritten."
    )
