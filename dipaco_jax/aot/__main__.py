r"""Compiles a run's steps for a TPU topology on any host: memory, roofline, collectives.

  python -m dipaco_jax.aot --config=configs/dipaco_2x4.py --topology=v5e:4x4 --slices=2 \
    [--config.mesh.data=4 ...] [--out=FILE.json]

libtpu (the `aot` extra) compiles for TPU devices that are described, not
present. The run's mesh is built over them exactly as the trainer builds it,
and the inner, outer and evaluation steps are the `Experiment`'s own jitted
functions, lowered with abstract inputs carrying the Experiment's shardings.
Per step it reports the per-chip memory (arguments, temporaries, outputs, and
the rest of the training state that stays resident) against the chip's HBM,
XLA's flops and bytes, a roofline time max(flops / peak, bytes / HBM
bandwidth), tokens/s and MFU, and the collectives with the mesh axes they span.
Exit status 1: a step does not fit in 90% of HBM, or an inner-step collective
spans 'path' (the report says which), or a bad input (one stderr line naming the
flag or field and the fix; --verbose_errors for its traceback). docs/tpu.md holds
the paper configs' numbers.
"""

from absl import flags

from dipaco_jax.aot import command

if __name__ == "__main__":
  command.define_flags()
  flags.adopt_module_key_flags(command)  # --help lists the command's flags.
  command.run()
