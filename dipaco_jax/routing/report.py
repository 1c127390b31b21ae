"""How good is a routing: shard sizes, paths x domains, purity, NMI, specialisation (numpy).

Shard sizes count every (document, path) pair, so top-k overlap counts a
document in each of its k shards. Confusion, purity and NMI use each
document's first (best) path only, as evaluation does.
"""

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np


def _first_path(path_ids) -> np.ndarray:
  ids = np.asarray(path_ids)
  if ids.ndim not in (1, 2) or ids.size == 0:
    raise ValueError(f"path_ids must be a non-empty [N] or [N, top_k] array; got {ids.shape}.")
  return ids if ids.ndim == 1 else ids[:, 0]


def _check_ids(ids: np.ndarray, n: int, what: str) -> None:
  if ids.min() < 0 or ids.max() >= n:
    raise ValueError(f"{what} must lie in [0, {n}); got range [{ids.min()}, {ids.max()}].")


def shard_sizes(path_ids, num_paths: int) -> np.ndarray:
  """Documents per path [P] (each of a document's top-k paths counts)."""
  _first_path(path_ids)  # Validates shape and emptiness.
  ids = np.asarray(path_ids).reshape(-1)
  _check_ids(ids, num_paths, "path ids")
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
  _check_ids(p_N, num_paths, "path ids")
  _check_ids(m_N, num_domains, "domain ids")
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


@dataclasses.dataclass(frozen=True)
class Specialisation:
  """Do the paths specialise on their shards? Losses are per token (nats), token-weighted.

  Documents with no scored token are left out of every number. Path p's *shard* is the
  validation documents its workers' shards hold (with replicas, the union of theirs).
  """

  loss_matrix: np.ndarray  # [P, P]: path p (row) on shard q's documents (column); NaN: none.
  shard_docs: np.ndarray  # [P] documents per shard.
  shard_tokens: np.ndarray  # [P] scored tokens per shard.
  loss: dict[str, float]  # routed, shard (each document on its shard's path), random, oracle.
  routed_best_share: float  # Documents whose routed path is their best path (argmin loss).
  shard_best_share: float  # Documents whose shard's path is their best path.
  domain_names: tuple[str, ...]  # Sorted; () when no domains were given.
  domain_docs: np.ndarray  # [M]
  domain_tokens: np.ndarray  # [M]
  domain_path_loss: np.ndarray  # [M, P]: every path on the domain's documents.
  domain_routed_loss: np.ndarray  # [M]: each document on its routed path.
  domain_oracle_loss: np.ndarray  # [M]: each document on its best path.
  domain_routes: np.ndarray  # [M, P]: documents of domain m routed to path p.
  left_out: int = 0  # Documents without a scored token (no longer than the prefix).

  @property
  def num_paths(self) -> int:
    return len(self.shard_docs)

  @property
  def own_minus_other_shards(self) -> np.ndarray:
    """[P] path p on its own shard minus its mean on the other shards (negative: specialised)."""
    return _own_minus_others(self.loss_matrix)

  @property
  def own_minus_other_paths(self) -> np.ndarray:
    """[P] shard q under its own path minus the other paths' mean on it (negative: specialised).

    Unlike the row form it does not reward a path for holding an easy shard.
    """
    return _own_minus_others(self.loss_matrix.T)

  @property
  def centred_matrix(self) -> np.ndarray:
    """[P, P] the grid less its row and column means (plus the grand mean), NaN-aware.

    What is left after each path's overall quality and each shard's difficulty: a negative
    diagonal is specialisation.
    """
    m = self.loss_matrix
    if np.isnan(m).all():
      return m.copy()
    with warnings.catch_warnings():  # A shard without documents: an all-NaN column.
      warnings.simplefilter("ignore", RuntimeWarning)
      row, col = np.nanmean(m, 1, keepdims=True), np.nanmean(m, 0, keepdims=True)
    return m - row - col + np.nanmean(m)

  @property
  def diagonal_gap(self) -> float:
    """Mean of the diagonal minus the mean off the diagonal (over shards with documents).

    On a full grid, neither path quality nor shard difficulty moves it (each adds the same
    to both means); centred_matrix's gives the same number.
    """
    m = self.loss_matrix
    off = ~np.eye(len(m), dtype=bool)
    if np.isnan(m).all() or len(m) == 1:
      return float("nan")
    return float(np.nanmean(np.diag(m)) - np.nanmean(m[off]))

  @property
  def routed_gain_share(self) -> float:
    """(random - routed) / (random - oracle): the oracle's gain over a random path, routed."""
    gap = self.loss["random"] - self.loss["oracle"]
    return float((self.loss["random"] - self.loss["routed"]) / gap) if gap > 0 else float("nan")

  @property
  def domain_majority_path(self) -> np.ndarray:
    """[M] the path most of the domain's documents are routed to (the lowest on a tie)."""
    return self.domain_routes.argmax(1)

  @property
  def domain_best_path(self) -> np.ndarray:
    """[M] the path with the lowest loss on the domain's documents."""
    return self.domain_path_loss.argmin(1)

  def as_dict(self) -> dict:
    """JSON-ready: arrays as lists, NaN as None, the derived numbers too."""

    def plain(x):
      if isinstance(x, np.ndarray):
        return plain(x.tolist())
      if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
      if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
      if isinstance(x, float) and np.isnan(x):
        return None
      return x

    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name in (
      "own_minus_other_shards",
      "own_minus_other_paths",
      "diagonal_gap",
      "centred_matrix",
      "routed_gain_share",
      "domain_majority_path",
      "domain_best_path",
    ):
      out[name] = getattr(self, name)
    return plain(out)


