"""The embedded multi-domain corpus shipped in `assets/corpus` (read without TensorFlow)."""

import json
import lzma
import os
from typing import Iterator

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
CORPUS_DIR = os.path.join(ASSETS_DIR, "corpus")
MANIFEST_PATH = os.path.join(CORPUS_DIR, "manifest.json")
DOCS_FILE = "documents.jsonl.xz"  # one per domain: CORPUS_DIR/<domain>/documents.jsonl.xz
LICENSE_FILE = "LICENSE.txt"  # the source's license notice, beside its data
SPLITS = ("train", "validation", "router")
# Domain -> what it is; the order fixes doc ids (build_corpus.py numbers documents in this order).
DOMAINS = {
  "novels": "Jane Austen's six novels, one document per chapter",
  "scripture": "King James Bible, one document per chapter",
  "plays": "Shakespeare's plays (one document per scene) and poems",
  "aphorisms": "BSD fortune cookies, one document per fortune",
  "python_docs": "Python 3.11 documentation sources (reStructuredText)",
  "perl_docs": "Perl 5.36 documentation (POD)",
  "kernel_docs": "Linux 6.1 kernel documentation (reStructuredText)",
}


def domain_path(domain: str, name: str = DOCS_FILE, corpus_dir: str = CORPUS_DIR) -> str:
  """Path of one domain's shipped file."""
  return os.path.join(corpus_dir, domain, name)


def check_files(corpus_dir: str = CORPUS_DIR) -> None:
  """Raises one clear error if a shipped corpus file is missing."""
  missing = [
    domain_path(d, corpus_dir=corpus_dir)
    for d in DOMAINS
    if not os.path.exists(domain_path(d, corpus_dir=corpus_dir))
  ]
  if missing:
    raise FileNotFoundError(
      f"Embedded corpus file(s) missing: {missing}. Reinstall dipaco_jax, or rebuild them with "
      "`python tools/build_corpus.py --src DIR --fetch`."
    )


def read_records(split: str | None = None, *, corpus_dir: str = CORPUS_DIR) -> Iterator[dict]:
  """Yields {doc_id, domain, split, title, text} of the shipped corpus in doc_id order."""
  if split is not None and split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; the embedded corpus has splits {SPLITS}.")
  check_files(corpus_dir)
  for domain in DOMAINS:
    with lzma.open(domain_path(domain, corpus_dir=corpus_dir), "rt", encoding="utf-8") as f:
      for line in f:
        record = json.loads(line)
        if split is None or record["split"] == split:
          yield record
