"""Shards cached across workdirs by their fingerprint: a second run on the same data starts at once.

A shard dir's content is fixed by `prepare.shard_config` (task, source and its
version or hash, workers, assignment with its router's array hash, top-k, seed,
subsample, tokenizer fingerprint). The cache keeps one complete copy per
fingerprint under `<cache>/shard_sets/<sha256 of it>`; a run whose shard dir is
empty copies a matching entry in instead of tokenizing and routing again, and a
run that writes a new shard dir adds it. The run's workdir stays
self-contained (evaluate, serve and the notebook read it as before).

config.data.shard_cache: "auto" (the default) is $DIPACO_CACHE_DIR, else
$XDG_CACHE_HOME/dipaco_jax, else ~/.cache/dipaco_jax; "off" turns it off; any
other value is the cache folder (a local path or gs://). Only one-process runs
use it: the hosts of a multi-host job do not share a local cache.

Copies are whole or invisible: into a local folder through a temporary name and
one rename; into an object store file by file with every meta.json last, so a
cut copy reads as an unfinished shard dir (which the writer completes).
"""

import hashlib
import json
import os
import uuid

from etils import epath

from dipaco_jax.data import assign as assign_lib
from dipaco_jax.data import prepare
from dipaco_jax.data import shards
from dipaco_jax.io import files

OFF = "off"
AUTO = "auto"


def cache_root(setting: str) -> epath.Path | None:
  """The cache folder of config.data.shard_cache, or None when off."""
  if setting == OFF:
    return None
  if setting == AUTO:
    base = files.user_cache_dir()
  else:
    base = setting
  return epath.Path(base) / "shard_sets"  # shards.CACHE_DIR (remote reads) is ./shards.


def fingerprint(data_cfg, num_workers: int, assign=None) -> str:
  """The cache key of the shard dir these arguments write (prepare.shard_config, hashed)."""
  if assign is None:
    assign = assign_lib.random_assignment(num_workers, seed=data_cfg.seed, top_k=data_cfg.top_k)
  want = prepare.shard_config(data_cfg, num_workers, assign)
  return hashlib.sha256(json.dumps(want, sort_keys=True).encode()).hexdigest()[:24]


def _complete(root: epath.Path) -> bool:
  return (root / shards.META).exists()


def _files(d: epath.Path) -> list[epath.Path]:
  """Every file under d (a shard dir is three levels deep; epath has no recursive glob on gs://)."""
  out = []
  for p in d.iterdir():
    out.extend(_files(p) if p.is_dir() else [p])
  return out


def _metas_last(src: epath.Path) -> list[epath.Path]:
  """Every file under src, data files first, then part markers, split metas, the dir's meta."""
  rank = lambda p: (
    p.name == shards.META and p.parent == src,
    p.name == shards.META,
    shards.PARTS_DIR in p.relative_to(src).parts,
    os.fspath(p),
  )
  return sorted(_files(src), key=rank)


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
  """Copies a complete shard dir to dst (absent), whole or invisibly (module docstring)."""
  remote = files.is_remote(dst)
  target = dst if remote else dst.parent / f".{dst.name}.{uuid.uuid4().hex}.tmp"
  for f in _metas_last(src):
    out = target / f.relative_to(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    f.copy(out, overwrite=True)
  if not remote:
    try:
      target.rename(dst)
    except OSError:  # Another run stored or fetched the same entry first: keep theirs.
      target.rmtree()


def fetch(setting: str, data_cfg, num_workers: int, shard_dir: str, assign=None) -> bool:
  """Copies the cached shards into shard_dir if it holds none; whether it did."""
  root = cache_root(setting)
  dst = epath.Path(shard_dir)
  if root is None or dst.exists() and any(dst.iterdir()):
    return False  # Off, or the run's own shards (whole or partly written) come first.
  entry = root / fingerprint(data_cfg, num_workers, assign)
  if not _complete(entry):
    return False
  if dst.exists():
    dst.rmdir()  # Empty: the rename below needs the name free.
  _copy_tree(entry, dst)
  return True


def store(setting: str, data_cfg, num_workers: int, shard_dir: str, assign=None) -> bool:
  """Adds the complete shard_dir to the cache unless its entry exists; whether it did."""
  root = cache_root(setting)
  src = epath.Path(shard_dir)
  if root is None or not _complete(src):
    return False
  entry = root / fingerprint(data_cfg, num_workers, assign)
  if _complete(entry):
    return False
  root.mkdir(parents=True, exist_ok=True)
  _copy_tree(src, entry)
  return True
