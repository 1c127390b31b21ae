"""HLO collective parsing: every replica-group form, bytes, axis crossing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dipaco_jax import hlo


class _Mesh:
  """Stands in for a jax Mesh: only `devices` (shape) and `axis_names` matter."""

  def __init__(self, shape, names):
    self.devices = np.arange(int(np.prod(shape))).reshape(shape)
    self.axis_names = names


MESH_2x2 = _Mesh((2, 2), ("path", "data"))  # Logical id = 2 * path + data.


def _one(line: str) -> hlo.Collective:
  (c,) = hlo.collectives("ENTRY %main {\n" + line + "\n}")
  return c


@pytest.mark.parametrize(
  "groups_text, groups",
  [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{{0,2},{1,3}}", ((0, 2), (1, 3))),
    ("{}", ()),
    ("[2,2]<=[4]", ((0, 1), (2, 3))),
    ("[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
    ("[1,4]<=[4]", ((0, 1, 2, 3),)),
    ("mesh['axis_0'=2,'axis_1'=2] {'axis_1'}", ((0, 1), (2, 3))),
    ("mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", ((0, 2), (1, 3))),
    ("mesh['a'=2,'b'=2] {'b','a'}", ((0, 2, 1, 3),)),
    # Non-iota mesh: the ids laid out [[0,2],[1,3]]; varying 'a' pairs 0,1.
    ("mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'a'}", ((0, 1), (2, 3))),
    ("mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'a'}", ((0, 1), (2, 3))),
    # Sub-axis (pre)size: 'x':(1)2 is the major half of x=8, (2)2 the middle.
    ("mesh['x'=8] {'x':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("maximal_mesh[device_id=3] {}", ((3,),)),
  ],
)
def test_replica_group_forms(groups_text, groups):
  c = _one(
    "  %ar = f32[8]{0} all-reduce(f32[8]{0} %p), channel_id=1, "
    f"replica_groups={groups_text}, use_global_device_ids=true, "
    "to_apply=%add"
  )
  assert c.op == "all-reduce"
  assert c.groups == groups
  assert c.nbytes == 32


def test_bytes_per_op():
  text = "\n".join(
    [
      # Tuple all-reduce: 2*3*4 + 5*2 bytes.
      "  %a = (f32[2,3]{1,0}, /*index=1*/bf16[5]{0}) all-reduce(%x, %y), "
      "replica_groups={{0,1}}, to_apply=%add",
      # all-gather counts its (bigger) output.
      "  %b = f32[4,16]{1,0} all-gather(f32[1,16]{1,0} %z), dimensions={0}, "
      "replica_groups=[1,4]<=[4]",
      # reduce-scatter counts its input: output 4*4 bytes x group of 4.
      "  %c = f32[4]{0} reduce-scatter(f32[16]{0} %w), dimensions={0}, "
      "replica_groups={{0,1,2,3}}, to_apply=%add",
      # Async forms: all-gather-start returns (operand, result).
      "  %d = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %q), "
      "dimensions={0}, replica_groups={{0,1,2,3}}",
      "  %e = (f32[6]{0}, f32[6]{0}, u32[], u32[]) collective-permute-start("
      "f32[6]{0} %r), source_target_pairs={{0,2},{2,0}}",
      "  ROOT %f = s32[3]{0} all-reduce-start(s32[3]{0} %s), "
      "replica_groups={{0},{1},{2},{3}}, to_apply=%add",
      "  %g = f32[3]{0} all-reduce-done(f32[3]{0} %f)",
      "  %h = f32[9]{0} add(f32[9]{0} %u, f32[9]{0} %v)",
    ]
  )
  got = [(c.op, c.nbytes, c.groups) for c in hlo.collectives(text)]
  assert got == [
    ("all-reduce", 34, ((0, 1),)),
    ("all-gather", 256, ((0, 1, 2, 3),)),
    ("reduce-scatter", 64, ((0, 1, 2, 3),)),
    ("all-gather-start", 32, ((0, 1, 2, 3),)),
    ("collective-permute-start", 24, ((0, 2), (2, 0))),
    ("all-reduce-start", 12, ((0,), (1,), (2,), (3,))),
  ]
  # On the 2x2 (path, data) mesh: %a stays in path 0, %e swaps paths.
  assert hlo.cross_axis_bytes(text, MESH_2x2, "path") == 256 + 64 + 32 + 24
  assert hlo.cross_axis_bytes(text, MESH_2x2, "data") == 34 + 256 + 64 + 32


def test_crosses_axis():
  assert not hlo.crosses_axis(((0, 1), (2, 3)), MESH_2x2, "path")
  assert hlo.crosses_axis(((0, 1), (2, 3)), MESH_2x2, "data")
  assert hlo.crosses_axis(((0, 2), (1, 3)), MESH_2x2, "path")
  assert hlo.crosses_axis((), MESH_2x2, "path")  # All devices.
  assert not hlo.crosses_axis((), _Mesh((1, 4), ("path", "data")), "path")
  assert not hlo.crosses_axis(((0, 0), (3, 3)), MESH_2x2, "path")  # Self-sends.


def test_unknown_group_form_raises():
  with pytest.raises(ValueError, match="replica_groups"):
    hlo.collectives("  %a = f32[2]{0} all-reduce(%x), replica_groups=<?>")


def test_compiled_reductions_on_permuted_mesh():
  """What the installed XLA prints: a data-axis sum never crosses 'path'."""
  devs = jax.devices()
  mesh = Mesh(
    np.array([devs[i] for i in (2, 0, 3, 1)]).reshape(2, 2),
    ("path", "data"),
    axis_types=(AxisType.Auto,) * 2,
  )
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("path", "data")))

  def text(f):
    return jax.jit(f).lower(x).compile().as_text()

  over_data, over_path = text(lambda v: v.sum(1)), text(lambda v: v.sum(0))
  assert hlo.collectives(over_data) and hlo.collectives(over_path)
  assert hlo.cross_axis_bytes(over_data, mesh, "path") == 0
  assert hlo.cross_axis_bytes(over_data, mesh, "data") > 0
  assert hlo.cross_axis_bytes(over_path, mesh, "path") > 0
  assert hlo.cross_axis_bytes(over_path, mesh, "data") == 0


def test_tpu_dcn_transfers_and_async_fusion_copies():
  """Two forms of multislice TPU HLO (libtpu 0.0.42, abridged from a compiled outer step).

  A MegaScale transfer is a send and a recv under one rendezvous: counted once,
  as the larger buffer (4*8*4 = 128 bytes), spanning 'path' (DCN_AXIS) only.
  An all-gather repeated in async collective fusions (same channel_id and
  chain_id) is one collective; shard_map's distinct collectives may share a
  channel_id (all are channel_id=1 on CPU) and are each counted.
  """
  megascale = (
    'frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
    '_xla_host_transfer_rendezvous="all_to_all.688_0",'
    '_xla_megascale_transfer_type="ALL_TO_ALL"}'
  )
  text = "\n".join(
    [
      f"  %send = (f32[4,8]{{1,0}}, u32[], token[]) send(%a, %t), channel_id=2, "
      f"is_host_transfer=true, {megascale}",
      f"  %recv = (f32[4,8]{{1,0}}, u32[], token[]) recv(%t), channel_id=1, "
      f"is_host_transfer=true, {megascale}",
    ]
    + [
      f"  %all-gather.{i} = f32[1,16]{{1,0}} all-gather(%p{i}), channel_id=1, "
      'replica_groups={{0,2},{1,3}}, dimensions={1}, frontend_attributes={chain_id="0"}'
      for i in range(3)
    ]
    + [
      f"  %all-to-all.{i} = f32[2]{{0}} all-to-all(%q{i}), channel_id=1, "
      "replica_groups={{0,2},{1,3}}, dimensions={0}"
      for i in range(2)
    ]
  )
  got = [(c.op, c.nbytes, c.dcn) for c in hlo.collectives(text)]
  assert got == [
    ("all-gather", 64, False),
    ("all-to-all", 8, False),
    ("all-to-all", 8, False),
    ("dcn-all-to-all", 128, True),
  ]
  assert hlo.dcn_bytes(text) == 128
  assert hlo.cross_axis_bytes(text, MESH_2x2, "path") == 64 + 8 + 8 + 128
  assert hlo.cross_axis_bytes(text, MESH_2x2, "data") == 0


@pytest.mark.parametrize(
  "shape, nbytes",
  [
    ("f4e2m1fn[16]{0}", 8),  # FP4: half a byte each.
    ("f8e4m3fn[3,5]{1,0}", 15),
    ("f8e4m3[4]{0}", 4),
    ("f8e5m2[4]{0}", 4),
    ("f6e3m2fn[8]{0}", 6),
    ("f8e8m0fnu[2]{0}", 2),
    ("s4[3]{0}", 2),  # 12 bits, rounded up to whole bytes.
    ("u2[8]{0}", 2),
    ("pred[5]{0}", 5),
    ("(bf16[2]{0}, f4e2m1fn[4]{0}, token[])", 6),
  ],
)
def test_every_element_width_is_counted(shape, nbytes):
  c = _one(f"  %ar = {shape} all-reduce(%p), replica_groups={{{{0,1}}}}, to_apply=%add")
  assert c.nbytes == nbytes


# A scan of 8 trips holding an all-reduce and a loop of 3 nested in it; a second all-reduce
# outside; a fusion the body calls (runs as often as its caller); a loop without a known count;
# one whose count only its condition gives (counter < 5, as TPU HLO prints a scan).
_LOOPS = """\
%cond5 (p: (s32[], f32[2])) -> pred[] {
  %constant.1 = s32[]{:T(128)} constant(5)
  %p = (s32[], f32[2]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.1), direction=LT
}
%bounded_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ar.bounded = f32[2]{0} all-reduce(f32[2]{0} %v), replica_groups={{0,1}}, to_apply=%add
}
%inner_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar.in = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={{0,2},{1,3}}, to_apply=%add
}
%fused (a: f32[2]) -> f32[2] {
  %ar.fused = f32[2]{0} all-reduce(f32[2]{0} %a), replica_groups={{0,1}}, to_apply=%add
}
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar.body = f32[8]{0} all-reduce(f32[8]{0} %y), replica_groups={{0,2},{1,3}}, to_apply=%add
  %f = f32[2]{0} fusion(%z), kind=kLoop, calls=%fused
  %w.in = (s32[], f32[4]) while(%t), condition=%cond, body=%inner_body, TRIPS_3
}
%unknown_body (p: (s32[], f32[1])) -> (s32[], f32[1]) {
  %ar.unknown = f32[1]{0} all-reduce(f32[1]{0} %u), replica_groups={{0,1}}, to_apply=%add
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, TRIPS_8
  %w2 = (s32[], f32[1]) while(%t1), condition=%cond, body=%unknown_body
  %w3 = (s32[], f32[2]) while(%t2), condition=%cond5, body=%bounded_body
  %ar.top = f32[16]{0} all-reduce(f32[16]{0} %a), replica_groups={{0,2},{1,3}}, to_apply=%add
}
""".replace("TRIPS_3", 'backend_config={"known_trip_count":{"n":"3"}}').replace(
  "TRIPS_8",
  'backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"8"}}',
)


def test_collectives_in_loops_count_once_per_trip():
  runs = hlo.trip_counts(_LOOPS)
  assert runs["main"] == 1 and runs["body"] == 8 and runs["inner_body"] == 24
  assert runs["fused"] == 8 and runs["unknown_body"] == 1  # No known count: a lower bound.
  assert runs["bounded_body"] == 5 and runs["cond5"] == 1
  got = {(c.nbytes, c.trips) for c in hlo.collectives(_LOOPS)}
  assert got == {(16, 24), (8, 8), (32, 8), (4, 1), (64, 1), (8, 5)}
  # Over 'path' (groups {0,2},{1,3}): 24 x 16 + 8 x 32 + 64 bytes.
  assert hlo.cross_axis_bytes(_LOOPS, MESH_2x2, "path") == 24 * 16 + 8 * 32 + 64
  assert hlo.cross_axis_bytes(_LOOPS, MESH_2x2, "data") == 8 * 8 + 4 + 5 * 8


def test_a_compiled_microbatch_scan_counts_its_reduction_per_microbatch():
  """The installed XLA's while loop: a gradient all-reduce inside a scan of 3 microbatches."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("path", "data"))

  def step(w, x):
    def body(acc, xi):
      return acc + jax.grad(lambda w: ((xi @ w) ** 2).sum())(w), None

    return jax.lax.scan(body, jnp.zeros_like(w), x)[0]

  w = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((3, 4, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
  text = jax.jit(step).lower(w, x).compile().as_text()
  (c,) = hlo.collectives(text)
  assert (c.op, c.nbytes, c.trips) == ("all-reduce", 8 * 8 * 4, 3)
  assert hlo.cross_axis_bytes(text, mesh, "data") == 3 * 256
  assert hlo.cross_axis_bytes(text, mesh, "path") == 0
