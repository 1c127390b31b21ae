"""The actors' persistent JAX compilation cache (config.elastic.compile_cache).

A worker actor that Ray restarts after a preemption, and every actor of the
next command, loads its inner, evaluation and outer steps from the cache
instead of compiling them again (seconds per actor on CPU, more on TPU).
"auto" (the default) is $JAX_COMPILATION_CACHE_DIR when set, else
`jax_cache/` in the user's dipaco_jax cache dir (data.shard_cache's "auto":
$DIPACO_CACHE_DIR, $XDG_CACHE_HOME/dipaco_jax or ~/.cache/dipaco_jax), resolved
on the actor's own host; "off" turns it off; any other value is the folder
(local or gs://). Only actor processes set it: the driver's process is the
user's (a notebook, a test) and keeps its own JAX settings.
"""

import importlib.util
import os

import jax

from dipaco_jax.data import shard_cache

OFF = "off"
AUTO = "auto"
MAX_BYTES = 1 << 40  # The cache's size limit (see `use`).


def directory(setting: str) -> str | None:
  """The cache folder of config.elastic.compile_cache on this host, or None when off."""
  if setting == OFF:
    return None
  if setting == AUTO:
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
      shard_cache.cache_root(shard_cache.AUTO).parent / "jax_cache"
    )
  return setting


def use(setting: str) -> None:
  """Points this process's compilations at the cache; call before its first compile."""
  folder = directory(setting)
  if folder is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", folder)
  # JAX writes an entry in place (no temporary name) unless the cache has a size limit; with
  # one it holds a file lock around every read and write. Actors of runs started together on
  # an empty cache then never read each other's half-written entries (each a warning and a
  # compile); the limit is one no run reaches.
  if importlib.util.find_spec("filelock") is not None:  # The lock's library (Ray's too).
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  # Every executable: an actor pays each compile again after each restart, small ones too.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
