"""metrics.jsonl, TensorBoard and tokens/s, on hand-chosen numbers."""

import collections
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from etils import epath

from dipaco_jax import errors
from dipaco_jax.io import metrics
from dipaco_jax.io import summaries
from dipaco_jax.runtime import console

import helpers

LABELS = ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]


def test_nan_mean_skips_nan():
  assert metrics.nan_mean([1.0, np.nan, 3.0]) == 2.0
  assert math.isnan(metrics.nan_mean([np.nan, np.nan]))


# --- The run's log: metrics.jsonl, TensorBoard events, tokens/s. ---


def _scalars(events) -> dict[str, list[tuple[int, float]]]:
  out = collections.defaultdict(list)
  for e in events:
    for v in e.summary.value:
      if v.HasField("simple_value"):
        out[v.tag].append((e.step, v.simple_value))
  return dict(out)


RECORD = {
  "phase": 0,
  "train_loss": [1.0, 3.0, 2.0, 6.0],
  "grad_norm": [0.5, np.nan, 1.5, 1.0],
  "outer_delta_norm": {"level_0": [4.0], "level_1": [0.25, 0.75]},
  "tokens_per_s": 100.0,
}


def test_tensorboard_values_name_each_path_and_module():
  scalars, hists = metrics.tensorboard_values(
    {"step": 10, **RECORD}, LABELS, {"level_1": ["module_0", "module_1"]}
  )
  assert math.isnan(scalars.pop("train/grad_norm/path_0-0-1"))  # Kept as recorded.
  assert scalars == {
    "train/phase": 0,
    "perf/tokens_per_s": 100.0,
    "train/loss/mean": 3.0,  # (1 + 3 + 2 + 6) / 4
    "train/grad_norm/mean": 1.0,  # (0.5 + 1.5 + 1) / 3: NaN skipped
    "train/loss/path_0-0-0": 1.0,
    "train/loss/path_0-0-1": 3.0,
    "train/loss/path_0-1-0": 2.0,
    "train/loss/path_0-1-1": 6.0,
    "train/grad_norm/path_0-0-0": 0.5,
    "train/grad_norm/path_0-1-0": 1.5,
    "train/grad_norm/path_0-1-1": 1.0,
    "outer/delta_norm/level_0/module_0": 4.0,  # Unnamed level: indices.
    "outer/delta_norm/level_1/module_0": 0.25,
    "outer/delta_norm/level_1/module_1": 0.75,
  }
  assert sorted(hists) == [
    "outer/delta_norm/level_0",
    "outer/delta_norm/level_1",
    "train/grad_norm",
    "train/loss",
  ]
  np.testing.assert_array_equal(hists["train/loss"], [1.0, 3.0, 2.0, 6.0])


def _numbers(record, prefix=""):
  """Every number of a record, by its JSON path (`param_norm.embed[2]`)."""
  out = {}
  for key, value in record.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_numbers(value, f"{name}."))
    elif isinstance(value, list):
      out.update({f"{name}[{i}]": v for i, v in enumerate(value)})
    elif key != "step":
      out[name] = value
  return out


def test_every_number_of_metrics_jsonl_reaches_tensorboard_with_its_value(tmp_path):
  # A record as the spmd loop writes one at an evaluated outer step, with every kind of key.
  record = {
    **RECORD,
    "grad_norm": [0.5, 0.25, 1.5, 1.0],
    "lr": 0.002,
    "param_norm": {"embed": [10.0, 10.5, 11.0, 11.5], "block_0": [3.0, 3.5, 4.0, 4.5]},
    "step_s": 0.5,
    "tflops_per_device": 0.01,
    "val_loss": [2.0, 2.5, 3.0, 1.0],
    "val_loss_mean": 2.125,
    "val_loss_routed_all_tokens": 2.1,
    "val_perplexity_routed_all_tokens": math.exp(2.1),
    "heldout_loss": [2.0, 2.0, 2.0, 2.0],
    "heldout_loss_mean": 2.0,
    "shards/tokens_min": 5.0,
  }
  log = metrics.MetricsLogger(tmp_path, worker_labels=LABELS)
  log.write(50, record)
  log.close()
  (saved,) = metrics.read_records(tmp_path)
  numbers = {k: v for k, v in _numbers(saved).items() if not k.endswith("_mean")}
  tb = {tag: v for tag, [(step, v)] in _scalars(helpers.events(tmp_path)).items() if step == 50}
  # Each number is one TensorBoard value (float32 there), and each value one of the numbers.
  assert sorted(map(np.float32, numbers.values())) == sorted(
    np.float32(v) for tag, v in tb.items() if not tag.endswith("/mean")
  ), (numbers, tb)
  assert tb["train/learning_rate"] == pytest.approx(0.002)
  assert tb["train/param_norm/block_0/path_0-1-1"] == 4.5
  assert tb["perf/per_device_tflops_per_sec"] == pytest.approx(0.01)
  assert tb["val/perplexity_routed_all_tokens"] == pytest.approx(math.exp(2.1))
  # The recorded means are the charts' means.
  assert tb["val/loss/mean"] == saved["val_loss_mean"] and tb["train/loss/mean"] == 3.0
  assert tb["heldout/loss/mean"] == saved["heldout_loss_mean"]
  # The Custom Scalars page overlays the paths of each per-path metric on one chart.
  layouts = [v for e in helpers.events(tmp_path) for v in e.summary.value]
  layouts = [v for v in layouts if v.metadata.plugin_data.plugin_name == "custom_scalars"]
  assert len(layouts) == 1


