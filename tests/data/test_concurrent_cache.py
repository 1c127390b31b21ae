"""Runs started together on an empty cache: all succeed and read the same shards.

Three processes at the same moment, each as a run's start does it on one empty
$DIPACO_CACHE_DIR: the embedded corpus prepared for tfds (one prepares, the others
wait for it: tfds alone renamed each one's copy onto the same name and all but one
failed), the run's shards through the shard cache (shard_plan.prepare_shards), and
the elastic actors' persistent compilation cache (jit_cache.use) filled by the same
programs.
"""

import os
import subprocess
import sys

import pytest

import helpers
from failure_rows import Row

# One run's start, in a child process: argv = workdir, the shared compilation cache.
_START = """
import sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp
import helpers
from failure_rows import Row
from dipaco_jax.core import topology
from dipaco_jax.runtime import shard_plan
from dipaco_jax.runtime.elastic import jit_cache
jit_cache.use(sys.argv[2])
cfg = helpers.micro_config(**{{"model.vocab_size": 8192, "data.subsample": 64}})
shards = shard_plan.prepare_shards(cfg, topology.from_config(cfg).num_workers, sys.argv[1])
print("tokens", shards.sizes("train").tolist())
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
print("value", float(f(jnp.arange(64.0).reshape(8, 8) / 64)))
"""


@pytest.mark.slow
@pytest.mark.ci  # CI runs it: the end-to-end check of what it guards.
def test_three_runs_started_together_on_an_empty_cache_all_succeed_with_the_same_shards(tmp_path):
  cache = tmp_path / "cache"  # Empty: nothing prepared, no shards, no compiled programs.
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  env["DIPACO_CACHE_DIR"] = str(cache)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The one under test: jit_cache.use's.
  code = _START.format(tests=os.path.join(helpers.ROOT, "tests"))  # helpers.py, failure_rows.py
  runs = [
    subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path / f"run{i}" / "shards"), str(cache / "jax")],
      cwd=helpers.ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(3)
  ]
  outs = [r.communicate(timeout=900) for r in runs]
  for r, (_, err) in zip(runs, outs):
    assert r.returncode == 0, err[-3000:]
    assert "Error reading persistent compilation cache entry" not in err, err[-3000:]
  said = [[l for l in out.splitlines() if l.startswith(("tokens ", "value "))] for out, _ in outs]
  assert len(said[0]) == 2 and said[0] == said[1] == said[2], said  # Same sizes, same value.
  # Every file but the part markers (they hold each writer's seconds): the same bytes.
  shards = [
    {
      k: v
      for k, v in helpers.tree_bytes(tmp_path / f"run{i}" / "shards").items()
      if "parts" not in k
    }
    for i in range(3)
  ]
  assert shards[0] and shards[0] == shards[1] == shards[2]
  # One prepared corpus, one shard-cache entry, no lock file left behind.
  assert len(os.listdir(cache / "shard_sets")) == 1
  assert [d for d in os.listdir(cache / "tfds" / "dipaco_embedded") if "incomplete" in d] == []
  left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".lock")]
  assert left == []


# The row this file adds to docs/failures.md (tests/project/test_failure_table.py).
TABLE = [
  Row(
    "three runs started at the same moment on an empty cache",
    "main (a run's start)",
    "all succeed: the first prepares the corpus while the others wait; each writes or copies "
    "the shards; the compilation cache is read whole",
    0,
    "the same shards, byte for byte, in every run; one cache entry; no lock file left",
    "tests/data/test_concurrent_cache.py",
    "tolerated",
  ),
]
