"""The `moe-trace` importer: a Parquet table of (seq, token, layer, slot, expert) rows whose schema
metadata `moe_trace` (JSON) names the model and its routing geometry (`model`, `E`, `top_k`,
`layers`, `hidden`, `inter`), as the H200 whole-pass benchmark writes its traces
(`data/h200/fulldepth/traces/`).

`layer` may be the model's own layer index or a count of MoE layers from 0: the sorted distinct
ids are mapped onto the preset's MoE layers in order (DeepSeek-V2-Lite's traces hold 1..26, its
layer 0 being dense; Mixtral's 0..31), after checking that there are as many as the model has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moesim.errors import InputError
from moesim.parsing import load_json
from moesim.tracegen.formats.schema import TraceGeometry
from moesim.tracegen.formats.trace import Trace
from moesim.tracegen.importers.registry import ROUTING_SOURCES
from moesim.tracegen.importers.table import read_table, routing_from_frame

METADATA_KEY = b"moe_trace"
# metadata key -> (geometry field, what it means) checked against the preset
_CHECKED = {"E": ("experts", "experts"), "top_k": ("top_k", "experts per token"), "hidden": ("hidden", "hidden size"),
            "inter": ("expert_intermediate", "expert intermediate size")}  # fmt: skip


def read_metadata(path: Path) -> dict[str, Any] | None:
    """The `moe_trace` metadata of a Parquet file (None when it has none)."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        raise InputError(f"{path}: not a readable parquet file ({first})") from None
    if METADATA_KEY not in metadata:
        return None
    meta = load_json(metadata[METADATA_KEY], f"{path}: schema metadata 'moe_trace'")
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), str):
        raise InputError(f"{path}: schema metadata 'moe_trace' needs field 'model' (the traced model's preset name)")
    return meta


def traced_model(path: Path) -> str:
    """The preset name a moe-trace file records."""
    meta = read_metadata(path)
    if meta is None:
        raise InputError(f"{path}: no 'moe_trace' schema metadata: not a moe-trace routing table")
    return str(meta["model"])


@ROUTING_SOURCES.register
@dataclass(frozen=True)
class MoeTraceImporter:
    """A Parquet routing table with `moe_trace` metadata (see the module docstring)."""

    name: ClassVar[str] = "moe-trace"

    def read(self, path: Path, geometry: TraceGeometry, normalize: bool = False) -> Trace:
        """The file's routing as a trace of `geometry` (`normalize` does not apply: no weights)."""
        return import_moe_trace(path, geometry)


def import_moe_trace(path: Path, geometry: TraceGeometry) -> Trace:
    """Check the metadata against the geometry, map the layer ids onto its MoE layers, import."""
    meta = read_metadata(path)
    if meta is None:
        raise InputError(f"{path}: no 'moe_trace' schema metadata: not a moe-trace routing table")
    for key, (field, meaning) in _CHECKED.items():
        if key in meta and meta[key] != getattr(geometry, field):
            raise InputError(
                f"{path}: metadata field '{key}' ({meaning}) is {meta[key]}, but {geometry.model} has {getattr(geometry, field)}"
            )
    frame = read_table(path)
    if "layer" not in frame.columns:
        raise InputError(f"{path}: column 'layer' is missing (need token, layer, slot, expert; optional seq)")
    if frame["layer"].null_count():
        raise InputError(f"{path}: row {int(frame['layer'].is_null().arg_true()[0])}: field 'layer' is empty")
    ids = np.unique(frame["layer"].to_numpy())
    moe = np.asarray(geometry.moe_layers, np.int64)
    if ids.size != moe.size:
        raise InputError(f"{path}: column 'layer' holds {ids.size} distinct layers, but {geometry.model} has {moe.size} MoE layers")
    mapped = moe[np.searchsorted(ids, frame["layer"].to_numpy())]
    frame = frame.with_columns(pl.Series("layer", mapped).cast(pl.Int64).alias("layer"))
    return routing_from_frame(frame, geometry, path, "moe-trace")
