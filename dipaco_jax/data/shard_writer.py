"""Writing shards in parallel: each process streams its part of a split; one step joins the parts.

Every one of N processes (`write_part(..., part=i, num_parts=N)`) routes the documents of
its contiguous 1/N of the split and writes one file per path (`shards.py` has the layout)
straight to the shard dir, then its done-marker; `finish_split` (process 0, once all
markers exist) writes the split's meta.json. A part without a marker is rewritten whole
on a rerun; finished parts are kept.
"""

import os
import re
import shutil
import tempfile
import time
from typing import Iterable, Sequence

import numpy as np
from array_record.python import array_record_module
from etils import epath

from dipaco_jax.data import corpus
from dipaco_jax.data import shards
from dipaco_jax.data.assign import Assignment
from dipaco_jax.data.document import Document
from dipaco_jax.data.shards import EMPTY_POLICIES
from dipaco_jax.data.shards import META
from dipaco_jax.data.shards import PARTS_DIR
from dipaco_jax.data.shards import EmptyShardError
from dipaco_jax.data.shards import IncompleteShardsError
from dipaco_jax.data.shards import part_name
from dipaco_jax.io import files
from dipaco_jax.io import progress

_WRITE_COMMAND = "python -m dipaco_jax.route --config=... --workdir=... "


def _check_workers(workers: Sequence[int], doc: Document, num_workers: int) -> list[int]:
  workers = [int(w) for w in workers]
  if not workers:
    raise ValueError(
      f"The assignment returned no worker for document {doc.doc_id}; every document "
      "needs at least one worker."
    )
  if len(set(workers)) != len(workers) or not all(0 <= w < num_workers for w in workers):
    raise ValueError(
      f"The assignment returned {workers} for document {doc.doc_id}; it must return "
      f"distinct worker ids in [0, {num_workers})."
    )
  return workers


def _assigned(documents: Iterable[Document], assign: Assignment):
  """(doc, workers) pairs; an assignment with `assign_batch` is asked a batch at a time."""
  batch_fn = getattr(assign, "assign_batch", None)
  if batch_fn is None:
    for doc in documents:
      yield doc, assign(doc)
    return
  batch, size = [], int(getattr(assign, "batch_size", 512))
  for doc in documents:
    batch.append(doc)
    if len(batch) == size:
      yield from zip(batch, batch_fn(batch))
      batch = []
  if batch:
    yield from zip(batch, batch_fn(batch))


class _PathWriter:
  """One path's files of one part: chunks of at most chunk_bytes, each stored when closed."""

  def __init__(self, split_dir: epath.Path, name: str, staging: str | None, chunk_bytes):
    self.split_dir, self.name, self.staging = split_dir, name, staging
    self.chunk_bytes = chunk_bytes
    self.files: list[list] = []  # [relative path, documents] per closed chunk, in order
    self._writer, self._bytes, self._docs = None, 0, 0

  def write(self, record: bytes) -> None:
    if self._writer is None:
      rel = f"{self.name}-{len(self.files):05d}.array_record"
      self._rel, self._local = rel, self._local_path(rel)
      self._writer = array_record_module.ArrayRecordWriter(self._local, "group_size:1")
    self._writer.write(record)
    self._bytes += len(record)
    self._docs += 1
    if self.chunk_bytes and self._bytes >= self.chunk_bytes:
      self.close()

  def _local_path(self, rel: str) -> str:
    if self.staging is None:
      (self.split_dir / rel).parent.mkdir(parents=True, exist_ok=True)
      return str(self.split_dir / rel)
    return os.path.join(self.staging, rel.replace("/", "_"))

  def close(self) -> None:
    if self._writer is None:
      return
    self._writer.close()
    if self.staging is not None:  # Copied up and dropped: local disk holds open chunks only.
      epath.Path(self.split_dir / self._rel).parent.mkdir(parents=True, exist_ok=True)
      epath.Path(self._local).copy(self.split_dir / self._rel, overwrite=True)
      os.remove(self._local)
    self.files.append([self._rel, self._docs])
    self._writer, self._bytes, self._docs = None, 0, 0


