"""One path's params <-> a Hugging Face Llama checkpoint (config.json, model.safetensors).

What maps, read off core/model.py: pre-norm RMSNorm (flax's ε 1e-6, float32 statistics), RoPE
on halves (rotate_half) with frequencies 1/10000^(2i/K) and positions 0..T-1, SwiGLU
(down(silu(gate x) * up x)), attention scale K^-0.5, no biases, one key/value head per query
head, embeddings unscaled. Flax keeps a kernel [in, out] (attention per head [D, H, K] and
[H, K, D], or as matrices [D, H K] and [H K, D], the same numbers in row-major order); torch's
Linear keeps [out, in]. Tied embeddings: the head scales its features by d_model^-0.5 before
the token table (model.Head), which Llama does not, so the scale is folded into the final
norm's weight (exact when d_model is a power of 4; else within a rounding).

A config Llama cannot hold (GELU MLP, learned positions, d_model not a multiple of the heads)
is refused in one line naming the field; so is a Llama checkpoint this model cannot hold.
Tensors are written with the `safetensors` library (numpy, no torch).
"""
# pylint: disable=invalid-name

import json
import math
from typing import Any

import numpy as np
import safetensors.numpy
from etils import epath

from dipaco_jax import errors
from dipaco_jax.config import sections
from dipaco_jax.io import files
from dipaco_jax.types import PyTree

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # Sharded checkpoints (read, never written).
TOKENIZER = "tokenizer.model"  # The SentencePiece model, as Llama checkpoints name it.
TOKENIZER_CONFIG = "tokenizer_config.json"
# flax.linen.RMSNorm's default ε and model.py's RoPE base: fixed in model.py.
RMS_EPS = 1e-6
ROPE_THETA = 10_000.0


def _field(name: str) -> str:
  return f"config.model.{name}"


def check_exportable(cfg: sections.ModelConfig) -> None:
  """Raises ConfigError naming the first field a Llama checkpoint cannot hold."""
  if cfg.mlp != "swiglu":
    raise errors.ConfigError(
      f"{_field('mlp')}={cfg.mlp!r}: a Llama checkpoint holds a gated SiLU MLP (Llama's "
      "SwiGLU) only; export a run trained with --config.model.mlp=swiglu."
    )
  if cfg.positions != "rope":
    raise errors.ConfigError(
      f"{_field('positions')}={cfg.positions!r}: a Llama checkpoint has rotary positions "
      "only; export a run trained with --config.model.positions=rope."
    )
  if cfg.d_model % cfg.num_heads:
    raise errors.ConfigError(
      f"{_field('num_heads')}={cfg.num_heads} does not divide {_field('d_model')}="
      f"{cfg.d_model}: transformers' LlamaConfig requires hidden_size % num_attention_heads "
      "== 0; export a run whose head count divides d_model."
    )


def tied_head_scale(d_model: int) -> float:
  """model.Head's factor on the tied head's features: folded into the final norm."""
  return d_model**-0.5


def hf_config(cfg: sections.ModelConfig, *, max_positions: int, special: dict) -> dict:
  """config.json of the Llama that computes this model's logits (after check_exportable)."""
  check_exportable(cfg)
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": max_positions,
    "rms_norm_eps": RMS_EPS,
    "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": cfg.tie_embeddings,
    "dtype": "float32",
    **special,
  }


def _linear(kernel_IxO: np.ndarray, inputs: int) -> np.ndarray:
  """A flax kernel (its first dims the `inputs`-sized input) as torch's Linear weight [O, I]."""
  return np.ascontiguousarray(np.asarray(kernel_IxO, np.float32).reshape(inputs, -1).T)


