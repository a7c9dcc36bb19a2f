"""Tiny (or large) random MoE models as GGUF files that llama.cpp loads, decodes and routes.

`build_tiny_model(path, spec)` writes a model of architecture `qwen3moe`, `llama` (Mixtral
style; with `experts=0` a dense llama, e.g. a dense draft), `qwen2moe` (one shared expert FFN),
`olmoe` or `deepseek2` (MLA attention, shared experts, optional leading dense layers), with:

- random weights: each tensor slice (one expert of an expert tensor, or a whole 2-D tensor) is
  drawn from its own counter-based stream keyed by (seed, tensor name, slice), uniform with unit
  variance (6× faster to draw than normals), scaled by 1/sqrt(fan-in); norms are ones;
- an output layer scaled by `output_scale` so greedy decoding is decisive (top-2 logit gaps far
  above numerical noise), with zero rows for the control tokens so greedy decoding never emits
  `<unk>`, `<s>` or `</s>` (generation runs to its token budget);
- a byte-level SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens
  `<0x00>`..`<0xFF>`, then single-character pieces (`▁` for space, letters, digits,
  punctuation) and lowercase letter pairs up to `vocab` tokens, so any text prompt tokenizes (byte fallback).

Files are streamed: tensor infos first, then each slice is generated and written in turn, so
memory stays at one slice (one expert of one tensor) whatever the file size; a 1 GB F16 file
takes a few seconds. The file appears under its name only when complete (`moesim.atomic`).

`build_draft_model(target_spec, noise, path)` writes a noisy copy of a target: the same base
weights plus `noise` × an independent unit-variance draw, before scaling. Greedy acceptance
falls from k/k (noise 0) towards 0 as the noise grows (a draft with tunable acceptance).
"""

from __future__ import annotations

import dataclasses
import json
import math
import string
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.atomic import atomic_path
from moesim.errors import ConfigError
from moesim.fields import option, option_name

ARCHITECTURES = ("qwen3moe", "llama", "qwen2moe", "olmoe", "deepseek2")
WEIGHT_TYPES = ("F32", "F16")
BYTE_TOKENS_START = 3  # <unk>, <s>, </s> come first
MIN_VOCAB = BYTE_TOKENS_START + 256
_SQRT3 = math.sqrt(3.0)
SPEC_KEY = "moesim.tiny_model_spec"  # JSON of the TinyModelSpec, so a noisy copy can be made from the file


def _extra_pieces() -> list[str]:
    """Pieces after the byte tokens: '▁', letters, digits, punctuation, then lowercase pairs."""
    letters = string.ascii_lowercase
    singles = ["▁", *letters, *string.ascii_uppercase, *string.digits, *string.punctuation]
    return singles + [a + b for a in letters for b in letters]


MAX_VOCAB = MIN_VOCAB + len(_extra_pieces())


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a random GGUF model; every field is written to the file's metadata."""

    arch: str = option("qwen3moe", "qwen3moe, llama (Mixtral style), qwen2moe, olmoe or deepseek2.")
    layers: int = option(4, "Transformer blocks.")
    experts: int = option(8, "Routed experts per MoE layer (llama: 0 = dense).")
    top_k: int = option(2, "Experts per token.")
    hidden: int = option(32, "Embedding width.")
    expert_ff: int = option(16, "Intermediate width of one expert.", name="--expert-intermediate")
    heads: int = option(4, "Attention heads.")
    kv_heads: int = option(2, "Key/value heads.")  # deepseek2 ignores it: its MLA attention is written with one KV head
    vocab: int = option(288, "Vocabulary size (259..1030; byte-level SentencePiece).")
    weight_type: str = option("F32", "F32 or F16 (GGUF), or mlx (an MLX model folder, F32).", name="--format", parse=str.upper, show=str)
    seed: int = option(0, "Random seed of the weights.")
    context_length: int = 4096
    output_scale: float = 8.0
    leading_dense: int = option(0, "deepseek2: leading dense layers.")
    dense_ff: int = 0  # width of dense FFNs (leading dense layers, dense llama); 0: 4 * expert_ff
    shared_experts: int = 1  # qwen2moe: one shared FFN of width shared_ff; deepseek2: count of expert-sized shared experts
    shared_ff: int = 0  # qwen2moe shared FFN width; 0: expert_ff
    kv_lora_rank: int = 16  # deepseek2 (MLA) only
    q_lora_rank: int = 16  # deepseek2 only
    rope_dim: int = 4  # deepseek2 only: rotary part of each query/key head
    noise: float = 0.0  # > 0: a noisy copy (draft) of the model with the same seed
    noise_seed: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        check_spec(self)

    @property
    def head_dim(self) -> int:
        """Attention head width = hidden / heads."""
        return self.hidden // self.heads

    @property
    def model_name(self) -> str:
        """`general.name`: given, or made from the shape."""
        if self.name:
            return self.name
        shape = f"L{self.layers}-E{self.experts}-K{self.top_k}-h{self.hidden}-ff{self.expert_ff}"
        base = f"tiny-{self.arch}-{shape}-{self.weight_type}-s{self.seed}"
        return base + (f"-noise{self.noise:g}" if self.noise else "")

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts."""
        return self.experts > 0

    @property
    def effective_dense_ff(self) -> int:
        """Width of dense FFN layers."""
        return self.dense_ff or 4 * self.expert_ff

    @property
    def effective_shared_ff(self) -> int:
        """Width of qwen2moe's shared expert FFN."""
        return self.shared_ff or self.expert_ff


