"""θ̄ from another run or a Llama (config.dipaco.init_from): the source checked, the params read.

The source is a dipaco_jax run's workdir (its latest checkpoint, worker 0) or a Hugging
Face Llama checkpoint's folder (config.json, model.safetensors, tokenizer.model: the
paper's fork from a pretrained dense model, io/hf_llama.py). Attention's kernels of a run
of the other model.attention_kernels layout are reshaped into this config's (the same
numbers).

Both runtimes and the router's features start from θ̄. Each check raises one
ConfigError naming config.dipaco.init_from and the fix, before the run writes
anything: a missing path, a checkpoint step folder given for its run, a run
with no finished checkpoint, params of another model; for a Llama, a folder that is
not one, a Llama of another shape or one this model cannot compute, a tokenizer that is
not the run's.
"""

import jax
from etils import epath

from dipaco_jax.config import sections
from dipaco_jax.errors import ConfigError
from dipaco_jax.io import checkpoint
from dipaco_jax.io import hf_llama
from dipaco_jax.types import PyTree

_FIELD = "config.dipaco.init_from"


def check_source(src: str, model_cfg: sections.ModelConfig | None = None) -> None:
  """Raises ConfigError unless `src` is a run with a finished checkpoint, or a Llama.

  A Llama's config.json is checked against `model_cfg` (the run's config.model) when given.
  """
  path = epath.Path(src)
  if not path.exists():
    raise ConfigError(
      f"{_FIELD}={src!r} does not exist: give the workdir of a finished dense run or a Hugging "
      "Face Llama checkpoint's folder, or '' for a random θ̄."
    )
  if hf_llama.is_checkpoint(src):
    config = hf_llama.read_config(src, f"{_FIELD}={src!r}")
    if model_cfg is not None:
      hf_llama.check_model(config, model_cfg, f"{_FIELD}={src!r}")
    return
  if path.parent.name == checkpoint.DIRNAME or path.name == checkpoint.DIRNAME:
    run = path.parent.parent if path.parent.name == checkpoint.DIRNAME else path.parent
    raise ConfigError(
      f"{_FIELD}={src!r} names a checkpoint folder, not a run: give the run's workdir "
      f"(--config.dipaco.init_from={run}); its latest checkpoint is read."
    )
  if not checkpoint.steps(src):
    raise ConfigError(
      f"{_FIELD}={src!r} holds no finished checkpoint (no {checkpoint.directory(src)}/<step>) "
      f"and no Hugging Face {hf_llama.CONFIG}: give the workdir of a dense run that has saved "
      "one, or a Llama checkpoint's folder."
    )


def check_tokenizer(src: str, sp_proto: bytes, vocab_path: str) -> None:
  """A Llama θ̄'s tokenizer.model must be the run's tokenizer (data.vocab_path), piece for piece."""
  if not hf_llama.is_checkpoint(src):
    return
  what = f"{_FIELD}={src!r}"
  theirs = hf_llama.read_tokenizer(src, what)
  if theirs == sp_proto:
    return
  a, b = hf_llama.pieces(theirs), hf_llama.pieces(sp_proto)
  if a != b:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    raise ConfigError(
      f"{what}: its {hf_llama.TOKENIZER} ({len(a)} pieces) is not the run's tokenizer "
      f"{vocab_path} ({len(b)} pieces; they differ from id {first}): train on the Llama's "
      f"vocabulary with --config.data.vocab_path={epath.Path(src) / hf_llama.TOKENIZER}."
    )


def initial(src: str, abstract_params: PyTree) -> PyTree | None:
  """θ̄ of a run from config.dipaco.init_from (`restore`), or None ("": a random θ̄)."""
  return restore(src, abstract_params) if src else None


def restore(src: str, abstract_params: PyTree) -> PyTree:
  """θ̄ of `src` (a run's worker 0, or a Llama), checked leaf by leaf against `abstract_params`."""
  check_source(src)
  # A run of the other model.attention_kernels layout holds the same numbers: reshaped.
  theta = kernels_like(_read(src), abstract_params)
  want = dict(jax.tree_util.tree_flatten_with_path(abstract_params)[0])
  got = dict(jax.tree_util.tree_flatten_with_path(theta)[0])
  for kp in sorted(set(want) | set(got), key=jax.tree_util.keystr):
    w, g = want.get(kp), got.get(kp)
    if w is None or g is None or tuple(w.shape) != tuple(g.shape):
      name = jax.tree_util.keystr(kp)
      have = "absent" if g is None else f"shape {tuple(g.shape)}"
      need = "absent" if w is None else f"shape {tuple(w.shape)}"
      raise ConfigError(
        f"{_FIELD}={src!r} holds params of another model: {name} is {have} there, {need} "
        "in this config's model: give a run of the same config.model (its config.json says)."
      )
  return jax.tree.map(lambda t, a: t.astype(a.dtype), theta, abstract_params)


def _read(src: str) -> PyTree:
  """The params at `src`: a run's worker 0, or a Llama's tensors in this model's tree."""
  if not hf_llama.is_checkpoint(src):
    return checkpoint.restore_worker_params(src)
  what = f"{_FIELD}={src!r}"
  config = hf_llama.read_config(src, what)
  hf_llama.check_llama(config, what)
  cfg = sections.ModelConfig(**hf_llama.model_fields(config))
  tensors = hf_llama.read_tensors(src, what)
  hf_llama.check_tensors(tensors, cfg, what)
  return hf_llama.from_tensors(tensors, cfg)


# Attention's kernels (model.attention_kernels): where their [H, K] pair sits, from the end.
_HEAD_PAIR = {"query": 2, "key": 2, "value": 2, "out": 3}


def _merged(shape: tuple, back: int) -> tuple:
  """`shape` with its [H, K] pair (`back` dims from the end) merged into H K."""
  i = len(shape) - back
  return tuple(shape[:i]) + (shape[i] * shape[i + 1],) + tuple(shape[i + 2 :])


def kernels_like(tree: PyTree, like: PyTree) -> PyTree:
  """`tree` with each attention kernel in `like`'s layout (model.attention_kernels).

  "heads" [.., D, H, K] / [.., H, K, D] and "matrix" [.., D, H K] / [.., H K, D] hold the
  same numbers in row-major order, so a reshape converts one into the other (θ̄ of a run
  of the other layout, config.dipaco.init_from). Any other leaf, or a shape that is not
  the other layout's, is returned as it is, for the caller's shape check to name.
  """
  shapes = {kp: tuple(a.shape) for kp, a in jax.tree_util.tree_flatten_with_path(like)[0]}

  def one(kp, x):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in kp]
    back = _HEAD_PAIR.get(names[-2]) if len(names) >= 3 and names[-3] == "attn" else None
    have, want = tuple(x.shape), shapes.get(kp)
    if names[-1] != "kernel" or back is None or want is None or have == want:
      return x
    merges = len(have) == len(want) + 1 and _merged(have, back) == want
    splits = len(want) == len(have) + 1 and _merged(want, back) == have
    return x.reshape(want) if merges or splits else x

  return jax.tree_util.tree_map_with_path(one, tree)
