"""dipaco_jax: DiPaCo (Distributed Path Composition) and DiLoCo in JAX/Flax."""

import os

# etils.epath serves gs:// with tf.io.gfile whenever TensorFlow is installed (tensorflow-datasets
# pulls it in), which imports TensorFlow at the first gs:// access; fsspec/gcsfs serves the same
# paths without it. Set before any path is opened (epath caches the choice); EPATH_USE_TF=1 in the
# environment keeps TensorFlow's.
os.environ.setdefault("EPATH_USE_TF", "false")

__version__ = "0.1.0"
