"""The trainer's shard plan: the active routing phase's shards and what the loop reads from them.

Phase 0's shards come from the configured router; phase k's from the k-th
discriminative re-shard (routing/phases.py, paper §2.4.2), which runs after
the outer steps `routing.discriminative_steps(config)`. `ShardPlan` holds the
active phase's shard set, its train feed (without early stopping's held-out
documents), its validation batches and early stopping's batches (each the same
at every evaluation) and α; `reshard` fits (or reloads) the next phase's router
with the paths' current params and opens its shards. What else happens at a
re-shard (the inner schedule restart) is the loop's business.

Resume stays bit-exact: the checkpoint's data state holds the active phase,
and a phase's router and shards are reused when they already exist.
"""

import jax
from absl import logging
from jax.experimental import multihost_utils

from dipaco_jax import data as data_lib
from dipaco_jax import routing
from dipaco_jax.data import feed as feed_lib
from dipaco_jax.data import shard_cache
from dipaco_jax.runtime import early_stopping
from dipaco_jax.types import PyTree


def prepare_shards(config, num_workers: int, shard_dir: str, assign=None) -> data_lib.ShardSet:
  """Every process writes 1/process_count of the shards (once); process 0 joins the parts.

  A one-process run first looks in the shard cache (data/shard_cache.py) and adds
  what it wrote to it.
  """
  part, num_parts = jax.process_index(), jax.process_count()
  cache = config.data.shard_cache if num_parts == 1 else shard_cache.OFF
  with data_lib.one_writer(shard_dir, num_parts):  # A shard dir shared with another run.
    if shard_cache.fetch(cache, config.data, num_workers, shard_dir, assign):
      logging.info("shards of %s copied from the shard cache", shard_dir)
    data_lib.write_shard_part(
      config.data, num_workers, shard_dir, assign=assign, part=part, num_parts=num_parts
    )
    multihost_utils.sync_global_devices(f"dipaco_shard_parts:{shard_dir}")
    if part == 0:
      data_lib.finish_shards(
        config.data, num_workers, shard_dir, assign=assign, num_parts=num_parts
      )
    multihost_utils.sync_global_devices(f"dipaco_shards_ready:{shard_dir}")
    shard_set = data_lib.prepare_shards(config.data, num_workers, shard_dir, assign=assign)
    if shard_cache.store(cache, config.data, num_workers, shard_dir, assign):
      logging.info("shards of %s added to the shard cache", shard_dir)
  return shard_set


class ShardPlan:
  """The active shard set of a run and everything the loop reads from it."""

  def __init__(self, config, workdir: str, exp):
    self.config, self.workdir, self.exp = config, str(workdir), exp
    self.reshard_steps = [
      s * config.dipaco.inner_steps for s in routing.discriminative_steps(config)
    ]
    needs = config.routing.router != "random" or self.reshard_steps
    self.extractor = routing.extractor_from_config(config) if needs else None
    self.phase = -1
    self._open(0)

  def _open(self, phase: int) -> None:
    """Prepares (or reopens) phase `phase`'s shards; rebuilds feed, α and eval batches."""
    self.router = routing.load_phase_router(
      self.config, self.workdir, self.exp.topo, phase, self.extractor
    )
    assign = routing.make_assignment(self.config, self.router, self.extractor)
    self.shard_set = prepare_shards(
      self.config,
      self.exp.topo.num_workers,
      routing.shard_dir(self.config, self.workdir, phase),
      assign=assign,
    )
    self.alpha_W = self.exp.recipe.alpha(self.shard_set.sizes("train"))
    rest, heldout = early_stopping.holdouts(self.config)
    self.train_it = feed_lib.make_feed(self.exp, self.shard_set, "train", holdout=rest)
    n = self.config.eval.batches
    val_it = feed_lib.make_feed(self.exp, self.shard_set, "validation", shuffle=False)
    self.eval_batches = [val_it.next_batch() for _ in range(n)]
    # Early stopping's loss: the held-out slice of each training shard, else validation.
    self.stop_batches = self.eval_batches
    if heldout is not None:
      it = feed_lib.make_feed(self.exp, self.shard_set, "train", shuffle=False, holdout=heldout)
      self.stop_batches = [it.next_batch() for _ in range(n)]
    self.phase = phase

  def shard_record(self) -> dict[str, float]:
    """The active phase's shard sizes and the router split's share moved off its argmin path.

    Tokens per training shard: min / median / max / mean, and min over mean.
    """
    stats = routing.report.token_stats(self.shard_set.sizes("train"))
    info = self.router.router.info if self.router.router is not None else {}
    return {
      "shards/phase": self.phase,
      **{f"shards/{k}": v for k, v in stats.items()},
      "shards/moved_off_label": float(info.get("moved_off_label", 0.0)),
    }

  def restore(self, data_state: dict) -> None:
    """Switches to the checkpoint's phase and position."""
    phase = int(data_state["routing"]["phase"])
    if phase != self.phase:
      self._open(phase)
    self.train_it.set_state(data_state["train"])

  def data_state(self) -> dict:
    return {
      "train": self.train_it.get_state(),
      "routing": {"phase": self.phase, "assignment": self.shard_set.meta.get("assignment")},
    }

  def reshards_after(self, step: int) -> bool:
    """Whether a discriminative re-shard follows the outer step at inner step `step`."""
    return step in self.reshard_steps

  def reshard(self, step: int, params_W: PyTree, scores_NxP=None) -> None:
    """The next discriminative phase: fit (or reload) its router on `params_W`; open its shards.

    `scores_NxP`: every path's scores of the router split, already computed
    (elastic mode's scoring tasks), in place of scoring with `params_W`.
    """
    phase = self.reshard_steps.index(step) + 1
    directory = routing.router_dir(self.workdir, phase)
    if not routing.Router.exists(directory):
      if scores_NxP is None:
        scorer = routing.PathScorer(self.exp, params_W, seq_len=routing.score_len(self.config))
        router = routing.fit_discriminative_router(self.config, scorer, self.extractor)
      else:
        router = routing.fit_discriminative_router(
          self.config, None, self.extractor, scores_NxP=scores_NxP, topo=self.exp.topo
        )
      if jax.process_index() == 0:
        router.save(directory)
      logging.info("discriminative phase %d at step %d: %s", phase, step, router.info)
    multihost_utils.sync_global_devices(f"dipaco_router_phase_{phase}")
    self._open(phase)
