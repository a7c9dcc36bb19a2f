"""Routing recorded elsewhere, imported into contract 1 (a registry: one class per source).

Every importer is given the model's geometry (a preset and weight format: ids alone do not say
which model produced them) and returns a validated in-memory `Trace`:

- `table`: Parquet, CSV or gzipped CSV (`.csv.gz`), long or wide. Long: one row per (token,
  layer, slot) with columns `token` (position in its sequence; `pos` is accepted instead),
  `layer` (the model's own layer index; must be a MoE layer), `slot` (0..k-1, router order),
  `expert`; optional `weight`. Wide: one row per (token, layer) with the k ids in columns
  `e0..e{k-1}` (router order), no weights. Both: optional `seq` (default 0), `task` (a string:
  the corpus a sequence comes from; it becomes the trace's sequence groups), `is_prompt`
  (default false), `token_id`. Sequences are numbered 0, 1, ... by task in order of first
  appearance, then by seq id; each sequence's positions must be contiguous and are renumbered
  from 0 (a dump that starts after the prompt keeps its spacing). Every (seq, token) needs
  every MoE layer (and slot) exactly once.
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

- `moe-trace`: a Parquet table of (seq, token, layer, slot, expert) rows with JSON schema
  metadata `moe_trace` (model, E, top_k, layers, hidden, inter), as the H200 whole-pass
  benchmark writes (`data/h200/fulldepth/traces/`); its sorted layer ids are mapped onto the
  preset's MoE layers in order.

`detect_source` picks the importer from the path: `.parquet` with `moe_trace` metadata →
moe-trace, `.csv`/`.csv.gz`/`.parquet` → table, `.safetensors` → hf-logits, a folder → vllm,
`.npz` → by its keys. Every imported trace records the source file's name and sha256 in its
provenance, with what a `provenance` object adds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moesim.errors import InputError
from moesim.models import builtin_names, load_preset
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace, read_trace
from moesim.tracegen.importers import hf_logits, moe_trace, table, vllm  # noqa: F401 (they register their importers)
from moesim.tracegen.importers.common import load_arrays, source_record
from moesim.tracegen.importers.registry import ROUTING_SOURCES
from moesim.tracegen.importers.table import table_suffix

AUTO = "auto"


def detect_source(path: Path) -> str:
    """The importer for a path, from its suffix (and for .npz, its keys)."""
    suffix = path.suffix.lower()
    if path.is_dir():
        return "vllm"
    if suffix == ".parquet" and moe_trace.read_metadata(path) is not None:
        return "moe-trace"
    if table_suffix(path):
        return "table"
    if suffix == ".safetensors":
        return "hf-logits"
    if suffix == ".npz":
        keys = load_arrays(path)
        return "vllm" if "topk_ids" in keys else "hf-logits"
    known = ".csv, .csv.gz, .parquet, .safetensors, .npz or a folder"
    raise InputError(f"{path}: cannot tell the routing source from the suffix '{suffix}' ({known})")


def import_routing(
    path: str | Path, geometry: TraceGeometry, source: str = AUTO, normalize: bool = False, provenance: dict[str, Any] | None = None
) -> Trace:
    """Import routing from `path` with the named importer (`auto`: from the path); the trace's provenance
    is `provenance` plus the source file's name and sha256."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if source != AUTO and source not in ROUTING_SOURCES:
        raise InputError(ROUTING_SOURCES.unknown(source, AUTO))
    name = detect_source(path) if source == AUTO else source
    trace = ROUTING_SOURCES.create(name).read(path, geometry, normalize)
    record = {**(provenance or {}), **source_record(path)}
    return dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, provenance=record)) if record else trace


TRACE_SUFFIXES = (".arrow", ".parquet")  # a moesim trace, or a moe-trace routing table (imported on reading)


def find_trace(name: str, folders: list[Path]) -> Path | None:
    """A bare trace name (no .arrow/.parquet suffix; it may hold dots, `model_p0.50`) as NAME.arrow
    or NAME.parquet in the first of the folders that has one."""
    for candidate in (folder / f"{name}{suffix}" for folder in folders for suffix in TRACE_SUFFIXES):
        if candidate.is_file():
            return candidate
    return None


def open_trace(path: Path, model: str | None = None) -> Trace:
    """A moesim trace (Arrow IPC), or a Parquet moe-trace table imported with the geometry of the
    preset it names (else of `model`)."""
    if path.suffix.lower() != ".parquet":
        return read_trace(path)
    name = moe_trace.traced_model(path)
    preset = load_preset(name if name in builtin_names("moe") or model is None else model)
    return import_routing(path, TraceGeometry.from_preset(preset), "moe-trace")
