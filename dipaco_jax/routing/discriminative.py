"""Discriminative routing (paper §2.4.2): best-path labels, a linear classifier, a calibrated bias.

Labels are the path with the highest log-likelihood per document. A P-class
logistic regression on standardised features learns to predict them. Small
paths come out under-represented in the classifier's argmax (some even empty),
so the bias is then calibrated until the argmax shard sizes match a target
distribution (see `calibrate_bias`).
"""

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax.config import sections
from dipaco_jax.routing import kmeans

LinearParams = dict[str, np.ndarray]  # w [D, P], b [P], mean [D], std [D].


def labels_from_scores(scores_NxP) -> np.ndarray:
  """Best path per document (argmax of log-likelihood; ties -> lowest id) -> int32 [N]."""
  kmeans.check_features(scores_NxP, name="scores")
  kmeans.check_finite(scores_NxP, name="scores")
  return np.argmax(np.asarray(scores_NxP), axis=1).astype(np.int32)


def _logits(x_NxD, params) -> jax.Array:
  return ((x_NxD - params["mean"]) / params["std"]) @ params["w"] + params["b"]


def linear_logits(x_NxD, params: LinearParams) -> np.ndarray:
  """Classifier logits [N, P] (bias included) for in-memory features."""
  return np.asarray(_logits(jnp.asarray(x_NxD, jnp.float32), params))


@functools.partial(jax.jit, static_argnames=("top_k",))
def _top_k_paths(x_NxD, params, *, top_k: int):
  return jax.lax.top_k(_logits(x_NxD, params), top_k)[1]


def predict_top_k(
  x_NxD, params: LinearParams, top_k: int = 1, *, batch_size: int = kmeans.DEFAULT_BATCH_SIZE
) -> np.ndarray:
  """Top_k paths by logit, best first -> int32 [N, top_k] (streams in batches)."""
  kmeans.check_features(x_NxD, params["w"].shape[0])
  kmeans.check_top_k(top_k, params["w"].shape[1])
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  fn = lambda xb: _top_k_paths(xb, p, top_k=top_k)
  return kmeans.stream_batches(fn, x_NxD, batch_size).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("num_paths", "steps", "batch_size", "lr"))
def _train(key, z_NxD, labels_N, l2, *, num_paths: int, steps: int, batch_size: int, lr: float):
  """Adam on mean cross-entropy + l2/2 ||w||^2 from zero init; returns (w, b, loss)."""
  n, d = z_NxD.shape
  params = {"w": jnp.zeros((d, num_paths)), "b": jnp.zeros((num_paths,))}
  tx = optax.adam(lr)

  def loss_fn(params, z_BxD, y_B):
    logits_BxP = z_BxD @ params["w"] + params["b"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BxP, y_B).mean()
    return ce + 0.5 * l2 * jnp.sum(params["w"] ** 2)

  def step(carry, i):
    params, opt_state = carry
    if batch_size >= n:  # Full batch.
      z_BxD, y_B = z_NxD, labels_N
    else:  # Minibatch drawn with replacement from a per-step key: reproducible.
      idx_B = jax.random.randint(jax.random.fold_in(key, i), (batch_size,), 0, n)
      z_BxD, y_B = z_NxD[idx_B], labels_N[idx_B]
    loss, grads = jax.value_and_grad(loss_fn)(params, z_BxD, y_B)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  (params, _), loss_S = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
  return params["w"], params["b"], loss_S


def fit_logistic(
  x_NxD,
  labels_N,
  num_paths: int,
  *,
  l2: float = 1e-4,
  steps: int = 500,
  learning_rate: float = 0.05,
  batch_size: int | None = None,
  seed: int = 0,
) -> LinearParams:
  """P-class logistic regression on standardised features (mean/std kept in the params)."""
  kmeans.check_features(x_NxD)
  kmeans.check_finite(x_NxD)
  labels_N = np.asarray(labels_N)
  if labels_N.shape != (x_NxD.shape[0],) or labels_N.min() < 0 or labels_N.max() >= num_paths:
    raise ValueError(
      f"labels must be [N={x_NxD.shape[0]}] ints in [0, {num_paths}); got shape "
      f"{labels_N.shape}, range [{labels_N.min()}, {labels_N.max()}]."
    )
  x_NxD = np.asarray(x_NxD, np.float32)
  mean_D = x_NxD.mean(axis=0)
  std_D = x_NxD.std(axis=0)
  std_D = np.where(std_D > 0, std_D, 1.0).astype(np.float32)  # Constant features stay 0.
  w, b, _ = _train(
    jax.random.PRNGKey(seed),
    jnp.asarray((x_NxD - mean_D) / std_D),
    jnp.asarray(labels_N, jnp.int32),
    jnp.float32(l2),
    num_paths=num_paths,
    steps=steps,
    batch_size=batch_size or x_NxD.shape[0],
    lr=learning_rate,
  )
  return {"w": np.asarray(w), "b": np.asarray(b), "mean": mean_D, "std": std_D}


