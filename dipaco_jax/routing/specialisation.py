"""The specialisation report: every path on every path's held-out shard (numpy).

Do the paths specialise on their shards? Each path's loss on each shard's
validation documents (`Specialisation.loss_matrix`, a blue diagonal where they
do), routed against random and oracle routing, per domain (metadata only).
`compute` takes every path's loss on every document (`evaluate.evaluate(run,
per_sequence=True)` scores them; `from_evaluation` reads its report);
`check_paths` and `check_held_out` refuse, in one line, a run it cannot say anything about.
"""
# pylint: disable=invalid-name

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

from dipaco_jax import errors
from dipaco_jax.routing import report


def check_paths(topo, workdir: str) -> None:
  """ArgumentError for a run with one path: there is nothing to compare."""
  if topo.num_paths < 2:
    raise errors.ArgumentError(
      f"{workdir} has one path ({topo.describe()}): the specialisation report scores every "
      "path on every path's held-out shard, so it needs a DiPaCo run with >= 2 paths (a "
      "dense or DiLoCo run has one; evaluate it with python -m dipaco_jax.evaluate)."
    )


def check_held_out(shard_set, workdir: str) -> None:
  """ArgumentError for a run whose shards hold no held-out (validation) documents."""
  held_out = shard_set.num_docs("validation") if "validation" in shard_set.splits else []
  if not np.sum(held_out):
    raise errors.ArgumentError(
      f"{workdir}: its shards ({shard_set.shard_dir}) hold no held-out (validation) "
      "documents, and the specialisation report scores every path on each path's held-out "
      "shard: write the run's shards from a corpus with a validation split."
    )


def from_evaluation(rep: dict, num_paths: int) -> "Specialisation":
  """The report from an `evaluate(run, per_sequence=True)` report of the run."""
  if "per_sequence" not in rep:
    raise ValueError("rep has no per-sequence losses: evaluate it with per_sequence=True.")
  seq = rep["per_sequence"]
  return compute(
    seq["nll"],
    seq["tokens"],
    rep["sequence_paths"],
    seq["shard_paths"],
    rep["domains"],
    num_paths=num_paths,
  )


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


def compute(
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
  report.check_ids(routed, P, "routed paths")
  report.check_ids(shard, P, "shard paths")
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
    (m_N, names), d = report.domain_index(dom[keep]), slice(None)
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


def to_markdown(rep: Specialisation, path_labels: Sequence[str] = ()) -> str:
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
