"""The spmd loop's outer exchange: what the state goes through after each inner step.

    exchange = experiment.exchange()          # One of the forms below, from config.outer.
    exchange.begin(state)                     # Once, with the fresh or restored state.
    state, norms = exchange(state, step, alpha_W)  # After every inner step.

The loop calls it once a step and names no outer program; which one runs is the
config's:

  `NoOuter`     outer.enabled=False: at each phase's end the store takes the workers'
                params (no outer optimizer: dense, or independent paths).
  `Plain`       the outer step (core/outer_layouts.py) every H inner steps.
  `Compressed`  outer.compression: the same, its deltas coded (with or without error
                feedback, `TrainStateEF.ef`), formed against each worker's phase-start
                params, which the exchange keeps (not checkpointed: the store holds them).
  `Streamed`    outer.fragments > 1 or outer.overlap > 0 (core/streaming.py), either
                compression: each fragment's groups at its own steps, an update in
                flight waits in the state (`TrainStateStream.jump`) until it lands.

norms: the ‖Δ‖ metrics of an outer step dispatched after this step (None: none was).
"""
# pylint: disable=invalid-name

from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.core import streaming


class NoOuter:
  """outer.enabled=False: the store follows the workers' params at each phase's end."""

  def __init__(self, exp, link=None):
    self.exp, self.link = exp, link
    self.H = exp.recipe.inner_steps
    self.total = exp.recipe.inner_steps * exp.recipe.outer_steps

  def describe(self) -> str:
    return "none (outer.enabled=False): the store takes the workers' params each phase"

  def begin(self, state) -> None:
    """Called once, with the fresh or restored state, before the first step."""
    del state

  def __call__(self, state, step: int, alpha_W):
    if step % self.H:
      return state, None
    return state.replace(store=self.exp.sync_store(state.params)), None


class Plain(NoOuter):
  """The outer step on the mesh every H inner steps."""

  def describe(self) -> str:
    return f"the outer step every {self.H} inner steps"

  def __call__(self, state, step: int, alpha_W):
    if step % self.H:
      return state, None
    store, outer_opt, params, om = self.exp.outer_step(
      state.store, state.outer_opt, state.params, alpha_W
    )
    return state.replace(store=store, outer_opt=outer_opt, params=params), om["delta_norm"]


class Compressed(NoOuter):
  """outer.compression: the workers' deltas coded, against their phase-start params."""

  start = None  # Each worker's params at its phase's start (its modules).

  def describe(self) -> str:
    c = self.exp.recipe.outer_cfg
    return (
      f"the outer step every {self.H} inner steps, {c.compression} "
      f"({'with' if self.exp.recipe.feedback else 'without'} error feedback)"
    )

  def begin(self, state) -> None:
    self.start = self.exp.start_params(state.store)

  def _step(self, program, state, alpha_W):
    """One compressed outer program on the state: (state, metrics)."""
    feedback = self.exp.recipe.feedback
    ef = recipe_lib.error_feedback(state) if feedback else {}
    store, outer_opt, params, om, ef = program(
      state.store, state.outer_opt, state.params, alpha_W, ef, self.start
    )
    state = state.replace(store=store, outer_opt=outer_opt, params=params)
    return (state.replace(ef=ef) if feedback else state), om

  def __call__(self, state, step: int, alpha_W):
    if step % self.H:
      return state, None
    state, om = self._step(self.exp.outer_step, state, alpha_W)
    self.start = self.exp.copy_params(state.params)  # The next phase's (params are donated).
    return state, om["delta_norm"]


class Streamed(Compressed):
  """outer.fragments / outer.overlap: each fragment's sync at its steps, landing τ steps on.

  link: a simulated slow network (benchmarks/stream_link.py), told when each exchange is
  dispatched (`sent(step, groups)`) and asked to finish it where its update must land
  (`landed(step, params)`); None (a run) costs nothing.
  """

  def __init__(self, exp, link=None):
    super().__init__(exp, link)
    self.F, self.tau = exp.recipe.fragments, exp.recipe.overlap
    self.compressed = exp.recipe.compressed

  def describe(self) -> str:
    fragments = [",".join(g) for g in self.exp.fragments]
    return (
      f"streamed: {self.F} fragments {fragments}, each lands {self.tau} inner steps after its "
      f"dispatch; deltas {self.exp.recipe.outer_cfg.compression if self.compressed else 'none'}"
    )

  def begin(self, state) -> None:
    if self.compressed:
      super().begin(state)

  def __call__(self, state, step: int, alpha_W):
    """After inner step `step`: land the update in flight, then sync the fragments due."""
    exp, link, tau = self.exp, self.link, self.tau
    end = step == self.total  # Everything lands, and every fragment syncs (a flush).
    if tau and (end or streaming.lands(step, self.F, self.H, tau)):
      if link is not None:
        link.landed(step, state.params)
      params, jump = exp.land(state.params, state.jump)
      state = state.replace(params=params, jump=jump)
    due = streaming.due(step, self.F, self.H)
    if not due and not end:
      return state, None
    groups = None if end else frozenset(g for f in due for g in exp.fragments[f])
    program = exp.outer_fragment(groups)
    old = exp.copy_params(state.params) if tau and not end else None  # θ_t, trained on.
    if self.compressed:
      state, om = self._step(program, state, alpha_W)
    else:
      store, outer_opt, params, om = program(state.store, state.outer_opt, state.params, alpha_W)
      state = state.replace(store=store, outer_opt=outer_opt, params=params)
    if link is not None:
      link.sent(step, sorted(groups) if groups else list(exp.abstract_state.store))
      if not tau or end:  # Applied at once: the next step waits for the exchange.
        link.landed(step, state.params)
    if self.compressed:  # Each worker's modules as they now are in the store.
      self.start = exp.start_params(state.store)
    if old is not None:  # In flight: the workers train on θ_t; θ_new − θ_t lands τ steps on.
      state = state.replace(params=old, jump=exp.jump(state.params, old))
    return state, om["delta_norm"]


def build(exp, link=None) -> NoOuter:
  """The exchange of `exp`'s recipe (the module docstring's table); link: Streamed's."""
  r = exp.recipe
  if r.fragments > 1 or r.overlap > 0 or link is not None:
    return Streamed(exp, link)
  if r.compressed:
    return Compressed(exp, link)
  return Plain(exp, link) if r.outer_enabled else NoOuter(exp, link)
