"""Elastic mode's shared storage: per-module and per-worker items under `<workdir>/elastic/`.

Every item is written whole (files.write_bytes: a temporary name renamed into
place, or one object upload on gs://), so a reader sees the old item or the
new one, never half of one. Arrays go to
`.npz` files read with `allow_pickle=False`; small records are JSON. Nothing
here unpickles. Layout (t = outer steps applied, i.e. the phase that reads it):

  store/<group>/m<e>/v<t>.npz      module e of a store group after t outer steps
  store/<group>/m<e>/opt<t>.npz    its outer momentum
  store/<group>/m<e>/u<t>.npz      outer.compression: the update v<t> − v<s>, codes and scales
                                   (v<t> = v<s> + decoded u<t>: what a worker holding v<s> reads,
                                   downlink.py; s = t-1, streamed the module's version before)
  workers/w<w>/opt<t>.npz          worker w's AdamW state at the start of phase t
  workers/w<w>/data<t>.json        its data position at the start of phase t
  workers/w<w>/out<t>/delta_<group>.npz  its delta θ_module − θ_w after phase t-1's inner steps
                                   (outer.compression: its codes and scales, core/compression.py)
  workers/w<w>/out<t>/ef_<group>.npz     its error-feedback residual after phase t-1 (float32)
  workers/w<w>/out<t>/done.json    written last: the task's outputs are complete
  workers/w<w>/progress<t>/s<i>/   task (t, w)'s params, AdamW state, data after i of H steps
  workers/w<w>/progress<t>/at.json written last: the newest complete s<i> (removed when done)
  alpha_phase<k>.json              routing phase k's α (k >= 1; phase 0's is in meta.json)
  scores_phase<k>/p<p>.npz         path p's scores of the router split for re-shard k (its task)
  coordinator.json, coordinator/results<t>.json, executors/x<i>.json, meta.json
  tasks.jsonl (+ tasks-<i>.jsonl)  the task log: one JSON line per event (parts on gs://)

Every JSON item carries a crc32 of its text ({"crc32": ..., "json": ...}) and every
.npz a CRC-32 per array (the zip format's, checked as it is read), so a truncated
file or a flipped byte is seen when it is read: one DamagedFileError naming the file
and what to do (`damaged`: move it, or its task's outputs, aside and rerun the same
command, which writes the same bytes again; repair.py rebuilds what was moved).
"""

# JAX and TensorBoard's protos (summaries) are imported where trees and the task log are
# touched: the coordinator actor reads and writes JSON only, and starts without them.
# pylint: disable=g-import-not-at-top

import functools
import io
import json
import os
import re
import zipfile
import zlib

import numpy as np
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import files
from dipaco_jax.types import PyTree

ROOT = "elastic"


def root(workdir: str) -> epath.Path:
  return epath.Path(workdir) / ROOT


def module_file(workdir: str, group: str, module: int, version: int, kind: str = "v") -> epath.Path:
  """Module params (kind "v"), its outer momentum ("opt") or its compressed update ("u")."""
  return root(workdir) / "store" / group / f"m{module}" / f"{kind}{version:05d}.npz"


def worker_dir(workdir: str, worker: int) -> epath.Path:
  return root(workdir) / "workers" / f"w{worker}"


def worker_opt_file(workdir: str, worker: int, phase: int) -> epath.Path:
  return worker_dir(workdir, worker) / f"opt{phase:05d}.npz"


def worker_data_file(workdir: str, worker: int, phase: int) -> epath.Path:
  return worker_dir(workdir, worker) / f"data{phase:05d}.json"


def worker_out_dir(workdir: str, worker: int, phase: int) -> epath.Path:
  """Outputs of task (phase - 1, worker): its deltas, AdamW state, data position, done.json."""
  return worker_dir(workdir, worker) / f"out{phase:05d}"


def delta_file(workdir: str, worker: int, phase: int, group: str) -> epath.Path:
  """Task (phase - 1, worker)'s delta of `group`: its module at version phase-1 minus its params.

  What crosses the slow network from a worker: the outer executors average these
  (the pseudo-gradient) into each module's outer step.
  """
  return worker_out_dir(workdir, worker, phase) / f"delta_{group}.npz"


def ef_file(workdir: str, worker: int, phase: int, group: str) -> epath.Path:
  """Task (phase - 1, worker)'s error-feedback residual of `group` (outer.error_feedback).

  What its codes dropped, added to its next delta by task (phase, worker); none before phase 1.
  """
  return worker_out_dir(workdir, worker, phase) / f"ef_{group}.npz"


def progress_dir(workdir: str, worker: int, phase: int) -> epath.Path:
  """Task (phase, worker)'s mid-task saves (elastic.progress_every_steps)."""
  return worker_dir(workdir, worker) / f"progress{phase:05d}"


