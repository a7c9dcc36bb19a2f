"""Model presets and their byte accounting (contract 5 in docs/architecture.md).

Presets are data (`presets.toml`, or a user's TOML or Hugging Face `config.json`); this module
turns them into frozen dataclasses and counts parameters and bytes: bytes of one expert, routed
expert bytes per MoE layer, non-expert bytes read per token, total and active parameters, and
the keys, KV bytes and attention FLOPs of a pass, each layer through its sliding window (`window_keys`).
`moesim.kernels` never imports this module: it counts ids, and bytes are applied here.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import protect
from moesim.errors import ConfigError, InputError
from moesim.fields import Checked, FieldError, build, checked, require
from moesim.parsing import load_json
from moesim.tomlfile import read_toml

# Bytes per weight by format: (bytes per block, weights per block), the real GGUF/OCP block sizes.
WEIGHT_FORMATS: dict[str, tuple[int, int]] = {
    "F32": (4, 1),
    "F16": (2, 1),
    "BF16": (2, 1),
    "FP8": (1, 1),
    "Q8_0": (34, 32),
    "Q6_K": (210, 256),
    "Q5_K": (176, 256),
    "Q4_K": (144, 256),
    "Q4_0": (18, 32),
    "MXFP4": (17, 32),
    "Q3_K": (110, 256),
    "Q2_K": (84, 256),
    # MLX affine quantisation, group size 64: packed weights plus a bf16 scale and bias per group.
    "AFFINE8": (68, 64),
    "AFFINE6": (52, 64),
    "AFFINE4": (36, 64),
}

# linear: a linear-attention layer (Gated DeltaNet): a fixed recurrent state, no KV per token.
ATTENTION_KINDS = ("mha", "gqa", "mla", "linear")
MAX_LAYERS = 1 << 16  # the trace's `layer` column is uint16
MAX_EXPERTS = 1 << 16  # expert ids are uint8 or uint16
MAX_WIDTH = 1 << 20  # hidden sizes, FFN widths, ranks: far above any model's
MAX_VOCAB = 1 << 24


def bytes_per_weight(weight_format: str) -> Fraction:
    """Bytes per weight = bytes per block / weights per block (exact)."""
    block_bytes, block_weights = WEIGHT_FORMATS[check_weight_format(weight_format)]
    return Fraction(block_bytes, block_weights)


def check_weight_format(weight_format: object, field: str | None = None) -> str:
    """The format's canonical (upper-case) name; an unknown one is an InputError, or a FieldError of `field`."""
    name = weight_format.upper() if isinstance(weight_format, str) else ""
    if name not in WEIGHT_FORMATS:
        message = f"unknown weight format {weight_format!r} (known: {', '.join(WEIGHT_FORMATS)})"
        raise FieldError(field, message) if field else InputError(message)
    return name


