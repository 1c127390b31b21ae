"""Grid validation and the store layout."""

import numpy as np
import pytest

from dipaco_jax.core import topology


def test_paper_16x16_layout():
  t = topology.build(
    ("embed,head", "block_0-5", "block_6-11"),
    (1, 16, 16),
    12,
    path_specific="embed,block_0,block_5,block_6,block_11",
  )
  assert t.num_paths == 256 and t.num_workers == 256
  assert t.private_groups == ("embed", "block_0", "block_5", "block_6", "block_11")
  assert t.level_groups == (
    ("head",),
    ("block_1", "block_2", "block_3", "block_4"),
    ("block_7", "block_8", "block_9", "block_10"),
  )
  # Row-major path order: path p = 16 * i + j.
  np.testing.assert_array_equal(t.paths[17], [0, 1, 1])
  # P_{l,e}: paths through each module.
  np.testing.assert_array_equal(np.bincount(t.worker_modules[:, 1], minlength=16), np.full(16, 16))
  np.testing.assert_array_equal(np.bincount(t.worker_modules[:, 0]), [256])


def test_replicas_and_subset():
  t = topology.build(("embed,block_0,head",), (3,), 1, paths=("0", "2"), replicas=2)
  assert t.num_workers == 4
  np.testing.assert_array_equal(t.worker_modules[:, 0], [0, 0, 2, 2])
  # Module 1 is on no path: P_{0,1} = 0.
  np.testing.assert_array_equal(np.bincount(t.worker_modules[:, 0], minlength=3), [2, 0, 2])
  assert t.path_label(1) == "2"
  assert t.worker_labels() == ["0/r0", "0/r1", "2/r0", "2/r1"]
  assert t.module_labels() == {"level_0": ["module_0", "module_1", "module_2"]}


def test_module_labels_name_private_copies_by_path():
  t = topology.build(("embed,head", "block_0", "block_1"), (1, 2, 2), 2, path_specific="block_1")
  assert t.worker_labels() == ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]
  assert t.module_labels() == {
    "level_0": ["module_0"],
    "level_1": ["module_0", "module_1"],
    "private": ["path_0-0-0", "path_0-0-1", "path_0-1-0", "path_0-1-1"],
  }


@pytest.mark.parametrize(
  "levels,ks,kw,msg",
  [
    (("embed,block_0-1", "block_1,head"), (2, 2), {}, "block_1' is in level 0 and level 1"),
    (("embed,block_0", "head"), (2, 2), {}, "belong to no level"),
    (("embed,block_0-1,head",), (0,), {}, "K=0"),
    (("embed,block_0-1,head",), (2.5,), {}, "K=2.5 modules; every level needs an integer K>=1"),
    (("embed,block_0-1,head",), (2,), {"paths": ("0", "2")}, "only 2 modules"),
    (("embed,block_0-1,head",), (2,), {"paths": ("0-1",)}, "one module id per level"),
    (("embed,block_0-1,head",), (2, 2), {}, "one K per level"),
    (("embed,block_0-7,head",), (2,), {}, "outside blocks 0-1"),
    (("embed,blocks,head",), (2,), {}, "unknown parameter group 'blocks'"),
    (("embed,block_0-1,head",), (2,), {"replicas": 0}, "replicas=0"),
  ],
)
def test_invalid_grids_fail_with_one_clear_message(levels, ks, kw, msg):
  with pytest.raises(topology.TopologyError, match=msg):
    topology.build(levels, ks, 2, **kw)
