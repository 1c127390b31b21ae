"""A run's router as files any reader can route with: arrays, assignment.json, θ̄ as a Llama.

`python -m dipaco_jax.export` writes them beside the exported paths:
  router/router.npz, router.json  the fitted router (router.py's format), absent for random
  router/assignment.json          kind, prefix length, which path each router output names
  router/base_model/              θ̄ as a Llama checkpoint: its last block gives the features
and README.md (`readme`) holds a routing function in numpy and transformers that picks the
path `serve` picks (tests/commands/test_export.py runs it).
"""

from dipaco_jax.core import topology as topo_lib
from dipaco_jax.io import files
from dipaco_jax.routing import assignment as assign_lib

DIR = "router"
ASSIGNMENT = "assignment.json"
BASE_MODEL = "base_model"


def path_dir(p: int) -> str:
  """The folder of path p's Llama checkpoint in an export."""
  return f"path_{p}"


def assignment(
  path_router: assign_lib.PathRouter, topo: topo_lib.Topology, *, prefix_len: int
) -> dict:
  """assignment.json: what a router output means, and what the README's function needs."""
  outputs = topo.num_workers if path_router.router is None or path_router.by_worker else None
  path_of_output = (
    topo.path_of_worker.tolist() if outputs is not None else list(range(topo.num_paths))
  )
  return {
    "kind": path_router.kind,
    "prefix_len": prefix_len,
    "grid": list(path_router.router.grid) if path_router.router is not None else [],
    "path_of_output": [int(p) for p in path_of_output],
    "seed": int(path_router.seed),
    "paths": {
      str(p): {"dir": path_dir(p), "modules": [int(m) for m in topo.paths[p]]}
      for p in range(topo.num_paths)
    },
  }


def write(out: str, path_router: assign_lib.PathRouter, meta: dict) -> None:
  """router/ under `out`: the router's arrays (when fitted) and assignment.json."""
  root = files.join(out, DIR)
  if path_router.router is not None:
    path_router.router.save(root)
  files.write_json(files.join(root, ASSIGNMENT), meta)


_ROUTE = '''```python
import hashlib
import json

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers import LlamaForCausalLM

EXPORT = "{out}"
a = json.load(open(f"{{EXPORT}}/router/assignment.json"))
tok = AutoTokenizer.from_pretrained(f"{{EXPORT}}/{first}")  # Every path has this tokenizer.
M = (1 << 64) - 1


def mix(x):  # splitmix64's finaliser: the random router's hash.
  x = (x + 0x9E3779B97F4A7C15) & M
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
  return x ^ (x >> 31)


got = {{}}  # The last block's output, caught by a hook (its hidden_states entry is normed).
base = None
if a["kind"] != "random":
  base = LlamaForCausalLM.from_pretrained(f"{{EXPORT}}/router/base_model").eval()
  hook = lambda m, args, o: got.update(h=o[0] if isinstance(o, tuple) else o)
  base.model.layers[-1].register_forward_hook(hook)


def features(ids):
  """Mean of θ̄'s last-block output (before the final norm) over input positions 1..L."""
  L = min(a["prefix_len"], len(ids) - 1)  # ids[0] is the BOS: position j reads piece j - 1.
  with torch.no_grad():
    base(torch.tensor([ids[: L + 1]]))
  return got["h"][0, 1 : L + 1].mean(0).double().numpy()


def route(text):
  """The path `python -m dipaco_jax.serve` picks for `text`."""
  ids = tok(text)["input_ids"]  # The BOS (the pad piece), then the text's pieces.
  if a["kind"] == "random":  # A hash of the pieces picks a worker.
    digest = hashlib.sha256(np.asarray(ids[1:], np.int32).tobytes()).digest()
    doc = int.from_bytes(digest[:7], "little")
    return a["path_of_output"][mix(mix(mix(a["seed"]) ^ doc)) % len(a["path_of_output"])]
  x, r = features(ids), dict(np.load(f"{{EXPORT}}/router/router.npz"))
  if a["kind"] == "kmeans":  # The nearest centroid, less its balancing bias.
    k = int(np.argmin(((x - r["centroids"]) ** 2).sum(1) - r.get("bias", 0.0)))
  elif a["kind"] == "product_kmeans":  # The nearest centroid per level, row-major.
    k, lo = 0, 0
    for l in range(len(a["grid"])):
      c = r[f"centroids_{{l}}"]
      k = k * len(c) + int(np.argmin(((x[lo : lo + c.shape[1]] - c) ** 2).sum(1)))
      lo += c.shape[1]
  else:  # linear: the discriminative router's largest logit.
    k = int(np.argmax((x - r["mean"]) / r["std"] @ r["w"] + r["b"]))
  return a["path_of_output"][k]
```'''


def readme(out: str, meta: dict, *, step: int, workdir: str, how: str) -> str:
  """README.md of an export: the folders, loading a path, and routing an input."""
  paths = ", ".join(f"`{v['dir']}` (modules {v['modules']})" for v in meta["paths"].values())
  kind = meta["kind"]
  first = next(iter(meta["paths"].values()))["dir"]
  grid_paths = len(set(meta["path_of_output"]))
  missing = (
    f" This export holds {len(meta['paths'])} of the grid's {grid_paths} paths: `route` may "
    "name one that is not here (`python -m dipaco_jax.export --all` writes every path)."
    if len(meta["paths"]) < grid_paths
    else ""
  )
  router = (
    "documents were assigned at random (i.i.d. shards): any path serves any input alike, and "
    "`route` reproduces the hash `serve` uses"
    if kind == "random"
    else f"a {kind} router on the features, its arrays in `router/router.npz` "
    "(`router/router.json` says how it was fitted)"
  )
  return f"""# DiPaCo paths as Hugging Face Llama checkpoints

Exported from `{workdir}` at step {step} ({how}) by `python -m dipaco_jax.export`.
Each path is a complete Llama (`config.json`, `model.safetensors`, `tokenizer.model`,
`tokenizer_config.json`): {paths}.

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("{out}/{first}")
    tok = AutoTokenizer.from_pretrained("{out}/{first}")
    out = model.generate(**tok("It is a truth", return_tensors="pt"), max_new_tokens=20)
    print(tok.decode(out[0], skip_special_tokens=True))

The tokenizer starts every input with the pad piece, the BOS these models were trained with
(T5 ids: pad 0, eos 1, unk 2). In float32 a path's logits are the JAX path's within float
rounding.

## Routing an input

DiPaCo serves one path per input, picked from its first {meta["prefix_len"]} tokens: the
feature is the mean of θ̄'s last-block output (before the final norm) over those tokens, θ̄
being the model every module started from (`router/base_model`, a Llama too); then {router}.
`router/assignment.json` names the path of each router output (`path_of_output`). In Python:

{_ROUTE.format(out=out, first=first)}

Then score or continue the text with the path it names:
`LlamaForCausalLM.from_pretrained(f"{{EXPORT}}/path_{{route(text)}}")`.{missing}
"""


def route_code(text: str) -> str:
  """The README's routing function (its python block), for the tests to run."""
  start = text.index("```python\n") + len("```python\n")
  return text[start : text.index("```", start)]
