"""Collectives of a compiled HLO module and the bytes that cross a mesh axis.

`exp.inner_step.lower(...).compile().as_text()` is the input. A collective's
replica groups list *logical* device ids: positions in the executable's device
assignment, which for a jit over `NamedSharding`s of a mesh is
`mesh.devices.flat` (not `Device.id`). A group crosses an axis when its
members sit at different coordinates of that axis.

XLA prints groups in four forms, all handled here:
  explicit   replica_groups={{0,1},{2,3}}   ({} = one group of all devices)
  iota       replica_groups=[2,2]<=[4]  or  [2,2]<=[2,2]T(1,0)
  mesh axes  replica_groups=mesh['a'=2,'b'=2] {'b'}  (optionally with
             `, device_ids=(...)` and sub-axes like 'b':(1)2)
  pairs      source_target_pairs={{0,1},{1,0}}  (collective-permute)

Two TPU-only forms. A program compiled for several slices holds each slice's
own collectives (ICI) as above, and the parts that cross slices over DCN as
`send`/`recv` host transfers for the MegaScale runtime: one rendezvous name
per transfer, with its type (ALL_REDUCE, ALL_TO_ALL, ...). Each is one
`Collective` with `dcn=True`, op "dcn-all-reduce" etc., the larger of its send
and receive buffers as bytes; it spans DCN_AXIS, the axis that
`sharding.make_mesh` lays across slices. And TPU async collective fusions
repeat one collective in every fusion that carries a share of its progress,
each copy with the same channel_id and `chain_id` attribute: it is counted
once. (Elsewhere channel ids repeat across distinct collectives: shard_map's
all carry channel_id=1 on CPU.)

Loops: a collective inside a `while` body (the microbatch `scan`) runs once per trip, so each
`Collective` carries `trips`, the product of the known trip counts of the loops around it
(`trip_counts`), and the byte totals multiply by it. Bytes of every element type: the width in
bits its name gives (f32, bf16, f8e4m3fn, f8e5m2, f6e3m2fn, f4e2m1fn, s4, ...), sub-byte
types packed. `custom_calls` lists the kernels (Pallas) a program calls, with their trips, for
the FLOPs XLA's cost analysis does not see.
"""
# pylint: disable=invalid-name

import math
import re
from typing import NamedTuple, Sequence

import numpy as np

OPS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
  "collective-broadcast",
)
_OP_RE = re.compile(r"\s(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+\w*)?)\[([^\]]*)\]")
# An element's bits from its type's name: pred (one byte), s4/u4/s2/u2 (packed), bf16, f32,
# f8e4m3fn, f8e5m2, f6e3m2fn, f4e2m1fn, f8e8m0fnu, c64 (two f32) ...: the number after the
# kind is the width in bits, whatever exponent/mantissa split follows.
_ELEMENT_RE = re.compile(r"(?:bf|f|s|u|c)([0-9]+)(?:e[0-9]+m[0-9]+\w*)?")
_IOTA_RE = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_RE = re.compile(
  r"(?:maximal_mesh\[device_id=(\d+)\]|mesh\[([^\]]*)\]"
  r"(?:, device_ids=\(([^)]*\)?)\))?) \{([^}]*)\}"
)


DCN_AXIS = "path"  # The mesh axis that spans TPU slices (sharding.make_mesh).
_MEGASCALE_RE = re.compile(
  r'_xla_host_transfer_handler_name="xla_megascale_runtime".*?'
  r'_xla_host_transfer_rendezvous="([^"]+)"'
)
_TRANSFER_RE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_CHAIN_RE = re.compile(r'\bchannel_id=(\d+).*\bchain_id="(\d+)"')


class Collective(NamedTuple):
  """One collective: opcode, bytes per device, and its device groups."""

  op: str  # e.g. "all-reduce", "all-gather-start" or (across slices) "dcn-all-to-all".
  nbytes: int  # Full buffer per device: the larger of its input and output.
  groups: tuple[tuple[int, ...], ...]  # Logical ids; () = all devices.
  dcn: bool = False  # A MegaScale transfer between slices: spans DCN_AXIS only.
  trips: int = 1  # Times it runs per execution: the trip counts of the loops around it.