def check_spec(spec: TinyModelSpec) -> None:
    """Reject specs llama.cpp cannot load (one line naming the field and value)."""

    def bad(field: str, why: str) -> ConfigError:
        spelling = option_name(TinyModelSpec, field)
        also = "" if spelling == "--" + field.replace("_", "-") else f" ({spelling})"
        return ConfigError(f"tiny model spec: field '{field}'{also} = {getattr(spec, field)!r}: {why}")

    if spec.arch not in ARCHITECTURES:
        raise bad("arch", f"must be one of {', '.join(ARCHITECTURES)}")
    if spec.weight_type not in WEIGHT_TYPES:
        raise bad("weight_type", f"must be one of {', '.join(WEIGHT_TYPES)}")
    for field in ("layers", "hidden", "heads", "kv_heads", "expert_ff", "context_length"):
        if getattr(spec, field) < 1:
            raise bad(field, "must be >= 1")
    if spec.experts < 0 or (spec.experts == 0 and spec.arch != "llama"):
        raise bad("experts", "must be >= 1 (only a llama model may be dense, with experts = 0)")
    if spec.is_moe and not 1 <= spec.top_k <= spec.experts:
        raise bad("top_k", f"must lie in 1..experts ({spec.experts})")
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise bad("heads", f"must divide hidden ({spec.hidden}) and be a multiple of kv_heads ({spec.kv_heads})")
    if spec.head_dim % 2:
        raise bad("hidden", f"hidden / heads = {spec.head_dim} must be even (rotary embedding)")
    if spec.arch == "olmoe" and spec.kv_heads != spec.heads:
        raise bad("kv_heads", f"olmoe needs kv_heads = heads ({spec.heads})")
    if not MIN_VOCAB <= spec.vocab <= MAX_VOCAB:
        raise bad("vocab", f"must lie in {MIN_VOCAB}..{MAX_VOCAB} (3 control + 256 byte tokens + pieces)")
    if spec.leading_dense and (spec.arch != "deepseek2" or not 0 <= spec.leading_dense < spec.layers):
        raise bad("leading_dense", "only deepseek2 has leading dense layers, and at least one layer must stay MoE")
    if spec.arch == "deepseek2":
        if spec.rope_dim % 2 or not 2 <= spec.rope_dim < spec.head_dim:
            raise bad("rope_dim", f"must be even and below the head width {spec.head_dim}")
        if spec.kv_lora_rank < 1 or spec.q_lora_rank < 1 or spec.shared_experts < 1:
            raise bad("kv_lora_rank", "deepseek2 needs kv_lora_rank, q_lora_rank and shared_experts >= 1")
    if not math.isfinite(spec.noise) or spec.noise < 0:
        raise bad("noise", "must be a finite number >= 0")
    if not math.isfinite(spec.output_scale) or spec.output_scale <= 0:
        raise bad("output_scale", "must be a positive number")


# ---- tensors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorPlan:
    """One tensor: numpy shape (the reverse of ggml's), how to fill it, its fan-in."""

    name: str
    shape: tuple[int, ...]
    fill: str  # "random" or "ones"
    fan_in: int = 1
    scale: float = 1.0
    zero_rows: tuple[int, ...] = ()  # rows (leading index) set to zero (control tokens of the output)


def _tensor_dtype(plan: _TensorPlan, spec: TinyModelSpec) -> np.dtype:
    """Norm vectors and biases stay F32; matrices take the spec's weight type."""
    if plan.fill == "ones" or len(plan.shape) == 1:
        return np.dtype(np.float32)
    return np.dtype(np.float16 if spec.weight_type == "F16" else np.float32)