def _own_minus_others(m_PxP: np.ndarray) -> np.ndarray:
  """Each row's diagonal entry minus the mean of its other (non-NaN) entries."""
  out = np.full(len(m_PxP), np.nan)
  for p, row in enumerate(m_PxP):
    others = np.delete(row, p)
    others = others[~np.isnan(others)]
    if len(others) and not np.isnan(row[p]):
      out[p] = row[p] - others.mean()
  return out


def specialisation(
  nll_NxP, tokens_N, routed_N, shard_N, domains_N=None, *, num_paths: int | None = None
) -> Specialisation:
  """The specialisation report from every path's loss on every document (plain numpy).

  nll_NxP: each path's summed loss (nats) over document n's scored tokens (tokens_N of them,
  the same for every path); routed_N: the path each document is routed to; shard_N: the path
  whose validation shard holds it; domains_N: a label per document (metadata only), or None.
  """
  nll = np.asarray(nll_NxP, np.float64)
  if nll.ndim != 2:
    raise ValueError(f"nll must be [N documents, P paths]; got shape {nll.shape}.")
  n, p_ = nll.shape
  P = p_ if num_paths is None else int(num_paths)
  if P != p_:
    raise ValueError(f"nll has {p_} path columns but num_paths={P}.")
  tok, routed, shard = (np.asarray(a).reshape(-1) for a in (tokens_N, routed_N, shard_N))
  dom = None if domains_N is None else np.asarray(domains_N).reshape(-1)
  for name, a in [("tokens", tok), ("routed", routed), ("shard", shard), ("domains", dom)]:
    if a is not None and len(a) != n:
      raise ValueError(f"need one {name} entry per document: {n} documents, {len(a)} entries.")
  if (tok < 0).any():
    raise ValueError("token counts must be >= 0.")
  keep = tok > 0
  if not keep.any():
    raise ValueError("no document has a scored token: nothing to report.")
  nll, tok = nll[keep], tok[keep].astype(np.float64)
  routed, shard = routed[keep].astype(np.int64), shard[keep].astype(np.int64)
  _check_ids(routed, P, "routed paths")
  _check_ids(shard, P, "shard paths")
  on_routed, on_shard, best = (
    nll[np.arange(len(nll)), routed],
    nll[np.arange(len(nll)), shard],
    nll.min(1),
  )
  total = tok.sum()
  shard_tok = np.bincount(shard, weights=tok, minlength=P)
  nll_QxP = np.zeros((P, P))
  np.add.at(nll_QxP, shard, nll)
  with np.errstate(invalid="ignore"):  # A shard without documents: NaN.
    matrix = (nll_QxP / shard_tok[:, None]).T
  if dom is None:  # No document has a domain: every domain array is empty.
    m_N, names, d = np.zeros(0, np.int64), [], slice(0, 0)
  else:
    (m_N, names), d = domain_index(dom[keep]), slice(None)
  M = len(names)
  d_tok = np.bincount(m_N, weights=tok[d], minlength=M)
  d_nll, routes = np.zeros((M, P)), np.zeros((M, P), np.int64)
  np.add.at(d_nll, m_N, nll[d])
  np.add.at(routes, (m_N, routed[d]), 1)
  per_tok = lambda x_M: x_M / np.maximum(d_tok, 1)  # Every domain kept has a scored token.
  return Specialisation(
    loss_matrix=matrix,
    shard_docs=np.bincount(shard, minlength=P),
    shard_tokens=shard_tok.astype(np.int64),
    loss={
      "routed": float(on_routed.sum() / total),
      "shard": float(on_shard.sum() / total),
      "random": float(nll.mean(1).sum() / total),
      "oracle": float(best.sum() / total),
    },
    routed_best_share=float((on_routed <= best).mean()),  # A tie with the best counts.
    shard_best_share=float((on_shard <= best).mean()),
    domain_names=tuple(names),
    domain_docs=np.bincount(m_N, minlength=M),
    domain_tokens=d_tok.astype(np.int64),
    domain_path_loss=per_tok(d_nll.T).T,
    domain_routed_loss=per_tok(np.bincount(m_N, weights=on_routed[d], minlength=M)),
    domain_oracle_loss=per_tok(np.bincount(m_N, weights=best[d], minlength=M)),
    domain_routes=routes,
    left_out=int((~keep).sum()),
  )