_CALL_RE = re.compile(
  r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def computation_name(line: str) -> str | None:
  """The name a computation's header line declares (`ENTRY %main (...) -> ... {`), else None."""
  if not line or line[0].isspace() or not line.rstrip().endswith("{"):
    return None
  head = line.removeprefix("ENTRY ").split(" ", 1)[0]
  return head.lstrip("%")


def _condition_bounds(hlo_text: str) -> dict[str, int]:
  """N of each computation that is a loop condition `x < constant(N)` (one s32 constant)."""
  out, current, consts, lt = {}, None, [], False
  for line in hlo_text.splitlines() + ["}"]:
    name = computation_name(line)
    if name is not None:
      current, consts, lt = name, [], False
    elif line.startswith("}"):
      if current is not None and lt and len(consts) == 1:
        out[current] = consts[0]
      current = None
    elif current is not None:
      c = re.search(r"= s32\[\]\S* constant\((\d+)\)", line)
      if c:
        consts.append(int(c.group(1)))
      if line.lstrip().startswith("ROOT") and " compare(" in line and "direction=LT" in line:
        lt = True
  return out


def trip_counts(hlo_text: str) -> dict[str, int]:
  """How many times each computation runs per execution of the module.

  ENTRY runs once; a `while` body runs its loop's trip count times per run of the
  computation holding the loop: the known_trip_count XLA notes (CPU), else the bound of a
  condition `counter < constant(N)` (jax's scan and fori_loop count from 0 by 1; TPU HLO
  notes no count), else once (a lower bound). Every other callee (fusions, conditions,
  branches, reducers) runs as often as its caller; one called from several places sums them.
  """
  callers: dict[str, list[tuple[str, int]]] = {}
  bounds = _condition_bounds(hlo_text)
  entry, current = None, None
  for line in hlo_text.splitlines():
    name = computation_name(line)
    if name is not None:
      current = name
      if line.startswith("ENTRY"):
        entry = name
      continue
    if current is None or " = " not in line:
      continue
    trip = _TRIP_RE.search(line)
    cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
    n = int(trip.group(1)) if trip else bounds.get(cond.group(1), 1) if cond else 1
    for kind, callee in _CALL_RE.findall(line):
      factor = n if kind == "body" else 1
      callers.setdefault(callee, []).append((current, factor))
    for branches in _BRANCHES_RE.findall(line):
      for callee in branches.split(","):
        callers.setdefault(callee.strip().lstrip("%"), []).append((current, 1))
  memo: dict[str, int] = {}

  def count(comp: str, seen=()) -> int:
    if comp == entry or comp not in callers:
      return 1 if comp == entry or entry is None else 0
    if comp not in memo:
      if comp in seen:  # Not an HLO module (no cycles there): count it once.
        return 1
      memo[comp] = sum(count(c, (*seen, comp)) * f for c, f in callers[comp])
    return memo[comp]

  names = {computation_name(line) for line in hlo_text.splitlines()} - {None}
  return {n: count(n) for n in names}


def element_bits(dtype: str) -> int | None:
  """Bits of one element of an HLO type (pred: 8; token: 0); None for a name that is no type."""
  if dtype == "pred":
    return 8
  if dtype == "token":
    return 0
  m = _ELEMENT_RE.fullmatch(dtype)
  return int(m.group(1)) if m else None


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple sums its elements; sub-byte types packed)."""
  total = 0
  for dtype, dims in _ARRAY_RE.findall(shape):
    bits = element_bits(dtype)
    if bits is None:
      continue
    dims = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
    total += -(-bits * math.prod(dims) // 8)  # Packed, rounded up to whole bytes.
  return total


def split_top(s: str) -> list[str]:
  """Splits `a, (b, c), d` on the commas outside brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return [p.strip() for p in parts if p.strip()]


def _tuple_elements(shape: str) -> list[str]:
  shape = shape.strip()
  if shape.startswith("(") and shape.endswith(")"):
    return split_top(shape[1:-1])
  return [shape]


def _int_lists(s: str) -> tuple[tuple[int, ...], ...]:
  """'{{0,1},{2,3}}' -> ((0, 1), (2, 3)); '{}' -> ()."""
  return tuple(
    tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([\d,\s]*)\}", s[1:-1])
  )


