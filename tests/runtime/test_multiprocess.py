"""The trainer as 2 processes (2 fake CPU devices each, loopback coordinator).

The 'path' axis spans the two processes (the stand-in for DCN between
slices): workers 0-1 live on process 0, workers 2-3 on process 1. The two
processes write the shards together (half the documents each). After two
outer steps the parameters must equal those of the same run as one process
with 4 devices (its shards written by one process), and a 2-process run must
resume from its checkpoint.
"""

import math
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dipaco_jax.io import checkpoint

from helpers import ROOT

# Three runs of two trainer processes and one of one process: minutes, outside the fast suite
# (-m "not slow").
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# Float tolerance: the outer step's cross-path sum runs through gloo across
# processes instead of in one XLA program, so the summation order may differ.
ATOL = 1e-6

FLAGS = [
  "--config.model.vocab_size=8192",
  "--config.model.d_model=32",
  "--config.model.num_layers=2",
  "--config.model.num_heads=2",
  "--config.model.head_dim=16",
  "--config.dipaco.level_groups=('embed,head','block_0','block_1')",
  "--config.dipaco.inner_steps=2",
  "--config.dipaco.outer_steps=2",
  "--config.data.seq_len=16",
  "--config.data.batch_size=2",
  "--config.inner.warmup_steps=2",
  "--config.ckpt.every_steps=1",
  "--config.ckpt.async_save=False",
  "--config.eval.batches=1",
  "--config.mesh.cpu_devices=0",  # Devices come from XLA_FLAGS here.
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _main(workdir, shard_dir, extra=()):
  return [
    sys.executable,
    "-m",
    "dipaco_jax.main",
    "--config=" + os.path.join(ROOT, "configs", "tiny.py"),
    f"--workdir={workdir}",
    f"--config.data.shard_dir={shard_dir}",
    *FLAGS,
    *extra,
  ]


def _run_two(workdir, shard_dir, extra=()):
  port = _free_port()
  procs = [
    subprocess.Popen(
      _main(
        workdir,
        shard_dir,
        [
          f"--coordinator_address=127.0.0.1:{port}",
          "--num_processes=2",
          f"--process_id={i}",
          *extra,
        ],
      ),
      env=_env(2),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=420)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]


def _state(workdir):
  ck = checkpoint.Checkpointer(str(workdir))
  return ck.latest_step(), checkpoint.restore_numpy(str(workdir))


@pytest.mark.timeout(900)
def test_two_processes_match_one_and_resume(tmp_path):
  shards = tmp_path / "shards"
  one = subprocess.run(
    _main(tmp_path / "one", shards),
    env=_env(4),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=420,
  )
  assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
  # The two processes write their own shards, half each (shard_plan.prepare_shards): the same
  # shards, so the same training.
  shards_2 = tmp_path / "shards_2"
  _run_two(tmp_path / "two", shards_2)
  assert sorted(p.name for p in (shards_2 / "train" / "parts").iterdir()) == [
    "part-00000-of-00002.json",
    "part-00001-of-00002.json",
  ]
  step1, a = _state(tmp_path / "one")
  step2, b = _state(tmp_path / "two")
  assert step1 == step2 == 4
  # Each process summed the rows (or, for store modules split over 'path', the parts of rows)
  # it holds: the saved checksums cover every element of every array.
  sums = checkpoint.read_checksums(str(tmp_path / "two"), 4)
  shapes = {k: v.shape for k, v in ocp.tree.to_flat_dict(b, sep=".").items()}
  split = 0
  for name, rows in sums["state"].items():
    for row, crc in enumerate(rows):
      if crc is None:
        parts = sums["pieces"]["state"][name][str(row)]
        volume = sum(math.prod(b - a for a, b in box) for box, _ in parts)
        assert volume == math.prod(shapes[name][1:]), (name, row, parts)
        split += 1
  assert split > 0 and len(sums["state"]) == len(shapes)
  diffs = [float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  print(f"max |1 process - 2 processes| = {max(diffs):.3g}")
  assert max(diffs) <= ATOL

  # Resume in the 2-process layout: stop after step 3 (mid-phase), restart.
  _run_two(tmp_path / "resumed", shards_2, ["--config.stop_at_step=3"])
  assert _state(tmp_path / "resumed")[0] == 3
  _run_two(tmp_path / "resumed", shards_2)
  step3, c = _state(tmp_path / "resumed")
  assert step3 == 4
  for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(c)):
    np.testing.assert_array_equal(x, y)
