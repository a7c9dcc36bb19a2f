"""Routing-trace format, contract 1 of docs/architecture.md (version 1).

An Arrow IPC file, one row per (sequence, position, MoE layer), sorted by (seq, pos, layer):

| column      | type                                   | meaning                                       |
|-------------|----------------------------------------|-----------------------------------------------|
| `seq`       | uint32                                 | sequence (prompt) index: 0, 1, 2, ... in order|
| `pos`       | uint32                                 | position in the sequence, 0, 1, 2, ...        |
| `layer`     | uint16                                 | the model's own layer index of a MoE layer    |
| `is_prompt` | bool                                   | prompt token (true) or generated (false)      |
| `experts`   | fixed_size_list<uint8 or uint16>[top_k] | selected expert ids in router order           |
| `weights`   | fixed_size_list<float32>[top_k]        | optional: gate weights of those experts       |
| `token`     | int32                                  | optional: token id at this position           |

Every position carries one row for each MoE layer, in the order of `moe_layers`. Schema
metadata: `moesim.format` = "routing-trace", `moesim.format_version` = "1", and `moesim.meta`
= JSON of `TraceMeta` (geometry, engine and version, backend, how the prompts were chosen).
Two optional keys, written only when set (older readers ignore them, so the version stays 1):
`moesim.provenance`, a JSON object saying where recorded routing came from (source, commit,
licence, recorder, caveats), and `moesim.groups`, a JSON list of named runs of consecutive
sequences `{name, first_seq, seqs}` covering every sequence once (e.g. the task each corpus
came from). Files are readable by pyarrow, polars and duckdb without moesim.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from moesim.errors import ConfigError, InputError
from moesim.fields import Checked, build, checked, require
from moesim.models import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, ExpertShape, ModelPreset, bytes_per_weight, check_weight_format
from moesim.parsing import load_json

TRACE_FORMAT = "routing-trace"
TRACE_FORMAT_VERSION = 1
META_FORMAT_KEY = b"moesim.format"
META_VERSION_KEY = b"moesim.format_version"
META_JSON_KEY = b"moesim.meta"
META_PROVENANCE_KEY = b"moesim.provenance"
META_GROUPS_KEY = b"moesim.groups"


@dataclass(frozen=True)
class TraceGeometry(Checked):
    """The routing geometry of the traced model (from a preset or from GGUF metadata); checked on
    construction: sizes positive, top_k <= experts <= 65536 (the id type), MoE layers increasing
    below `layers`, a known weight format, expert bytes finite and >= 0 (0: from the shape)."""

    model: str
    layers: int = checked(ge=1, le=MAX_LAYERS)
    moe_layers: tuple[int, ...] = checked(ge=0, lt=MAX_LAYERS)
    experts: int = checked(ge=1, le=MAX_EXPERTS)
    top_k: int = checked(ge=1, le=MAX_EXPERTS)
    hidden: int = checked(ge=1, le=MAX_WIDTH)
    expert_intermediate: int = checked(ge=1, le=MAX_WIDTH)
    weight_format: str = checked()
    shared_experts: int = checked(0, ge=0, le=MAX_EXPERTS)
    shared_intermediate: int = checked(0, ge=0, le=MAX_WIDTH)
    expert_bytes: float = checked(0.0, ge=0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_format", check_weight_format(self.weight_format, "weight_format"))
        require(self.top_k <= self.experts, "top_k", f"must be <= experts ({self.experts}), got {self.top_k}")
        layers = list(self.moe_layers)
        ordered = bool(layers) and layers == sorted(set(layers)) and layers[-1] < self.layers
        require(ordered, "moe_layers", f"must be increasing indices below layers ({self.layers}), got {_short(layers)}")
        if not self.expert_bytes:
            bytes_ = 3 * self.hidden * self.expert_intermediate * bytes_per_weight(self.weight_format)
            object.__setattr__(self, "expert_bytes", float(bytes_))

    @classmethod
    def from_preset(cls, preset: ModelPreset, weight_format: str | None = None, purpose: str = "routing") -> TraceGeometry:
        """Geometry of a MoE preset in a weight format (default: the preset's own); a dense preset is
        one line saying what (`purpose`) needs a MoE model."""
        preset.require_moe(purpose)
        fmt = (weight_format or preset.default_format).upper()
        return cls(
            model=preset.name,
            layers=preset.layers,
            moe_layers=preset.moe_layers,
            experts=preset.experts,
            top_k=preset.top_k,
            hidden=preset.hidden,
            expert_intermediate=preset.expert_intermediate,
            weight_format=fmt,
            shared_experts=preset.shared_experts,
            shared_intermediate=preset.shared_intermediate,
            expert_bytes=preset.expert_bytes(fmt),
        )

    @property
    def expert_shape(self) -> ExpertShape:
        """Shape of one routed expert."""
        return ExpertShape(self.hidden, self.expert_intermediate, self.weight_format)

    @property
    def expert_id_type(self) -> pa.DataType:
        """The smallest unsigned type that holds every expert id."""
        return pa.uint8() if self.experts <= 256 else pa.uint16()


def _short(values: list[Any]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"


@dataclass(frozen=True)
class SequenceGroup:
    """A named run of consecutive sequences: `seqs` sequences from `first_seq` (e.g. one task's corpus)."""

    name: str
    first_seq: int
    seqs: int


@dataclass(frozen=True)
class TraceMeta(Checked):
    """Everything a trace says about itself besides the rows."""

    geometry: TraceGeometry
    engine: str = "unknown"
    engine_version: str = ""
    backend: str = "unknown"
    prompts: str = ""
    generator: dict[str, Any] = field(default_factory=dict)
    format_version: int = TRACE_FORMAT_VERSION
    provenance: dict[str, Any] = field(default_factory=dict)
    groups: tuple[SequenceGroup, ...] = ()

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) of `moesim.meta` (without provenance and groups, which have their own keys)."""
        data = dataclasses.asdict(self)
        del data["provenance"], data["groups"]
        return json.dumps(data, sort_keys=True)

    def group_of(self, seq: int) -> str:
        """The name of the group holding sequence `seq` ('' without groups)."""
        return next((g.name for g in self.groups if g.first_seq <= seq < g.first_seq + g.seqs), "")

    @classmethod
    def from_json(cls, text: str, source: str) -> TraceMeta:
        """Parse and check the `moesim.meta` JSON."""
        return meta_from_json(cls, text, source)


def groups_of(names: list[str]) -> tuple[SequenceGroup, ...]:
    """Groups of consecutive sequences from each sequence's group name (none when every name is empty)."""
    if not any(names):
        return ()
    groups: list[SequenceGroup] = []
    for i, name in enumerate(names):
        if groups and groups[-1].name == name:
            groups[-1] = SequenceGroup(name, groups[-1].first_seq, groups[-1].seqs + 1)
        else:
            groups.append(SequenceGroup(name, i, 1))
    return tuple(groups)


def parse_provenance(text: str, source: str) -> dict[str, Any]:
    """The `moesim.provenance` JSON: an object."""
    data = load_json(text, f"{source}: schema metadata 'moesim.provenance'")
    if not isinstance(data, dict):
        raise InputError(f"{source}: schema metadata 'moesim.provenance' must be a JSON object, got {type(data).__name__}")
    return data


def parse_groups(text: str, source: str) -> tuple[SequenceGroup, ...]:
    """The `moesim.groups` JSON: a list of {name, first_seq, seqs}, consecutive from sequence 0, names unique."""
    data = load_json(text, f"{source}: schema metadata 'moesim.groups'")
    try:
        groups = tuple(SequenceGroup(**item) for item in data)
    except TypeError as exc:
        raise InputError(f"{source}: schema metadata 'moesim.groups' must be a list of {{name, first_seq, seqs}} ({exc})") from None
    check_groups(groups, None, source)
    return groups


def check_groups(groups: tuple[SequenceGroup, ...], n_seqs: int | None, source: str) -> None:
    """Groups run consecutively from sequence 0 with unique non-empty names (and cover all `n_seqs` when given)."""
    end = 0
    for i, g in enumerate(groups):
        if not isinstance(g.name, str) or not g.name or g.name in {h.name for h in groups[:i]}:
            raise InputError(f"{source}: metadata field 'groups[{i}].name' must be a unique non-empty string, got {g.name!r}")
        for key in ("first_seq", "seqs"):
            value = getattr(g, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "seqs" else 0):
                raise InputError(f"{source}: metadata field 'groups[{i}].{key}' is {value!r}, expected an integer >= {int(key == 'seqs')}")
        if g.first_seq != end:
            raise InputError(f"{source}: metadata field 'groups[{i}].first_seq' is {g.first_seq}, expected {end} (consecutive groups)")
        end += g.seqs
    if groups and n_seqs is not None and end != n_seqs:
        raise InputError(f"{source}: metadata field 'groups' covers {end} sequences, the trace has {n_seqs}")


def meta_from_json(cls: type, text: str, source: str, prepare: Callable[[Any], Any] | None = None) -> Any:
    """A file's `moesim.meta` JSON through the schema layer (`prepare`: applied to the parsed JSON
    first): one line naming the file and the metadata key."""
    data = load_json(text, f"{source}: schema metadata 'moesim.meta'")
    try:
        return build(cls, prepare(data) if prepare else data, "", source, Path("."), noun="metadata key")
    except ConfigError as exc:
        raise InputError(str(exc)) from None


def checked_geometry(source: object, **values: Any) -> TraceGeometry:
    """A geometry from values read elsewhere (a GGUF file's keys and tensors): one line naming the file."""
    try:
        return build(TraceGeometry, values, "", str(source), Path("."), noun="geometry key")
    except ConfigError as exc:
        raise InputError(str(exc)) from None


def routing_fields(geometry: TraceGeometry, with_weights: bool) -> list[pa.Field]:
    """The routing columns of a file: `experts` (top_k ids per row) and, with weights, `weights`
    (top_k float32 gate weights)."""
    k = geometry.top_k
    fields = [pa.field("experts", pa.list_(geometry.expert_id_type, k), nullable=False)]
    if with_weights:
        fields.append(pa.field("weights", pa.list_(pa.float32(), k), nullable=False))
    return fields


def format_metadata(file_format: str, format_version: int, meta_json: str) -> dict[bytes, bytes]:
    """A file's metadata keys of its format, version and JSON metadata."""
    return {META_FORMAT_KEY: file_format.encode(), META_VERSION_KEY: str(format_version).encode(), META_JSON_KEY: meta_json.encode()}


def trace_schema(meta: TraceMeta, with_weights: bool, with_tokens: bool) -> pa.Schema:
    """The Arrow schema of a version-1 trace, metadata included."""
    fields = [
        pa.field("seq", pa.uint32(), nullable=False),
        pa.field("pos", pa.uint32(), nullable=False),
        pa.field("layer", pa.uint16(), nullable=False),
        pa.field("is_prompt", pa.bool_(), nullable=False),
        *routing_fields(meta.geometry, with_weights),
    ]
    if with_tokens:
        fields.append(pa.field("token", pa.int32(), nullable=False))
    metadata = format_metadata(TRACE_FORMAT, meta.format_version, meta.to_json())
    if meta.provenance:
        metadata[META_PROVENANCE_KEY] = json.dumps(meta.provenance, sort_keys=True, ensure_ascii=False).encode()
    if meta.groups:
        metadata[META_GROUPS_KEY] = json.dumps([dataclasses.asdict(g) for g in meta.groups], sort_keys=True, ensure_ascii=False).encode()
    return pa.schema(fields, metadata=metadata)


def checked_format(metadata: dict[bytes, bytes], source: str, file_format: str, version: int, words: tuple[str, str, str]) -> str:
    """The JSON metadata of a file of `file_format` at `version` (`format_metadata` undone); another
    format or version is one InputError line, worded by (the file, its format, "version " or "")."""
    fmt = metadata.get(META_FORMAT_KEY)
    if fmt != file_format.encode():
        raise InputError(f"{source}: not a moesim {words[0]} (schema metadata 'moesim.format' is {fmt!r})")
    written = metadata.get(META_VERSION_KEY, b"").decode(errors="replace")
    if written != str(version):
        raise InputError(f"{source}: unknown {words[1]} format version {written!r} (this moesim reads {words[2]}{version})")
    return metadata.get(META_JSON_KEY, b"").decode(errors="replace")


def meta_from_schema(schema: pa.Schema, source: str) -> TraceMeta:
    """Read and check a trace's schema metadata (format, version, geometry)."""
    metadata = schema.metadata or {}
    meta_json = checked_format(metadata, source, TRACE_FORMAT, TRACE_FORMAT_VERSION, ("routing trace", "trace", "version "))
    meta = TraceMeta.from_json(meta_json, source)
    if meta.format_version != TRACE_FORMAT_VERSION:
        raise InputError(f"{source}: metadata field 'format_version' is {meta.format_version}, expected {TRACE_FORMAT_VERSION}")
    _check_columns(schema, meta, source)
    extra: dict[str, Any] = {}
    if META_PROVENANCE_KEY in metadata:
        extra["provenance"] = parse_provenance(metadata[META_PROVENANCE_KEY].decode(errors="replace"), source)
    if META_GROUPS_KEY in metadata:
        extra["groups"] = parse_groups(metadata[META_GROUPS_KEY].decode(errors="replace"), source)
    return dataclasses.replace(meta, **extra) if extra else meta


def _check_columns(schema: pa.Schema, meta: TraceMeta, source: str) -> None:
    expected = {"seq": pa.uint32(), "pos": pa.uint32(), "layer": pa.uint16(), "is_prompt": pa.bool_()}
    for name, dtype in expected.items():
        if name not in schema.names:
            raise InputError(f"{source}: column '{name}' is missing")
        if schema.field(name).type != dtype:
            raise InputError(f"{source}: column '{name}' has type {schema.field(name).type}, expected {dtype}")
    if "experts" not in schema.names:
        raise InputError(f"{source}: column 'experts' is missing")
    experts = schema.field("experts").type
    if not pa.types.is_fixed_size_list(experts) or not pa.types.is_unsigned_integer(experts.value_type):
        raise InputError(f"{source}: column 'experts' has type {experts}, expected a fixed-size list of unsigned ids")
    if experts.list_size != meta.geometry.top_k:
        raise InputError(
            f"{source}: field 'experts' holds {experts.list_size} ids per row but the metadata says top_k = {meta.geometry.top_k}"
        )
    if np.iinfo(experts.value_type.to_pandas_dtype()).max < meta.geometry.experts - 1:
        raise InputError(f"{source}: column 'experts' type {experts.value_type} cannot hold {meta.geometry.experts} experts")
    if "weights" in schema.names:
        weights = schema.field("weights").type
        if not (pa.types.is_fixed_size_list(weights) and weights.value_type == pa.float32() and weights.list_size == meta.geometry.top_k):
            raise InputError(f"{source}: column 'weights' has type {weights}, expected fixed_size_list<float>[{meta.geometry.top_k}]")
    if "token" in schema.names and schema.field("token").type != pa.int32():
        raise InputError(f"{source}: column 'token' has type {schema.field('token').type}, expected int32")
