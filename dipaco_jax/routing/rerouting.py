"""Re-routing at evaluation every W tokens (paper §2.4.3, §7.2.2).

After the prefix, a sequence is cut into chunks [L + kW, L + (k+1)W). The
sequence router's path (from the prefix) scores the first chunk; at each later
boundary b a test-time router reads the text so far (t_0..t_{b-1}) and picks
the path for the next chunk. One test-time router serves every W.

Training labels (both kinds): T_b = argmax_p Σ_{j=b}^{b+window-1} S[j, p], the
best path over a forward window of per-token log-likelihoods S (window 0 = to
the sequence end; the paper's Table 3 uses the whole sequence). Kinds:
  linear       logistic regression (router.fit_linear_router) on the running
               mean of θ̄'s last-block hidden state over the text so far.
  transformer  θ̄ fine-tuned with a linear head to predict T_b at every token
               (the paper's choice; AdamW, cosine from the peak, no warmup).
"""
# pylint: disable=invalid-name

import zlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax import errors
from dipaco_jax.core import model as model_lib
from dipaco_jax.io import files
from dipaco_jax.io import progress
from dipaco_jax.routing import router as router_lib
from dipaco_jax.types import PyTree

PARAMS_FILE = "params.msgpack"  # The transformer re-router's params.


def check_window(W: int) -> int:
  """Raises ValueError unless the re-routing interval is a positive integer."""
  if not isinstance(W, (int, np.integer)) or isinstance(W, bool) or W <= 0:
    raise ValueError(
      f"re-routing window W must be an integer > 0 (tokens per chunk); got {W!r}. "
      "Set config.eval.rerouting_windows, e.g. (16, 32, 64, 128)."
    )
  return int(W)


def boundaries(length: int, prefix_len: int, W: int) -> list[int]:
  """Chunk starts after the prefix: L, L+W, ... below `length`."""
  return list(range(prefix_len, max(length, prefix_len), check_window(W)))


def window_labels(s_NxTxP: np.ndarray, lengths_N: np.ndarray, window: int = 0) -> np.ndarray:
  """T[n, b] = best path over targets b..b+window-1 (0 = to the end) of sequence n -> [N, T]."""
  N, T, _ = s_NxTxP.shape
  c_NxT1xP = np.concatenate([np.zeros_like(s_NxTxP[:, :1]), np.cumsum(s_NxTxP, 1)], 1)
  b_T = np.arange(T)
  end_NxT = np.asarray(lengths_N)[:, None] * np.ones((1, T), np.int64)
  if window > 0:
    end_NxT = np.minimum(end_NxT, b_T[None] + window)
  end_NxT = np.maximum(end_NxT, b_T[None])
  sums = np.take_along_axis(c_NxT1xP, end_NxT[:, :, None], 1) - c_NxT1xP[:, :T]
  return sums.argmax(-1).astype(np.int32)


def chunk_paths(
  first_N: np.ndarray, lengths_N: np.ndarray, prefix_len: int, W: int, decide
) -> np.ndarray:
  """Path scoring each target token [N, T_max]; decide(rows, b) -> paths for chunk at b."""
  T = int(np.max(lengths_N)) if len(lengths_N) else 0
  out = np.repeat(np.asarray(first_N, np.int64)[:, None], max(T, 1), 1)
  for b in boundaries(T, prefix_len, W)[1:]:
    rows = np.flatnonzero(np.asarray(lengths_N) > b)
    if rows.size:
      out[rows, b:] = np.asarray(decide(rows, b))[:, None]
  return out


def fit_linear(
  running_NxT1xD: np.ndarray,
  labels_NxT: np.ndarray,
  lengths_N: np.ndarray,
  *,
  prefix_len: int,
  stride: int,
  grid,
  seed: int = 0,
) -> router_lib.Router:
  """Logistic regression from the running mean at b to T_b, on every stride-th b >= L."""
  xs, ys = [], []
  for n, length in enumerate(lengths_N):
    bs = np.arange(prefix_len, length, max(1, stride))
    xs.append(running_NxT1xD[n, bs])
    ys.append(labels_NxT[n, bs])
  x, y = np.concatenate(xs), np.concatenate(ys)
  if not len(x):
    raise ValueError(
      f"no router-split sequence is longer than the {prefix_len}-token prefix: no "
      "re-routing examples."
    )
  P = int(np.prod(grid))
  # fit_linear_router takes scores: a one-hot of the label makes argmax = label.
  return router_lib.fit_linear_router(x, np.eye(P, dtype=np.float32)[y], grid, seed=seed)