@dataclass(frozen=True)
class ExpertShape:
    """Shape of one routed expert (SwiGLU: gate, up, down) in a weight format."""

    hidden: int
    intermediate: int
    weight_format: str = "BF16"

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert = 3·hidden·intermediate · bytes per weight."""
        return float(3 * self.hidden * self.intermediate * bytes_per_weight(self.weight_format))


@dataclass(frozen=True)
class AttentionShape(Checked):
    """Attention projection shape; MLA fields are zero for MHA/GQA.

    `output_gate`: the query projection also yields a gate of the same width (Qwen3.5/3.6);
    `shared_kv`: keys double as values (no value projection, one cached tensor: Gemma 4's full
    layers); `linear`: heads = value heads, kv_heads = key heads, with a short causal convolution
    of `conv_kernel` taps over q, k and v.
    """

    kind: str = checked(choices=ATTENTION_KINDS)
    heads: int = checked(ge=1, le=MAX_WIDTH)
    kv_heads: int = checked(ge=1, le=MAX_WIDTH)
    head_dim: int = checked(ge=1, le=MAX_WIDTH)
    q_lora_rank: int = checked(0, ge=0, le=MAX_WIDTH)
    kv_lora_rank: int = checked(0, ge=0, le=MAX_WIDTH)
    qk_nope_head_dim: int = checked(0, ge=0, le=MAX_WIDTH)
    qk_rope_head_dim: int = checked(0, ge=0, le=MAX_WIDTH)
    v_head_dim: int = checked(0, ge=0, le=MAX_WIDTH)
    sliding_window: int = checked(0, ge=0, lt=1 << 32)
    sinks: bool = False
    output_gate: bool = False
    shared_kv: bool = False
    conv_kernel: int = checked(0, ge=0, le=MAX_WIDTH)

    def __post_init__(self) -> None:
        require(self.kind != "mla" or self.kv_lora_rank > 0, "kv_lora_rank", "is required (> 0) for MLA attention")

    def params(self, hidden: int, qkv_bias: bool, attention_bias: bool, qk_norm: bool) -> int:
        """Attention parameters of one layer (projections, biases, norms, sinks)."""
        if self.kind == "linear":
            key_width, value_width = self.kv_heads * self.head_dim, self.heads * self.head_dim
            projections = hidden * (2 * key_width + 2 * value_width + 2 * self.heads) + value_width * hidden
            return projections + self.conv_kernel * (2 * key_width + value_width) + 2 * self.heads + self.head_dim
        if self.kind == "mla":
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.heads * qk_head
            else:
                q = hidden * self.heads * qk_head
            kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            out = self.heads * self.v_head_dim * hidden
            return q + kv_a + kv_b + out
        q_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        kv_tensors = 1 if self.shared_kv else 2
        total = hidden * q_width * (2 if self.output_gate else 1) + kv_tensors * hidden * kv_width + q_width * hidden
        if qkv_bias or attention_bias:
            total += q_width + kv_tensors * kv_width
        if attention_bias:
            total += hidden
        if qk_norm:
            total += 2 * self.head_dim
        if self.sinks:
            total += self.heads
        return total

    def flops_per_context_token(self) -> float:
        """Attention FLOPs of one query against one cached token: 2·heads·(key width + value width)
        (MLA in its absorbed form over the latent, as llama.cpp runs it; 0 for linear attention)."""
        if self.kind == "linear":
            return 0.0
        if self.kind == "mla":
            return 2.0 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.heads * self.head_dim

    def kv_cache_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """KV-cache bytes one token adds to one layer (MLA caches the latent and the rope key; a
        linear-attention layer keeps a fixed state instead)."""
        if self.kind == "linear":
            return 0.0
        if self.kind == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element
        return (1 if self.shared_kv else 2) * self.kv_heads * self.head_dim * bytes_per_element


Keys = float | np.ndarray  # a count of keys or tokens, or an array of them


def window_keys(context: Keys, window: int, span: Keys = 1.0) -> Keys:
    """Mean keys per query under window W over s consecutive key counts centred on c: mean of min(c − (s−1)/2 + i, W), i < s (W = 0: c).

    `context` is the mean key count per query of one sequence; `span` s how many consecutive key
    counts the queries run over: 1 for a decode or verify pass at the mean context (min(c, W)),
    U·P for the U·P prompt tokens of a causal prompt test, N for the N decode passes of a test.
    """
    if window == 0:
        return context
    first = context - (span - 1.0) / 2.0
    below = np.clip(np.floor(window - first) + 1.0, 0.0, span)  # the key counts at or under W
    return (below * first + below * (below - 1.0) / 2.0 + (span - below) * window) / span


def windowed(by_window: tuple[tuple[int, float], ...], context_tokens: Keys, sequences: Keys, span: Keys) -> Keys:
    """Σ_{W>0} x_W·S·window_keys(context/S, W, span): a per-key quantity x over the windowed layers of S sequences."""
    total: Keys = 0.0
    for window, per_key in by_window[1:]:
        total = total + per_key * sequences * window_keys(context_tokens / sequences, window, span)
    return total


def kv_read(kv_by_window: tuple[tuple[int, float], ...], context_tokens: Keys, sequences: Keys = 1.0, span: Keys = 1.0) -> Keys:
    """KV bytes the queries of a pass read: kv_0·context over the full layers + Σ_{W>0} kv_W·S·keys(context/S, W, span)."""
    return kv_by_window[0][1] * context_tokens + windowed(kv_by_window, context_tokens, sequences, span)


def attention_work(
    flops_by_window: tuple[tuple[int, float], ...], tokens: Keys, context_tokens: Keys, sequences: Keys = 1.0, span: Keys = 1.0
) -> Keys:
    """Attention FLOPs of a pass of n tokens: a_0·n/S·context over the full layers + Σ_{W>0} a_W·n·keys(context/S, W, span)."""
    full = flops_by_window[0][1] * tokens / sequences * context_tokens
    return full + windowed(flops_by_window, context_tokens, sequences, span) * tokens / sequences


@dataclass(frozen=True)
class ModelPreset(Checked):
    """Architecture numbers of one model; `kind` is 'moe' (a target) or 'dense' (a draft)."""

    name: str
    kind: str = checked(choices=("moe", "dense"))
    layers: int = checked(ge=1, le=MAX_LAYERS)
    hidden: int = checked(ge=1, le=MAX_WIDTH)
    vocab: int = checked(ge=1, le=MAX_VOCAB)
    attention: AttentionShape
    experts: int = checked(0, ge=0, le=MAX_EXPERTS)
    top_k: int = checked(0, ge=0, le=MAX_EXPERTS)
    expert_intermediate: int = checked(0, ge=0, le=MAX_WIDTH)
    shared_experts: int = checked(0, ge=0, le=MAX_EXPERTS)
    shared_intermediate: int = checked(0, ge=0, le=MAX_WIDTH)
    dense_intermediate: int = checked(0, ge=0, le=MAX_WIDTH)
    dense_layers: tuple[int, ...] = checked((), ge=0, lt=MAX_LAYERS)
    tie_embeddings: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    ffn_gated: bool = True
    embedding_dim: int = checked(0, ge=0, le=MAX_WIDTH)  # 0: the hidden size
    default_format: str = "BF16"
    hf_id: str = ""
    published_total_params_b: float = checked(0.0, ge=0.0)
    alt_attention: AttentionShape | None = None
    alt_attention_layers: tuple[int, ...] = checked((), ge=0, lt=MAX_LAYERS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_format", check_weight_format(self.default_format, "default_format"))
        for key in ("dense_layers", "alt_attention_layers"):
            object.__setattr__(self, key, tuple(sorted(set(getattr(self, key)))))
            require(all(i < self.layers for i in getattr(self, key)), key, f"must list layer indices below {self.layers}")
        require((self.alt_attention is None) == (not self.alt_attention_layers), "alt_attention", "and alt_attention_layers go together")
        if self.kind == "moe":
            for key in ("experts", "top_k", "expert_intermediate"):
                require(getattr(self, key) >= 1, key, f"must be >= 1 for a MoE model, got {getattr(self, key)}")
            require(self.top_k <= self.experts, "top_k", f"must be <= experts ({self.experts}), got {self.top_k}")
            require(len(self.dense_layers) < self.layers, "dense_layers", "lists every layer; a MoE model needs one MoE layer")
        if self.kind == "dense" or self.dense_layers:
            require(self.dense_intermediate >= 1, "dense_intermediate", "is required (>= 1) for dense layers")

    def require_moe(self, purpose: str) -> ModelPreset:
        """This preset; a dense one is one line saying what (`purpose`) needs a MoE model."""
        if self.kind != "moe":
            raise InputError(f"model preset '{self.name}' has no experts; {purpose} needs a MoE model")
        return self

    # ---- layer structure -------------------------------------------------------------

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Model layer indices that route tokens to experts."""
        if self.kind != "moe":
            return ()
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.layers) if i not in dense)

    # ---- parameter counts ----------------------------------------------------------------

    def expert_params(self) -> int:
        """Parameters of one routed expert: 3·hidden·intermediate (SwiGLU), plus biases."""
        params = 3 * self.hidden * self.expert_intermediate
        if self.expert_bias:
            params += 2 * self.expert_intermediate + self.hidden
        return params

    def shared_params_per_moe_layer(self) -> int:
        """Parameters of the shared experts or shared FFN (and its gate) of one MoE layer."""
        params = self.shared_experts * 3 * self.hidden * self.expert_intermediate
        if self.shared_intermediate:
            params += 3 * self.hidden * self.shared_intermediate + self.hidden
        return params

    def router_params(self) -> int:
        """Router (gate) parameters of one MoE layer."""
        return self.hidden * self.experts + (self.experts if self.router_bias else 0)

    def attention_of(self, layer: int) -> AttentionShape:
        """The attention shape of a layer: `alt_attention` on `alt_attention_layers`, else `attention`."""
        return self.alt_attention if self.alt_attention is not None and layer in self.alt_attention_layers else self.attention

    def attention_params(self, layer: int = 0) -> int:
        """Attention parameters of one layer."""
        return self.attention_of(layer).params(self.hidden, self.qkv_bias, self.attention_bias, self.qk_norm)

    def kv_cache_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """KV-cache bytes one token of context adds over all layers."""
        return float(sum(self.attention_of(i).kv_cache_bytes_per_token(bytes_per_element) for i in range(self.layers)))

    def by_window(self, per_layer: Callable[[AttentionShape], float]) -> tuple[tuple[int, float], ...]:
        """(window W, Σ per_layer(shape)) over the layers of each sliding window, in layer order; W = 0 (full attention) first."""
        sums = {0: 0.0}
        for i in range(self.layers):
            shape = self.attention_of(i)
            sums[shape.sliding_window] = sums.get(shape.sliding_window, 0.0) + per_layer(shape)
        return tuple(sums.items())

    @cached_property
    def attention_flops_by_window(self) -> tuple[tuple[int, float], ...]:
        """Attention FLOPs of one query against one key, summed over the layers of each window (`by_window`)."""
        return self.by_window(AttentionShape.flops_per_context_token)

    def kv_bytes_read(self, context_tokens: Keys, sequences: Keys = 1.0, span: Keys = 1.0, bytes_per_element: float = 2.0) -> Keys:
        """KV bytes the queries of a pass read over all layers, each layer its window's keys (`kv_read`)."""
        return kv_read(self.by_window(lambda a: a.kv_cache_bytes_per_token(bytes_per_element)), context_tokens, sequences, span)

    def attention_flops(self, tokens: Keys, context_tokens: Keys, sequences: Keys = 1.0, span: Keys = 1.0) -> Keys:
        """Attention FLOPs of a pass over all layers, each layer its window's keys (`attention_work`)."""
        return attention_work(self.attention_flops_by_window, tokens, context_tokens, sequences, span)

    def lm_head_params(self) -> int:
        """Parameters of the output head (vocab x the embedding width)."""
        return self.vocab * self.embedding_width

    def non_expert_params_per_layer(self, layer: int) -> int:
        """Parameters of layer `layer` other than routed experts (attention, norms, FFN parts)."""
        norms = 2 * self.hidden
        if layer in self.moe_layers:
            ffn = self.router_params() + self.shared_params_per_moe_layer()
        else:
            ffn = (3 if self.ffn_gated else 2) * self.hidden * self.dense_intermediate
        return self.attention_params(layer) + norms + ffn

    @property
    def embedding_width(self) -> int:
        """Width of the embedding table and LM head: `embedding_dim`, or the hidden size when 0."""
        return self.embedding_dim or self.hidden

    def projection_params(self) -> int:
        """The projections between a narrower embedding and the hidden size (OPT-350M): 2·hidden·width."""
        return 0 if self.embedding_width == self.hidden else 2 * self.hidden * self.embedding_width

    def embedding_params(self) -> int:
        """Input embedding table plus LM head (counted once when tied), and their projections."""
        return self.vocab * self.embedding_width * (1 if self.tie_embeddings else 2) + self.projection_params()

    def total_params(self) -> int:
        """All parameters: embeddings, every layer, every expert, final norm."""
        layers = sum(self.non_expert_params_per_layer(i) for i in range(self.layers))
        experts = len(self.moe_layers) * self.experts * self.expert_params()
        return self.embedding_params() + layers + experts + self.hidden

    def active_params(self) -> int:
        """Parameters used for one token: all but the unselected routed experts."""
        unselected = len(self.moe_layers) * (self.experts - self.top_k) * self.expert_params()
        return self.total_params() - unselected

    # ---- bytes -------------------------------------------------------------------------

    def expert_shape(self, weight_format: str | None = None) -> ExpertShape:
        """Shape of one routed expert in a weight format (default: the preset's own)."""
        return ExpertShape(self.hidden, self.expert_intermediate, (weight_format or self.default_format).upper())

    def expert_bytes(self, weight_format: str | None = None) -> float:
        """Bytes of one routed expert = expert_params · bytes per weight."""
        return float(self.expert_params() * bytes_per_weight(weight_format or self.default_format))

    def routed_expert_bytes_per_layer(self, weight_format: str | None = None) -> float:
        """Bytes of all E routed experts of one MoE layer."""
        return self.experts * self.expert_bytes(weight_format)

    def non_expert_params_per_token(self) -> int:
        """Parameters a decode step reads besides routed experts: every layer's non-expert weights,
        the LM head, the final norm and one embedding row."""
        return self._non_expert_params

    @cached_property
    def _non_expert_params(self) -> int:
        layers = sum(self.non_expert_params_per_layer(i) for i in range(self.layers))
        return layers + self.vocab * self.embedding_width + self.projection_params() + 2 * self.hidden

    def non_expert_bytes_per_token(self, weight_format: str | None = None) -> float:
        """Weight bytes a batch-1 decode step reads besides routed experts."""
        return float(self.non_expert_params_per_token() * bytes_per_weight(weight_format or self.default_format))

    def weight_bytes(self, weight_format: str | None = None) -> float:
        """Bytes of all the model's weights in a format (total parameters · bytes per weight)."""
        return float(self.total_params() * bytes_per_weight(weight_format or self.default_format))

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for trace and profile metadata)."""
        return dataclasses.asdict(self)


# ---- loading -----------------------------------------------------------------------------


def preset_from_table(name: str, table: dict[str, Any], source: str = "presets.toml", section: str | None = None) -> ModelPreset:
    """Build and check a ModelPreset from one TOML table (`section`: its key path in the file, default the name)."""
    section = name if section is None else section
    if isinstance(table, dict) and "name" in table:
        raise ConfigError(f"{source}: key '{section + '.' if section else ''}name': unknown key (the preset's name is its table's)")
    return build(ModelPreset, {"kind": "moe", **table, "name": name} if isinstance(table, dict) else table, section, source, Path("."))


@cache
def _builtin_tables() -> dict[str, dict[str, Any]]:
    text = resources.files("moesim").joinpath("presets.toml").read_text()
    return tomllib.loads(text)


def builtin_names(kind: str | None = None) -> list[str]:
    """Names of the built-in presets (optionally of one kind: 'moe', 'dense', 'eagle')."""
    return [n for n, t in _builtin_tables().items() if kind is None or t.get("kind", "moe") == kind]


PRESET_FILES = "a preset .toml or a Hugging Face config.json"


def load_preset(name_or_path: str | Path) -> ModelPreset:
    """A built-in preset by name, or a preset from a TOML file or a Hugging Face config.json."""
    text = str(name_or_path)
    tables = _builtin_tables()
    if text in tables:
        if tables[text].get("kind") == "eagle":
            raise InputError(f"'{text}' is an EAGLE-style draft head, not a model of its own: name it as a drafter (drafter '{text}')")
        return preset_from_table(text, tables[text])
    path = Path(text)
    if path.suffix == ".toml" or path.suffix == ".json":
        if path.suffix == ".json":
            if not path.is_file():
                raise InputError(f"{path}: no such preset file")
            protect(path)
            return preset_from_hf_config(path)
        data = read_toml(path, "preset")
        if len(data) == 1 and isinstance(next(iter(data.values())), dict) and "layers" not in data:
            ((name, table),) = data.items()
            return preset_from_table(name, table, source=str(path))
        return preset_from_table(path.stem, data, source=str(path), section="")
    known = ", ".join(n for n in tables if tables[n].get("kind") != "eagle")
    raise InputError(f"unknown model preset '{text}' (built-in: {known}; or {PRESET_FILES})")


def load_target(name_or_path: str | Path) -> ModelPreset:
    """A MoE target preset: a built-in MoE preset or a preset file with routed experts (one line
    listing the MoE presets when it is not)."""
    text = str(name_or_path)
    moe = ", ".join(builtin_names("moe"))
    if text in _builtin_tables() and text not in builtin_names("moe"):
        raise InputError(f"'{text}' is a draft model, not a MoE target (MoE presets: {moe}; or {PRESET_FILES})")
    if text not in _builtin_tables() and Path(text).suffix not in (".toml", ".json"):
        raise InputError(f"unknown MoE model preset '{text}' (built-in: {moe}; or {PRESET_FILES})")
    preset = load_preset(text)
    if preset.kind != "moe":
        raise InputError(f"{text}: model '{preset.name}' has no routed experts; a target must be a MoE model")
    return preset


def draft_for(name_or_path: str | Path, target: ModelPreset) -> ModelPreset:
    """A draft model as a dense preset; an EAGLE-style head is resolved against `target`."""
    table = _builtin_tables().get(str(name_or_path))
    if table is None or table.get("kind") != "eagle":
        draft = load_preset(name_or_path)
        if draft.kind != "dense":
            raise InputError(f"draft model '{name_or_path}' is not a dense model")
        return draft
    intermediate = round(float(table["ffn_ratio"]) * target.hidden)
    # The fusion layer (2h -> h) is folded into a wider dense FFN-equivalent: its h·2h weights
    # equal those of an FFN of width 2h/3 (3 matrices of h·I).
    fusion_width = round(2 * target.hidden / 3)
    return ModelPreset(
        name=f"{name_or_path}@{target.name}",
        kind="dense",
        layers=int(table["layers"]),
        hidden=target.hidden,
        vocab=int(table.get("draft_vocab", target.vocab)),
        attention=dataclasses.replace(target.attention, sliding_window=0, sinks=False)
        if target.attention.kind != "mla"
        else AttentionShape("mha", target.attention.heads, target.attention.heads, 128),
        dense_intermediate=intermediate + fusion_width,
        tie_embeddings=True,
        default_format=str(table.get("default_format", target.default_format)),
    )


# ---- Hugging Face config.json ------------------------------------------------------------


@dataclass(frozen=True)
class HFConfig(Checked):
    """The keys of a Hugging Face config.json moesim reads (null = absent), with their bounds."""

    hidden_size: int = checked(ge=1, le=MAX_WIDTH)
    num_hidden_layers: int = checked(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = checked(ge=1, le=MAX_WIDTH)
    vocab_size: int = checked(ge=1, le=MAX_VOCAB)
    model_type: str = ""
    _name_or_path: str = ""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_key_value_heads: int | None = checked(None, ge=1, le=MAX_WIDTH)
    head_dim: int | None = checked(None, ge=1, le=MAX_WIDTH)
    n_routed_experts: int | None = checked(None, ge=0, le=MAX_EXPERTS)
    num_local_experts: int | None = checked(None, ge=0, le=MAX_EXPERTS)
    num_experts: int | None = checked(None, ge=0, le=MAX_EXPERTS)
    num_experts_per_tok: int | None = checked(None, ge=1, le=MAX_EXPERTS)
    num_experts_per_token: int | None = checked(None, ge=1, le=MAX_EXPERTS)
    experts_per_token: int | None = checked(None, ge=1, le=MAX_EXPERTS)
    moe_intermediate_size: int | None = checked(None, ge=1, le=MAX_WIDTH)
    intermediate_size: int | None = checked(None, ge=1, le=MAX_WIDTH)
    n_shared_experts: int | None = checked(None, ge=0, le=MAX_EXPERTS)
    shared_expert_intermediate_size: int | None = checked(None, ge=0, le=MAX_WIDTH)
    first_k_dense_replace: int | None = checked(None, ge=0, le=MAX_LAYERS)
    kv_lora_rank: int | None = checked(None, ge=0, le=MAX_WIDTH)
    q_lora_rank: int | None = checked(None, ge=0, le=MAX_WIDTH)
    qk_nope_head_dim: int | None = checked(None, ge=0, le=MAX_WIDTH)
    qk_rope_head_dim: int | None = checked(None, ge=0, le=MAX_WIDTH)
    v_head_dim: int | None = checked(None, ge=0, le=MAX_WIDTH)
    sliding_window: int | None = checked(None, ge=0, lt=1 << 32)
    layer_types: tuple[str, ...] = ()  # gpt-oss: "sliding_attention" / "full_attention" per layer
    ffn_dim: int | None = checked(None, ge=1, le=MAX_WIDTH)  # OPT
    word_embed_proj_dim: int | None = checked(None, ge=1, le=MAX_WIDTH)  # OPT

    def first(self, path: Path, *keys: str) -> int:
        """The first of `keys` given; none given is one line naming the first."""
        for key in keys:
            if getattr(self, key) is not None:
                return getattr(self, key)
        raise InputError(f"{path}: key '{keys[0]}' is missing from the config")


def preset_from_hf_config(path: Path) -> ModelPreset:
    """Read a Hugging Face config.json (Mixtral, Qwen-MoE, DeepSeek, OLMoE, Phi-MoE, gpt-oss, dense, OPT)."""
    raw = load_json(path.read_bytes(), str(path))
    if not isinstance(raw, dict):
        raise InputError(f"{path}: a config.json must hold an object")
    known = {f.name for f in dataclasses.fields(HFConfig)}
    c = build(HFConfig, {k: v for k, v in raw.items() if k in known and v is not None}, "", str(path), path.parent)
    heads = c.num_attention_heads
    table: dict[str, Any] = {
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "tie_embeddings": c.tie_word_embeddings,
        "hf_id": c._name_or_path,
    }
    experts = c.n_routed_experts or c.num_local_experts or c.num_experts or 0
    attention: dict[str, Any] = {
        "kind": "gqa",
        "heads": heads,
        "kv_heads": c.num_key_value_heads or heads,
        "head_dim": c.head_dim or c.hidden_size // heads,
    }
    if c.kv_lora_rank:
        nope, rope = c.first(path, "qk_nope_head_dim"), c.first(path, "qk_rope_head_dim")
        attention.update(
            kind="mla", q_lora_rank=c.q_lora_rank or 0, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
            v_head_dim=c.first(path, "v_head_dim"), head_dim=nope + rope,
        )  # fmt: skip
    elif attention["kv_heads"] == heads:
        attention["kind"] = "mha"
    if attention["head_dim"] < 1:
        raise InputError(
            f"{path}: key 'hidden_size' ({c.hidden_size}) is smaller than 'num_attention_heads' ({heads}) and 'head_dim' is not given"
        )
    if c.model_type == "gpt_oss":
        attention.update(sliding_window=c.sliding_window or 0, sinks=True)
        table.update(expert_bias=True, router_bias=True, attention_bias=True)
    if c.model_type in ("qwen2_moe", "qwen2"):
        table["qkv_bias"] = True
    if c.model_type in ("qwen3_moe", "qwen3", "olmoe"):
        table["qk_norm"] = True
    if c.model_type == "phimoe" or c.attention_bias:
        table["attention_bias"] = True
    if c.model_type == "deepseek_v3":
        table["router_bias"] = True
    if c.model_type == "opt":
        tied = c.tie_word_embeddings if raw.get("tie_word_embeddings") is not None else True  # OPT ties by default
        table.update(ffn_gated=False, attention_bias=True, tie_embeddings=tied, embedding_dim=c.word_embed_proj_dim or c.hidden_size)
    table["attention"] = attention
    full = [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"]
    if attention.get("sliding_window") and full:
        table.update(alt_attention={**attention, "sliding_window": 0}, alt_attention_layers=full)
    if experts:
        table["kind"] = "moe"
        table["experts"] = experts
        table["top_k"] = c.first(path, "num_experts_per_tok", "num_experts_per_token", "experts_per_token")
        table["expert_intermediate"] = c.first(path, "moe_intermediate_size", "intermediate_size")
        table["shared_experts"] = c.n_shared_experts or 0
        table["shared_intermediate"] = c.shared_expert_intermediate_size or 0
        first_dense = c.first_k_dense_replace or 0
        table["dense_layers"] = list(range(first_dense))
        if first_dense:
            table["dense_intermediate"] = c.first(path, "intermediate_size")
    else:
        table["kind"] = "dense"
        table["dense_intermediate"] = c.first(path, "intermediate_size", "ffn_dim")
    name = path.parent.name if path.name == "config.json" else path.stem
    return preset_from_table(name, table, source=str(path), section="")