def target_distribution(
  target: str | Sequence[float],
  labels_N,
  num_paths: int,
  *,
  min_share: float = 0.0,
  weights_N=None,
) -> np.ndarray:
  """'labels' (label frequencies), 'uniform', or given shard sizes -> fractions [P], none 0.

  With `weights_N` (e.g. each document's tokens) the label frequencies are weighted.

  Each path's share is floored at one document (1/N) before normalising, so a
  path that won no label still gets a (tiny) shard instead of an empty one.
  `min_share` in [0, 1] floors every share at min_share / P (a fraction of the
  uniform share, so a path that lost the label vote still trains on a useful
  shard; 1 = uniform), taking the difference from the larger shares in
  proportion to their size.
  """
  n = len(labels_N)
  if isinstance(target, str):
    if target not in sections.DISCRIMINATIVE_TARGETS:
      raise ValueError(
        f"target must be one of {sections.DISCRIMINATIVE_TARGETS} or P shard sizes; got {target!r}."
      )
    if target == "labels":
      w_N = None if weights_N is None else np.asarray(weights_N, np.float64)
      t_P = np.bincount(np.asarray(labels_N), weights=w_N, minlength=num_paths).astype(np.float64)
    else:
      t_P = np.ones(num_paths)
  else:
    t_P = np.asarray(target, np.float64)
    if t_P.shape != (num_paths,) or (t_P < 0).any() or not t_P.sum() > 0:
      raise ValueError(
        f"target shard sizes must be {num_paths} non-negative numbers with a "
        f"positive sum; got shape {t_P.shape}."
      )
  t_P = np.maximum(t_P / t_P.sum(), 1.0 / n)
  t_P = t_P / t_P.sum()
  if not 0.0 <= min_share <= 1.0:
    raise ValueError(
      f"min_share must lie in [0, 1] (a fraction of the uniform share); got {min_share}."
    )
  floor = min_share / num_paths
  floored = np.zeros(num_paths, bool)
  for _ in range(num_paths):  # Scaling the rest down can put another share under the floor.
    floored |= t_P < floor - 1e-15
    rest = t_P[~floored].sum()
    t_P = np.where(floored, floor, t_P * (1.0 - floor * floored.sum()) / max(rest, 1e-300))
    if not (t_P < floor - 1e-12).any():
      break
  return t_P / t_P.sum()


def _counts(logits_NxP: np.ndarray, b_P: np.ndarray, w_N: np.ndarray | None = None) -> np.ndarray:
  """Argmax shard sizes [P]: documents, or the sum of their weights w_N."""
  s_NxP = logits_NxP + b_P.astype(logits_NxP.dtype)
  return np.bincount(np.argmax(s_NxP, axis=1), weights=w_N, minlength=logits_NxP.shape[1])


def check_weights(weights_N, n: int) -> np.ndarray | None:
  """None, or n positive finite document weights as float64 (one clear error otherwise)."""
  if weights_N is None:
    return None
  w_N = np.asarray(weights_N, np.float64)
  if w_N.shape != (n,) or not np.all(np.isfinite(w_N)) or not np.all(w_N > 0):
    raise ValueError(
      f"document weights must be {n} positive finite numbers (e.g. tokens per document); "
      f"got shape {w_N.shape}."
    )
  return w_N


def _fill_empty(logits_NxP: np.ndarray, b_P: np.ndarray, max_rounds: int) -> np.ndarray:
  """Raises each empty path's bias just enough to win its best-margin document(s)."""
  # Leave a clear gap to the next document so float32 re-evaluation agrees.
  gap = 1e-4 * (1.0 + np.abs(logits_NxP).max() + np.abs(b_P).max())
  for _ in range(max_rounds):
    empty = np.nonzero(_counts(logits_NxP, b_P) == 0)[0]
    if empty.size == 0:
      return b_P
    q = empty[0]
    s_NxP = logits_NxP + b_P.astype(logits_NxP.dtype)
    margin_N = s_NxP[:, q] - np.max(np.delete(s_NxP, q, axis=1), axis=1)  # All <= 0.
    m_N = np.append(np.sort(margin_N)[::-1], -np.inf)
    j = int(np.argmax(m_N[:-1] - m_N[1:] > gap))  # Usually 0: only the best document moves.
    b_P = b_P.copy()
    b_P[q] -= m_N[j] - gap / 2 if np.isinf(m_N[j + 1]) else (m_N[j] + m_N[j + 1]) / 2
  empty = np.nonzero(_counts(logits_NxP, b_P) == 0)[0]
  if empty.size:
    raise ValueError(
      f"bias calibration could not give paths {empty.tolist()} a document: their "
      "logits never beat the others (degenerate classifier or fewer documents "
      "than paths); use more router data or fewer paths."
    )
  return b_P


