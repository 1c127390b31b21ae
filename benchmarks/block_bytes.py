r"""One transformer block's forward and backward compiled for one TPU chip: its HBM bytes by op.

  python benchmarks/block_bytes.py --config=configs/dense_150m.py --topology=v6e:2x2 \
    --batch=8 --set model.remat=none [--hlo=/tmp/block.hlo.txt] [--top=25]

A lever on a block's bytes (RoPE's form, the attention kernel's options) is seen here in a
few CPU minutes, against a full step's tens (dipaco_jax.aot); the step's own figures are
still dipaco_jax.aot's. The block (config.model, remat as configured) runs on `--batch`
sequences of data.seq_len with splash attention, on one chip of `--topology` (libtpu, no
TPU needed); the loss is the output's squares summed, its gradient taken for the block's
params and input. Printed: XLA's bytes and FLOPs (the Pallas kernels' FLOPs added, as
dipaco_jax.aot adds them), then benchmarks/hlo_bytes.py's tiled count by source.
"""
# pylint: disable=invalid-name

import argparse
import importlib.util
import sys

import hlo_bytes  # Beside us.
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax.aot import compile as compile_lib
from dipaco_jax.config import sections
from dipaco_jax.core import model as model_lib


def model_config(path: str, sets: list[str]) -> tuple[sections.ModelConfig, int]:
  """config.model of the config file with `--set model.FIELD=VALUE` applied, and seq_len."""
  spec = importlib.util.spec_from_file_location("config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  for s in sets:
    key, value = s.split("=", 1)
    section, name = key.split(".")
    setattr(c[section], name, type(c[section][name])(value))
  return sections.ModelConfig(**c.model.to_dict()), c.data.seq_len


def compile_block(cfg: sections.ModelConfig, seq_len: int, batch: int, topology: str):
  """The block's gradient compiled for one chip of `topology`."""
  device = compile_lib.topology_devices(topology, 1)[0]
  mesh = Mesh(np.array([device]).reshape(1, 1, 1), ("path", "data", "model"))
  cls = model_lib.Block
  if cfg.remat != "none":
    cls = model_lib.nn.remat(cls, policy=model_lib.REMAT_POLICIES[cfg.remat])
  block = cls(cfg, mesh=mesh)
  dtype = jnp.dtype(cfg.dtype)
  x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), dtype)
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  init = lambda: model_lib.Block(cfg).init(
    jax.random.key(0),
    jnp.zeros((1, seq_len, cfg.d_model), dtype),
    jnp.ones((1, seq_len), jnp.int32),
    jnp.zeros((1, seq_len), jnp.int32),
  )
  loss = lambda p, x, s, pos: jnp.sum(block.apply(p, x, s, pos).astype(jnp.float32) ** 2)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=NamedSharding(mesh, P()))
  return grad.lower(jax.eval_shape(init), x, ids, ids).compile()


def main(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="a config file, e.g. configs/dense_150m.py")
  p.add_argument("--topology", default="v6e:2x2", help="CHIP:AxB; one chip of it is compiled for")
  p.add_argument("--batch", type=int, default=8, help="sequences in the block's input")
  p.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE (repeatable)")
  p.add_argument("--hlo", default="", help="write the compiled HLO text here")
  p.add_argument("--top", type=int, default=25, help="sources listed")
  a = p.parse_args(argv)
  cfg, seq_len = model_config(a.config, a.set)
  compiled = compile_block(cfg, seq_len, a.batch, a.topology)
  flops, nbytes = compile_lib.cost(compiled)
  text = compiled.as_text()
  if a.hlo:
    with open(a.hlo, "w") as f:
      f.write(text)
  kflops, calls = compile_lib.kernel_flops(text, cfg, seq_len)
  s = hlo_bytes.summary(hlo_bytes.op_rows(text), a.top)
  print(f"XLA: {nbytes:.4e} bytes, {flops + kflops:.4e} FLOPs ({kflops:.3e} in {calls} kernels)")
  print(f"tiled {s['bytes']:.4e} bytes, elements {s['element_bytes']:.4e}; by source:")
  for k, v in s["by_source"].items():
    print(f"  {v:.3e} {v / s['bytes']:6.1%}  {k}")


if __name__ == "__main__":
  main(sys.argv[1:])
