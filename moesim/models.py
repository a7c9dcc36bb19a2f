"""Model presets and their byte accounting (contract 5 in docs/architecture.md).

Presets are data (`presets.toml`, or a user's TOML or Hugging Face `config.json`); this module
turns them into frozen dataclasses and counts parameters and bytes: bytes of one expert, routed
expert bytes per MoE layer, non-expert bytes read per token, total and active parameters.
`moesim.kernels` never imports this module: it counts ids, and bytes are applied here.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from moesim.errors import ConfigError, InputError
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


def bytes_per_weight(weight_format: str) -> Fraction:
    """Bytes per weight = bytes per block / weights per block (exact)."""
    try:
        block_bytes, block_weights = WEIGHT_FORMATS[weight_format.upper()]
    except KeyError:
        known = ", ".join(WEIGHT_FORMATS)
        raise InputError(f"unknown weight format '{weight_format}' (known: {known})") from None
    return Fraction(block_bytes, block_weights)


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
class AttentionShape:
    """Attention projection shape; MLA fields are zero for MHA/GQA.

    `output_gate`: the query projection also yields a gate of the same width (Qwen3.5/3.6);
    `shared_kv`: keys double as values (no value projection, one cached tensor: Gemma 4's full
    layers); `linear`: heads = value heads, kv_heads = key heads, with a short causal convolution
    of `conv_kernel` taps over q, k and v.
    """

    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    sinks: bool = False
    output_gate: bool = False
    shared_kv: bool = False
    conv_kernel: int = 0

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


@dataclass(frozen=True)
class ModelPreset:
    """Architecture numbers of one model; `kind` is 'moe' (a target) or 'dense' (a draft)."""

    name: str
    kind: str
    layers: int
    hidden: int
    vocab: int
    attention: AttentionShape
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    shared_intermediate: int = 0
    dense_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()
    tie_embeddings: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    ffn_gated: bool = True
    embedding_dim: int = 0
    default_format: str = "BF16"
    hf_id: str = ""
    published_total_params_b: float = 0.0
    alt_attention: AttentionShape | None = None
    alt_attention_layers: tuple[int, ...] = ()

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

    def attention_flops_per_context_token(self) -> float:
        """Attention FLOPs of one query token against one cached token, over all layers."""
        return float(sum(self.attention_of(i).flops_per_context_token() for i in range(self.layers)))

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

_INT_FIELDS = (
    "layers", "hidden", "vocab", "experts", "top_k", "expert_intermediate", "shared_experts",
    "shared_intermediate", "dense_intermediate", "embedding_dim",
)  # fmt: skip
_BOOL_FIELDS = ("tie_embeddings", "expert_bias", "router_bias", "attention_bias", "qkv_bias", "qk_norm", "ffn_gated")


def _require_int(source: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source}: field '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _attention_from_table(source: str, table: Any, prefix: str = "attention") -> AttentionShape:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: field '{prefix}' is missing or not a table")
    kind = table.get("kind")
    if kind not in ATTENTION_KINDS:
        raise ConfigError(f"{source}: field '{prefix}.kind' must be one of {ATTENTION_KINDS}, got {kind!r}")
    known = {f.name for f in dataclasses.fields(AttentionShape)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{source}: unknown field '{prefix}.{sorted(unknown)[0]}'")
    flags = {"sinks", "output_gate", "shared_kv"}
    values: dict[str, Any] = {"kind": kind}
    for key in known - {"kind"} - flags:
        if key in table:
            values[key] = _require_int(source, f"{prefix}.{key}", table[key], 0)
    for key in ("heads", "kv_heads", "head_dim"):
        if key not in values:
            raise ConfigError(f"{source}: field '{prefix}.{key}' is missing")
        _require_int(source, f"{prefix}.{key}", values[key], 1)
    for key in flags & set(table):
        values[key] = bool(table[key])
    if kind == "mla" and not values.get("kv_lora_rank"):
        raise ConfigError(f"{source}: field '{prefix}.kv_lora_rank' is required for MLA attention")
    return AttentionShape(**values)


def _layer_list(where: str, table: dict[str, Any], key: str, layers: int) -> tuple[int, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in value):
        raise ConfigError(f"{where}: field '{key}' must list layer indices below {layers}")
    return tuple(sorted(set(value)))


def preset_from_table(name: str, table: dict[str, Any], source: str = "presets.toml") -> ModelPreset:
    """Build and check a ModelPreset from one TOML table."""
    where = f"{source}: preset '{name}'"
    kind = table.get("kind", "moe")
    if kind not in ("moe", "dense"):
        raise ConfigError(f"{where}: field 'kind' must be 'moe' or 'dense', got {kind!r}")
    known = {f.name for f in dataclasses.fields(ModelPreset)} - {"name"}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field '{sorted(unknown)[0]}'")
    values: dict[str, Any] = {"name": name, "kind": kind}
    for key in _INT_FIELDS:
        if key in table:
            values[key] = _require_int(where, key, table[key], 0)
    for key in ("layers", "hidden", "vocab"):
        if key not in values:
            raise ConfigError(f"{where}: field '{key}' is missing")
        _require_int(where, key, values[key], 1)
    for key in _BOOL_FIELDS:
        if key in table:
            values[key] = bool(table[key])
    values["attention"] = _attention_from_table(where, table.get("attention"))
    values["dense_layers"] = _layer_list(where, table, "dense_layers", values["layers"])
    if "alt_attention" in table or "alt_attention_layers" in table:
        values["alt_attention"] = _attention_from_table(where, table.get("alt_attention"), "alt_attention")
        values["alt_attention_layers"] = _layer_list(where, table, "alt_attention_layers", values["layers"])
    fmt = str(table.get("default_format", "BF16")).upper()
    bytes_per_weight(fmt)
    values["default_format"] = fmt
    values["hf_id"] = str(table.get("hf_id", ""))
    values["published_total_params_b"] = float(table.get("published_total_params_b", 0.0))
    preset = ModelPreset(**values)
    if kind == "moe":
        for key in ("experts", "top_k", "expert_intermediate"):
            _require_int(where, key, getattr(preset, key), 1)
        if preset.top_k > preset.experts:
            raise ConfigError(f"{where}: field 'top_k' ({preset.top_k}) exceeds 'experts' ({preset.experts})")
        if not preset.moe_layers:
            raise ConfigError(f"{where}: every layer is listed in 'dense_layers'; a MoE model needs one MoE layer")
    if (kind == "dense" or preset.dense_layers) and preset.dense_intermediate < 1:
        raise ConfigError(f"{where}: field 'dense_intermediate' is required for dense layers")
    return preset


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
            return preset_from_hf_config(path)
        data = read_toml(path, "preset")
        if len(data) == 1 and isinstance(next(iter(data.values())), dict) and "layers" not in data:
            ((name, table),) = data.items()
        else:
            name, table = path.stem, data
        return preset_from_table(name, table, source=str(path))
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
        vocab=target.vocab,
        attention=dataclasses.replace(target.attention, sliding_window=0, sinks=False)
        if target.attention.kind != "mla"
        else AttentionShape("mha", target.attention.heads, target.attention.heads, 128),
        dense_intermediate=intermediate + fusion_width,
        tie_embeddings=True,
        default_format=str(table.get("default_format", target.default_format)),
    )


# ---- Hugging Face config.json ------------------------------------------------------------


def _hf(config: dict[str, Any], path: Path, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is not None:
        return default
    raise InputError(f"{path}: field '{keys[0]}' is missing from the config")


def preset_from_hf_config(path: Path) -> ModelPreset:
    """Read a Hugging Face config.json (Mixtral, Qwen-MoE, DeepSeek, OLMoE, Phi-MoE, gpt-oss, dense, OPT)."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config.json must hold an object")
    model_type = str(config.get("model_type", ""))
    hidden = _hf(config, path, "hidden_size")
    layers = _hf(config, path, "num_hidden_layers")
    heads = _hf(config, path, "num_attention_heads")
    table: dict[str, Any] = {
        "layers": layers,
        "hidden": hidden,
        "vocab": _hf(config, path, "vocab_size"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "hf_id": str(config.get("_name_or_path", "")),
    }
    experts = config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts") or 0
    attention: dict[str, Any] = {
        "kind": "gqa",
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
    }
    if config.get("kv_lora_rank"):
        attention.update(
            kind="mla",
            q_lora_rank=config.get("q_lora_rank") or 0,
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=_hf(config, path, "qk_nope_head_dim"),
            qk_rope_head_dim=_hf(config, path, "qk_rope_head_dim"),
            v_head_dim=_hf(config, path, "v_head_dim"),
        )
        attention["head_dim"] = attention["qk_nope_head_dim"] + attention["qk_rope_head_dim"]
    elif attention["kv_heads"] == heads:
        attention["kind"] = "mha"
    if model_type == "gpt_oss":
        attention.update(sliding_window=config.get("sliding_window") or 0, sinks=True)
        table.update(expert_bias=True, router_bias=True, attention_bias=True)
    if model_type in ("qwen2_moe", "qwen2"):
        table["qkv_bias"] = True
    if model_type in ("qwen3_moe", "qwen3", "olmoe"):
        table["qk_norm"] = True
    if model_type == "phimoe" or config.get("attention_bias"):
        table["attention_bias"] = True
    if model_type == "deepseek_v3":
        table["router_bias"] = True
    if model_type == "opt":
        table.update(ffn_gated=False, attention_bias=True, tie_embeddings=bool(config.get("tie_word_embeddings", True)))
        table["embedding_dim"] = config.get("word_embed_proj_dim") or hidden
    table["attention"] = attention
    if experts:
        table["kind"] = "moe"
        table["experts"] = experts
        table["top_k"] = _hf(config, path, "num_experts_per_tok", "num_experts_per_token", "experts_per_token")
        table["expert_intermediate"] = _hf(config, path, "moe_intermediate_size", "intermediate_size")
        table["shared_experts"] = config.get("n_shared_experts") or 0
        table["shared_intermediate"] = config.get("shared_expert_intermediate_size") or 0
        first_dense = config.get("first_k_dense_replace") or 0
        table["dense_layers"] = list(range(first_dense))
        if first_dense:
            table["dense_intermediate"] = _hf(config, path, "intermediate_size")
    else:
        table["kind"] = "dense"
        table["dense_intermediate"] = _hf(config, path, "intermediate_size", "ffn_dim")
    name = path.parent.name if path.name == "config.json" else path.stem
    return preset_from_table(name, table, source=str(path))
