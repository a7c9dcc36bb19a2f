"""Routing recorded elsewhere, imported into contract 1 (a registry: one class per source).

Every importer is given the model's geometry (a preset and weight format: ids alone do not say
which model produced them) and returns a validated in-memory `Trace`:

- `table`: Parquet or CSV, one row per (token, layer, slot) with columns `token` (position in
  its sequence), `layer` (the model's own layer index; must be a MoE layer), `slot` (0..k-1,
  router order), `expert`; optional `seq` (default 0), `weight`, `is_prompt`, `token_id`.
  Sequences are numbered 0, 1, ... in order of their ids; each sequence's positions must be
  contiguous and are renumbered from 0 (a dump that starts after the prompt keeps its spacing).
  Every (seq, token) needs every (MoE layer, slot) exactly once.
- `hf-logits`: Hugging Face transformers router logits, `.safetensors` or `.npz` with tensors
  `router_logits.0`, `router_logits.1`, ... (the `output_router_logits` tuple, one per MoE
  layer in order), each (tokens, E) or (batch, seq, E), float; optional `input_ids`
  (batch, seq) and `attention_mask` (padding is dropped). Top-k = the k largest logits (softmax
  is monotone), ties to the lower id; weights = softmax probabilities of the chosen experts,
  renormalised over the top-k with `normalize` (Mixtral, Qwen3: `norm_topk_prob`). Routers with
  bias-corrected or group-limited selection (DeepSeek-V3) are not reproduced from logits: use
  the table importer with the ids the model chose.
- `vllm`: `.npz` files written per forward step by the documented hook on vLLM's
  `FusedMoE.select_experts` (docs/importing.md): `topk_ids` (moe_layers, tokens, k), optional
  `topk_weights` (same shape), `seq` and `pos` (tokens,), `is_prompt` (tokens,). A folder of
  steps is read in file-name order. Without `pos`, tokens take positions in order of arrival.

`detect_source` picks the importer from the path: `.csv`/`.parquet` → table, `.safetensors` →
hf-logits, a folder → vllm, `.npz` → by its keys.
"""

from __future__ import annotations

from pathlib import Path

from moesim.errors import InputError
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers import hf_logits, table, vllm  # noqa: F401 (they register their importers)
from moesim.tracegen.importers.common import load_arrays
from moesim.tracegen.importers.registry import IMPORTERS

AUTO = "auto"


def detect_source(path: Path) -> str:
    """The importer for a path, from its suffix (and for .npz, its keys)."""
    suffix = path.suffix.lower()
    if path.is_dir():
        return "vllm"
    if suffix in (".csv", ".parquet"):
        return "table"
    if suffix == ".safetensors":
        return "hf-logits"
    if suffix == ".npz":
        keys = load_arrays(path)
        return "vllm" if "topk_ids" in keys else "hf-logits"
    raise InputError(f"{path}: cannot tell the routing source from the suffix '{suffix}' (.csv, .parquet, .safetensors, .npz or a folder)")


def import_routing(path: str | Path, geometry: TraceGeometry, source: str = AUTO, normalize: bool = False) -> Trace:
    """Import routing from `path` with the named importer (`auto`: from the path)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if source != AUTO and source not in IMPORTERS:
        raise InputError(IMPORTERS.unknown(source, AUTO))
    name = detect_source(path) if source == AUTO else source
    return IMPORTERS.create(name).read(path, geometry, normalize)