def _attention_plans(spec: TinyModelSpec, i: int) -> list[_TensorPlan]:
    h, hd = spec.hidden, spec.head_dim
    b = f"blk.{i}."
    if spec.arch == "deepseek2":
        nope = hd - spec.rope_dim
        return [
            _TensorPlan(b + "attn_q_a_norm.weight", (spec.q_lora_rank,), "ones"),
            _TensorPlan(b + "attn_kv_a_norm.weight", (spec.kv_lora_rank,), "ones"),
            _TensorPlan(b + "attn_q_a.weight", (spec.q_lora_rank, h), "random", h),
            _TensorPlan(b + "attn_q_b.weight", (spec.heads * hd, spec.q_lora_rank), "random", spec.q_lora_rank),
            _TensorPlan(b + "attn_kv_a_mqa.weight", (spec.kv_lora_rank + spec.rope_dim, h), "random", h),
            _TensorPlan(b + "attn_k_b.weight", (spec.heads, spec.kv_lora_rank, nope), "random", nope),
            _TensorPlan(b + "attn_v_b.weight", (spec.heads, hd, spec.kv_lora_rank), "random", spec.kv_lora_rank),
            _TensorPlan(b + "attn_output.weight", (h, spec.heads * hd), "random", spec.heads * hd),
        ]
    kv = spec.kv_heads * hd
    plans = [
        _TensorPlan(b + "attn_q.weight", (spec.heads * hd, h), "random", h),
        _TensorPlan(b + "attn_k.weight", (kv, h), "random", h),
        _TensorPlan(b + "attn_v.weight", (kv, h), "random", h),
        _TensorPlan(b + "attn_output.weight", (h, spec.heads * hd), "random", spec.heads * hd),
    ]
    if spec.arch == "qwen3moe":
        plans += [_TensorPlan(b + "attn_q_norm.weight", (hd,), "ones"), _TensorPlan(b + "attn_k_norm.weight", (hd,), "ones")]
    if spec.arch == "olmoe":
        plans += [_TensorPlan(b + "attn_q_norm.weight", (h,), "ones"), _TensorPlan(b + "attn_k_norm.weight", (h,), "ones")]
    return plans


def _ffn_plans(spec: TinyModelSpec, i: int) -> list[_TensorPlan]:
    h, b = spec.hidden, f"blk.{i}."
    if not spec.is_moe or i < spec.leading_dense:
        ff = spec.effective_dense_ff
        return [
            _TensorPlan(b + "ffn_gate.weight", (ff, h), "random", h),
            _TensorPlan(b + "ffn_up.weight", (ff, h), "random", h),
            _TensorPlan(b + "ffn_down.weight", (h, ff), "random", ff),
        ]
    e, ff = spec.experts, spec.expert_ff
    plans = [
        _TensorPlan(b + "ffn_gate_inp.weight", (e, h), "random", h),
        _TensorPlan(b + "ffn_gate_exps.weight", (e, ff, h), "random", h),
        _TensorPlan(b + "ffn_up_exps.weight", (e, ff, h), "random", h),
        _TensorPlan(b + "ffn_down_exps.weight", (e, h, ff), "random", ff),
    ]
    shared = {"qwen2moe": spec.effective_shared_ff, "deepseek2": spec.shared_experts * ff}.get(spec.arch, 0)
    if shared:
        plans += [
            _TensorPlan(b + "ffn_gate_shexp.weight", (shared, h), "random", h),
            _TensorPlan(b + "ffn_up_shexp.weight", (shared, h), "random", h),
            _TensorPlan(b + "ffn_down_shexp.weight", (h, shared), "random", shared),
        ]
    if spec.arch == "qwen2moe":
        plans.append(_TensorPlan(b + "ffn_gate_inp_shexp.weight", (h,), "random", h))
    return plans


def tensor_plans(spec: TinyModelSpec) -> list[_TensorPlan]:
    """Every tensor of the model, in file order."""
    h, v = spec.hidden, spec.vocab
    plans = [
        _TensorPlan("token_embd.weight", (v, h), "random", 1),
        _TensorPlan("output_norm.weight", (h,), "ones"),
        _TensorPlan("output.weight", (v, h), "random", h, spec.output_scale, tuple(range(BYTE_TOKENS_START))),
    ]
    for i in range(spec.layers):
        plans.append(_TensorPlan(f"blk.{i}.attn_norm.weight", (h,), "ones"))
        plans += _attention_plans(spec, i)
        plans.append(_TensorPlan(f"blk.{i}.ffn_norm.weight", (h,), "ones"))
        plans += _ffn_plans(spec, i)
    return plans