def to_tensors(params: PyTree, cfg: sections.ModelConfig) -> dict[str, np.ndarray]:
  """One path's params (no leading axis) as LlamaForCausalLM's state dict (float32)."""
  check_exportable(cfg)
  D, HK = cfg.d_model, cfg.num_heads * cfg.head_dim
  out = {"model.embed_tokens.weight": np.asarray(params["embed"]["token"], np.float32)}
  for i in range(cfg.num_layers):
    b, pre = params[f"block_{i}"], f"model.layers.{i}."
    attn = b["attn"]
    out[pre + "input_layernorm.weight"] = np.asarray(b["attn_norm"]["scale"], np.float32)
    for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
      out[pre + f"self_attn.{theirs}.weight"] = _linear(attn[ours]["kernel"], D)
    out[pre + "self_attn.o_proj.weight"] = _linear(attn["out"]["kernel"], HK)
    out[pre + "post_attention_layernorm.weight"] = np.asarray(b["mlp_norm"]["scale"], np.float32)
    for ours, theirs in (("mlp_gate", "gate_proj"), ("mlp_in", "up_proj")):
      out[pre + f"mlp.{theirs}.weight"] = _linear(b[ours]["kernel"], D)
    out[pre + "mlp.down_proj.weight"] = _linear(b["mlp_out"]["kernel"], cfg.mlp_dim)
  norm = np.asarray(params["head"]["norm"]["scale"], np.float64)
  if cfg.tie_embeddings:
    norm = norm * tied_head_scale(D)
  else:
    out["lm_head.weight"] = _linear(params["head"]["unembed"]["kernel"], D)
  out["model.norm.weight"] = norm.astype(np.float32)
  return out


def from_tensors(tensors: dict[str, np.ndarray], cfg: sections.ModelConfig) -> PyTree:
  """LlamaForCausalLM's state dict as one path's params, attention kernels per head."""
  D, H, K, F = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  t = lambda name: np.asarray(tensors[name], np.float32)
  kernel = lambda name, shape: {"kernel": np.ascontiguousarray(t(name).T.reshape(shape))}
  params: dict[str, Any] = {"embed": {"token": t("model.embed_tokens.weight")}}
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    attn = {
      ours: kernel(pre + f"self_attn.{theirs}.weight", (D, H, K))
      for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))
    }
    attn["out"] = kernel(pre + "self_attn.o_proj.weight", (H, K, D))
    params[f"block_{i}"] = {
      "attn": attn,
      "attn_norm": {"scale": t(pre + "input_layernorm.weight")},
      "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")},
      "mlp_gate": kernel(pre + "mlp.gate_proj.weight", (D, F)),
      "mlp_in": kernel(pre + "mlp.up_proj.weight", (D, F)),
      "mlp_out": kernel(pre + "mlp.down_proj.weight", (F, D)),
    }
  norm = np.asarray(tensors["model.norm.weight"], np.float64)
  head: dict[str, Any] = {}
  if cfg.tie_embeddings:
    norm = norm / tied_head_scale(D)
  else:
    head["unembed"] = kernel("lm_head.weight", (D, tensors["lm_head.weight"].shape[0]))
  head["norm"] = {"scale": norm.astype(np.float32)}
  params["head"] = head
  return params


def tokenizer_config(sp_proto: bytes) -> dict:
  """tokenizer_config.json for a SentencePiece model of the T5 layout (vocab.py).

  transformers' TokenizersBackend converts tokenizer.model exactly (byte fallback and the
  user pieces included); its BOS is the pad piece, the token that starts every input here.
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  sp = spm.SentencePieceProcessor()
  sp.LoadFromSerializedProto(sp_proto)
  piece = sp.id_to_piece
  return {
    "tokenizer_class": "TokenizersBackend",
    "bos_token": piece(sp.pad_id()),
    "eos_token": piece(sp.eos_id()),
    "unk_token": piece(sp.unk_id()),
    "pad_token": piece(sp.pad_id()),
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
  }


def special_ids(sp_proto: bytes) -> dict:
  """config.json's bos/eos/pad ids: inputs start with the pad id (the T5 layout, vocab.py)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  sp = spm.SentencePieceProcessor()
  sp.LoadFromSerializedProto(sp_proto)
  return {"bos_token_id": sp.pad_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}