def alpha_file(workdir: str, routing_phase: int) -> epath.Path:
  """α of discriminative routing phase k >= 1 (the driver writes it at the re-shard)."""
  return root(workdir) / f"alpha_phase{routing_phase}.json"


def scores_file(workdir: str, routing_phase: int, path: int) -> epath.Path:
  """Path `path`'s scores of the router split, for the re-shard into routing phase k."""
  return root(workdir) / f"scores_phase{routing_phase}" / f"p{path:05d}.npz"


def numbered(folder: epath.Path, prefix: str, suffix: str = ".json") -> dict[int, epath.Path]:
  """Files `<prefix><n><suffix>` of `folder` (none if it is missing), keyed by n, in order."""
  if not folder.exists():
    return {}
  found = {int(f.name[len(prefix) : -len(suffix)]): f for f in folder.glob(f"{prefix}*{suffix}")}
  return dict(sorted(found.items()))


def _write_atomic(path: epath.Path, data: bytes) -> None:
  files.write_bytes(path, data)  # Whole; several writers of the same bytes are fine.


# What reading a file of elastic storage can fail with when its bytes are not what was written:
# a cut or corrupted zip (BadZipFile, "Bad CRC-32"), a bad .npy header or JSON (ValueError),
# a stream that ends early (EOFError), a compressed member that does not inflate (zlib.error).
_UNREADABLE = (zipfile.BadZipFile, ValueError, EOFError, zlib.error, KeyError)


def _action(path: epath.Path, workdir: epath.Path) -> str:
  """What to do about a damaged file of elastic storage: the move, and what the rerun redoes."""
  rel = os.path.relpath(os.fspath(path), os.fspath(workdir / ROOT))
  aside = lambda p: f"move {p} aside (mv {p} {p}.damaged)"
  rerun = "and rerun the same command"
  if m := re.fullmatch(r"store/[^/]+/m\d+/(v|opt|u)(\d+)\.npz", rel):
    t = int(m.group(2))
    how = (
      f"rebuilds it from version {t - 1} and phase {t - 1}'s deltas"
      if t
      else "writes version 0 again from the run's initial parameters"
    )
    return f"{aside(path)} {rerun}: the driver {how}"
  if m := re.fullmatch(r"workers/w(\d+)/(?:out(\d+)/.*|opt(\d+)\.npz|data(\d+)\.json)", rel):
    w, t = int(m.group(1)), int(next(g for g in m.groups()[1:] if g is not None))
    out = worker_out_dir(os.fspath(workdir), w, t)
    return (
      f"{aside(out)} {rerun}: task (phase {t - 1}, worker {w}) runs again and writes the same bytes"
    )
  if m := re.fullmatch(r"workers/w(\d+)/progress(\d+)/.*", rel):
    w, t = int(m.group(1)), int(m.group(2))
    folder = progress_dir(os.fspath(workdir), w, t)
    return f"{aside(folder)} {rerun}: task (phase {t}, worker {w}) starts from its first step"
  if m := re.fullmatch(r"scores_phase(\d+)/p(\d+)\.npz", rel):
    return f"{aside(path)} {rerun}: path {int(m.group(2))} scores the router split again"
  if re.fullmatch(r"coordinator/results\d+\.json", rel):
    return f"{aside(path)} {rerun}: that phase's tasks run again and write the same bytes"
  if rel == "coordinator.json":
    return f"{aside(path)} {rerun}: the queue is rebuilt from its results and the store"
  if re.fullmatch(r"executors/x\d+(?:\.json|/.*)", rel):
    return f"{aside(path)} {rerun}: the executor's reports are sent to it again"
  if re.fullmatch(r"alpha_phase\d+\.json", rel) or rel == "meta.json":
    return f"{aside(path)} {rerun}: the driver writes it again"
  return f"{aside(path)} {rerun}"


def damaged(path: epath.Path, reason: str) -> errors.DamagedFileError:
  """The one-line error for a file of elastic storage that cannot be read as written."""
  path = epath.Path(path)
  workdir = next((p for p in path.parents if p.name == ROOT), None)
  action = _action(path, workdir.parent) if workdir is not None else f"move {path} aside"
  return errors.DamagedFileError(f"elastic storage file {path} is damaged ({reason}); {action}.")


def _read_bytes(path: epath.Path) -> bytes:
  try:
    return epath.Path(path).read_bytes()
  except FileNotFoundError:
    raise damaged(path, "missing") from None


