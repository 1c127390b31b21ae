"""The divergence guard: stops a diverged run at the step it shows, before that state is kept.

Three rules, checked on every inner step's metrics, per worker (config.guard; 0 turns a rule off):
  * a non-finite training loss;
  * a group's parameter norm (embed, block_i, head) above `max_param_norm_ratio` times its
    norm at the start of the inner phase, i.e. of the store's module the worker started the
    phase from: AdamW steps far too large blow the params up long before the loss turns NaN
    (inner.lr=1e6 reaches ~1e13 within a phase, the loss sits at ln V);
  * a mean training loss over the last `stuck_steps` inner steps at or above ln V, the loss of
    predicting uniformly over the vocabulary: a model that learns anything (even unigram
    counts) is well below it. A random init starts near (or above) ln V, so the window must
    lie after `inner.warmup_steps`. "At" allows STUCK_MARGIN: a float32 uniform prediction
    reads just below ln V.
Both runtimes run the same rules from the recipe (`Recipe.guard`): the spmd loop on all workers
at once, each elastic task on its own worker. The phase's reference norms are the same in both
(the store's modules, whatever was restarted); the loss window holds the steps this guard has
seen: since the spmd process started, or since the run started for an elastic worker (its task
reads its earlier tasks' losses).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import errors
from dipaco_jax.config import sections

STUCK_MARGIN = 0.01  # Nats: a loss this close to ln V counts as "at" it.

INNER_LR = "config.inner.lr"  # The inner LR field(s) a stop names (Muon's too: Recipe.guard).


def _lower_lr(lr: str) -> str:
  return (
    f"Lower {lr}, raise config.inner.warmup_steps or set config.inner.clip_norm, then rerun "
    "the same command to resume"
  )


def all_finite(tree) -> jax.Array:
  """Whether every entry of every leaf is finite (checked before params are kept)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


class DivergenceError(errors.UserError):
  """Training diverged: a non-finite loss or params, a loss stuck at ln V, exploding params."""


class NonFiniteLossError(DivergenceError):
  """A worker's training loss (or a parameter) became NaN or Inf."""


class DivergenceGuard:
  """The rules over the workers `labels` ([W] losses and {group: [W]} norms per step)."""

  def __init__(
    self,
    cfg: sections.GuardConfig,
    *,
    vocab_size: int,
    warmup_steps: int,
    inner_steps: int,
    labels: list[str],
    kept: str = "no checkpoint was saved",
    fetch=jax.device_get,
    lr: str = INNER_LR,
  ):
    """The rules over workers `labels`.

    `kept`: what the run keeps if the guard stops it now (the runtime's words). `fetch`:
    brings a phase's reference norms ({group: norms}) to this host (the spmd loop's gathers
    across processes); None: they are read where they are (one process, e.g. an elastic task).
    """
    self.cfg, self.labels, self.kept, self.fetch, self.lr = cfg, labels, kept, fetch, lr
    self.ln_v = float(np.log(vocab_size))
    self.warmup, self.H = warmup_steps, inner_steps
    self._reference = {}  # Inner phase -> (its start step, {group: norms [W]}).
    self._losses = collections.deque(maxlen=max(cfg.stuck_steps, 1))

  def saved(self, step: int) -> None:
    """A checkpoint of `step` is kept: the words of a later stop say so."""
    self.kept = f"the last checkpoint, step {step}, is kept and nothing later was saved"

  def start_phase(self, phase: int, norms: dict) -> None:
    """The norms the phase's steps are held against: the workers' params at its start.

    `norms` ({group: [W]}) may be device arrays still being computed: they are
    read when the phase's first step is checked.
    """
    self._reference = {p: r for p, r in self._reference.items() if p >= phase - 1}
    self._reference[phase] = (phase * self.H, norms)

  def seed_losses(self, losses_SxW) -> None:
    """Earlier steps' losses, oldest first, as if this guard had seen them (a task's past)."""
    for loss_W in losses_SxW:
      self._losses.append(np.asarray(loss_W, np.float64))

  def _stop(self, cls, what: str, fix: str):
    raise cls(f"{what}: the run diverged; {self.kept}. {fix}.")

  def _paths(self, bad_W: np.ndarray) -> list[str]:
    return [self.labels[w] for w in np.flatnonzero(bad_W)]

  def check(self, step: int, loss_W, norms: dict[str, np.ndarray]) -> None:
    """Raises DivergenceError when a rule fires at inner step `step`."""
    loss_W = np.asarray(loss_W, np.float64).reshape(-1)
    bad_W = ~np.isfinite(loss_W)
    if bad_W.any():
      self._stop(
        NonFiniteLossError,
        f"non-finite training loss at step {step} on paths {self._paths(bad_W)}",
        _lower_lr(self.lr),
      )
    self._check_norms(step, norms)
    if not self.cfg.stuck_steps:
      return
    n = self.cfg.stuck_steps
    self._losses.append(loss_W)
    if len(self._losses) == n and step - n >= self.warmup:
      mean_W = np.mean(self._losses, axis=0)
      bad_W = mean_W >= self.ln_v - STUCK_MARGIN
      if bad_W.any():
        self._stop(
          DivergenceError,
          f"training loss stayed at or above ln V = {self.ln_v:.3f} (uniform prediction; "
          f"mean {np.max(mean_W):.3f}) over steps {step - n + 1}-{step} "
          f"on paths {self._paths(bad_W)}, after warmup",
          f"Check {self.lr} (too high blows the model up, too low never leaves "
          "ln V) and start again in a new --workdir, or raise config.guard.stuck_steps",
        )

  def _check_norms(self, step: int, norms: dict[str, np.ndarray]) -> None:
    ratio_max, phase = self.cfg.max_param_norm_ratio, (step - 1) // self.H
    if not ratio_max or phase not in self._reference:
      return
    start, norms0 = self._reference[phase]
    if isinstance(norms0, dict):  # First read: to the host, once.
      groups = list(norms0)
      host = self.fetch(norms0)
      norms0 = groups, np.stack([np.asarray(host[g], np.float64).reshape(-1) for g in groups])
      self._reference[phase] = start, norms0
    groups, norm0_GxW = norms0
    norm_GxW = np.stack([np.asarray(norms[g], np.float64).reshape(-1) for g in groups])
    ratio_GxW = norm_GxW / np.maximum(norm0_GxW, 1e-30)
    bad_GxW = ~(ratio_GxW <= ratio_max)  # NaN too.
    if bad_GxW.any():
      g, w = np.unravel_index(
        np.argmax(np.where(bad_GxW, np.nan_to_num(ratio_GxW, nan=np.inf), -np.inf)), ratio_GxW.shape
      )
      self._stop(
        DivergenceError,
        f"parameter norm of {groups[g]} grew {ratio_GxW[g, w]:.3g}x since step {start} "
        f"(to {norm_GxW[g, w]:.3g}) on paths {self._paths(bad_GxW.any(0))} at step {step}, "
        f"over config.guard.max_param_norm_ratio={ratio_max:g}",
        _lower_lr(self.lr),
      )

  def not_finite(self, step: int) -> None:
    """Stops on non-finite params found before they are kept at `step`."""
    self._stop(
      NonFiniteLossError,
      f"non-finite parameters after step {step}",
      f"Lower {self.lr} or config.outer.lr, then rerun the same command to resume",
    )