def test_logger_appends_jsonl_and_writes_events_tensorboard_reads(tmp_path, monkeypatch):
  log = metrics.MetricsLogger(tmp_path, worker_labels=LABELS)
  log.write_hparams({"inner": {"lr": 0.002}, "dipaco": {"modules_per_level": (1, 2, 2)}})
  # Appending never rewrites a file whole.
  for method in ("write_text", "write_bytes"):
    monkeypatch.setattr(epath.Path, method, lambda *a, **k: pytest.fail("rewrote a file"))
  log.write(5, RECORD)
  after_one = (tmp_path / "metrics.jsonl").read_text()
  log.write(
    10, {"val_loss": [2.0, 2.0, 3.0, 1.0], "val_perplexity_routed_all_tokens": math.exp(2.0)}
  )
  log.close()
  text = (tmp_path / "metrics.jsonl").read_text()
  assert text.startswith(after_one) and text.count("\n") == 2
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [5, 10]
  assert metrics.read_records(tmp_path)[0]["outer_delta_norm"] == RECORD["outer_delta_norm"]
  events = helpers.events(tmp_path)
  assert events[0].file_version == "brain.Event:2"
  scalars = _scalars(events)
  assert scalars["train/loss/path_0-1-1"] == [(5, 6.0)]
  assert scalars["val/loss/path_0-0-0"] == [(10, 2.0)]
  assert scalars["val/loss/mean"] == [(10, 2.0)]
  assert scalars["val/perplexity_routed_all_tokens"] == [(10, pytest.approx(math.exp(2.0)))]
  assert scalars["outer/delta_norm/level_1/module_1"] == [(5, 0.75)]
  plugins = {v.tag: v.metadata.plugin_data.plugin_name for e in events for v in e.summary.value}
  assert plugins["train/loss"] == plugins["val/loss"] == "histograms"
  assert plugins["_hparams_/session_start_info"] == "hparams"


def test_curves_gather_each_key_by_step_from_the_records_on_disk(tmp_path):
  log = metrics.MetricsLogger(tmp_path, worker_labels=LABELS)
  log.write(5, {"train_loss": [1.0, 3.0, 2.0, 6.0]})  # A log step: no outer step, no eval.
  log.write(
    10, {**RECORD, "val_loss": [2.0, np.nan, 3.0, 1.0], "val_perplexity_routed_all_tokens": 7.5}
  )
  log.write(20, {"train_loss": [0.5, 1.0, 1.5, 2.0], "outer_delta_norm": {"level_1": [1.0, 2.0]}})
  log.close()
  c = metrics.curves(metrics.read_records(tmp_path))
  assert sorted(c) == [
    "outer_delta_norm",
    "train_loss",
    "val_loss",
    "val_perplexity_routed_all_tokens",
  ]
  np.testing.assert_array_equal(c["train_loss"][0], [5, 10, 20])
  np.testing.assert_array_equal(c["train_loss"][1][:, 3], [6.0, 6.0, 2.0])  # Path 0-1-1.
  np.testing.assert_array_equal(c["val_loss"][0], [10])
  np.testing.assert_array_equal(c["val_loss"][1], [[2.0, np.nan, 3.0, 1.0]])  # NaN kept.
  np.testing.assert_array_equal(c["val_perplexity_routed_all_tokens"][1], [7.5])
  steps, norms = c["outer_delta_norm"]["level_1"]
  np.testing.assert_array_equal(steps, [10, 20])
  np.testing.assert_array_equal(norms, [[0.25, 0.75], [1.0, 2.0]])
  np.testing.assert_array_equal(c["outer_delta_norm"]["level_0"][0], [10])
  assert metrics.curves([{"step": 1, "tokens_per_s": 3.0}]) == {}