class TransformerRerouter:
  """θ̄ plus a [D, P] head: path logits at every position (decides at any token)."""

  def __init__(self, model_cfg: model_lib.ModelConfig, num_paths: int):
    self.model = model_lib.Transformer(model_cfg)
    self.num_paths = num_paths
    self._logits = jax.jit(self._logits_fn)

  def _logits_fn(self, params, inputs_BxT):
    _, h_BxTxD = self.model.apply({"params": params["base"]}, inputs_BxT, return_hidden=True)
    return h_BxTxD.astype(jnp.float32) @ params["head"]["w"] + params["head"]["b"]

  def init(self, base: PyTree) -> PyTree:
    d = jax.tree.leaves(base["embed"])[0].shape[-1]
    return {
      "base": base,
      "head": {"w": jnp.zeros((d, self.num_paths)), "b": jnp.zeros((self.num_paths,))},
    }

  def fit(
    self,
    base: PyTree,
    tokens_NxT: np.ndarray,
    labels_NxT: np.ndarray,
    mask_NxT: np.ndarray,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
  ) -> PyTree:
    """Fine-tunes θ̄ + head on cross-entropy to T_b at the masked positions."""
    tx = optax.adamw(optax.cosine_decay_schedule(lr, max(steps, 1), alpha=0.05), weight_decay=0.0)
    params = self.init(base)
    opt = tx.init(params)
    # Inputs [BOS, t_0..t_{T-1}]: position b reads t_{b-1} and decides for targets from b.
    inputs = np.concatenate([np.zeros((len(tokens_NxT), 1), np.int32), tokens_NxT], 1)
    labels = np.concatenate([labels_NxT, labels_NxT[:, -1:]], 1)
    mask = np.concatenate([mask_NxT, np.zeros_like(mask_NxT[:, :1])], 1).astype(np.float32)

    @jax.jit
    def step(params, opt, x, y, m):
      def loss_fn(p):
        ce = optax.softmax_cross_entropy_with_integer_labels(self._logits_fn(p, x), y)
        return (ce * m).sum() / jnp.maximum(m.sum(), 1.0)

      loss, g = jax.value_and_grad(loss_fn)(params)
      upd, opt = tx.update(g, opt, params)
      return optax.apply_updates(params, upd), opt, loss

    rng = np.random.default_rng(seed)
    bs = min(batch_size, len(inputs))
    progress.note(
      f"transformer re-router: fine-tuning θ̄ for {steps} steps of {bs} sequences; the "
      "estimate follows the first steps (config.eval.rerouters=('linear',) skips it)."
    )
    timer = progress.Timer(skip=1, n=3)  # Step 1 compiles.
    with progress.bar(total=steps, desc="transformer re-router", unit="step") as pbar:
      for _ in range(steps):
        idx = rng.choice(len(inputs), bs, replace=False)
        params, opt, loss = step(params, opt, inputs[idx], labels[idx], mask[idx])
        loss.block_until_ready()  # Keeps dispatch close (CPU collectives).
        pbar.update(1)
        if (per_step := timer.tick()) is not None:
          progress.note(
            f"transformer re-router: {per_step:.2f} s/step, about "
            f"{progress.eta(per_step * (steps - timer.steps))} for the other "
            f"{steps - timer.steps} steps."
          )
    return params

  def logits(self, params: PyTree, tokens_NxT: np.ndarray, batch_size: int = 64) -> np.ndarray:
    """[N, T+1, P]: entry b is the decision after reading t_0..t_{b-1}."""
    inputs = np.concatenate([np.zeros((len(tokens_NxT), 1), np.int32), tokens_NxT], 1)
    outs = []
    for s in range(0, len(inputs), batch_size):
      rows = inputs[s : s + batch_size]
      m = len(rows)
      if m < batch_size:
        rows = np.concatenate([rows, np.zeros((batch_size - m,) + rows.shape[1:], np.int32)])
      outs.append(np.asarray(self._logits(params, rows))[:m])
    return np.concatenate(outs)


def save_transformer(params: PyTree, directory: str) -> None:
  """The params as msgpack, then a crc32 of those bytes (4 bytes, little-endian)."""
  data = flax.serialization.msgpack_serialize(jax.device_get(params))
  files.write_bytes(
    files.path(directory) / PARAMS_FILE, data + zlib.crc32(data).to_bytes(4, "little")
  )


def load_transformer(directory: str) -> PyTree | None:
  """The saved params, their crc32 checked (None if none is saved); DamagedFileError if not."""
  path = files.path(directory) / PARAMS_FILE
  if not path.exists():
    return None
  data = path.read_bytes()
  body, crc = data[:-4], int.from_bytes(data[-4:], "little")
  problem = None if len(data) > 4 and zlib.crc32(body) == crc else "its crc32 does not match"
  if problem is None:
    try:
      return flax.serialization.msgpack_restore(body)
    except Exception as e:  # pylint: disable=broad-except  # msgpack's errors have no common base.
      problem = f"{type(e).__name__}: {e}"
  raise errors.DamagedFileError(
    f"re-router file {path} is damaged ({problem}); move {directory} aside (mv {directory} "
    f"{directory}.damaged) and rerun evaluate: it fits the transformer re-router again."
  )