def _num(x: float, fmt: str = ".4f") -> str:
  return "-" if np.isnan(x) else format(x, fmt)


def specialisation_to_markdown(rep: Specialisation, path_labels: Sequence[str] = ()) -> str:
  """The loss grid with each path's own-minus-others, the routing summary, the domains."""
  P = rep.num_paths
  label = list(path_labels) or [str(p) for p in range(P)]
  ls = rep.loss
  lines = [
    f"{int(rep.shard_docs.sum())} documents ({rep.left_out} more without a scored token left "
    f"out), {int(rep.shard_tokens.sum())} scored tokens; loss "
    f"per token: routed {ls['routed']:.4f}, own shard's path {ls['shard']:.4f}, random path "
    f"{ls['random']:.4f}, oracle {ls['oracle']:.4f}; routing takes "
    f"{_num(rep.routed_gain_share, '.1%')} of the oracle's gain over a random path",
    "",
    f"routed path = best path for {rep.routed_best_share:.1%} of documents (own shard's path: "
    f"{rep.shard_best_share:.1%}; a random pick: {1 / P:.1%}); diagonal minus off-diagonal "
    f"mean: {_num(rep.diagonal_gap, '+.4f')} (negative: the paths specialise)",
    "",
    "loss of path (row) on shard (column), with path p's own shard minus its other shards "
    "and shard q under its own path minus the other paths:",
    "",
    "| path \\ shard | " + " | ".join(label) + " | own - other shards |",
    "|---|" + "---:|" * P + "---:|",
  ]
  own_rows, own_cols = rep.own_minus_other_shards, rep.own_minus_other_paths
  for p in range(P):
    cells = [f"**{_num(v)}**" if q == p else _num(v) for q, v in enumerate(rep.loss_matrix[p])]
    lines.append(f"| {label[p]} | " + " | ".join(cells) + f" | {_num(own_rows[p], '+.4f')} |")
  lines.append("| own - other paths | " + " | ".join(_num(v, "+.4f") for v in own_cols) + " | |")
  lines.append("| documents | " + " | ".join(str(int(v)) for v in rep.shard_docs) + " | |")
  if rep.domain_names:
    lines += [
      "",
      "| domain | docs | routed loss | oracle loss | mostly routed to | best path (loss) |",
      "|---|---:|---:|---:|---|---|",
    ]
    for m, name in enumerate(rep.domain_names):
      routes, p_loss = rep.domain_routes[m], rep.domain_path_loss[m]
      major, best = int(rep.domain_majority_path[m]), int(rep.domain_best_path[m])
      lines.append(
        f"| {name} | {int(rep.domain_docs[m])} | {rep.domain_routed_loss[m]:.4f} | "
        f"{rep.domain_oracle_loss[m]:.4f} | {label[major]} ({routes[major] / routes.sum():.0%}) "
        f"| {label[best]} ({p_loss[best]:.4f}) |"
      )
  return "\n".join(lines) + "\n"
