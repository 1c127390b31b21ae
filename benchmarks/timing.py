"""Timing harness for benchmarks: step loops, interleaved repetitions, ratios, --set overrides.

Every loop blocks at least every BLOCK_EVERY steps (unblocked loops
of jitted steps with collectives abort on fake CPU devices).
"""
# pylint: disable=invalid-name

import json
import os
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_EVERY = 4


def field_overrides(sets) -> dict:
  """--set's "field=value" strings as {field: value}, each value read as JSON where it parses."""

  def value(text: str):
    try:
      return json.loads(text)
    except json.JSONDecodeError:
      return text

  return {k: value(v) for k, v in (kv.split("=", 1) for kv in sets)}


def write_json(path: str, report: dict) -> None:
  """Writes a benchmark's report whole or not at all (tmp file, then rename)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, default=float)
  os.replace(tmp, path)
  print(f"wrote {path}")


class Loop:
  """A step function with its own state; `run(n)` times n steps."""

  def __init__(self, step, state, tokens_per_call: int):
    self.step, self.state, self.tokens = step, state, tokens_per_call
    # Process CPU seconds (all threads) of the last `run`: user + system, and each.
    self.cpu_s = self.user_s = self.sys_s = 0.0

  def run(self, n: int) -> float:
    """Wall seconds of n steps (CPU seconds go to `cpu_s`, `user_s`, `sys_s`)."""
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for i in range(n):
      self.state = self.step(self.state)
      if (i + 1) % BLOCK_EVERY == 0 or i == n - 1:
        jax.block_until_ready(self.state)
    c1 = resource.getrusage(resource.RUSAGE_SELF)  # Microseconds, every thread.
    self.user_s, self.sys_s = c1.ru_utime - c0.ru_utime, c1.ru_stime - c0.ru_stime
    self.cpu_s = self.user_s + self.sys_s
    return time.perf_counter() - t0


def gemm_loop(n: int, k: int, m: int, device) -> tuple[Loop, int]:
  """fp32 [n, k] @ [k, m] on `device`, and its 2 n k m FLOPs per call."""
  rng = np.random.default_rng(0)
  a = jax.device_put(rng.standard_normal((n, k), np.float32), device)
  b = jax.device_put(rng.standard_normal((k, m), np.float32), device)
  dot = jax.jit(jnp.dot)
  return Loop(lambda _: dot(a, b), None, 0), 2 * n * k * m


def interleave(loops: dict, reps: int, compared: list[str], system_s: dict | None = None):
  """Seconds and CPU seconds per call of each loop, one entry per repetition.

  The compared loops run back to back in alternating order (A B C, C B A, ...)
  so that each repetition's ratio sees the same load on a shared host. A dict
  passed as `system_s` receives the system-time part of the CPU seconds.
  """
  secs = {k: [] for k in loops}
  cpu = {k: [] for k in loops}
  sys_cpu = {k: [] for k in loops}  # The system part of `cpu`.
  for rep in range(reps):
    for k in (compared if rep % 2 == 0 else compared[::-1]) + [
      k for k in loops if k not in compared
    ]:
      loop, calls = loops[k]
      secs[k].append(loop.run(calls) / calls)
      cpu[k].append(loop.cpu_s / calls)
      sys_cpu[k].append(loop.sys_s / calls)
  if system_s is not None:
    system_s.update(sys_cpu)
  return secs, cpu


def paired_ratio(loops: dict, t: dict, k: str, hardware: int = 1, base: str = "plain"):
  """Tokens/s of loop k per unit of hardware over loop `base`'s.

  `t` holds seconds per call per repetition (`interleave`). Returns (median
  over repetitions, per repetition, ratio of best times); Nones without k.
  """
  if k not in t:
    return None, None, None
  tok_k, tok_b = loops[k][0].tokens / hardware, loops[base][0].tokens
  per_rep = [tok_k * p / (tok_b * q) for p, q in zip(t[base], t[k])]
  best = tok_k * min(t[base]) / (tok_b * min(t[k]))
  return statistics.median(per_rep), per_rep, best
