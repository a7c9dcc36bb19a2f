"""The `hf-logits` importer: Hugging Face router logits; see the package docstring."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from moesim.errors import InputError
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers.common import Sequence, assemble, load_arrays
from moesim.tracegen.importers.registry import ROUTING_SOURCES

_LOGITS_KEY = re.compile(r"^router_logits\.(\d+)$")


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


@ROUTING_SOURCES.register
@dataclass(frozen=True)
class HFLogitsImporter:
    """Hugging Face transformers router logits (`output_router_logits`) in .safetensors or .npz."""

    name: ClassVar[str] = "hf-logits"

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """Top-k of the logits per token and layer; `normalize` renormalises the top-k probabilities."""
        return import_hf_logits(path, geometry, normalize)


def import_hf_logits(path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
    """`output_router_logits` tensors saved as .safetensors or .npz (see docs/importing.md)."""
    arrays = load_arrays(path)
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
        Sequence(experts[b][mask[b]], weights[b][mask[b]], np.zeros(int(mask[b].sum()), bool), None if ids is None else ids[b][mask[b]])
        for b in range(batch_shape[0])
        if mask[b].any()
    ]
    return assemble(geometry, sequences, "transformers", path)
