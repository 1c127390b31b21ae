"""Streamed outer sync in elastic mode: each phase's tasks cut at its fragments' syncs and landings.

The spmd loop (core/streaming.py) syncs fragment f after the inner steps t with t mod H =
o_f and, with outer.overlap = τ, lands its update τ steps later. An elastic task reads
versioned inputs and writes versioned outputs; it cannot wait inside for a module's outer
step (with fewer actors than paths that wait would never end). Streamed, a task therefore
trains one *unit*: the inner steps between two events of that schedule.

  Without overlap, phase p has F units; unit j ends after step pH + o_j (the last one at
  (p+1)H) and sends fragment j's deltas; the executors step fragment j's modules; the next
  unit starts from those modules and from the worker's own params of every other group,
  which the worker kept (as every spmd worker keeps them between its fragments' syncs).
  With overlap τ, each unit is cut again τ steps after each sync: the unit after a sync
  starts without the fragment's outer step (the worker trains on its θ_t, as the spmd
  workers do) and the unit after it lands the update: θ ← θ_new + (θ_{t+τ} − θ_t).
  The run's last unit syncs every fragment (spmd's flush at its last step), so the final
  store is the same.

Module versions count units: version v of a module is the store as unit v reads it, written
only where its fragment synced (v = 1 + the unit whose end synced it); a unit reads the
newest written version at or below its own (`stored`). F = 1 without overlap is the plain
schedule: one unit per phase, every module stepped after each one (version t = phase t).
Plain Python, no JAX: the coordinator's readiness (`need`) reads it.
"""
# pylint: disable=invalid-name

import dataclasses


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The units of a run: H, T, fragment offsets o_0 < ... < o_{F-2} (< H), τ, group -> f."""

  H: int
  T: int
  offsets: tuple[int, ...] = ()  # core/streaming.offset of fragments 0..F-2 (F-1 syncs at H).
  tau: int = 0
  fragment_of: tuple[tuple[str, int], ...] = ()  # (group, its fragment), every store group.

  @property
  def F(self) -> int:
    return len(self.offsets) + 1

  @property
  def streamed(self) -> bool:
    return self.F > 1 or self.tau > 0

  @property
  def per_phase(self) -> int:
    """m: the units of one phase (F, or 2F with overlap)."""
    return self.F * (2 if self.tau else 1)

  @property
  def U(self) -> int:
    """The training units of the run (unit U: the final evaluation only)."""
    return self.T * self.per_phase

  def _ends(self) -> list[int]:
    """Each unit's last inner step within its phase (1..H)."""
    if not self.tau:
      return [*self.offsets, self.H]
    return [self.tau, *(s for o in self.offsets for s in (o, o + self.tau)), self.H]

  def phase(self, u: int) -> int:
    return u // self.per_phase

  def first_unit(self, phase: int) -> int:
    return phase * self.per_phase

  def span(self, u: int) -> tuple[int, int]:
    """(inner steps done before unit u, after it) over the run (u = U: (TH, TH))."""
    if u >= self.U:
      return self.H * self.T, self.H * self.T
    p, k = divmod(u, self.per_phase)
    ends = self._ends()
    return p * self.H + (ends[k - 1] if k else 0), p * self.H + ends[k]

  def _sync_index(self, f: int) -> int:
    """k: within its phase, the unit whose end syncs fragment f."""
    return 2 * f + 1 if self.tau else f

  def groups(self) -> list[str]:
    return [g for g, _ in self.fragment_of]

  def synced(self, u: int) -> set[str]:
    """The store groups whose deltas unit u sends (every group at the run's last unit)."""
    if u == self.U - 1 or not self.streamed:
      return set(self.groups())
    k = u % self.per_phase
    return {g for g, f in self.fragment_of if self._sync_index(f) == k}

  def landing(self, u: int) -> set[str]:
    """Overlap: the groups whose update lands at unit u's start (synced at unit u − 2's end)."""
    if not self.tau or u < 2 or u >= self.U:
      return set()
    return self.synced(u - 2)

  def fresh(self, u: int) -> set[str]:
    """The groups that unit u starts from the store (the others: the worker's own params)."""
    if u == 0 or u >= self.U or not self.streamed:
      return set(self.groups())
    return set() if self.tau else self.synced(u - 1)

  def _last_sync(self, u: int, group: str) -> int:
    """The last unit before u whose end synced `group` (-1: none)."""
    if u >= self.U:
      return self.U - 1
    if not self.streamed:
      return u - 1
    k = self._sync_index(dict(self.fragment_of)[group])
    p = (u - 1 - k) // self.per_phase
    return p * self.per_phase + k if u - 1 - k >= 0 else -1

  def stored(self, u: int, group: str) -> int:
    """The version of `group`'s modules unit u reads as the store (the newest written)."""
    return self._last_sync(u, group) + 1

  def need(self, u: int, group: str) -> int:
    """The version `group`'s modules must hold before unit u's task may start.

    With overlap, not the update of a sync at unit u − 1's end: that lands one unit on.
    """
    if self.tau and 0 < u < self.U:
      return self.stored(u - 1, group)
    return self.stored(u, group)
