"""The DiPaCo grid: levels of modules, parameter groups, paths and workers.

A *level* owns parameter groups (`embed`, `block_i`, `head`) and holds K_l
alternative modules. A *path* picks one module per level. A group may instead
be *path-specific*: one private copy per path. Dense, DiLoCo and flat MoE are
grids too (one level, K=1 or K=P). Each path may be trained by several
*replicas* (DiLoCo workers with different data); the leading axis of every
per-path array runs over these workers, so a worker is the unit of the inner
loop and the outer step averages over workers.

The store holds one *store group* per (level, group) with a leading K_l axis;
a path-specific group is a store group whose "level" has one module per path.
"""

import dataclasses
import itertools
import re
from typing import Sequence

import numpy as np

from dipaco_jax.errors import ConfigError

PRIVATE = "private"


class TopologyError(ConfigError):
  """An invalid grid description (config.dipaco)."""


@dataclasses.dataclass(frozen=True)
class StoreGroup:
  """One parameter group in the store: K modules, and which one each worker uses."""

  name: str  # Model parameter group, e.g. "block_3".
  level: str  # Level name ("level_0", ...) or PRIVATE.
  module_of_worker: np.ndarray  # [W] int: module index used by each worker.
  num_modules: int  # K: leading size of this group in the store.


@dataclasses.dataclass(frozen=True)
class Topology:
  """A validated grid: levels, paths, workers and the store layout."""

  groups: tuple[str, ...]  # All model groups, in model order.
  level_groups: tuple[tuple[str, ...], ...]  # Shared (non-private) groups per level.
  modules_per_level: tuple[int, ...]  # K_l.
  private_groups: tuple[str, ...]  # Path-specific groups.
  paths: np.ndarray  # [P, L] module id per level for each distinct path.
  replicas: int  # Workers per path.

  @property
  def num_levels(self) -> int:
    return len(self.modules_per_level)

  @property
  def num_paths(self) -> int:
    return int(self.paths.shape[0])

  @property
  def num_workers(self) -> int:
    return self.num_paths * self.replicas

  @property
  def path_of_worker(self) -> np.ndarray:
    """[W] path index of each worker; replicas of a path are adjacent."""
    return np.repeat(np.arange(self.num_paths), self.replicas)

  @property
  def worker_modules(self) -> np.ndarray:
    """[W, L] module id per level for each worker."""
    return self.paths[self.path_of_worker]

  def level_name(self, l: int) -> str:
    return f"level_{l}"

  def store_groups(self) -> tuple[StoreGroup, ...]:
    """Every group of the store, with the module each worker reads from it."""
    out, wm = [], self.worker_modules
    for l, names in enumerate(self.level_groups):
      for g in names:
        out.append(StoreGroup(g, self.level_name(l), wm[:, l], self.modules_per_level[l]))
    for g in self.private_groups:
      out.append(StoreGroup(g, PRIVATE, self.path_of_worker, self.num_paths))
    order = {g: i for i, g in enumerate(self.groups)}
    return tuple(sorted(out, key=lambda s: order[s.name]))

  def path_label(self, p: int) -> str:
    return "-".join(str(int(m)) for m in self.paths[p])

  def worker_labels(self) -> list[str]:
    """Each worker's path label, with `/r<i>` for its replica when paths have several."""
    return [
      self.path_label(int(p)) + (f"/r{w % self.replicas}" if self.replicas > 1 else "")
      for w, p in enumerate(self.path_of_worker)
    ]

  def module_labels(self) -> dict[str, list[str]]:
    """Each level's module names: `module_<k>`, or `path_<label>` for the private copies."""
    out = {}
    for s in self.store_groups():
      if s.level == PRIVATE:
        out[s.level] = [f"path_{self.path_label(p)}" for p in range(s.num_modules)]
      else:
        out[s.level] = [f"module_{k}" for k in range(s.num_modules)]
    return out

  def describe(self) -> str:
    grid = "x".join(str(k) for k in self.modules_per_level)
    return (
      f"grid {grid}: {self.num_paths} paths x {self.replicas} replicas = "
      f"{self.num_workers} workers; private groups: "
      f"{','.join(self.private_groups) or 'none'}"
    )


