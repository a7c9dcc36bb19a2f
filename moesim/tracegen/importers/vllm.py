"""The `vllm` importer: per-step dumps of the documented hook; see the package docstring."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from moesim.errors import InputError
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers.common import Sequence, assemble, load_arrays
from moesim.tracegen.importers.registry import ROUTING_SOURCES


@ROUTING_SOURCES.register
@dataclass(frozen=True)
class VllmImporter:
    """`.npz` step files from the documented vLLM hook (a folder in name order, or one file)."""

    name: ClassVar[str] = "vllm"

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """The steps' routing as a trace (`normalize` does not apply: the hook gives the weights)."""
        return import_vllm(path, geometry)


def import_vllm(path: Path, geometry: TraceGeometry) -> Trace:
    """`.npz` step files from the documented vLLM hook (a folder in name order, or one file)."""
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{path}: the folder holds no .npz step files")
    n_layers, k = len(geometry.moe_layers), geometry.top_k
    ids, weights, seqs, positions, prompt = [], [], [], [], []
    for file in files:
        arrays = load_arrays(file)
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
        sequences.append(Sequence(experts[rows], None if gate is None else gate[rows], is_prompt[rows]))
    return assemble(geometry, sequences, "vllm", path)
