"""Per-worker shard storage: one ArrayRecord file per (split, worker), one record per document.

Layout of a shard dir (local or gs://):
  <split>/worker_00000.array_record ... documents routed to each worker (random access by index)
  <split>/meta.json                      tokens and docs per worker; written last = split complete
  meta.json                              what prepare_shards built it from (task, assignment, vocab)
ArrayRecord reads and writes local files only, so a gs:// shard dir is written through a local
staging dir and copied up (meta last); reading copies one worker's file to a local cache first.
"""

import hashlib
import json
import os
import shutil
import struct
import tempfile
from typing import Iterable, Sequence

import numpy as np
from array_record.python import array_record_module
from etils import epath

from dipaco_jax import errors
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab
from dipaco_jax.data.assign import Assignment
from dipaco_jax.data.document import Document

META = "meta.json"
FORMAT = 2  # 2: files and metadata count workers (worker_*.array_record, num_workers).
EMPTY_POLICIES = {
  "error": "raise, naming the empty workers, and leave the split incomplete (no meta.json)",
  "allow": "keep empty shards (size 0, so alpha 0); reading an empty worker's shard raises",
}
CACHE_DIR = os.environ.get(
  "DIPACO_SHARD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dipaco_jax", "shards")
)
_HEADER = struct.Struct("<qBH")  # doc_id, bytes per token (2 or 4), domain length


class EmptyShardError(ValueError):
  """Some worker received no document."""


def damaged(path, shard_dir, reason: str) -> errors.DamagedFileError:
  """The one-line error for an unreadable file of a shard dir, with the fix."""
  return errors.DamagedFileError(
    f"shard file {path} is damaged ({reason}); move {shard_dir} aside (mv {shard_dir} "
    f"{shard_dir}.damaged) and rerun: the shards are written again from the same assignment."
  )


def read_json(path, shard_dir) -> dict:
  """One of a shard dir's JSON files (DamagedFileError naming it if it does not parse)."""
  try:
    return json.loads(epath.Path(path).read_text())
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
    raise damaged(path, shard_dir, errors.json_problem(e)) from e


def shard_file(worker: int) -> str:
  return f"worker_{worker:05d}.array_record"


def _is_remote(path: str) -> bool:
  return "://" in str(path)


def encode(doc: Document) -> bytes:
  """One document as one record: header, domain (utf-8), token ids (uint16, or uint32 if needed)."""
  tokens = np.asarray(doc.tokens)
  if tokens.ndim != 1 or not len(tokens) or tokens[-1] != vocab.EOS_ID or tokens.min() < 0:
    raise ValueError(
      f"Document {doc.doc_id}: tokens must be a non-empty 1-D array of ids ending "
      f"with EOS ({vocab.EOS_ID}); got {tokens[-3:] if tokens.ndim else tokens}."
    )
  width = 2 if tokens.max() < 2**16 else 4
  domain = doc.domain.encode("utf-8")[: 2**16 - 1]
  dtype = np.uint16 if width == 2 else np.uint32
  return _HEADER.pack(int(doc.doc_id), width, len(domain)) + domain + tokens.astype(dtype).tobytes()


def decode(record: bytes) -> Document:
  doc_id, width, domain_len = _HEADER.unpack_from(record)
  start = _HEADER.size + domain_len
  tokens = np.frombuffer(record, np.uint16 if width == 2 else np.uint32, offset=start)
  return Document(doc_id, tokens.astype(np.int32), record[_HEADER.size : start].decode("utf-8"))


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


def write_shards(
  shard_dir: str,
  split: str,
  documents: Iterable[Document],
  assign: Assignment,
  num_workers: int,
  *,
  empty_policy: str = "error",
) -> np.ndarray:
  """Streams documents into per-worker shards of one split; returns tokens per worker [W]."""
  if split not in corpus.SPLITS:
    raise ValueError(f"Unknown split {split!r}; choose one of {corpus.SPLITS}.")
  if empty_policy not in EMPTY_POLICIES:
    raise ValueError(
      f"Unknown empty_policy {empty_policy!r}; choose one of {list(EMPTY_POLICIES)}."
    )
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1; got {num_workers}.")
  split_dir = epath.Path(shard_dir) / split
  if (split_dir / META).exists():
    raise FileExistsError(
      f"{split_dir} already holds a complete shard split; shards are written "
      "once. Use a new shard_dir, or delete this one to rewrite it."
    )
  remote = _is_remote(shard_dir)
  staging = tempfile.mkdtemp(prefix="dipaco_shards_") if remote else str(split_dir)
  os.makedirs(staging, exist_ok=True)
  writers = [
    array_record_module.ArrayRecordWriter(os.path.join(staging, shard_file(p)), "group_size:1")
    for p in range(num_workers)
  ]
  tokens_W, docs_W = np.zeros(num_workers, np.int64), np.zeros(num_workers, np.int64)
  try:
    for doc in documents:
      record = encode(doc)
      for p in _check_workers(assign(doc), doc, num_workers):
        writers[p].write(record)
        tokens_W[p] += len(doc.tokens)
        docs_W[p] += 1
  finally:
    for writer in writers:
      writer.close()
  empty = np.flatnonzero(docs_W == 0).tolist()
  if empty and empty_policy == "error":
    raise EmptyShardError(
      f"{len(empty)} of {num_workers} workers got no {split} document: {empty[:20]}. Use fewer "
      "workers, more data, another assignment, or empty_shard_policy='allow' to keep them empty."
    )
  if remote:
    split_dir.mkdir(parents=True, exist_ok=True)
    for p in range(num_workers):
      epath.Path(staging, shard_file(p)).copy(split_dir / shard_file(p), overwrite=True)
    shutil.rmtree(staging)
  meta = {
    "format": FORMAT,
    "split": split,
    "num_workers": num_workers,
    "tokens": tokens_W.tolist(),
    "docs": docs_W.tolist(),
    "empty_policy": empty_policy,
    "assignment": getattr(assign, "description", None),
  }
  (split_dir / META).write_text(json.dumps(meta, indent=1) + "\n")  # last: marks the split done
  return tokens_W