def _size_error(c_P: np.ndarray, want_P: np.ndarray, unit: float = 1.0) -> float:
  """Worst shard's |log size ratio| to its target, +1 doc (`unit`) each side: tiny ones finite."""
  return float(np.abs(np.log((c_P + unit) / (want_P + unit))).max())


def shard_stats(c_P: np.ndarray, t_P: np.ndarray, unit: float = 1.0) -> dict[str, float]:
  """How far shard sizes c_P are from target fractions t_P (see calibrate_bias)."""
  n = c_P.sum()
  return {
    "max_ratio_err": _size_error(c_P, n * t_P, unit),
    "tv": float(0.5 * np.abs(c_P / n - t_P).sum()),
    "empty": int((c_P == 0).sum()),
  }


def calibrate_bias(
  logits_NxP,
  target_P,
  *,
  tol: float = 0.1,
  max_iters: int = 500,
  step: float = 1.0,
  weights_N=None,
) -> tuple[np.ndarray, dict[str, float]]:
  """Bias shift [P] so argmax shard sizes match target_P and no path is empty.

  Sizes count documents, or with `weights_N` the sum of their weights (tokens per
  document: what a path trains on); "+1 document" below is then +1 mean weight.

  Iterates b_p += step * log(target_p / predicted_p) on the argmax shard sizes
  (+1 document each side, so an empty path takes a finite step), halving the
  step whenever 20 iterations bring no improvement and restarting from the
  best bias seen. "Best" is the worst shard's size ratio to its target; it stops
  once every shard is within a factor 1 + tol of its target, either way (sizes +1).
  Then a guarantee step gives each still-empty path one document by raising its
  bias just past its best-margin document. Returns (bias, info): max_ratio_err
  (worst |log ratio|), tv (total-variation distance of the shard fractions to
  the target: the share of documents that sit on the wrong path size-wise),
  iters, empty.
  """
  logits_NxP = np.asarray(logits_NxP, np.float32)  # As the router computes them.
  n, p = logits_NxP.shape
  t_P = np.asarray(target_P, np.float64)
  if t_P.shape != (p,) or not np.all(t_P > 0) or abs(t_P.sum() - 1) > 1e-6:
    raise ValueError(
      f"target_P must be {p} positive fractions summing to 1; use "
      "target_distribution() to build it."
    )
  if n < p:
    raise ValueError(f"{n} documents cannot fill {p} paths; use more router data.")
  w_N = check_weights(weights_N, n)
  unit = 1.0 if w_N is None else float(w_N.mean())
  want_P = (n if w_N is None else w_N.sum()) * t_P
  b_P = np.zeros(p)
  best_b, best_err, since_best, it = b_P, np.inf, 0, 0
  for it in range(1, max_iters + 1):  # noqa: B007  (`it` is reported after the loop)
    c_P = _counts(logits_NxP, b_P, w_N)
    err = _size_error(c_P, want_P, unit)
    if err < best_err:
      best_b, best_err, since_best = b_P, err, 0
    else:
      since_best += 1
      if since_best >= 20:  # Oscillating between sizes: smaller steps from the best.
        step, since_best, b_P = step / 2, 0, best_b
    if best_err <= np.log1p(tol):
      break
    b_P = b_P + step * np.log((want_P + unit) / (c_P + unit))
  b_P = _fill_empty(logits_NxP, best_b, max_rounds=4 * p)
  info = {**shard_stats(_counts(logits_NxP, b_P, w_N), t_P, unit), "iters": it}
  if info["max_ratio_err"] > np.log1p(tol):
    logging.warning(
      "bias calibration: worst shard off its target by log-ratio %.3f > "
      "log(1+tol) after %d iterations.",
      info["max_ratio_err"],
      it,
    )
  return b_P.astype(np.float32), info


def calibration_sizes(c_P) -> dict[str, float]:
  """Shard sizes [P] (weight units) on the calibration documents: min, median, max, min/mean."""
  c_P = np.asarray(c_P, np.float64)
  return {
    "calib_min": float(c_P.min()),
    "calib_median": float(np.median(c_P)),
    "calib_max": float(c_P.max()),
    "calib_min_over_mean": float(c_P.min() / max(c_P.mean(), 1e-300)),
  }


