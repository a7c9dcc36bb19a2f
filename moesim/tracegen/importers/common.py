"""What every routing importer shares: a sequence's arrays, the assembled and checked `Trace`,
and reading NumPy / safetensors archives with one-line errors."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import InputError, first_line
from moesim.parsing import load_json
from moesim.tracegen.formats.schema import SequenceGroup, TraceGeometry, TraceMeta
from moesim.tracegen.formats.trace import Trace


@dataclass(frozen=True)
class Sequence:
    """One imported sequence: routing per position (T, L, K) and optional extras."""

    experts: np.ndarray
    weights: np.ndarray | None
    is_prompt: np.ndarray
    token_id: np.ndarray | None = None


def assemble(
    geometry: TraceGeometry, sequences: list[Sequence], engine: str, source: Path, groups: tuple[SequenceGroup, ...] = ()
) -> Trace:
    """The sequences as one validated trace (ids checked against the geometry), in `groups` when given."""
    if not sequences:
        raise InputError(f"{source}: no routing to import")
    id_type = geometry.expert_id_type.to_pandas_dtype()
    experts = np.concatenate([s.experts for s in sequences])
    check_ids(experts, geometry, source)
    with_weights = all(s.weights is not None for s in sequences)
    with_tokens = all(s.token_id is not None for s in sequences)
    lengths = [s.experts.shape[0] for s in sequences]
    meta = TraceMeta(
        geometry=geometry,
        engine=engine,
        backend="imported",
        prompts=f"imported from {source.name}: {len(sequences)} sequences"
        + (f" ({', '.join(f'{g.name}: {g.seqs}' for g in groups)})" if groups else ""),
        groups=groups,
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


def check_ids(experts: np.ndarray, geometry: TraceGeometry, source: Path) -> None:
    """Every id lies in 0..E-1 and no token's top-k repeats an expert."""
    flat = experts.reshape(-1, geometry.top_k)
    bad = np.flatnonzero(((flat < 0) | (flat >= geometry.experts)).any(axis=1))
    if bad.size:
        raise InputError(f"{source}: expert id {int(flat[bad[0]].max())} is outside 0..{geometry.experts - 1} ({geometry.model})")
    ordered = np.sort(flat, axis=1)
    bad = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if bad.size:
        raise InputError(f"{source}: a token's top-k repeats an expert: {flat[bad[0]].tolist()}")


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """The named arrays of a .safetensors or .npz file."""
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.numpy import load_file

            return load_file(str(path))
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = first_line(exc)
        raise InputError(f"{path}: not a readable {path.suffix.lstrip('.')} file ({first})") from None
    except Exception as exc:  # safetensors raises its own SafetensorError
        if exc.__class__.__name__ != "SafetensorError":
            raise
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None


def read_provenance(path: Path) -> dict[str, Any]:
    """A provenance JSON object (where imported routing came from), for the trace's metadata."""
    try:
        data = load_json(path.read_bytes(), str(path))
    except OSError as exc:
        raise InputError(f"{path}: cannot read the provenance file ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a provenance file holds one JSON object, got {type(data).__name__}")
    return data


def source_record(path: Path) -> dict[str, Any]:
    """The imported file's name and sha256 (nothing for a folder)."""
    if not path.is_file():
        return {}
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"imported_file": path.name, "imported_sha256": digest.hexdigest()}