def _unit_uniform(key: list[int], size: int) -> np.ndarray:
    """Counter-based stream: uniform on [-sqrt 3, sqrt 3] (mean 0, variance 1), float32."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence(key)))
    values = rng.random(size, dtype=np.float32)
    values *= np.float32(2 * _SQRT3)
    values -= np.float32(_SQRT3)
    return values


def _slices(plan: _TensorPlan, spec: TinyModelSpec) -> Iterator[np.ndarray]:
    """The tensor's values slice by slice along its leading axis (whole when 1-D or 2-D)."""
    dtype = _tensor_dtype(plan, spec)
    if plan.fill == "ones":
        yield np.ones(plan.shape, dtype)
        return
    name_key = zlib.crc32(plan.name.encode())
    per_slice = len(plan.shape) == 3
    count = plan.shape[0] if per_slice else 1
    inner = plan.shape[1:] if per_slice else plan.shape
    size = math.prod(inner)
    scale = np.float32(plan.scale / math.sqrt(plan.fan_in))
    for index in range(count):
        values = _unit_uniform([spec.seed, name_key, index, 0], size)
        if spec.noise:
            values += np.float32(spec.noise) * _unit_uniform([spec.noise_seed, name_key, index, 1], size)
        values *= scale
        values = values.reshape(inner)
        if plan.zero_rows:
            values[list(plan.zero_rows)] = 0.0
        yield values.astype(dtype, copy=False)


# ---- metadata -----------------------------------------------------------------------------


def _vocabulary(spec: TinyModelSpec) -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    pieces = _extra_pieces()[: spec.vocab - MIN_VOCAB]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # longer pieces score higher so the tokenizer prefers them
    scores = [0.0] * MIN_VOCAB + [-1000.0 + len(p) * 100.0 - i * 1e-3 for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


def _write_metadata(writer: object, spec: TinyModelSpec) -> None:
    import gguf

    w: gguf.GGUFWriter = writer  # type: ignore[assignment]
    arch = spec.arch
    w.add_name(spec.model_name)
    w.add_description("random weights written by moesim trace tiny-model")
    w.add_string(SPEC_KEY, json.dumps(dataclasses.asdict(spec), sort_keys=True))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.weight_type == "F16" else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else spec.kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if spec.is_moe:
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.top_k)
    if arch in ("llama", "olmoe"):
        w.add_feed_forward_length(spec.expert_ff if spec.is_moe else spec.effective_dense_ff)
    else:
        w.add_expert_feed_forward_length(spec.expert_ff)
        w.add_feed_forward_length(spec.effective_dense_ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(spec.effective_shared_ff)
    if arch == "deepseek2":
        nope = spec.head_dim - spec.rope_dim
        w.add_leading_dense_block_count(spec.leading_dense)
        w.add_q_lora_rank(spec.q_lora_rank)
        w.add_kv_lora_rank(spec.kv_lora_rank)
        w.add_key_length(spec.kv_lora_rank + spec.rope_dim)
        w.add_value_length(spec.kv_lora_rank)
        w.add_key_length_mla(nope + spec.rope_dim)
        w.add_value_length_mla(spec.head_dim)
        w.add_rope_dimension_count(spec.rope_dim)
        w.add_expert_shared_count(spec.shared_experts)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    tokens, scores, types = _vocabulary(spec)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


# ---- writing ------------------------------------------------------------------------------


def model_bytes(spec: TinyModelSpec) -> int:
    """Bytes of all tensor data (the file is this plus metadata and alignment)."""
    return sum(math.prod(p.shape) * _tensor_dtype(p, spec).itemsize for p in tensor_plans(spec))


def expert_weight_bytes(spec: TinyModelSpec) -> int:
    """Bytes of the routed experts' weights over all MoE layers."""
    return sum(math.prod(p.shape) * _tensor_dtype(p, spec).itemsize for p in tensor_plans(spec) if p.name.endswith("_exps.weight"))


def build_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write `spec` as a GGUF file at `path` (atomically, streaming one slice at a time)."""
    import gguf

    path = Path(path)
    plans = tensor_plans(spec)
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(tmp, spec.arch)
        _write_metadata(writer, spec)
        for plan in plans:
            dtype = _tensor_dtype(plan, spec)
            writer.add_tensor_info(plan.name, plan.shape, dtype, math.prod(plan.shape) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for plan in plans:
            written = 0
            for values in _slices(plan, spec):
                values.tofile(fout)
                written += values.nbytes
            writer.write_padding(fout, written)
        writer.close()
    return path


def build_draft_model(target_spec: TinyModelSpec, noise: float, path: str | Path) -> Path:
    """Write a noisy copy of `target_spec`: same base weights plus noise × an independent draw."""
    return build_tiny_model(path, dataclasses.replace(target_spec, noise=float(noise), name=""))
