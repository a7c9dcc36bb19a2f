"""Routing recorded elsewhere, imported into contract 1 (a registry: one function per source).

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

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.tracegen.schema import TraceGeometry, TraceMeta
from moesim.tracegen.trace import Trace

_LOGITS_KEY = re.compile(r"^router_logits\.(\d+)$")


@dataclass(frozen=True)
class _Sequence:
    """One imported sequence: routing per position (T, L, K) and optional extras."""

    experts: np.ndarray
    weights: np.ndarray | None
    is_prompt: np.ndarray
    token_id: np.ndarray | None = None


def _assemble(geometry: TraceGeometry, sequences: list[_Sequence], engine: str, source: Path) -> Trace:
    if not sequences:
        raise InputError(f"{source}: no routing to import")
    id_type = geometry.expert_id_type.to_pandas_dtype()
    experts = np.concatenate([s.experts for s in sequences])
    _check_ids(experts, geometry, source)
    with_weights = all(s.weights is not None for s in sequences)
    with_tokens = all(s.token_id is not None for s in sequences)
    lengths = [s.experts.shape[0] for s in sequences]
    meta = TraceMeta(
        geometry=geometry,
        engine=engine,
        backend="imported",
        prompts=f"imported from {source.name}: {len(sequences)} sequences",
    )
    return Trace(
        meta=meta,
        seq=np.repeat(np.arange(len(sequences), dtype=np.uint32), lengths),
        pos=np.concatenate([np.arange(n, dtype=np.uint32) for n in lengths]),
        is_prompt=np.concatenate([s.is_prompt for s in sequences]).astype(bool),
        experts=experts.astype(id_type),
        weights=np.concatenate([s.weights for s in sequences]).astype(np.float32) if with_weights else None,  # type: ignore[misc]
        token=np.concatenate([s.token_id for s in sequences]).astype(np.int32) if with_tokens else None,  # type: ignore[misc]
    )


def _check_ids(experts: np.ndarray, geometry: TraceGeometry, source: Path) -> None:
    flat = experts.reshape(-1, geometry.top_k)
    bad = np.flatnonzero(((flat < 0) | (flat >= geometry.experts)).any(axis=1))
    if bad.size:
        raise InputError(f"{source}: expert id {int(flat[bad[0]].max())} is outside 0..{geometry.experts - 1} ({geometry.model})")
    ordered = np.sort(flat, axis=1)
    bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if bad.size:
        raise InputError(f"{source}: a token's top-k repeats an expert: {flat[bad[0]].tolist()}")


# ---- table ----------------------------------------------------------------------------------


def _read_table(path: Path) -> pl.DataFrame:
    try:
        if path.suffix.lower() == ".csv":
            return pl.read_csv(path)
        return pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        raise InputError(f"{path}: not a readable {path.suffix.lstrip('.') or 'table'} file ({first})") from None


def _int_column(frame: pl.DataFrame, name: str, path: Path) -> np.ndarray:
    column = frame[name]
    if column.null_count():
        row = int(np.flatnonzero(column.is_null().to_numpy())[0])
        raise InputError(f"{path}: row {row}: field '{name}' is empty")
    if not column.dtype.is_integer():
        raise InputError(f"{path}: column '{name}' must hold integers, got {column.dtype}")
    values = column.to_numpy().astype(np.int64)
    bad = np.flatnonzero(values < 0)
    if bad.size:
        raise InputError(f"{path}: row {int(bad[0])}: field '{name}' is {values[bad[0]]}, expected >= 0")
    return values


def _cast(frame: pl.DataFrame, name: str, dtype: pl.DataType, path: Path) -> np.ndarray:
    """An optional column as numpy of a given type (one line naming it when it does not convert)."""
    try:
        column = frame[name].cast(dtype)
    except pl.exceptions.PolarsError:
        raise InputError(f"{path}: column '{name}' does not convert to {dtype}") from None
    if column.null_count():
        row = int(np.flatnonzero(column.is_null().to_numpy())[0])
        raise InputError(f"{path}: row {row}: field '{name}' is empty")
    return column.to_numpy()


def import_table(path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
    """A Parquet/CSV table of (seq, token, layer, slot, expert[, weight]) rows."""
    frame = _read_table(path)
    for name in ("token", "layer", "slot", "expert"):
        if name not in frame.columns:
            raise InputError(f"{path}: column '{name}' is missing (need token, layer, slot, expert; optional seq, weight)")
    token, layer, slot, expert = (_int_column(frame, n, path) for n in ("token", "layer", "slot", "expert"))
    seq = _int_column(frame, "seq", path) if "seq" in frame.columns else np.zeros_like(token)
    moe = np.asarray(geometry.moe_layers, np.int64)
    n_layers, k = moe.shape[0], geometry.top_k
    layer_index = np.searchsorted(moe, layer)
    bad = np.flatnonzero((layer_index >= n_layers) | (moe[np.minimum(layer_index, n_layers - 1)] != layer))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{path}: row {i}: field 'layer' is {layer[i]}, not a MoE layer of {geometry.model} ({list(geometry.moe_layers)})")
    bad = np.flatnonzero(slot >= k)
    if bad.size:
        raise InputError(f"{path}: row {int(bad[0])}: field 'slot' is {slot[bad[0]]}, expected 0..{k - 1} (top-k = {k})")
    bad = np.flatnonzero(expert >= geometry.experts)
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{path}: row {i}: field 'expert' is {expert[i]}, but {geometry.model} has {geometry.experts} experts")
    order = np.lexsort((slot, layer_index, token, seq))
    key = np.stack([seq[order], token[order], layer_index[order], slot[order]], axis=1)
    repeated = np.flatnonzero((key[1:] == key[:-1]).all(axis=1))
    if repeated.size:
        i = int(order[repeated[0] + 1])
        raise InputError(f"{path}: row {i}: (seq {seq[i]}, token {token[i]}, layer {layer[i]}, slot {slot[i]}) appears twice")
    position_start = np.flatnonzero(np.r_[True, (key[1:, :2] != key[:-1, :2]).any(axis=1)])
    counts = np.diff(np.r_[position_start, key.shape[0]])
    bad = np.flatnonzero(counts != n_layers * k)
    if bad.size:
        i = int(order[position_start[bad[0]]])
        raise InputError(
            f"{path}: seq {seq[i]} token {token[i]} has {counts[bad[0]]} rows, expected {n_layers * k} (every MoE layer × every slot)"
        )
    pos_seq, pos_token = key[position_start, 0], key[position_start, 1]
    experts = expert[order].reshape(-1, n_layers, k)
    weights = None
    if "weight" in frame.columns:
        weights = _cast(frame, "weight", pl.Float32, path)[order].reshape(-1, n_layers, k)
        if not np.isfinite(weights).all():
            raise InputError(f"{path}: column 'weight' holds an empty or non-finite value")
    prompt = _cast(frame, "is_prompt", pl.Boolean, path)[order][:: n_layers * k] if "is_prompt" in frame.columns else None
    token_id = _cast(frame, "token_id", pl.Int32, path)[order][:: n_layers * k] if "token_id" in frame.columns else None
    sequences = []
    starts = np.flatnonzero(np.r_[True, pos_seq[1:] != pos_seq[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], pos_seq.shape[0]], strict=True):
        gaps = np.flatnonzero(np.diff(pos_token[a:b]) != 1)
        if gaps.size:
            missing = pos_token[a + gaps[0]] + 1
            raise InputError(f"{path}: seq {pos_seq[a]} has no rows for token {missing} (positions must be contiguous)")
        sequences.append(
            _Sequence(
                experts[a:b],
                None if weights is None else weights[a:b],
                np.zeros(b - a, bool) if prompt is None else prompt[a:b],
                None if token_id is None else token_id[a:b],
            )
        )
    return _assemble(geometry, sequences, "table", path)


# ---- Hugging Face router logits -------------------------------------------------------------


def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.numpy import load_file

            return load_file(str(path))
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        raise InputError(f"{path}: not a readable {path.suffix.lstrip('.')} file ({first})") from None
    except Exception as exc:  # safetensors raises its own SafetensorError
        if exc.__class__.__name__ != "SafetensorError":
            raise
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None


def top_k_from_logits(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (largest logit first, ties to the lower id) and their softmax probabilities."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=-1, keepdims=True)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


def import_hf_logits(path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
    """`output_router_logits` tensors saved as .safetensors or .npz (see docs/importing.md)."""
    arrays = _load_arrays(path)
    found = sorted((int(m.group(1)), name) for name in arrays if (m := _LOGITS_KEY.match(name)))
    n_layers = len(geometry.moe_layers)
    if [i for i, _ in found] != list(range(len(found))) or len(found) != n_layers:
        raise InputError(
            f"{path}: expected tensors router_logits.0 .. router_logits.{n_layers - 1} (one per MoE layer of {geometry.model}), "
            f"found {len(found)} ({', '.join(n for _, n in found[:4]) or 'none'})"
        )
    logits = [np.asarray(arrays[name]) for _, name in found]
    first = logits[0]
    for (_, name), value in zip(found, logits, strict=True):
        if value.shape != first.shape or value.shape[-1] != geometry.experts or value.ndim not in (2, 3):
            raise InputError(
                f"{path}: tensor '{name}' has shape {value.shape}, expected (tokens, E) or (batch, seq, E) with E = {geometry.experts}"
            )
        if not np.issubdtype(value.dtype, np.floating) or not np.isfinite(value).all():
            raise InputError(f"{path}: tensor '{name}' must hold finite floats (save with .float()), got {value.dtype}")
    input_ids = arrays.get("input_ids")
    batch_shape = first.shape[:2] if first.ndim == 3 else (1, first.shape[0])
    if first.ndim == 2 and input_ids is not None and input_ids.ndim == 2 and input_ids.size == first.shape[0]:
        batch_shape = input_ids.shape
    stacked = np.stack([v.reshape(*batch_shape, geometry.experts) for v in logits], axis=2).astype(np.float64)  # (B, S, L, E)
    for name in ("input_ids", "attention_mask"):
        if name in arrays and np.asarray(arrays[name]).size != batch_shape[0] * batch_shape[1]:
            raise InputError(f"{path}: tensor '{name}' has shape {np.asarray(arrays[name]).shape}, the logits hold {batch_shape} tokens")
    mask = arrays.get("attention_mask")
    mask = np.ones(batch_shape, bool) if mask is None else np.asarray(mask).reshape(batch_shape).astype(bool)
    ids = None if input_ids is None else np.asarray(input_ids).reshape(batch_shape)
    experts, weights = top_k_from_logits(stacked, geometry.top_k, normalize)
    sequences = [
        _Sequence(experts[b][mask[b]], weights[b][mask[b]], np.zeros(int(mask[b].sum()), bool), None if ids is None else ids[b][mask[b]])
        for b in range(batch_shape[0])
        if mask[b].any()
    ]
    return _assemble(geometry, sequences, "transformers", path)


# ---- vLLM topk_ids dumps --------------------------------------------------------------------


def import_vllm(path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
    """`.npz` step files from the documented vLLM hook (a folder in name order, or one file)."""
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{path}: the folder holds no .npz step files")
    n_layers, k = len(geometry.moe_layers), geometry.top_k
    ids, weights, seqs, positions, prompt = [], [], [], [], []
    for file in files:
        arrays = _load_arrays(file)
        if "topk_ids" not in arrays:
            raise InputError(f"{file}: array 'topk_ids' is missing")
        step = np.asarray(arrays["topk_ids"])
        if step.ndim != 3 or step.shape[0] != n_layers or step.shape[2] != k:
            raise InputError(f"{file}: array 'topk_ids' has shape {step.shape}, expected ({n_layers}, tokens, {k}) for {geometry.model}")
        n = step.shape[1]
        ids.append(step.transpose(1, 0, 2))
        if "topk_weights" in arrays and np.asarray(arrays["topk_weights"]).shape != step.shape:
            raise InputError(f"{file}: array 'topk_weights' has shape {np.asarray(arrays['topk_weights']).shape}, 'topk_ids' {step.shape}")
        weights.append(np.asarray(arrays["topk_weights"]).transpose(1, 0, 2) if "topk_weights" in arrays else None)
        for name, store, default in (
            ("seq", seqs, np.zeros(n, np.int64)),
            ("pos", positions, np.full(n, -1, np.int64)),
            ("is_prompt", prompt, np.zeros(n, bool)),
        ):
            value = np.asarray(arrays.get(name, default)).reshape(-1)
            if value.shape[0] != n:
                raise InputError(f"{file}: array '{name}' has {value.shape[0]} entries for {n} tokens")
            store.append(value)
    seq = np.concatenate(seqs).astype(np.int64)
    pos = np.concatenate(positions).astype(np.int64)
    if (pos < 0).all():
        pos = np.zeros_like(seq)
        for s in np.unique(seq):
            pos[seq == s] = np.arange(int((seq == s).sum()))
    elif (pos < 0).any():
        raise InputError(f"{path}: some step files have 'pos' and others not")
    experts = np.concatenate(ids)
    gate = None if any(w is None for w in weights) else np.concatenate(weights)  # type: ignore[arg-type]
    is_prompt = np.concatenate(prompt).astype(bool)
    order = np.lexsort((pos, seq))
    seq, pos = seq[order], pos[order]
    sequences = []
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], seq.shape[0]], strict=True):
        if not np.array_equal(pos[a:b], np.arange(b - a)):
            where = int(np.flatnonzero(pos[a:b] != np.arange(b - a))[0])
            raise InputError(
                f"{path}: seq {seq[a]} has position {pos[a + where]} where {where} was expected "
                "(positions must run 0, 1, 2, ... once: disable prefix caching and record every step)"
            )
        rows = order[a:b]
        sequences.append(_Sequence(experts[rows], None if gate is None else gate[rows], is_prompt[rows]))
    return _assemble(geometry, sequences, "vllm", path)


Importer = Callable[[Path, TraceGeometry, bool], Trace]
IMPORTERS: dict[str, Importer] = {"table": import_table, "hf-logits": import_hf_logits, "vllm": import_vllm}


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
        keys = _load_arrays(path)
        return "vllm" if "topk_ids" in keys else "hf-logits"
    raise InputError(f"{path}: cannot tell the routing source from the suffix '{suffix}' (.csv, .parquet, .safetensors, .npz or a folder)")


def import_routing(path: str | Path, geometry: TraceGeometry, source: str = "auto", normalize: bool = False) -> Trace:
    """Import routing from `path` with the named importer (`auto`: from the path)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    name = detect_source(path) if source == "auto" else source
    if name not in IMPORTERS:
        raise InputError(f"unknown routing source '{source}' (known: auto, {', '.join(IMPORTERS)})")
    return IMPORTERS[name](path, geometry, normalize)
