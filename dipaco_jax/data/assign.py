"""Document -> worker assignments, each with the `description` that shard metadata records."""

from typing import Callable, Sequence

from dipaco_jax.data.document import Document

Assignment = Callable[[Document], Sequence[int]]  # worker ids, most preferred first
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
  """splitmix64 finaliser: a fast, well-spread 64-bit hash of an integer."""
  x = (x + 0x9E3779B97F4A7C15) & _MASK
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
  return x ^ (x >> 31)


def with_description(assign: Assignment, description: str) -> Assignment:
  """Attaches the description that identifies an assignment in shard metadata (e.g. a router)."""
  assign.description = description
  return assign


def random_assignment(num_workers: int, *, seed: int, top_k: int = 1) -> Assignment:
  """i.i.d. assignment (DiLoCo's sharding): a hash of (seed, doc_id) picks top_k workers."""
  if num_workers < 1 or not 1 <= top_k <= num_workers:
    raise ValueError(
      f"random_assignment needs num_workers >= 1 and 1 <= top_k <= num_workers; got "
      f"num_workers={num_workers}, top_k={top_k}."
    )
  seed_hash = _mix(seed & _MASK)

  def assign(doc: Document) -> list[int]:
    h = _mix(seed_hash ^ (doc.doc_id & _MASK))
    workers = list(range(num_workers))
    for j in range(top_k):  # partial Fisher-Yates shuffle driven by the hash chain
      h = _mix(h)
      k = j + h % (num_workers - j)
      workers[j], workers[k] = workers[k], workers[j]
    return workers[:top_k]

  return with_description(assign, f"random(num_workers={num_workers},seed={seed},top_k={top_k})")


def first_only(assign: Assignment) -> Assignment:
  """The same assignment restricted to its first choice (validation shards never overlap)."""
  first = with_description(
    lambda doc: list(assign(doc))[:1], f"first_of({getattr(assign, 'description', '?')})"
  )
  if hasattr(assign, "assign_batch"):  # Keeps routing in batches (shard_writer asks for batches).
    first.assign_batch = lambda docs: [list(w)[:1] for w in assign.assign_batch(docs)]
    first.batch_size = getattr(assign, "batch_size", 512)
  return first