def expand_groups(spec: str, num_layers: int) -> list[str]:
  """'embed,block_0-5,head' -> ['embed', 'block_0', ..., 'block_5', 'head']."""
  out = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    m = re.fullmatch(r"block_(\d+)(?:-(\d+))?", item)
    if m:
      lo = int(m.group(1))
      hi = int(m.group(2)) if m.group(2) else lo
      if hi < lo or hi >= num_layers:
        raise TopologyError(
          f"group range '{item}' is outside blocks 0-{num_layers - 1}: "
          "fix config.dipaco.level_groups / path_specific."
        )
      out.extend(f"block_{i}" for i in range(lo, hi + 1))
    elif item in ("embed", "head"):
      out.append(item)
    else:
      raise TopologyError(
        f"unknown parameter group '{item}': use embed, head, block_i or block_i-j."
      )
  return out


def _parse_paths(specs: Sequence[str], ks: Sequence[int]) -> np.ndarray:
  """('0-1', '1-0') -> [[0, 1], [1, 0]]; empty -> every path of the grid."""
  if not specs:
    return np.array(list(itertools.product(*[range(k) for k in ks])), dtype=np.int32).reshape(
      -1, len(ks)
    )
  rows = []
  for s in specs:
    try:
      ids = [int(x) for x in str(s).split("-")]
    except ValueError:
      raise TopologyError(
        f"config.dipaco.paths has path {s!r}: write each path as its module ids, one per level, "
        "joined by '-' (e.g. '0-1')."
      ) from None
    if len(ids) != len(ks):
      raise TopologyError(
        f"path '{s}' names {len(ids)} modules but the grid has {len(ks)} "
        "levels: write one module id per level, e.g. '0-1'."
      )
    for l, (m, k) in enumerate(zip(ids, ks)):
      if not 0 <= m < k:
        raise TopologyError(
          f"path '{s}' names module {m} of level {l}, which has only {k} modules (0-{k - 1})."
        )
    rows.append(ids)
  paths = np.array(rows, dtype=np.int32)
  if len({tuple(r) for r in rows}) != len(rows):
    raise TopologyError(
      "config.dipaco.paths lists a path twice: use "
      "config.dipaco.replicas for several workers per path."
    )
  return paths


def build(
  level_groups: Sequence[str],
  modules_per_level: Sequence[int],
  num_layers: int,
  *,
  path_specific: str = "",
  paths: Sequence[str] = (),
  replicas: int = 1,
) -> Topology:
  """Validates a grid description and returns its Topology."""
  for l, k in enumerate(modules_per_level):  # An integer count: 2.5 is refused, not truncated.
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
      raise TopologyError(
        f"level {l} has K={k!r} modules; every level needs an integer K>=1 "
        "(config.dipaco.modules_per_level)."
      )
  ks = tuple(int(k) for k in modules_per_level)
  if len(level_groups) != len(ks):
    raise TopologyError(
      f"{len(level_groups)} levels in config.dipaco.level_groups but "
      f"{len(ks)} entries in modules_per_level: give one K per level."
    )
  if not ks:
    raise TopologyError("the grid needs at least one level.")
  if replicas < 1:
    raise TopologyError(f"config.dipaco.replicas={replicas}: must be >= 1.")
  all_groups = tuple(["embed"] + [f"block_{i}" for i in range(num_layers)] + ["head"])
  private = expand_groups(path_specific, num_layers)
  owner: dict[str, int] = {}
  for l, spec in enumerate(level_groups):
    for g in expand_groups(spec, num_layers):
      if g in owner:
        raise TopologyError(
          f"group '{g}' is in level {owner[g]} and level {l}: each group "
          "belongs to exactly one level."
        )
      owner[g] = l
  orphans = [g for g in all_groups if g not in owner and g not in private]
  if orphans:
    raise TopologyError(
      f"groups {orphans} belong to no level: add them to a level in "
      "config.dipaco.level_groups or to config.dipaco.path_specific."
    )
  shared = tuple(
    tuple(g for g in all_groups if owner.get(g) == l and g not in private) for l in range(len(ks))
  )
  path_arr = _parse_paths(paths, ks)
  return Topology(
    groups=all_groups,
    level_groups=shared,
    modules_per_level=ks,
    private_groups=tuple(g for g in all_groups if g in private),
    paths=path_arr,
    replicas=int(replicas),
  )


def from_config(config) -> Topology:
  """Builds the Topology named by `config.dipaco` for `config.model`."""
  d = config.dipaco
  return build(
    tuple(d.level_groups),
    tuple(d.modules_per_level),
    config.model.num_layers,
    path_specific=d.path_specific,
    paths=tuple(d.paths),
    replicas=d.replicas,
  )
