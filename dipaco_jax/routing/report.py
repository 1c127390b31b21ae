"""How good is a routing: shard sizes, paths x domains, purity, NMI (numpy).

Shard sizes count every (document, path) pair, so top-k overlap counts a
document in each of its k shards. Confusion, purity and NMI use each
document's first (best) path only, as evaluation does. Whether the paths
specialise on their shards: specialisation.py.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np


def _first_path(path_ids) -> np.ndarray:
  ids = np.asarray(path_ids)
  if ids.ndim not in (1, 2) or ids.size == 0:
    raise ValueError(f"path_ids must be a non-empty [N] or [N, top_k] array; got {ids.shape}.")
  return ids if ids.ndim == 1 else ids[:, 0]


def check_ids(ids: np.ndarray, n: int, what: str) -> None:
  if ids.min() < 0 or ids.max() >= n:
    raise ValueError(f"{what} must lie in [0, {n}); got range [{ids.min()}, {ids.max()}].")


def shard_sizes(path_ids, num_paths: int) -> np.ndarray:
  """Documents per path [P] (each of a document's top-k paths counts)."""
  _first_path(path_ids)  # Validates shape and emptiness.
  ids = np.asarray(path_ids).reshape(-1)
  check_ids(ids, num_paths, "path ids")
  return np.bincount(ids, minlength=num_paths)


def token_stats(tokens_W) -> dict[str, float]:
  """Training tokens per shard: min / median / max / mean, and the smallest over the mean."""
  t_W = np.asarray(tokens_W, np.float64)
  mean = float(t_W.mean())
  return {
    "tokens_min": float(t_W.min()),
    "tokens_median": float(np.median(t_W)),
    "tokens_max": float(t_W.max()),
    "tokens_mean": mean,
    "min_over_mean": float(t_W.min() / mean) if mean > 0 else float("nan"),
  }


def confusion(path_ids, domains, num_paths: int, num_domains: int) -> np.ndarray:
  """Counts [P, M]: documents routed (top-1) to path p that come from domain m."""
  p_N = _first_path(path_ids)
  m_N = np.asarray(domains).reshape(-1)
  if m_N.shape != p_N.shape:
    raise ValueError(f"need one domain per document: {p_N.shape[0]} paths, {m_N.shape[0]} domains.")
  check_ids(p_N, num_paths, "path ids")
  check_ids(m_N, num_domains, "domain ids")
  c_PxM = np.zeros((num_paths, num_domains), np.int64)
  np.add.at(c_PxM, (p_N, m_N), 1)
  return c_PxM


def purity(c_PxM: np.ndarray) -> float:
  """Share of documents that sit in their path's majority domain (1 = every path one domain)."""
  return float(c_PxM.max(axis=1).sum() / c_PxM.sum())


def _entropy(count) -> float:
  q = count[count > 0] / count.sum()
  return float(-(q * np.log(q)).sum())


def nmi(c_PxM: np.ndarray) -> float:
  """Normalized mutual information I(path; domain) / mean(H(path), H(domain)).

  Arithmetic-mean normalisation (as scikit-learn's default); 1.0 when both sides
  are constant, 0.0 when only one is.
  """
  h_p, h_m = _entropy(c_PxM.sum(axis=1)), _entropy(c_PxM.sum(axis=0))
  if h_p == 0.0 and h_m == 0.0:
    return 1.0
  joint = c_PxM / c_PxM.sum()
  outer = joint.sum(axis=1, keepdims=True) * joint.sum(axis=0, keepdims=True)
  nz = joint > 0
  mi = float((joint[nz] * np.log(joint[nz] / outer[nz])).sum())
  return max(0.0, mi) / ((h_p + h_m) / 2)


@dataclasses.dataclass(frozen=True)
class RouterReport:
  """Routing quality numbers; `confusion` is None when no domains were given."""

  sizes: np.ndarray  # [P]
  confusion: np.ndarray | None  # [P, M]
  domain_names: tuple[str, ...]
  purity: float | None
  nmi: float | None

  @property
  def num_empty(self) -> int:
    return int((self.sizes == 0).sum())

  @property
  def imbalance(self) -> float:
    """Largest shard over the mean shard (1 = perfectly even)."""
    return float(self.sizes.max() / self.sizes.mean())


def report(
  path_ids, num_paths: int, domains=None, domain_names: Sequence[str] | None = None
) -> RouterReport:
  """Builds a RouterReport; domains are ints in [0, M) (M = len(domain_names) if given)."""
  sizes = shard_sizes(path_ids, num_paths)
  if domains is None:
    return RouterReport(sizes, None, (), None, None)
  m = len(domain_names) if domain_names is not None else int(np.max(domains)) + 1
  names = tuple(domain_names) if domain_names is not None else tuple(str(i) for i in range(m))
  c_PxM = confusion(path_ids, domains, num_paths, m)
  return RouterReport(sizes, c_PxM, names, purity(c_PxM), nmi(c_PxM))


def to_markdown(rep: RouterReport) -> str:
  """Summary line plus a paths x domains table (sizes only when no domains)."""
  s = rep.sizes
  lines = [
    f"paths: {len(s)}, documents (with overlap): {int(s.sum())}, shard size "
    f"min/mean/max: {int(s.min())}/{s.mean():.1f}/{int(s.max())}, empty: {rep.num_empty}, "
    f"imbalance (max/mean): {rep.imbalance:.2f}"
  ]
  if rep.confusion is None:
    lines += ["", "| path | docs |", "|---:|---:|"]
    lines += [f"| {p} | {int(n)} |" for p, n in enumerate(s)]
    return "\n".join(lines) + "\n"
  lines.append(f"purity: {rep.purity:.4f}, NMI(path, domain): {rep.nmi:.4f}")
  lines += [
    "",
    "| path | top-1 docs | " + " | ".join(rep.domain_names) + " | majority |",
    "|---:|---:|" + "---:|" * len(rep.domain_names) + "---|",
  ]
  for p, row in enumerate(rep.confusion):
    major = rep.domain_names[int(row.argmax())] if row.sum() else "-"
    lines.append(
      f"| {p} | {int(row.sum())} | " + " | ".join(str(int(v)) for v in row) + f" | {major} |"
    )
  return "\n".join(lines) + "\n"


def domain_index(domains) -> tuple[np.ndarray, list[str]]:
  names = sorted(set(np.asarray(domains).tolist()))
  index = {n: i for i, n in enumerate(names)}
  return np.array([index[d] for d in domains], np.int64), names


def quality(path_router, split_data: dict, *, top_k: int = 1) -> RouterReport:
  """Shard sizes and the paths x domains table of a routed split (domains never train)."""
  ids, names = domain_index(split_data["domains"])
  paths = path_router.paths(split_data["doc_ids"], split_data.get("features"), top_k)
  return report(paths, path_router.topo.num_paths, ids, names)
