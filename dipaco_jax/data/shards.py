"""Per-path shard storage, written in parallel: part files per (process, path), one record per doc.

Layout of a shard dir (local or gs://):
  <split>/worker_00003/part-00001-of-00002-00000.array_record  path 3's documents from process 1
                                                               of 2, chunk 0 (random access)
  <split>/parts/part-00001-of-00002.json  process 1's done-marker: its files, docs and tokens per
                                          path; written after all its files are closed and stored
  <split>/meta.json  every path's files in read order (part, then chunk); written last from all
                     done-markers = the split is complete
  meta.json          what prepare_shards built the dir from (task, source, assignment, vocab)
Each of N processes writes the documents of its contiguous 1/N of the split (`tfds.even_splits`),
so reading a path's files in part order gives the same documents in the same order for every N.
ArrayRecord writes local files only: a gs:// part is written in local chunks of at most
`REMOTE_CHUNK_BYTES`, each copied up when closed; reading copies a path's files to a local cache.
"""

import hashlib
import json
import os
import struct
import uuid
from typing import Iterable, Sequence

import numpy as np
from array_record.python import array_record_module
from etils import epath

from dipaco_jax import errors
from dipaco_jax.data import corpus
from dipaco_jax.data import vocab
from dipaco_jax.data.document import Document
from dipaco_jax.io import files

META = "meta.json"
PARTS_DIR = "parts"  # <split>/parts/part-*-of-*.json: the done-marker of each process's part
# 3: a path's shard is a list of part files (one or more per writing process); 2: one file per path.
FORMAT = 3
REMOTE_CHUNK_BYTES = 32 << 20  # local disk per open path while writing to gs:// (≤ W x this)
EMPTY_POLICIES = {
  "error": "raise, naming the empty workers, and leave the split incomplete (no meta.json)",
  "allow": "keep empty shards (size 0, so alpha 0); reading an empty worker's shard raises",
}
CACHE_DIR = os.environ.get(
  "DIPACO_SHARD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dipaco_jax", "shards")
)
_HEADER = struct.Struct("<qBH")  # doc_id, bytes per token (2 or 4), domain length


class EmptyShardError(errors.UserError, ValueError):
  """Some worker received no document."""


class IncompleteShardsError(errors.UserError, ValueError):
  """Some process's part of a split has no done-marker (still running, or it crashed)."""


class OldFormatError(errors.UserError):
  """A shard dir written by an older dipaco_jax, in a layout this version does not read."""


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


def check_format(meta: dict, shard_dir) -> dict:
  """The meta of a split or dir, refusing an older layout with the way out (nothing is deleted)."""
  have = meta.get("format", 1)
  if have != FORMAT:
    raise OldFormatError(
      f"shard dir {shard_dir} holds format-{have} shards (an older dipaco_jax: one file per "
      f"path); this version reads format {FORMAT} (part files per writing process). Move it "
      f"aside (mv {shard_dir} {shard_dir}.format{have}) and rerun to write it again; nothing in "
      "it was changed."
    )
  return meta


def part_name(part: int, num_parts: int) -> str:
  return f"part-{part:05d}-of-{num_parts:05d}"


def worker_dir(worker: int) -> str:
  return f"worker_{worker:05d}"


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


