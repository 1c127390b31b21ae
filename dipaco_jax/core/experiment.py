"""A recipe placed on a mesh: shardings and the jitted inner, outer and eval programs.

`Experiment` is the spmd runtime's form of the recipe (recipe.py): the
single-path steps mapped over the workers with `jax.vmap`, jitted once each with
explicit shardings and donation, and the outer step as one program over the
mesh. Routing, evaluation, serving and the AOT tool use the same programs.
"""
# pylint: disable=invalid-name

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax.core import exchange as exchange_lib
from dipaco_jax.core import guard as guard_lib
from dipaco_jax.core import paths as paths_lib
from dipaco_jax.core import recipe as recipe_lib
from dipaco_jax.core import sharding
from dipaco_jax.core import streaming
from dipaco_jax.core import topology
from dipaco_jax.data import feed
from dipaco_jax.errors import ConfigError
from dipaco_jax.types import PyTree

TrainState = recipe_lib.TrainState


class Experiment:
  """A config's recipe on a mesh: shardings and jitted steps over all workers."""

  def __init__(self, config, mesh=None):
    self.config = config
    topo = topology.from_config(config)
    self.mesh = mesh or sharding.make_mesh(config.mesh, topo.num_workers)
    self.recipe = r = recipe_lib.Recipe.from_config(config, mesh=self.mesh)
    self.topo, self.model, self.model_cfg = r.topo, r.model, r.model_cfg
    sharding.check_batch_divides(config.data.batch_size, self.mesh.shape["data"])
    sharding.check_microbatches(
      config.data.batch_size, r.inner_cfg.microbatches, self.mesh.shape["data"]
    )
    mc, model_axis = r.model_cfg, self.mesh.shape["model"]
    if mc.attention_kernels == "matrix" and mc.num_heads % model_axis:
      raise ConfigError(
        f"config.model.attention_kernels='matrix' splits [D, H K] kernels over the 'model' mesh "
        f"axis ({model_axis}), which does not divide model.num_heads={mc.num_heads}: a cut "
        "inside a head; choose a config.mesh.model that divides num_heads, or "
        "attention_kernels='heads'."
      )
    self.fsdp = config.mesh.fsdp
    abstract = jax.eval_shape(r.init_state, jax.random.key(0), None)
    specs = self._state_specs(abstract)
    if r.compressed:  # Blocks must not straddle the devices that code their parts.
      sharding.check_block(abstract.params, specs.params, self.mesh.shape, r.outer_cfg)
    self.state_sharding = sharding.named(self.mesh, specs)
    self.abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_sharding
    )
    ps, ss = self.state_sharding.params, self.state_sharding.store
    self.batch_sharding = NamedSharding(self.mesh, sharding.batch_spec())
    per_worker = NamedSharding(self.mesh, P("path"))
    replicated = NamedSharding(self.mesh, P())
    # spmd_axis_name: the workers' axis is 'path' inside the step too, so a shard_map in the
    # model (splash attention) keeps each worker's share on its own devices.
    over_workers = lambda f: jax.vmap(f, spmd_axis_name="path")
    self.inner_step = jax.jit(
      over_workers(r.train_step),
      in_shardings=(ps, self.state_sharding.inner_opt, self.batch_sharding),
      out_shardings=(ps, self.state_sharding.inner_opt, per_worker),
      donate_argnums=(0, 1),
    )
    outer_in = (ss, self.state_sharding.outer_opt, ps, replicated)
    outer_out = (ss, self.state_sharding.outer_opt, ps, replicated)
    if r.compressed:  # (..., ef, start) -> (..., ef): outer_layouts.sharded_outer_step.
      ef = self.state_sharding.ef if r.feedback else {}
      outer_in, outer_out = (*outer_in, ef, ps), (*outer_out, ef)
    outer_specs = (specs.store, specs.outer_opt, specs.params)
    self._outer_program = lambda groups: jax.jit(
      r.outer_program(self.mesh, outer_specs, groups),
      in_shardings=outer_in,
      out_shardings=outer_out,
      donate_argnums=(0, 1, 2, 4) if r.compressed else (0, 1, 2),
    )
    self._outer_programs = {}
    self.outer_step = self.outer_fragment(None)
    # outer.fragments: each fragment's store groups; outer.overlap: the update in flight.
    self.fragments = streaming.split(abstract.store, r.fragments)
    # θ_new − θ_t and θ + jump, where a fragment's update is in flight (core/streaming.py).
    self.jump = jax.jit(
      lambda new, old: jax.tree.map(lambda n, o: n - o, new, old),
      in_shardings=(ps, ps),
      out_shardings=ps,
      donate_argnums=(0,),
    )
    self.land = jax.jit(  # (θ + jump, 0): the update lands, nothing is in flight after.
      lambda params, jump: (
        jax.tree.map(lambda p, j: p + j, params, jump),
        jax.tree.map(jnp.zeros_like, jump),
      ),
      in_shardings=(ps, ps),
      out_shardings=(ps, ps),
      donate_argnums=(0, 1),
    )
    # With compression: each worker's params at its phase's start (its modules), kept by the
    # spmd loop beside the state (not checkpointed: the store holds them at any step).
    self.start_params = jax.jit(
      lambda store: paths_lib.assemble(store, self.topo), in_shardings=(ss,), out_shardings=ps
    )
    self.copy_params = jax.jit(
      lambda params: jax.tree.map(jnp.copy, params), in_shardings=(ps,), out_shardings=ps
    )
    self.eval_step = jax.jit(
      over_workers(r.eval_step),
      in_shardings=(ps, self.batch_sharding),
      out_shardings=per_worker,
    )
    self.sync_store = jax.jit(
      lambda params: paths_lib.disassemble(params, self.topo), in_shardings=(ps,), out_shardings=ss
    )
    self.group_norms = jax.jit(
      jax.vmap(r.group_norms), in_shardings=(ps,), out_shardings=per_worker
    )
    # The norms of the params each worker starts a phase from: its modules in the store.
    self.store_norms = jax.jit(
      lambda store: jax.vmap(r.group_norms)(paths_lib.assemble(store, self.topo)),
      in_shardings=(ss,),
      out_shardings=per_worker,
    )
    self.all_finite = jax.jit(guard_lib.all_finite)

  def exchange(self, link=None) -> exchange_lib.NoOuter:
    """The spmd loop's outer exchange, one call per inner step (core/exchange.py).

    link: a simulated slow network for benchmarks (exchange.Streamed); None for a run.
    """
    return exchange_lib.build(self, link)

  def outer_fragment(self, groups):
    """The jitted outer step that syncs the store groups `groups` (None: all), built once."""
    key = None if groups is None else tuple(sorted(groups))
    if key not in self._outer_programs:
      self._outer_programs[key] = self._outer_program(None if key is None else frozenset(key))
    return self._outer_programs[key]

  def _state_specs(self, abstract: TrainState) -> TrainState:
    r = self.recipe
    ps = sharding.worker_specs(abstract.params, self.mesh, self.fsdp)
    compression = (r.outer_cfg.compression, r.outer_cfg.compression_block)
    ss = sharding.store_specs(
      abstract.store, self.mesh, self.topo, self.fsdp, compression if r.compressed else None
    )
    specs = TrainState(
      step=P(),
      rng=P(),
      store=ss,
      params=ps,
      outer_opt=sharding.opt_state_specs(r.outer_tx, abstract.outer_opt, ss, leading=None),
      inner_opt=sharding.opt_state_specs(r.inner_tx, abstract.inner_opt, ps, leading="path"),
    )
    specs = r.with_ef(specs, ps) if r.feedback else specs
    return r.with_jump(specs, ps) if r.overlap else specs

  def init_state(self, seed: int, theta: PyTree | None = None) -> TrainState:
    """A fresh, sharded state (θ̄ given, e.g. from a dense pretraining)."""
    init = jax.jit(self.recipe.init_state, out_shardings=self.state_sharding)
    return init(jax.random.key(seed), theta)

  @property
  def batch_shape(self) -> tuple[int, int, int]:
    """Global [W, B, T] of one inner step's batch."""
    return (self.topo.num_workers, self.config.data.batch_size, self.config.data.seq_len)

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's block of [W, B, T] (see feed.local_block) to global arrays."""
    return {
      k: jax.make_array_from_process_local_data(self.batch_sharding, v, self.batch_shape)
      for k, v in batch.items()
    }

  def evaluate_sums(self, params: PyTree, batches) -> tuple[np.ndarray, np.ndarray]:
    """Summed validation loss and token count of each worker on its own shard, [W] each."""
    loss_sum = weight = 0.0
    for batch in batches:
      out = feed.host(self.eval_step(params, self.put_batch(batch)))
      loss_sum, weight = loss_sum + out["loss_sum"], weight + out["weight"]
    return np.asarray(loss_sum, np.float64), np.asarray(weight, np.float64)

  @staticmethod
  def losses(loss_sum_W: np.ndarray, tokens_W: np.ndarray) -> np.ndarray:
    """Token-weighted loss per worker [W] from `evaluate_sums` (NaN: no tokens)."""
    return np.where(tokens_W > 0, loss_sum_W / np.maximum(tokens_W, 1.0), np.nan)

  def evaluate(self, params: PyTree, batches) -> np.ndarray:
    """Token-weighted validation loss of each worker on its own shard [W] (NaN: no tokens)."""
    return self.losses(*self.evaluate_sums(params, batches))