def balanced_labels(scores_NxP, target_P, *, tol: float = 0.1, weights_N=None) -> np.ndarray:
  """Each document's path under a bias on its scores calibrated to target_P -> int32 [N].

  A capacity-constrained best path: documents move off their best path to their
  next best where that path is under its target. The scores are divided by the median
  gap between each document's two best before calibrating, so steps are O(1).
  """
  s_NxP = np.asarray(scores_NxP, np.float64)
  two_NxK = np.sort(s_NxP, axis=1)[:, -2:]
  gap = float(np.median(two_NxK[:, 1] - two_NxK[:, 0]))
  z_NxP = s_NxP / (gap if gap > 0 else 1.0)
  b_P, _ = calibrate_bias(
    z_NxP - z_NxP.max(axis=1, keepdims=True), target_P, tol=tol, weights_N=weights_N
  )
  return np.argmax(z_NxP + b_P, axis=1).astype(np.int32)


def fit_discriminative(
  x_NxD,
  scores_NxP,
  *,
  target: str | Sequence[float] = "labels",
  min_share: float = 0.0,
  tol: float = 0.1,
  l2: float = 1e-4,
  steps: int = 500,
  learning_rate: float = 0.05,
  batch_size: int | None = None,
  seed: int = 0,
  weights_N=None,
  calibration: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[LinearParams, dict[str, float]]:
  """Labels from scores, logistic regression, bias calibration -> (params, info).

  With min_share > 0 the classifier learns balanced labels: each document's path
  under a bias on the scores calibrated to the floored target (`balanced_labels`),
  so every path has examples of its own. Best-path labels alone leave the paths
  that won none with identical classifier columns, which no bias can tell apart.

  weights_N: each scored document's weight (its tokens) for the target and the
  balanced labels. calibration: (features [M, D], weights [M]) of the documents
  the bias is calibrated on (e.g. a sample of the training split, so that the
  training shards' tokens, not the scored documents' count, meet the target);
  None: the scored documents with weights_N. The info's `calib_*` entries give the
  calibrated shard sizes (in weight units) on those documents.
  """
  kmeans.check_features(scores_NxP, name="scores")
  if scores_NxP.shape[0] != x_NxD.shape[0]:
    raise ValueError(
      f"features have {x_NxD.shape[0]} rows but scores have "
      f"{scores_NxP.shape[0]}; score the same documents you featurise."
    )
  num_paths = scores_NxP.shape[1]
  labels_N = labels_from_scores(scores_NxP)
  w_N = check_weights(weights_N, len(labels_N))
  t_P = target_distribution(target, labels_N, num_paths, min_share=min_share, weights_N=w_N)
  train_N = balanced_labels(scores_NxP, t_P, tol=tol, weights_N=w_N) if min_share > 0 else labels_N
  params = fit_logistic(
    x_NxD,
    train_N,
    num_paths,
    l2=l2,
    steps=steps,
    learning_rate=learning_rate,
    batch_size=batch_size,
    seed=seed,
  )
  cx_MxD, cw_M = (x_NxD, w_N) if calibration is None else calibration
  kmeans.check_features(cx_MxD, x_NxD.shape[1], name="calibration features")
  cw_M = check_weights(cw_M, cx_MxD.shape[0])
  shift_P, info = calibrate_bias(linear_logits(cx_MxD, params), t_P, tol=tol, weights_N=cw_M)
  info = {f"calib_{k}": v for k, v in info.items()}
  params["b"] = params["b"] + shift_P
  calib_P = np.bincount(predict_top_k(cx_MxD, params)[:, 0], weights=cw_M, minlength=num_paths)
  # Report what the saved router does (float32, batched), not the numpy copy calibrated on.
  pred_N = predict_top_k(x_NxD, params)[:, 0]
  c_P = np.bincount(pred_N, minlength=num_paths)
  l_P = np.bincount(labels_N, minlength=num_paths)
  # Shard sizes on the router split, and the share of documents routed off their best path.
  info.update(
    shard_stats(c_P, t_P),
    **calibration_sizes(calib_P),
    train_accuracy=float(np.mean(pred_N == labels_N)),
    moved_off_label=float(np.mean(pred_N != labels_N)),
    docs_min=int(c_P.min()),
    docs_median=float(np.median(c_P)),
    docs_max=int(c_P.max()),
    # Before the bias: the best-path labels' shard sizes (what argmax labels would give).
    argmin_docs_min=int(l_P.min()),
    argmin_docs_median=float(np.median(l_P)),
    argmin_docs_max=int(l_P.max()),
  )
  return params, info