class ShardDocuments(Sequence):
  """Random access to one worker's documents of one split (len, [i], read_many)."""

  def __init__(self, filename: str, num_docs: int, shard_dir: str | None = None):
    shard_dir = shard_dir or os.path.dirname(os.path.dirname(filename))
    if not os.path.exists(filename):
      raise damaged(filename, shard_dir, "missing")
    self._reader = array_record_module.ArrayRecordReader(filename, "readahead_buffer_size:0")
    if self._reader.num_records() != num_docs:
      # A truncated ArrayRecord file loses its footer and reads as 0 records.
      raise damaged(
        filename,
        shard_dir,
        f"holds {self._reader.num_records()} documents, its meta.json says {num_docs}",
      )
    self._num_docs = num_docs

  def __len__(self) -> int:
    return self._num_docs

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.read_many(range(*index.indices(self._num_docs)))
    if not -self._num_docs <= index < self._num_docs:
      raise IndexError(f"document {index} of {self._num_docs}")
    return decode(self._reader.read([int(index) % self._num_docs])[0])

  def read_many(self, indices: Iterable[int]) -> list[Document]:
    """Several documents in one read call (faster than one by one)."""
    return [decode(r) for r in self._reader.read([int(i) for i in indices])]


class ShardSet:
  """The complete splits of a shard dir: sizes per worker and each worker's documents."""

  def __init__(self, shard_dir: str):
    self.shard_dir = str(shard_dir)
    root = epath.Path(shard_dir)
    if not root.exists():
      raise FileNotFoundError(
        f"Shard dir {shard_dir} does not exist; write it with prepare_shards (or write_shards)."
      )
    self._splits = {
      split: read_json(root / split / META, shard_dir)
      for split in corpus.SPLITS
      if (root / split / META).exists()
    }
    if not self._splits:
      raise ValueError(
        f"Shard dir {shard_dir} holds no complete split (no <split>/{META}); an "
        "interrupted write? Delete it and write it again."
      )
    num_workers = {m["num_workers"] for m in self._splits.values()}
    if len(num_workers) != 1:
      raise ValueError(f"Splits of {shard_dir} disagree on num_workers: {num_workers}.")
    self.num_workers = num_workers.pop()
    self.meta = read_json(root / META, shard_dir) if (root / META).exists() else {}
    self._open = {}

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def _split_meta(self, split: str) -> dict:
    if split not in self._splits:
      raise ValueError(
        f"Shard dir {self.shard_dir} has no complete {split!r} split; it has {self.splits}."
      )
    return self._splits[split]

  def sizes(self, split: str) -> np.ndarray:
    """Tokens per worker [num_workers]: |D_p| for the outer step's alpha weights."""
    return np.asarray(self._split_meta(split)["tokens"], np.int64)

  def num_docs(self, split: str) -> np.ndarray:
    return np.asarray(self._split_meta(split)["docs"], np.int64)

  def documents(self, worker: int, split: str) -> ShardDocuments:
    """Random access to the documents of one worker's shard."""
    num_docs = self.num_docs(split)
    if not 0 <= worker < self.num_workers:
      raise ValueError(
        f"Worker {worker} out of range: this shard set has {self.num_workers} workers."
      )
    if (worker, split) not in self._open:
      filename = os.path.join(self.shard_dir, split, shard_file(worker))
      if _is_remote(self.shard_dir):
        filename = _local_copy(filename)
      self._open[worker, split] = ShardDocuments(filename, int(num_docs[worker]), self.shard_dir)
    return self._open[worker, split]


def _local_copy(remote_file: str) -> str:
  """Copies a remote shard file into the local cache once (ArrayRecord reads local files only)."""
  key = hashlib.sha256(os.path.dirname(remote_file).encode()).hexdigest()[:16]
  local = os.path.join(CACHE_DIR, key, os.path.basename(remote_file))
  if not os.path.exists(local):
    os.makedirs(os.path.dirname(local), exist_ok=True)
    epath.Path(remote_file).copy(local + ".tmp", overwrite=True)
    os.replace(local + ".tmp", local)  # atomic: a half-copied file is never mistaken for whole
  return local
