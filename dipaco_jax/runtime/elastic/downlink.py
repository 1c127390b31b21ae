"""A worker's downlink: a module's version read whole, or rebuilt from the update's codes.

With outer.compression the executor writes, beside version v of a module, the update
u<v> that crosses coded, and v<v> is what those codes rebuild (executor._apply:
apply_update(v<s>, u<v>), s the version the step started from: `Schedule.stored(v − 1)`,
v − 1 unless streamed). An actor that holds v<s> from an earlier read rebuilds v<v> with
the same program on the same bytes, so it holds v<v>'s bytes, and reads only u<v>; any
other module is read whole (float32). Both kinds of task read through it: an unstreamed
task's modules (task_io._receive) and a streamed unit's (streamed.py).

It holds one version of each module of the last task's path (`keep`), as the actor's
memory holds that path's params anyway; a new actor, or a restarted one, holds nothing
and reads whole.
"""
# pylint: disable=invalid-name

import jax

from dipaco_jax.runtime.elastic import storage


class Downlink:
  """Module versions as a worker reads them: held, rebuilt from u<v>, or read whole."""

  def __init__(self, grid, workdir: str, rebuild=None):
    """`rebuild`: the jitted Recipe.apply_update (None: never rebuilds, reads whole)."""
    self.grid, self.workdir = grid, str(workdir)
    self._rebuild = rebuild if grid.recipe.compressed else None
    self._held = {}  # (group, module) -> (version, tree): the store's bytes of that version.

  def module(self, group: str, module: int, version: int) -> tuple[dict, int]:
    """Module (group, module) at `version` ({group: tree}) and the bytes read from storage."""
    key = (group, module)
    held = self._held.get(key)
    if held is not None and held[0] == version:  # Read (or rebuilt) already: nothing moves.
      return held[1], 0
    update = storage.module_file(self.workdir, group, module, version, "u")
    was = self.grid.sched.stored(version - 1, group) if version > 0 else None
    if self._rebuild and held is not None and held[0] == was and update.exists():
      delta = storage.load_tree(update, self.grid.delta_template(group))
      tree, nbytes = jax.device_get(self._rebuild(held[1], delta)), storage.size(update)
    else:  # No update (version 0, outer.enabled off), or not the version it starts from.
      f = storage.module_file(self.workdir, group, module, version)
      tree, nbytes = storage.load_tree(f, self.grid.module_template(group)), storage.size(f)
    self._held[key] = (version, tree)
    return tree, nbytes

  def keep(self, modules) -> None:
    """Forgets every held module but `modules` ((group, module) pairs: one path's)."""
    keys = set(modules)
    self._held = {k: v for k, v in self._held.items() if k in keys}
