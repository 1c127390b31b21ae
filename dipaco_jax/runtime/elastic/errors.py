"""Elastic mode's config checks: one clear error per unsupported or bad setting (no Ray import)."""

from etils import epath

from dipaco_jax.core import topology
from dipaco_jax.errors import ConfigError
from dipaco_jax.runtime.elastic import storage

META = "elastic/meta.json"  # Written when an elastic run initializes its storage.
# Its storage's format: 2 since the workers write deltas (θ_module − θ_worker), not params; 3
# since every JSON item carries its crc32 (storage.save_json).
FORMAT = 3
_FORMATS = {1: "workers' params, not deltas", 2: "JSON items without checksums"}


class ElasticConfigError(ConfigError):
  """A config or workdir the elastic mode cannot run; the message names the field and the fix."""


def _check_streamed(o, e, r) -> None:
  """What a streamed elastic run (runtime/elastic/fragments.py: tasks of units) cannot join."""
  streamed = f"config.outer.fragments={o.fragments}, outer.overlap={o.overlap}"
  if e.quorum < 1.0:
    raise ElasticConfigError(
      f"{streamed} with elastic.quorum={e.quorum}: a streamed unit's task reads its fragment's "
      "step, which waits for every report; set elastic.quorum=1.0, or fragments=1 and overlap=0."
    )
  if e.progress_every_steps > 0:
    raise ElasticConfigError(
      f"{streamed} with elastic.progress_every_steps={e.progress_every_steps}: a streamed task "
      "trains only the steps between two syncs, and saves no progress within them; set "
      "elastic.progress_every_steps=0, or fragments=1 and overlap=0."
    )
  if e.pace_steps or e.token_weights:
    raise ElasticConfigError(
      f"{streamed} with elastic.pace_steps={e.pace_steps}, token_weights={e.token_weights}: "
      "a streamed unit trains a fixed span between two syncs, "
      "which pacing would cut and weigh as a short task; turn them off, or fragments=1 and "
      "overlap=0."
    )
  if r.discriminative_at_outer_step >= 0 and r.discriminative_phases >= 1:
    raise ElasticConfigError(
      f"{streamed} with routing.discriminative_at_outer_step={r.discriminative_at_outer_step}: "
      "an elastic re-shard scores the store's modules, which a streamed run's workers do not "
      "hold at a phase's end; use dipaco.mode='spmd', or fragments=1 and overlap=0."
    )


def check_config(config) -> None:
  """Refuses what the elastic mode cannot run, before anything starts.

  Each field's own rule (a count >= 1, a timeout > 0, worker_resources' JSON) is in its
  declaration (config/sections.py): these are the relations only the pool has.
  """
  m = config.mesh
  if m.path not in (-1, 1):
    raise ElasticConfigError(
      f"config.mesh.path={m.path}: an elastic worker runs one path; a mesh "
      "spanning paths is the spmd mode's. Set --config.mesh.path=1."
    )
  if m.data > 1 or m.model > 1 or m.fsdp:
    raise ElasticConfigError(
      f"config.mesh.data={m.data}, mesh.model={m.model}, mesh.fsdp={m.fsdp}: elastic workers "
      "run a path on one device for now; set data and model to 1 (or -1) and fsdp to False."
    )
  H = config.dipaco.inner_steps
  if config.eval.every_steps % H:
    every = config.eval.every_steps
    raise ElasticConfigError(
      f"config.eval.every_steps={every} is not a multiple of dipaco.inner_steps={H}: an elastic "
      "task evaluates its path at the start of a phase, from the stored modules; set "
      f"--config.eval.every_steps={max(H, every // H * H)} (or {(every // H + 1) * H})."
    )
  if config.stop_at_step >= 0:
    raise ElasticConfigError(
      f"config.stop_at_step={config.stop_at_step}: the elastic pool stops on no inner step (it "
      "stores every phase's state as it goes: stop the command and rerun it to resume); set "
      "stop_at_step=-1."
    )
  o, e, r = config.outer, config.elastic, config.routing
  if o.enabled and (o.fragments > 1 or o.overlap > 0):
    _check_streamed(o, e, r)
  if not config.outer.enabled:
    shared = [
      s.name
      for s in topology.from_config(config).store_groups()
      if len(set(s.module_of_worker.tolist())) < len(s.module_of_worker)
    ]
    if shared:
      raise ElasticConfigError(
        f"config.outer.enabled=False with modules that several workers share (group "
        f"{shared[0]}): the spmd loop then keeps each worker's own params from phase to phase, "
        "while an elastic task starts from the store's module; use dipaco.mode='spmd', or a "
        "grid in which no two workers share a module."
      )


def started(workdir: str) -> bool:
  """Whether `workdir` holds an elastic run's storage (its modules' version 0 on)."""
  return (epath.Path(workdir) / META).exists()


def check_workdir_mode(workdir: str, run_mode: str) -> None:
  """Refuses a workdir written by the other mode (its state would be ignored)."""
  wd = epath.Path(workdir)
  elastic = (wd / META).exists()
  if run_mode == "elastic" and not elastic and (wd / "checkpoints").exists():
    raise ElasticConfigError(
      f"{workdir} holds a run of config.dipaco.mode='spmd'; elastic cannot resume it. Use a new "
      "--workdir or rerun with --config.dipaco.mode=spmd."
    )
  if run_mode != "elastic" and elastic:
    raise ElasticConfigError(
      f"{workdir} holds a run of config.dipaco.mode='elastic'; rerun with "
      "--config.dipaco.mode=elastic or use a new --workdir."
    )
  if elastic:
    meta = storage.load_json(wd / META, checksum=False)  # An older format's has none.
    found = meta.get("format", 1) if isinstance(meta, dict) else None
    if found == FORMAT:  # This format's meta.json has its crc32: plain JSON was edited.
      storage.load_json(wd / META)
    elif found != FORMAT:
      raise ElasticConfigError(
        f"{workdir} holds an elastic run of storage format {found} "
        f"({_FORMATS.get(found, 'unknown')}; this version writes {FORMAT}): finish it with the "
        "version that started it, or use a new --workdir."
      )
