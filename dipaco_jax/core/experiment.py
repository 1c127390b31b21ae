"""A run's fixed parts: grid, model, optimizers, mesh, shardings, jitted steps.

`Experiment` derives everything from the config once; `train.py` runs the loop.
"""
# pylint: disable=invalid-name

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax.core import inner as inner_lib
from dipaco_jax.core import model as model_lib
from dipaco_jax.core import outer as outer_lib
from dipaco_jax.core import paths as paths_lib
from dipaco_jax.core import sharding
from dipaco_jax.core import topology
from dipaco_jax.data import feed
from dipaco_jax.errors import ConfigError
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


def model_config(config) -> model_lib.ModelConfig:
  return model_lib.ModelConfig.of(config)


def inner_config(config) -> inner_lib.InnerConfig:
  """Inner settings; the cosine runs over all H*T inner steps unless given."""
  d, total = config.dipaco, config.inner.total_steps
  return inner_lib.InnerConfig.of(
    config,
    total_steps=d.inner_steps * d.outer_steps if total is None else total,
  )


def outer_config(config) -> outer_lib.OuterConfig:
  return outer_lib.OuterConfig.of(config)


class Experiment:
  """Grid, model, optimizers, mesh, shardings and jitted steps of a config."""

  def __init__(self, config, mesh=None):
    self.config = config
    self.topo = topology.from_config(config)
    self.model_cfg = model_config(config)
    self.model = model_lib.Transformer(self.model_cfg)
    self.inner_cfg = inner_config(config)
    self.tx = inner_lib.optimizer(self.inner_cfg)
    self.outer_cfg = outer_config(config)
    self.outer_tx = outer_lib.optimizer(self.outer_cfg)
    self.outer_enabled = config.outer.enabled
    self.mesh = mesh or sharding.make_mesh(config.mesh, self.topo.num_workers)
    sharding.check_batch_divides(config.data.batch_size, self.mesh.shape["data"])
    mb = self.inner_cfg.microbatches
    if config.data.batch_size % (mb * self.mesh.shape["data"]):
      raise ConfigError(
        f"config.inner.microbatches={mb} must split the batch (config.data.batch_size="
        f"{config.data.batch_size}) into microbatches that the 'data' mesh axis "
        f"({self.mesh.shape['data']}) divides: choose a divisor of batch_size / data."
      )
    self.fsdp = config.mesh.fsdp
    abstract = jax.eval_shape(self._init, jax.random.key(0), None)
    specs = self._state_specs(abstract)
    self.state_sharding = sharding.named(self.mesh, specs)
    self.abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_sharding
    )
    ps, ss = self.state_sharding.params, self.state_sharding.store
    self.batch_sharding = NamedSharding(self.mesh, sharding.batch_spec())
    per_worker = NamedSharding(self.mesh, P("path"))
    replicated = NamedSharding(self.mesh, P())
    self.inner_step = jax.jit(
      jax.vmap(
        functools.partial(inner_lib.train_step, model=self.model, tx=self.tx, microbatches=mb)
      ),
      in_shardings=(ps, self.state_sharding.inner_opt, self.batch_sharding),
      out_shardings=(ps, self.state_sharding.inner_opt, per_worker),
      donate_argnums=(0, 1),
    )
    self.outer_step = jax.jit(
      outer_lib.sharded_outer_step(
        self.topo, self.outer_cfg, self.mesh, (specs.store, specs.outer_opt, specs.params)
      ),
      in_shardings=(ss, self.state_sharding.outer_opt, ps, replicated),
      out_shardings=(ss, self.state_sharding.outer_opt, ps, replicated),
      donate_argnums=(0, 1, 2),
    )
    self.eval_step = jax.jit(
      jax.vmap(functools.partial(inner_lib.eval_step, model=self.model, microbatches=mb)),
      in_shardings=(ps, self.batch_sharding),
      out_shardings=per_worker,
    )
    self.sync_store = jax.jit(
      functools.partial(paths_lib.disassemble, topo=self.topo), in_shardings=(ps,), out_shardings=ss
    )
    self.group_norms = jax.jit(
      jax.vmap(inner_lib.group_norms), in_shardings=(ps,), out_shardings=per_worker
    )
    self.all_finite = jax.jit(
      lambda t: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)]))
    )

  def _init(self, rng: jax.Array, theta: PyTree | None) -> TrainState:
    """All modules from θ̄ (given, or one random init), or independent inits."""
    if theta is None and self.config.dipaco.init == "independent":
      kmax = max(s.num_modules for s in self.topo.store_groups())
      thetas = jax.vmap(lambda k: model_lib.init_params(self.model_cfg, k))(
        jax.random.split(rng, kmax)
      )
      store = {
        s.name: jax.tree.map(lambda x, k=s.num_modules: x[:k], thetas[s.name])
        for s in self.topo.store_groups()
      }
    else:
      if theta is None:
        theta = model_lib.init_params(self.model_cfg, rng)
      store = paths_lib.init_store(theta, self.topo)
    params = paths_lib.assemble(store, self.topo)
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      rng=jax.random.key_data(rng),
      store=store,
      outer_opt=self.outer_tx.init(store),
      params=params,
      inner_opt=inner_lib.init_opt_state(self.tx, params),
    )

  def _state_specs(self, abstract: TrainState) -> TrainState:
    ps = sharding.worker_specs(abstract.params, self.mesh, self.fsdp)
    ss = sharding.store_specs(abstract.store, self.mesh, self.topo, self.fsdp)
    return TrainState(
      step=P(),
      rng=P(),
      store=ss,
      params=ps,
      outer_opt=sharding.opt_state_specs(self.outer_tx, abstract.outer_opt, ss, leading=None),
      inner_opt=sharding.opt_state_specs(self.tx, abstract.inner_opt, ps, leading="path"),
    )

  def init_state(self, seed: int, theta: PyTree | None = None) -> TrainState:
    """A fresh, sharded state (θ̄ given, e.g. from a dense pretraining)."""
    init = jax.jit(self._init, out_shardings=self.state_sharding)
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

  def alpha(self, sizes_W: np.ndarray) -> jax.Array:
    """Outer weights α_w: shard sizes |D_w| or uniform."""
    if self.outer_cfg.weighting == "uniform":
      return jnp.ones(self.topo.num_workers, jnp.float32)
    return jnp.asarray(np.asarray(sizes_W, np.float64) / max(np.max(sizes_W), 1), jnp.float32)

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