def _progress(documents, total, desc: str):
  return progress.bar(documents, total=total, desc=desc, unit="doc")


def write_part(
  shard_dir: str,
  split: str,
  documents: Iterable[Document],
  assign: Assignment,
  num_workers: int,
  *,
  part: int = 0,
  num_parts: int = 1,
  resume: bool = False,
  chunk_bytes: int | None = None,
  total: int | None = None,
) -> dict:
  """Streams one process's documents into its part files of every path; returns its done-marker.

  resume=True keeps a part whose done-marker exists with the same assignment (the caller
  vouches the documents are the same); otherwise the part is written again. chunk_bytes
  bounds each file (default: REMOTE_CHUNK_BYTES on gs://, unbounded locally); total is the
  expected number of documents, for the progress bar's ETA.
  """
  if split not in corpus.SPLITS:
    raise ValueError(f"Unknown split {split!r}; choose one of {corpus.SPLITS}.")
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1; got {num_workers}.")
  if not 0 <= part < num_parts:
    raise ValueError(f"part {part} of {num_parts}: need 0 <= process_index < num_processes.")
  split_dir = epath.Path(shard_dir) / split
  if (split_dir / META).exists():
    raise FileExistsError(
      f"{split_dir} already holds a complete shard split; shards are written "
      "once. Use a new shard_dir, or delete this one to rewrite it."
    )
  description = getattr(assign, "description", None)
  name = part_name(part, num_parts)
  marker_path = split_dir / PARTS_DIR / f"{name}.json"
  if marker_path.exists():
    marker = shards.read_json(marker_path, shard_dir)
    if resume and marker.get("assignment") == description and marker["num_workers"] == num_workers:
      return marker
    marker_path.unlink()  # First: a crash while rewriting must not leave a stale marker.
  remote = files.is_remote(shard_dir)
  if chunk_bytes is None and remote:
    chunk_bytes = shards.REMOTE_CHUNK_BYTES
  staging = tempfile.mkdtemp(prefix="dipaco_shards_") if remote else None
  writers = [
    _PathWriter(split_dir, f"{shards.worker_dir(w)}/{name}", staging, chunk_bytes)
    for w in range(num_workers)
  ]
  tokens_W, docs_W = np.zeros(num_workers, np.int64), np.zeros(num_workers, np.int64)
  start, seen = time.time(), 0
  desc = f"shards {split} {name}"
  try:
    for doc, workers in _assigned(_progress(documents, total, desc), assign):
      record = shards.encode(doc)
      seen += 1
      for p in _check_workers(workers, doc, num_workers):
        writers[p].write(record)
        tokens_W[p] += len(doc.tokens)
        docs_W[p] += 1
    for writer in writers:
      writer.close()
  finally:
    if staging is not None:
      shutil.rmtree(staging, ignore_errors=True)
  marker = {
    "format": shards.FORMAT,
    "split": split,
    "part": part,
    "num_parts": num_parts,
    "num_workers": num_workers,
    "assignment": description,
    "tokens": tokens_W.tolist(),
    "docs": docs_W.tolist(),
    "files": [w.files for w in writers],
    "source_docs": seen,
    "seconds": round(time.time() - start, 3),
  }
  (split_dir / PARTS_DIR).mkdir(parents=True, exist_ok=True)
  files.write_json(marker_path, marker)  # last: this part is done
  return marker


def missing_parts(shard_dir: str, split: str, num_parts: int) -> list[str]:
  """Names of the parts of a split whose done-marker does not exist yet."""
  parts = epath.Path(shard_dir) / split / PARTS_DIR
  return [
    part_name(i, num_parts)
    for i in range(num_parts)
    if not (parts / f"{part_name(i, num_parts)}.json").exists()
  ]


