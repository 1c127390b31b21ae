"""Streaming outer sync: the store's groups in F fragments, synced at staggered inner steps.

`outer.fragments` = F splits the store's groups into F fragments of about equal bytes (each
group whole: the greedy longest-first split, so a group larger than 1/F of the bytes is a
fragment alone). Fragment f syncs at the inner steps t with t mod H = o_f, o_f = ((f+1) H // F)
mod H: each fragment still syncs every H steps, F times fewer bytes cross at once, and the
last fragment syncs at the phase's end (o = 0), where the re-shards and the guard's phases
are. F = 1 is the plain outer step (every group at t mod H = 0). At the run's last step every
fragment whose inner steps since its last sync are not yet in the store syncs once more (a
flush), so the final store holds every step.

`outer.overlap` = τ: the exchange of a fragment dispatched after step t lands after step
t + τ. The outer step uses the deltas of step t (what a worker sends when it dispatches);
the workers meanwhile train on their local params, and on landing each worker's fragment
becomes its new module plus what its τ steps changed locally: θ ← θ_new + (θ_{t+τ} − θ_t)
(τ steps of staleness for that fragment, as Streaming DiLoCo; the local steps are kept,
not averaged with the new module). τ = 0 applies the update at once. An exchange still in
flight at the run's last step lands there.
"""

import jax
import numpy as np

from dipaco_jax.errors import ConfigError
from dipaco_jax.types import PyTree


def check(fragments: int, overlap: int, inner_steps: int, num_groups: int, enabled: bool) -> None:
  """ConfigError, in one line, for a fragment count or overlap that the schedule cannot run."""
  if (fragments > 1 or overlap > 0) and not enabled:
    raise ConfigError(
      f"config.outer.fragments={fragments}, outer.overlap={overlap} with outer.enabled=False: "
      "there is no outer exchange to stream; set fragments=1 and overlap=0."
    )
  if fragments > num_groups:
    raise ConfigError(
      f"config.outer.fragments={fragments} exceeds the {num_groups} groups of the store: a "
      f"fragment holds whole groups; give at most {num_groups}."
    )
  if fragments > inner_steps:
    raise ConfigError(
      f"config.outer.fragments={fragments} exceeds dipaco.inner_steps={inner_steps}: each "
      f"fragment syncs at its own inner step of a phase; give at most {inner_steps}."
    )
  gap = inner_steps // fragments
  if overlap >= gap:
    raise ConfigError(
      f"config.outer.overlap={overlap} is not below the {gap} inner steps between two "
      f"fragments' syncs (dipaco.inner_steps={inner_steps} / outer.fragments={fragments}): an "
      f"exchange must land before the next one starts; give at most {gap - 1}."
    )


def split(store: PyTree, fragments: int) -> tuple[tuple[str, ...], ...]:
  """The store's group names in `fragments` fragments of about equal bytes, model order within.

  Greedy: the largest group first, each to the fragment with the fewest bytes so far (the
  lowest index on a tie), so the split depends on the shapes alone.
  """
  nbytes = {
    g: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(t))
    for g, t in store.items()
  }
  order = list(store)
  load, parts = [0] * fragments, [[] for _ in range(fragments)]
  for g in sorted(order, key=lambda g: (-nbytes[g], order.index(g))):
    f = min(range(fragments), key=lambda i: (load[i], i))
    parts[f].append(g)
    load[f] += nbytes[g]
  return tuple(tuple(sorted(p, key=order.index)) for p in parts)


def offset(f: int, fragments: int, inner_steps: int) -> int:
  """o_f: fragment f syncs after the inner steps t with t mod H = o_f."""
  return (f + 1) * inner_steps // fragments % inner_steps


def due(step: int, fragments: int, inner_steps: int) -> list[int]:
  """The fragments that sync after inner step `step` (counted from 1) by the schedule."""
  return [f for f in range(fragments) if step % inner_steps == offset(f, fragments, inner_steps)]


def lands(step: int, fragments: int, inner_steps: int, overlap: int) -> bool:
  """Whether an exchange dispatched `overlap` steps before lands after inner step `step`."""
  return overlap > 0 and step > overlap and bool(due(step - overlap, fragments, inner_steps))
