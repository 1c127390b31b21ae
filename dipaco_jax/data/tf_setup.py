"""Imports TensorFlow for the data front end (seqio, tfds) and keeps it off the accelerators.

TensorFlow's C++ start-up notices on a host without CUDA (`failed call to cuInit`, oneDNN)
are held back (io/native.py); any other line it prints is written as it came.
"""

from dipaco_jax.io import native

with native.quiet_fd2():
  import tensorflow as tf

  try:
    # JAX owns the GPUs/TPUs; TF only tokenizes on the host.
    tf.config.set_visible_devices([], "GPU")
  except RuntimeError:  # TF already initialised its devices elsewhere; nothing left to change.
    pass
