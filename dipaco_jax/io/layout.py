"""orbax's layout of a checkpoints directory: the items of a step, the files each holds, the steps.

A checkpoints directory holds one directory per finished step, named by the
step, with one directory per item. checkpoint.py says where a run's
checkpoints directory is; the modules below it take that directory (`root`).
"""

import os

from etils import epath

CHECKSUMS = "checksums"
ITEMS = ("state", "data", "best", CHECKSUMS)
# orbax's JSON files in a step directory (the OCDBT files are checked by TensorStore).
JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")
# Files every finished step holds, by item: `state` and `data` are always saved; `best` and
# `checksums` when present (and an OCDBT item needs its manifest).
REQUIRED = {
  "state": ("_METADATA", "manifest.ocdbt"),
  "data": ("metadata",),
  "best": ("_METADATA", "manifest.ocdbt"),
  CHECKSUMS: ("metadata",),
}
ALWAYS_SAVED = ("state", "data")
# Key of the data item listing the items of its step: a step missing one of them is damaged,
# whatever it lacks (the checksums item included). Steps saved before it list none.
SAVED_ITEMS = "saved_items"


def finished_steps(root: epath.Path) -> list[int]:
  """The finished steps in a checkpoints directory, oldest first."""
  # orbax writes into a temporary name and renames to the bare step when finished.
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def kv_url(path) -> str:
  """A directory as TensorStore's key-value store base: a URL, or a local path as file://."""
  return str(path) if "://" in str(path) else "file://" + os.path.abspath(str(path))