def _reason(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _npz(path: epath.Path) -> dict[str, np.ndarray]:
  """Every array of an .npz, read whole (so each member's CRC-32 is checked)."""
  try:
    with np.load(io.BytesIO(_read_bytes(path)), allow_pickle=False) as z:
      return {k: z[k] for k in z.files}
  except _UNREADABLE as e:
    raise damaged(path, _reason(e)) from None


def _keys(tree: PyTree) -> list[str]:
  import jax

  return [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save_tree(path: epath.Path, tree: PyTree) -> None:
  """Leaves of `tree` to one .npz, keyed by their tree path."""
  import jax

  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  buf = io.BytesIO()
  np.savez(buf, **{jax.tree_util.keystr(kp): np.asarray(x) for kp, x in flat})
  _write_atomic(path, buf.getvalue())


def load_tree(path: epath.Path, template: PyTree) -> PyTree:
  """The .npz at `path` as a tree shaped like `template` (shapes and dtypes checked)."""
  import jax

  arrays = _npz(path)
  leaves = []
  for key, t in zip(_keys(template), jax.tree.leaves(template)):
    if key not in arrays:
      raise errors.UserError(
        f"{path} has no array {key}: it was written by another model or grid; use a new --workdir."
      )
    x = arrays[key]
    if tuple(x.shape) != tuple(t.shape) or x.dtype != np.dtype(t.dtype):
      raise errors.UserError(
        f"{path}: {key} is {x.dtype}{list(x.shape)}, expected "
        f"{np.dtype(t.dtype)}{list(t.shape)}; use a new --workdir."
      )
    leaves.append(x)
  return jax.tree.unflatten(jax.tree.structure(template), leaves)


def size(path: epath.Path) -> int:
  """A stored item's bytes."""
  return int(path.stat().length)


def save_array(path: epath.Path, x: np.ndarray) -> None:
  """One array to an .npz (any shape: the reader takes what is there)."""
  buf = io.BytesIO()
  np.savez(buf, x=np.asarray(x))
  _write_atomic(path, buf.getvalue())


def load_array(path: epath.Path) -> np.ndarray:
  arrays = _npz(path)
  if "x" not in arrays:
    raise damaged(path, f"holds {sorted(arrays)}, not the array x")
  return arrays["x"]


def _crc(text: str) -> str:
  return f"{zlib.crc32(text.encode()):08x}"


def save_json(path: epath.Path, obj) -> None:
  """`obj` as JSON with a crc32 of its text: {"crc32": ..., "json": obj}."""
  text = json.dumps(obj, sort_keys=True)
  _write_atomic(path, json.dumps({"crc32": _crc(text), "json": obj}, sort_keys=True).encode())


def load_json(path: epath.Path, *, checksum: bool = True):
  """What save_json wrote, its crc32 checked; `checksum=False` also reads plain JSON (old runs)."""
  try:
    found = json.loads(_read_bytes(path))
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
    raise damaged(path, errors.json_problem(e)) from None
  if not (isinstance(found, dict) and found.keys() == {"crc32", "json"}):
    if not checksum:
      return found
    raise damaged(path, "no crc32: it is not as this version writes it")
  text = json.dumps(found["json"], sort_keys=True)
  if _crc(text) != found["crc32"]:
    raise damaged(path, f"crc32 {_crc(text)} read, {found['crc32']} written")
  return found["json"]


TASK_LOG_PART_BYTES = 1 << 16  # gs://: the newest part of the task log, rewritten per event.


def task_log_part(workdir: str, i: int) -> epath.Path:
  """Part i of the task log: tasks.jsonl, then tasks-00001.jsonl, ... (object stores only)."""
  return root(workdir) / ("tasks.jsonl" if i == 0 else f"tasks-{i:05d}.jsonl")


def _end_torn_line(path: epath.Path) -> None:
  """Ends the last line of a local log if a kill left it without its newline."""
  if not path.exists():
    return
  with path.open("rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() == 0:
      return
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
  if last != b"\n":
    with path.open("ab") as f:
      f.write(b"\n")


class TaskLog:
  """The run's task log, the driver its one writer: summaries.AppendLog's parts on gs://.

  An object store cannot append (gcsfs turns mode "a" into an overwrite), so
  there the log is a sequence of parts, each rewritten whole. Locally it is one
  file; a line torn by a kill is ended before the next run appends, so only
  that line is lost (readers skip it).
  """

  def __init__(self, workdir: str):
    from dipaco_jax.io import summaries

    part = functools.partial(task_log_part, str(workdir))
    if summaries.appends_in_place(part(0)):
      _end_torn_line(part(0))
    self._log = summaries.AppendLog(part, part_bytes=TASK_LOG_PART_BYTES)

  def append(self, obj) -> None:
    self._log.append((json.dumps(obj, sort_keys=True) + "\n").encode())

  def close(self) -> None:
    self._log.close()


def read_task_log(workdir: str) -> list[dict]:
  """Every event of the task log, in order; a line torn by a kill mid-write is skipped."""
  from dipaco_jax.io import summaries

  out = []
  for part in summaries.existing_parts(functools.partial(task_log_part, str(workdir))):
    for line in part.read_text().splitlines():
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out