def write(
  out: str,
  params: PyTree,
  cfg: sections.ModelConfig,
  sp_proto: bytes,
  *,
  max_positions: int,
) -> None:
  """Writes one Llama checkpoint into folder `out`: config, weights, tokenizer files."""
  config = hf_config(cfg, max_positions=max_positions, special=special_ids(sp_proto))
  tensors = to_tensors(params, cfg)
  files.write_bytes(
    files.join(out, WEIGHTS), safetensors.numpy.save(tensors, metadata={"format": "pt"})
  )
  files.write_bytes(files.join(out, TOKENIZER), sp_proto)
  files.write_json(files.join(out, TOKENIZER_CONFIG), tokenizer_config(sp_proto))
  files.write_json(files.join(out, CONFIG), config)  # Last: a folder with it is whole.


# --- Reading a Llama checkpoint (config.dipaco.init_from). ---


def is_checkpoint(src: str) -> bool:
  """Whether folder `src` holds a Hugging Face config.json, not a dipaco_jax run's config.json."""
  p = epath.Path(src) / CONFIG
  if not p.exists():
    return False
  try:
    config = json.loads(p.read_text())
  except (ValueError, OSError):
    return True  # Not a run's (the trainer writes it whole): read_config names the problem.
  return not (isinstance(config, dict) and "dipaco" in config)


def read_config(src: str, what: str) -> dict:
  """`src`/config.json of a Llama; anything else is one ConfigError starting with `what`."""
  p = epath.Path(src) / CONFIG
  try:
    config = json.loads(p.read_text())
  except (ValueError, OSError) as e:
    raise errors.ConfigError(
      f"{what}: {p} is not a Hugging Face config (not JSON: {e}); give a Llama checkpoint's folder."
    ) from e
  kind = config.get("model_type") if isinstance(config, dict) else None
  if kind != "llama":
    raise errors.ConfigError(
      f"{what}: {p} describes model_type={kind!r}, not a Llama: give a Hugging Face Llama "
      "checkpoint's folder (model_type 'llama') or a dipaco_jax run's workdir."
    )
  return config


def _rope_theta(config: dict) -> float:
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    return float("nan")  # Scaled RoPE: refused by the caller as another base.
  return float(rope.get("rope_theta", config.get("rope_theta", ROPE_THETA)))


def check_llama(config: dict, what: str) -> None:
  """Refuses, in one line naming the field, a Llama this model cannot compute."""
  heads = config.get("num_attention_heads")
  fixed = (
    ("hidden_act", config.get("hidden_act", "silu"), "silu"),
    ("attention_bias", bool(config.get("attention_bias", False)), False),
    ("mlp_bias", bool(config.get("mlp_bias", False)), False),
    ("num_key_value_heads", config.get("num_key_value_heads") or heads, heads),
    ("rms_norm_eps", float(config.get("rms_norm_eps", RMS_EPS)), RMS_EPS),
    ("rope_theta", _rope_theta(config), ROPE_THETA),
    ("pretraining_tp", config.get("pretraining_tp", 1) or 1, 1),
  )
  for name, have, want in fixed:
    if have != want:
      raise errors.ConfigError(
        f"{what}: its config.json has {name}={have!r}, which dipaco_jax's model cannot hold "
        f"(it computes {name}={want!r}, core/model.py): give a Llama checkpoint with {want!r}."
      )