def finish_split(
  shard_dir: str,
  split: str,
  num_parts: int,
  *,
  num_workers: int,
  assignment: str | None,
  empty_policy: str = "error",
) -> np.ndarray:
  """Writes a split's meta.json from all its parts' done-markers; returns tokens per worker."""
  if empty_policy not in EMPTY_POLICIES:
    raise ValueError(
      f"Unknown empty_policy {empty_policy!r}; choose one of {list(EMPTY_POLICIES)}."
    )
  split_dir = epath.Path(shard_dir) / split
  other = sorted(
    p.name
    for p in (split_dir / PARTS_DIR).glob("part-*.json")
    if not p.name.endswith(f"-of-{num_parts:05d}.json")
  )
  if other:
    raise IncompleteShardsError(
      f"{split_dir} holds parts of a job with another number of processes ({other[0]}); "
      f"rerun with that --num_processes, or point the run at a new shard dir (this one is kept)."
    )
  missing = missing_parts(shard_dir, split, num_parts)
  if missing:
    indices = ",".join(str(i) for i in part_indices(missing))
    raise IncompleteShardsError(
      f"{split_dir} is incomplete: {len(missing)} of {num_parts} parts have no done-marker "
      f"({split_dir / PARTS_DIR / missing[0]}.json ...): their process is still running or "
      f"crashed. Rerun process(es) {indices} ({_WRITE_COMMAND}--num_processes={num_parts} "
      "--process_id=I); the finished parts are kept."
    )
  markers = [
    shards.read_json(split_dir / PARTS_DIR / f"{part_name(i, num_parts)}.json", shard_dir)
    for i in range(num_parts)
  ]
  for m in markers:
    if m["num_workers"] != num_workers or m.get("assignment") != assignment:
      raise ValueError(
        f"{split_dir}: part {m['part']} was written for num_workers={m['num_workers']}, "
        f"assignment {m.get('assignment')!r}, not {num_workers}, {assignment!r}. Point the run "
        "at a new shard dir (this one is kept)."
      )
  tokens_W = np.sum([m["tokens"] for m in markers], axis=0, dtype=np.int64)
  docs_W = np.sum([m["docs"] for m in markers], axis=0, dtype=np.int64)
  empty = np.flatnonzero(docs_W == 0).tolist()
  if empty and empty_policy == "error":
    raise EmptyShardError(
      f"{len(empty)} of {num_workers} workers got no {split} document: {empty[:20]}. Use fewer "
      "workers, more data, another assignment, or empty_shard_policy='allow' to keep them empty."
    )
  meta = {
    "format": shards.FORMAT,
    "split": split,
    "num_workers": num_workers,
    "num_parts": num_parts,
    "tokens": tokens_W.tolist(),
    "docs": docs_W.tolist(),
    "empty_policy": empty_policy,
    "assignment": assignment,
    "files": [[f for m in markers for f in m["files"][w]] for w in range(num_workers)],
  }
  files.write_json(split_dir / META, meta)  # last: marks the split done
  return tokens_W


def write_shards(
  shard_dir: str,
  split: str,
  documents: Iterable[Document],
  assign: Assignment,
  num_workers: int,
  *,
  empty_policy: str = "error",
  chunk_bytes: int | None = None,
) -> np.ndarray:
  """Streams documents into per-worker shards of one split (one process); tokens per worker [W]."""
  if empty_policy not in EMPTY_POLICIES:
    raise ValueError(
      f"Unknown empty_policy {empty_policy!r}; choose one of {list(EMPTY_POLICIES)}."
    )
  write_part(shard_dir, split, documents, assign, num_workers, chunk_bytes=chunk_bytes)
  return finish_split(
    shard_dir,
    split,
    1,
    num_workers=num_workers,
    assignment=getattr(assign, "description", None),
    empty_policy=empty_policy,
  )


def part_indices(names: Sequence[str]) -> list[int]:
  """Process indices of part names ("part-00003-of-00008" -> 3)."""
  return [int(re.match(r"part-(\d+)-of-", n).group(1)) for n in names]