def _iota_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
  """[G,S]<=[dims]T(perm): iota over dims, transposed, cut into G groups of S."""
  group_shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  return tuple(tuple(int(i) for i in row) for row in ids.reshape(group_shape[0], -1))


def _mesh_device_array(sizes: list[int], device_ids: str | None) -> np.ndarray:
  """Logical ids laid out on the mesh: iota, `[dims]T(perm)` or a flat list."""
  if not device_ids:
    return np.arange(math.prod(sizes)).reshape(sizes)
  iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids)
  if iota:
    dims = [int(x) for x in iota.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(2):
      ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
    return ids.reshape(sizes)
  return np.array([int(x) for x in device_ids.split(",")]).reshape(sizes)


def _mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
  """Groups of a mesh-axes list: vary the named (sub-)axes, fix the rest."""
  if m.group(1) is not None:  # maximal_mesh: a single device.
    return ((int(m.group(1)),),)
  names, sizes = [], []
  for item in split_top(m.group(2)):
    name, size = item.rsplit("=", 1)
    names.append(name.strip().strip("'"))
    sizes.append(int(size))
  ids = _mesh_device_array(sizes, m.group(3))
  # Split each mesh axis into its referenced sub-axes (pre_size, size) so
  # every grouped axis becomes one dimension of a reshaped device array.
  refs = []
  for item in split_top(m.group(4)):
    sub = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", item.strip())
    if sub is None:
      raise ValueError(f"unparsed mesh axis {item!r} in replica_groups")
    axis = names.index(sub.group(1))
    pre, size = (int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, sizes[axis])
    refs.append((axis, pre, size))
  dims, grouped = [], []
  for axis, full in enumerate(sizes):
    cuts = sorted((pre, size, k) for k, (a, pre, size) in enumerate(refs) if a == axis)
    # Sub-axis (pre)size of an axis is the dim of that size after a major
    # part of size `pre` (Shardy's convention); pieces run major to minor.
    pieces, done = [], 1
    for pre, size, k in cuts:
      if pre != done:
        pieces.append((pre // done, None))
      pieces.append((size, k))
      done = pre * size
    if done != full:
      pieces.append((full // done, None))
    for size, k in pieces:
      if k is not None:
        grouped.append((k, len(dims)))
      dims.append(size)
  arr = ids.reshape(dims)
  order = [d for _, d in sorted(grouped)]
  rest = [d for d in range(len(dims)) if d not in order]
  group_size = math.prod(dims[d] for d in order)
  flat = arr.transpose(rest + order).reshape(-1, group_size)
  return tuple(tuple(int(i) for i in row) for row in flat)


def _groups(attrs: str) -> tuple[tuple[int, ...], ...]:
  """Device groups from an instruction's attribute text."""
  m = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", attrs)
  if m:
    return _int_lists(m.group(1))
  if "replica_groups=" not in attrs:
    return ()
  rest = attrs.split("replica_groups=", 1)[1]
  if rest.startswith("{"):
    m = re.match(r"\{(?:\{[\d,\s]*\},?\s*)*\}", rest)
    return _int_lists(m.group(0))
  m = _IOTA_RE.match(rest)
  if m:
    return _iota_groups(m)
  m = _MESH_RE.match(rest)
  if m:
    return _mesh_groups(m)
  raise ValueError(
    f"unparsed replica_groups: {rest[:120]!r}; this XLA "
    "prints a form dipaco_jax/hlo.py does not know: add it there."
  )


def _nbytes(op: str, shape: str, groups) -> int:
  """The larger of a collective's per-device input and output buffers."""
  base, is_start = op.removesuffix("-start"), op.endswith("-start")
  elements = _tuple_elements(shape)
  if is_start and base == "all-gather":
    # all-gather-start returns (operands, results): count the results.
    return _shape_bytes(", ".join(elements[len(elements) // 2 :]))
  if is_start and base == "collective-permute":
    return _shape_bytes(elements[0])  # (operand, result, contexts...).
  out = _shape_bytes(shape)
  if base == "reduce-scatter":
    return out * (len(groups[0]) if groups else 1)
  return out


def _megascale(line: str, transfers: dict[str, Collective], trips: int) -> None:
  """Records a MegaScale send or recv under its rendezvous (the larger buffer of the two)."""
  m = _MEGASCALE_RE.search(line)
  op = re.search(r" = (.*?) (send|recv)\(", line)
  if m is None or op is None:
    return
  t = _TRANSFER_RE.search(line)
  kind = "dcn-" + (t.group(1).lower().replace("_", "-") if t else "transfer")
  nbytes = _shape_bytes(_tuple_elements(re.sub(r"/\*.*?\*/", "", op.group(1)))[0])
  prev = transfers.get(m.group(1))
  transfers[m.group(1)] = Collective(kind, max(nbytes, prev.nbytes if prev else 0), (), True, trips)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction (and async start) in an HLO module's text, with its trips."""
  out, seen, transfers = [], set(), {}
  runs, trips = trip_counts(hlo_text), 1
  for line in hlo_text.splitlines():
    name = computation_name(line)
    if name is not None:
      trips = runs.get(name, 1)
      continue
    if "xla_megascale_runtime" in line:
      _megascale(line, transfers, trips)
      continue
    m = _OP_RE.search(line)
    if m is None or " = " not in line[: m.start() + 1]:
      continue
    shape = re.sub(r"/\*.*?\*/", "", line[line.index(" = ") + 3 : m.start()])
    op = m.group(1) + (m.group(2) or "")
    attrs = line[m.end() :]
    chain = _CHAIN_RE.search(attrs)
    if chain:  # One collective, however many async fusions repeat it.
      if (op, chain.groups()) in seen:
        continue
      seen.add((op, chain.groups()))
    groups = _groups(attrs)
    out.append(Collective(op, _nbytes(op, shape, groups), groups, False, trips))
  return out + list(transfers.values())


class CustomCall(NamedTuple):
  """One custom call (a Pallas kernel): its instruction name, result arrays and trips."""

  name: str  # e.g. "splash_mha_fwd_segmented_no_residuals.3".
  results: tuple[tuple[str, tuple[int, ...]], ...]  # (element type, dims) of each result.
  trips: int = 1


def custom_calls(hlo_text: str, prefix: str = "") -> list[CustomCall]:
  """The custom calls whose instruction name starts with `prefix`, with their trip counts."""
  out, runs, trips = [], trip_counts(hlo_text), 1
  for line in hlo_text.splitlines():
    name = computation_name(line)
    if name is not None:
      trips = runs.get(name, 1)
      continue
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) custom-call\(", line)
    if m is None or not m.group(1).startswith(prefix):
      continue
    shape = re.sub(r"/\*.*?\*/", "", m.group(2))
    results = tuple(
      (dtype, tuple(int(d) for d in dims.split(",") if d.strip()))
      for dtype, dims in _ARRAY_RE.findall(shape)
      if element_bits(dtype) is not None
    )
    out.append(CustomCall(m.group(1), results, trips))
  return out


def spans(c: Collective, mesh, axis: str) -> bool:
  """Whether a collective spans `axis`: a DCN transfer spans DCN_AXIS alone."""
  if c.dcn:
    return (
      axis == DCN_AXIS and np.asarray(mesh.devices).shape[list(mesh.axis_names).index(axis)] > 1
    )
  return crosses_axis(c.groups, mesh, axis)


def crosses_axis(groups: Sequence[Sequence[int]], mesh, axis: str) -> bool:
  """Whether any group spans two coordinates of `axis` (() = all devices)."""
  shape = np.asarray(mesh.devices).shape
  k = list(mesh.axis_names).index(axis)
  if not groups:
    return shape[k] > 1
  for g in groups:
    coords = {np.unravel_index(int(i), shape)[k] for i in g}
    if len(coords) > 1:
      return True
  return False


def cross_axis_bytes(hlo_text: str, mesh, axis: str) -> int:
  """Bytes per device, per execution, of collectives spanning `axis` (DCN transfers included).

  A collective inside a loop counts once per trip (`Collective.trips`).
  """
  return sum(c.nbytes * c.trips for c in collectives(hlo_text) if spans(c, mesh, axis))


def dcn_bytes(hlo_text: str) -> int:
  """Bytes per device, per execution, of the MegaScale transfers between slices (every trip)."""
  return sum(c.nbytes * c.trips for c in collectives(hlo_text) if c.dcn)