def model_fields(config: dict) -> dict[str, Any]:
  """The config.model fields of the model a Llama config.json describes."""
  D = int(config["hidden_size"])
  H = int(config["num_attention_heads"])
  F = int(config["intermediate_size"])
  ratio = F / D
  if int(D * ratio) != F:  # mlp_dim = int(D * ratio): the float must round down to F.
    ratio = math.nextafter(ratio, math.inf)
  return {
    "vocab_size": int(config["vocab_size"]),
    "d_model": D,
    "num_layers": int(config["num_hidden_layers"]),
    "num_heads": H,
    "head_dim": int(config.get("head_dim") or D // H),
    "mlp_ratio": ratio,
    "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    "mlp": "swiglu",
    "positions": "rope",
  }


def check_model(config: dict, cfg: sections.ModelConfig, what: str) -> None:
  """Refuses a run whose config.model is not the Llama's, naming every flag to set."""
  check_llama(config, what)
  want = model_fields(config)
  have = {k: getattr(cfg, k) for k in want}
  bad = [k for k in want if have[k] != want[k] and k != "mlp_ratio"]
  if cfg.mlp_dim != int(config["intermediate_size"]):
    bad.append("mlp_ratio")
  if bad:
    flags = " ".join(f"--config.model.{k}={want[k]!r}".replace("'", "") for k in bad)
    raise errors.ConfigError(
      f"{what} is a Llama of another shape than config.model ("
      + ", ".join(f"{k} {have[k]!r} here, {want[k]!r} there" for k in bad)
      + f"): set {flags}."
    )


def read_tensors(src: str, what: str) -> dict[str, np.ndarray]:
  """Every tensor of `src`'s model.safetensors (or its shards, by the index) as numpy."""
  root = epath.Path(src)
  if (root / WEIGHTS).exists():
    names = [WEIGHTS]
  elif (root / WEIGHTS_INDEX).exists():
    names = sorted(set(json.loads((root / WEIGHTS_INDEX).read_text())["weight_map"].values()))
  else:
    raise errors.ConfigError(
      f"{what}: {src} holds no {WEIGHTS} (nor {WEIGHTS_INDEX}): give a Llama checkpoint saved "
      "in safetensors (save_pretrained's default)."
    )
  out = {}
  for name in names:
    try:
      out.update(safetensors.numpy.load((root / name).read_bytes()))
    except Exception as e:  # pylint: disable=broad-except  # safetensors' errors vary by cause.
      raise errors.DamagedFileError(
        f"{what}: {root / name} cannot be read as safetensors ({e}); copy the checkpoint again."
      ) from e
  return out


def check_tensors(tensors: dict[str, np.ndarray], cfg: sections.ModelConfig, what: str) -> None:
  """Every tensor the Llama of `cfg` needs, of its shape; one line naming the first that is not."""
  want = {k: v.shape for k, v in to_tensors(_zeros_params(cfg), cfg).items()}
  for name, shape in want.items():
    got = tensors.get(name)
    if got is None or tuple(got.shape) != tuple(shape):
      have = "absent" if got is None else f"shape {tuple(got.shape)}"
      raise errors.ConfigError(
        f"{what}: tensor {name} is {have} in its safetensors, {tuple(shape)} in the Llama its "
        "config.json describes: the checkpoint is incomplete or not a LlamaForCausalLM."
      )


def _zeros_params(cfg: sections.ModelConfig) -> PyTree:
  """Zero params of `cfg` (shapes only matter), without jax."""
  D, H, K, F, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  z = lambda *shape: np.zeros(shape, np.float32)
  block = {
    "attn": {n: {"kernel": z(D, H, K)} for n in ("query", "key", "value")},
    "attn_norm": {"scale": z(D)},
    "mlp_norm": {"scale": z(D)},
    "mlp_gate": {"kernel": z(D, F)},
    "mlp_in": {"kernel": z(D, F)},
    "mlp_out": {"kernel": z(F, D)},
  }
  block["attn"]["out"] = {"kernel": z(H, K, D)}
  head = {
    "norm": {"scale": z(D)},
    **({} if cfg.tie_embeddings else {"unembed": {"kernel": z(D, V)}}),
  }
  return {
    "embed": {"token": z(V, D)},
    **{f"block_{i}": block for i in range(cfg.num_layers)},
    "head": head,
  }


def read_tokenizer(src: str, what: str) -> bytes:
  """`src`/tokenizer.model's bytes: the SentencePiece model the checkpoint was trained with."""
  p = epath.Path(src) / TOKENIZER
  if not p.exists():
    raise errors.ConfigError(
      f"{what}: {src} has no {TOKENIZER}: dipaco_jax tokenizes with SentencePiece, so import a "
      "Llama checkpoint that ships its SentencePiece model."
    )
  return p.read_bytes()


def pieces(sp_proto: bytes) -> list[str]:
  """A SentencePiece model's pieces in id order (its vocabulary)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  sp = spm.SentencePieceProcessor()
  sp.LoadFromSerializedProto(sp_proto)
  return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def nonempty(out: str) -> bool:
  """Whether folder `out` exists and holds anything (an export never writes over files)."""
  p = epath.Path(out)
  return p.exists() and (not p.is_dir() or any(True for _ in p.iterdir()))