class ShardDocuments(Sequence):
  """Random access to one worker's documents of one split, over its part files in order."""

  def __init__(self, part_files: Sequence[tuple[str, int]], shard_dir: str):
    self._readers = []
    for filename, num_docs in part_files:
      if not os.path.exists(filename):
        raise damaged(filename, shard_dir, "missing")
      reader = array_record_module.ArrayRecordReader(filename, "readahead_buffer_size:0")
      if reader.num_records() != num_docs:
        # A truncated ArrayRecord file loses its footer and reads as 0 records.
        raise damaged(
          filename,
          shard_dir,
          f"holds {reader.num_records()} documents, its meta.json says {num_docs}",
        )
      self._readers.append(reader)
    self._starts = np.cumsum([0] + [n for _, n in part_files])
    self._num_docs = int(self._starts[-1])

  def __len__(self) -> int:
    return self._num_docs

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.read_many(range(*index.indices(self._num_docs)))
    if not -self._num_docs <= index < self._num_docs:
      raise IndexError(f"document {index} of {self._num_docs}")
    return self.read_many([int(index) % self._num_docs])[0]

  def read_many(self, indices: Iterable[int]) -> list[Document]:
    """Several documents, one read call per file (faster than one by one)."""
    indices = np.asarray(list(indices), np.int64).reshape(-1)
    file_of = np.searchsorted(self._starts, indices, side="right") - 1
    out = [None] * len(indices)
    for f in np.unique(file_of):
      (where,) = np.nonzero(file_of == f)
      records = self._readers[f].read([int(i) for i in indices[where] - self._starts[f]])
      for j, r in zip(where, records):
        out[j] = decode(r)
    return out


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
      split: check_format(read_json(root / split / META, shard_dir), shard_dir)
      for split in corpus.SPLITS
      if (root / split / META).exists()
    }
    self.meta = read_json(root / META, shard_dir) if (root / META).exists() else {}
    self._check_meta(root)
    if not self._splits:
      begun = [s for s in corpus.SPLITS if (root / s / PARTS_DIR).exists()]
      raise IncompleteShardsError(
        f"Shard dir {shard_dir} holds no complete split (no <split>/{META}); an interrupted "
        + (
          f"write ({begun[0]} has parts): rerun the same command, the finished parts are kept."
          if begun
          else "write? Delete it and write it again."
        )
      )
    self.num_workers = next(iter(self._splits.values()))["num_workers"]
    self._open = {}

  def _check_meta(self, root: epath.Path) -> None:
    """The splits' meta.json files against each other and the dir's: DamagedFileError if not."""
    for split in self.meta.get("splits", []):
      if split not in self._splits:
        raise damaged(
          root / split / META, self.shard_dir, f"missing, though {root / META} lists {split!r}"
        )
    listed = self.meta.get("tokens", {})
    for split, m in self._splits.items():
      where = root / split / META
      try:
        W = int(m["num_workers"])
        counts = {k: len(m[k]) for k in ("tokens", "docs", "files")}
      except (KeyError, TypeError, ValueError) as e:
        raise damaged(where, self.shard_dir, f"no valid {e} entry") from None
      if any(n != W for n in counts.values()):
        raise damaged(where, self.shard_dir, f"{counts} entries for {W} workers")
      if "num_workers" in self.meta and W != self.meta["num_workers"]:
        raise damaged(
          where, self.shard_dir, f"{W} workers, {root / META} says {self.meta.get('num_workers')}"
        )
      if split in listed and list(listed[split]) != list(m["tokens"]):
        raise damaged(where, self.shard_dir, f"its token counts differ from {root / META}'s")

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._splits)

  def _split_meta(self, split: str) -> dict:
    if split not in self._splits:
      raise IncompleteShardsError(
        f"Shard dir {self.shard_dir} has no complete {split!r} split; it has {self.splits}."
      )
    return self._splits[split]

  def sizes(self, split: str) -> np.ndarray:
    """Tokens per worker [num_workers]: |D_p| for the outer step's alpha weights."""
    return np.asarray(self._split_meta(split)["tokens"], np.int64)

  def num_docs(self, split: str) -> np.ndarray:
    return np.asarray(self._split_meta(split)["docs"], np.int64)

  def files(self, worker: int, split: str) -> list[tuple[str, int]]:
    """(file, documents) of one worker's shard in read order (paths in the shard dir)."""
    split_dir = os.path.join(self.shard_dir, split)
    return [
      (os.path.join(split_dir, rel), n) for rel, n in self._split_meta(split)["files"][worker]
    ]

  def documents(self, worker: int, split: str) -> ShardDocuments:
    """Random access to the documents of one worker's shard."""
    self._split_meta(split)
    if not 0 <= worker < self.num_workers:
      raise ValueError(
        f"Worker {worker} out of range: this shard set has {self.num_workers} workers."
      )
    if (worker, split) not in self._open:
      part_files = self.files(worker, split)
      if files.is_remote(self.shard_dir):
        part_files = [(_local_copy(f), n) for f, n in part_files]
      self._open[worker, split] = ShardDocuments(part_files, self.shard_dir)
    return self._open[worker, split]


def _local_copy(remote_file: str) -> str:
  """Copies a remote shard file into the local cache once (ArrayRecord reads local files only)."""
  key = hashlib.sha256(os.path.dirname(remote_file).encode()).hexdigest()[:16]
  local = os.path.join(CACHE_DIR, key, os.path.basename(remote_file))
  if not os.path.exists(local):
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.{uuid.uuid4().hex}.tmp"  # Its own: runs on one host copy it at once.
    epath.Path(remote_file).copy(tmp, overwrite=True)
    os.replace(tmp, local)  # atomic: a half-copied file is never mistaken for whole
  return local