def test_a_log_written_before_the_rename_reads_the_trainers_routed_metric_by_its_new_name(tmp_path):
  # The trainer's routed validation counts every token (the routing prefix included); it was
  # logged as val_loss_routed / val_perplexity_routed, a name evaluate's prefix-excluded
  # routed perplexity could claim. The same numbers read under the names that say so.
  old = {"step": 10, "val_loss_routed": 2.0, "val_perplexity_routed": math.exp(2.0)}
  (tmp_path / "metrics.jsonl").write_text(json.dumps(old) + "\n")
  (record,) = metrics.read_records(tmp_path)
  assert record == {
    "step": 10,
    "val_loss_routed_all_tokens": 2.0,
    "val_perplexity_routed_all_tokens": math.exp(2.0),
  }
  assert sorted(metrics.curves([record])) == ["val_perplexity_routed_all_tokens"]
  assert metrics.TB_NAMES["val_perplexity_routed_all_tokens"] == "val/perplexity_routed_all_tokens"
  assert not metrics.RENAMED_KEYS.keys() & metrics.TB_NAMES.keys()
  # The run's closing summary names it so, and says where the prefix-excluded number is.
  said = console._quality(record)  # pylint: disable=protected-access
  assert said.startswith(f"routed validation perplexity, all tokens {math.exp(2.0):.1f} ("), said
  assert "`evaluate` reports the prefix-excluded perplexity" in said, said


def _jsonl(steps) -> str:
  """The lines MetricsLogger writes for records {"loss": step} at `steps`."""
  return "".join(json.dumps({"loss": float(s), "step": s}) + "\n" for s in steps)


def test_resume_drops_records_after_the_step_and_a_torn_last_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(_jsonl([5, 10, 15]) + '{"step": 20, "lo')
  log = metrics.MetricsLogger(tmp_path, resume_step=10)
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [5, 10]
  log.write(15, {"loss": 1.5})
  log.close()
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [5, 10, 15]
  # TensorBoard drops the earlier event files' points from step 11 on.
  starts = [e.step for e in helpers.events(tmp_path) if e.HasField("session_log")]
  assert starts == [11]
  (tmp_path / "metrics.jsonl").write_text('{"step": 5}\nnot json\n{"step": 10}\n')
  with pytest.raises(errors.DamagedFileError, match="metrics.jsonl line 2: invalid JSON"):
    metrics.MetricsLogger(tmp_path, resume_step=10)


def test_on_an_object_store_the_log_rolls_into_parts(tmp_path, monkeypatch):
  monkeypatch.setattr(summaries, "appends_in_place", lambda path: False)
  monkeypatch.setattr(summaries, "PART_BYTES", 60)
  assert len(_jsonl([1])) == 25  # Two records fit in a part, a third starts the next.
  log = metrics.MetricsLogger(tmp_path)
  for step in range(1, 8):
    log.write(step, {"loss": float(step)})
  log.close()
  names = ["metrics.jsonl", "metrics-00001.jsonl", "metrics-00002.jsonl", "metrics-00003.jsonl"]
  assert sorted(p.name for p in tmp_path.glob("metrics*")) == sorted(names)
  assert [(tmp_path / n).read_text() for n in names] == [
    _jsonl([1, 2]),
    _jsonl([3, 4]),
    _jsonl([5, 6]),
    _jsonl([7]),
  ]
  assert [r["step"] for r in metrics.read_records(tmp_path)] == list(range(1, 8))
  # A resume at step 3 keeps parts 0 and 1's first record, removes the later parts, and
  # goes on in part 1.
  log = metrics.MetricsLogger(tmp_path, resume_step=3)
  log.write(4, {"loss": 4.0})
  log.close()
  assert sorted(p.name for p in tmp_path.glob("metrics*")) == sorted(names[:2])
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [1, 2, 3, 4]
  # The event files rolled too, and read back in order.
  assert len(list(tmp_path.glob("events.out.tfevents.*"))) > 2
  assert [s for s, _ in _scalars(helpers.events(tmp_path))["loss"]] == [1, 2, 3, 4, 5, 6, 7, 4]


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


def test_tokens_per_s_counts_writes_and_saves_and_step_s_does_not():
  clock = _Clock()
  meter = metrics.Throughput(100, step=0, clock=clock)
  for _ in range(2):  # Steps 1-2: 1 s each.
    with meter.timed():
      clock.t += 1.0
  assert meter.rates(2) == {"tokens_per_s": 100.0, "step_s": 1.0}  # 200 tokens / 2 s
  clock.t += 0.5  # The metrics write of step 2.
  clock.t += 2.0  # A checkpoint save.
  for _ in range(2):  # Steps 3-4.
    with meter.timed():
      clock.t += 1.0
  # 200 tokens over 2.5 + 2 s of steps = 4.5 s; the steps alone took 1 s each.
  assert meter.rates(4) == {"tokens_per_s": pytest.approx(200 / 4.5), "step_s": 1.0}


def test_the_training_start_imports_no_tensorflow(tmp_path):
  # A fresh process: in this one other tests may have imported TensorFlow already.
  code = (
    "import sys\n"
    "from dipaco_jax import cli, main, train\nfrom dipaco_jax.io import metrics\n"
    "log = metrics.MetricsLogger(sys.argv[1])\n"
    "log.write_hparams({'a': 1})\n"
    "log.write(1, {'train_loss': [1.0, 2.0]})\n"
    "log.close()\n"
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'seqio')))\n"
  )
  env = {**os.environ, "PYTHONPATH": helpers.ROOT, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[-1] == "[]"
  assert [r["step"] for r in metrics.read_records(tmp_path)] == [1]
