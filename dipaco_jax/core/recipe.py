"""Everything a run is made of, built once from a config, before any device placement.

    recipe = Recipe.from_config(config)
    params, opt, metrics = recipe.train_step(params, opt, batch)  # ONE path, un-jitted

The grid, the model (config.model: remat, the attention kernel, the chunked loss), the inner
optimizer (config.inner: clipped AdamW, or Muon + AdamW, on the warmup-cosine, microbatches), the
outer optimizer (config.outer), the divergence guard's thresholds (config.guard),
and the pure functions of a run: one path's train, eval and scoring steps, the
initial state, and the outer step of a module from its workers' deltas. Both
runtimes take them as they are. The spmd `Experiment` maps the single-path steps
over the workers (`jax.vmap`) and jits them with shardings, and runs the outer
step as one program over the mesh (`outer_program`); the elastic worker jits the
same single-path step for its one path and the executors jit `module_outer_step`.
Neither builds a model or an optimizer, so a field of those sections reaches both
runtimes the same way (tests/runtime/test_runtimes.py holds every field to that).
"""
# pylint: disable=invalid-name

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax.config import sections
from dipaco_jax.core import attention as attention_lib
from dipaco_jax.core import compression as comp
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.core import inner as inner_lib
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import outer as outer_lib
from dipaco_jax.core import outer_layouts
from dipaco_jax.core import paths as paths_lib
from dipaco_jax.core import streaming
from dipaco_jax.core import topology
from dipaco_jax.types import PyTree


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (and is checkpointed)."""

  step: jax.Array  # Inner steps done by every worker.
  rng: jax.Array
  store: PyTree  # Global modules, leaves [K, ...].
  outer_opt: PyTree  # Outer momentum, store-shaped.
  params: PyTree  # Worker params, leaves [W, ...].
  inner_opt: PyTree  # Worker AdamW states, leading W.


@flax.struct.dataclass
class TrainStateEF(TrainState):
  """The state of a run with error feedback (outer.compression, outer.error_feedback).

  A run without it keeps `TrainState`, so its checkpoints are as they were.
  """

  ef: PyTree  # Each worker's error-feedback residual, params-shaped float32 [W, ...].


@flax.struct.dataclass
class TrainStateStream(TrainState):
  """The state of a run whose outer updates land late (outer.overlap > 0, core/streaming.py)."""

  jump: PyTree  # θ_new − θ_t of the fragment in flight (0 elsewhere), params-shaped [W, ...].


@flax.struct.dataclass
class TrainStateStreamEF(TrainStateEF):
  """outer.overlap > 0 with error feedback."""

  jump: PyTree


def error_feedback(state: TrainState) -> PyTree | None:
  """The state's error-feedback residuals, or None (a run without them)."""
  return getattr(state, "ef", None)


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
  """A run's grid, model, optimizers, guard thresholds and its pure single-path functions."""

  topo: topology.Topology
  model_cfg: sections.ModelConfig
  inner_cfg: sections.InnerConfig  # total_steps resolved (H*T unless given).
  outer_cfg: sections.OuterConfig
  guard_cfg: sections.GuardConfig
  init: str  # config.dipaco.init: every module from one θ̄, or each its own.
  inner_steps: int  # H.
  outer_steps: int  # T.
  model: model_lib.Transformer
  inner_tx: optax.GradientTransformation
  outer_tx: optax.GradientTransformation
  # The 'data' shards of the batch whose gradients the microbatch scan keeps apart until it
  # ends (inner.grad_sums): the mesh's 'data' axis, 1 without a mesh or with FSDP (which
  # shards the gradient over 'data' as it goes).
  data_shards: int = 1

  @classmethod
  def from_config(cls, config, mesh=None) -> "Recipe":
    """The recipe of `config`; `mesh`: the spmd program's (splash attention's shard_map)."""
    d = config.dipaco
    total = config.inner.total_steps
    model_cfg = sections.ModelConfig.of(config)
    inner_cfg = sections.InnerConfig.of(
      config, total_steps=d.inner_steps * d.outer_steps if total is None else total
    )
    outer_cfg = comp.resolved(sections.OuterConfig.of(config))  # compression "auto" chosen.
    topo = topology.from_config(config)
    streaming.check(
      outer_cfg.fragments,
      outer_cfg.overlap,
      d.inner_steps,
      len(topo.store_groups()),
      outer_cfg.enabled,
    )
    # What the backend cannot run (splash off TPU, cuDNN off GPU) fails here, in both runtimes.
    attention_lib.check(
      model_cfg, (config.data.seq_len, config.eval.seq_len), attention_lib.platform_of(mesh)
    )
    return cls(
      topo=topo,
      model_cfg=model_cfg,
      inner_cfg=inner_cfg,
      outer_cfg=outer_cfg,
      guard_cfg=sections.GuardConfig.of(config),
      init=d.init,
      inner_steps=d.inner_steps,
      outer_steps=d.outer_steps,
      model=model_lib.Transformer(model_cfg, mesh=mesh, fsdp=mesh is not None and config.mesh.fsdp),
      inner_tx=inner_lib.optimizer(inner_cfg),
      outer_tx=outer_lib.optimizer(outer_cfg),
      data_shards=1 if mesh is None or config.mesh.fsdp else int(mesh.shape["data"]),
    )

  @property
  def outer_enabled(self) -> bool:
    return self.outer_cfg.enabled

  @property
  def compressed(self) -> bool:
    """Whether the workers' deltas cross in a compressed form (outer.compression)."""
    return self.outer_cfg.enabled and self.outer_cfg.compression != "none"

  @property
  def fragments(self) -> int:
    """F, the fragments synced at staggered steps (outer.fragments; 1: all groups at once)."""
    return self.outer_cfg.fragments if self.outer_cfg.enabled else 1

  @property
  def overlap(self) -> int:
    """τ, the inner steps an outer update is in flight (outer.overlap; 0: applied at once)."""
    return self.outer_cfg.overlap if self.outer_cfg.enabled else 0

  @property
  def feedback(self) -> bool:
    """Whether each worker keeps an error-feedback residual (state `ef`)."""
    return self.compressed and self.outer_cfg.error_feedback

  # One path (no leading worker axis): the runtimes map or jit these.

  def train_step(self, params: PyTree, opt_state: PyTree, batch: dict):
    """One inner optimizer step of one path: (params, opt_state, metrics)."""
    return inner_lib.train_step(
      params,
      opt_state,
      batch,
      model=self.model,
      tx=self.inner_tx,
      microbatches=self.inner_cfg.microbatches,
      data_shards=self.data_shards,
    )

  def finish_step(self, params: PyTree, opt_state: PyTree, g_sum, loss_sum, weight):
    """The part of a microbatched `train_step` after its scan (inner.finish_step)."""
    return inner_lib.finish_step(params, opt_state, g_sum, loss_sum, weight, tx=self.inner_tx)

  def eval_step(self, params: PyTree, batch: dict) -> dict:
    """Summed loss and token count of one batch for one path."""
    return inner_lib.eval_step(
      params, batch, model=self.model, microbatches=self.inner_cfg.microbatches
    )

  def token_logprobs(self, params: PyTree, inputs_BxT: jax.Array, targets_BxT: jax.Array):
    """log p(target_t | inputs_<=t) for one path: [B, T] float32 (routing, scoring)."""
    logits_BxTxV = self.model.apply({"params": params}, inputs_BxT)
    return -optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)

  def init_opt(self, params: PyTree) -> PyTree:
    """One path's inner optimizer state (every worker keeps its own: DiLoCo never syncs them)."""
    return self.inner_tx.init(params)

  def group_norms(self, params: PyTree) -> dict:
    """‖θ_g‖ per group of one path: the divergence guard's input."""
    return inner_lib.group_norms(params)

  def restart_schedule(self, inner_opt: PyTree) -> PyTree:
    """The inner LR schedule from its start, Adam's moments kept (a re-shard, paper Fig. 10)."""
    return inner_lib.restart_schedule(inner_opt)

  # The run's state.

  def init_params(self, rng: jax.Array) -> PyTree:
    """θ̄: one path's params at random."""
    return model_lib.init_params(self.model_cfg, rng)

  def abstract_params(self) -> PyTree:
    """θ̄'s shapes and dtypes, without computing it."""
    return jax.eval_shape(self.init_params, jax.random.key(0))

  def init_state(self, rng: jax.Array, theta: PyTree | None = None) -> TrainState:
    """The state at step 0: all modules from θ̄ (given, or one random init), or each its own."""
    if theta is None and self.init == "independent":
      kmax = max(s.num_modules for s in self.topo.store_groups())
      thetas = jax.vmap(self.init_params)(jax.random.split(rng, kmax))
      store = {
        s.name: jax.tree.map(lambda x, k=s.num_modules: x[:k], thetas[s.name])
        for s in self.topo.store_groups()
      }
    else:
      store = paths_lib.init_store(self.init_params(rng) if theta is None else theta, self.topo)
    params = paths_lib.assemble(store, self.topo)
    state = TrainState(
      step=jnp.zeros((), jnp.int32),
      rng=jax.random.key_data(rng),
      store=store,
      outer_opt=self.outer_tx.init(store),
      params=params,
      inner_opt=jax.vmap(self.init_opt)(params),
    )
    state = self.with_ef(state, self.init_ef(params)) if self.feedback else state
    return self.with_jump(state, self.init_jump(params)) if self.overlap else state

  @staticmethod
  def with_ef(state: TrainState, ef: PyTree) -> TrainStateEF:
    """`state` with error-feedback residuals `ef`."""
    fields = {f: getattr(state, f) for f in TrainState.__dataclass_fields__}
    return TrainStateEF(**fields, ef=ef)

  @staticmethod
  def with_jump(state: TrainState, jump: PyTree) -> TrainStateStream:
    """`state` (with or without residuals) with the update in flight `jump`."""
    if isinstance(state, TrainStateEF):
      fields = {f: getattr(state, f) for f in TrainStateEF.__dataclass_fields__}
      return TrainStateStreamEF(**fields, jump=jump)
    fields = {f: getattr(state, f) for f in TrainState.__dataclass_fields__}
    return TrainStateStream(**fields, jump=jump)

  @staticmethod
  def init_jump(params: PyTree) -> PyTree:
    """No update in flight: zeros shaped and typed as the params."""
    return jax.tree.map(jnp.zeros_like, params)

  @staticmethod
  def init_ef(params: PyTree) -> PyTree:
    """Every worker's error-feedback residual at the start: zeros, float32."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)

  # The outer step.

  def alpha(self, sizes_W) -> jax.Array:
    """Outer weights α_w: shard sizes |D_w| (over the largest) or uniform."""
    if self.outer_cfg.weighting == "uniform":
      return jnp.ones(self.topo.num_workers, jnp.float32)
    return jnp.asarray(np.asarray(sizes_W, np.float64) / max(np.max(sizes_W), 1), jnp.float32)

  def outer_program(self, mesh, specs, groups=None):
    """The spmd outer step over `mesh` (specs of store, outer state, params): to be jitted.

    groups: the store groups it syncs (a fragment's, or a flush's), None for all.
    """
    return outer_layouts.sharded_outer_step(
      self.topo, self.outer_cfg, self.outer_tx, mesh, specs, groups
    )

  def module_outer_step(self, theta: PyTree, opt_state: PyTree, deltas_N: PyTree, alpha_N):
    """One module's outer step from its N workers' deltas (an elastic executor's)."""
    return outer_lib.module_outer_step(
      theta, opt_state, deltas_N, alpha_N, tx=self.outer_tx, cfg=self.outer_cfg
    )

  def worker_deltas(self, module: PyTree, params: PyTree) -> PyTree:
    """A worker's own delta Δ = θ_module − θ_worker of each leaf (float32), what it sends."""
    one = np.zeros(1, np.int32)  # Both carry a leading axis of 1.
    return jax.tree.map(lambda m, p: outer_lib.worker_deltas(m, p, one), module, params)

  def encode_deltas(self, deltas: PyTree, residual: PyTree | None):
    """A worker's deltas (leading 1) in their wire form, and its next residual (or None).

    (wire: each leaf a {"q": codes, "s": scales} dict (core/compression.py), the
    next residual Δ + e − C(Δ + e), None without feedback).
    """
    one = lambda d, e: outer_lib.sent(self.outer_cfg, d, e)[::2]  # (wire, next residual).
    res = residual if residual is not None else jax.tree.map(lambda _: None, deltas)
    pairs = jax.tree.map(one, deltas, res, is_leaf=lambda x: x is None)
    is_pair = lambda x: isinstance(x, tuple)
    wire = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
    nxt = None if residual is None else jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
    return wire, nxt

  def decode_deltas(self, wire: PyTree, template: PyTree) -> PyTree:
    """The float32 deltas (shaped as `template`, leading 1) of `encode_deltas`' wire form."""
    c = self.outer_cfg

    def one(t, enc):
      n = comp.as_rows(jnp.zeros(t.shape, jnp.float32)).shape[-1]
      dec = comp.decode(enc, c.compression, c.compression_block, n, c.compression_keep)
      return dec.reshape(t.shape)

    return jax.tree.map(one, template, wire, is_leaf=lambda x: isinstance(x, dict) and "q" in x)

  def apply_update(self, module: PyTree, wire: PyTree) -> PyTree:
    """A module (leading 1) rebuilt from its previous version and the downlink's wire form.

    The executor writes the new version with this program and a worker that holds the
    previous version rebuilds it with the same one: the same bytes.
    """
    return jax.tree.map(lambda o, e: outer_lib.apply_update(o, e, self.outer_cfg), module, wire)

  def wire_template(self, template: PyTree) -> PyTree:
    """Shapes and dtypes of the wire form of deltas shaped as `template` (leading 1)."""
    zeros = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), template)
    return jax.eval_shape(lambda d: self.encode_deltas(d, None)[0], zeros)

  # The guard.

  def guard(self, labels: list[str], **kw) -> guard_lib.DivergenceGuard:
    """The divergence guard over workers `labels` (config.guard's thresholds)."""
    if self.inner_cfg.optimizer == "muon":  # Its stops name both LRs: either may be the cause.
      kw.setdefault("lr", "config.inner.lr (AdamW's leaves) or config.inner.muon_lr (Muon's)")
    return guard_lib.DivergenceGuard(
      self.guard_cfg,
      vocab_size=self.model_cfg.vocab_size,
      warmup_steps=self.inner_cfg.warmup_steps,
      inner_steps=self.inner_steps,
      labels=labels,
      **kw,
    )
