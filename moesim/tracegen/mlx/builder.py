"""Tiny random MLX model folders that mlx_lm loads, runs and routes (`trace tiny-model --format mlx`).

The GGUF builder's `TinyModelSpec` (arch `qwen3moe` → mlx_lm `qwen3_moe`, `llama` with experts →
`mixtral`) becomes a folder of `config.json` (the spec kept under `moesim_tiny_model_spec`, so a
noisy copy can be made from the folder), `model.safetensors` (float32: MLX's CPU `gather_mm` runs
float32 only) and a byte-level tokenizer (`tokenizer.json`, `tokenizer_config.json`). The tensors
are the ones mlx_lm's own model class declares for that config; each is drawn from the GGUF
builder's counter-based stream keyed by (seed, tensor name, slice): uniform with unit variance,
scaled by 1/sqrt(fan-in), norms ones, the output layer scaled by `output_scale` with a zero row
for the end-of-text token and for ids the tokenizer has no text for (greedy decoding runs to its
token budget). A noisy copy (a draft) adds `noise` × an independent draw before scaling, as the
GGUF builder's `build_draft_model` does.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from moesim.atomic import output_dir
from moesim.errors import InputError
from moesim.fields import option_name
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, _unit_uniform
from moesim.tracegen.mlx.runtime import import_mlx, read_config

MODEL_TYPES = {"qwen3moe": "qwen3_moe", "llama": "mixtral"}  # TinyModelSpec arch -> mlx_lm model_type (llama dense: llama)
SPEC_KEY = "moesim_tiny_model_spec"
EOS = "<|endoftext|>"
TOKENIZER_TOKENS = 257  # 256 byte tokens, then EOS


def mlx_model_name(spec: TinyModelSpec) -> str:
    """The model's name: the spec's, marked as MLX ('tiny-mlx-...')."""
    return spec.model_name.replace("tiny-", "tiny-mlx-", 1)


def mlx_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The mlx_lm config.json of a tiny model spec."""
    if spec.arch not in MODEL_TYPES:
        raise InputError(f"--format mlx: field 'arch' = {spec.arch!r}: MLX tiny models are {' or '.join(MODEL_TYPES)}")
    if spec.vocab < TOKENIZER_TOKENS:
        raise InputError(f"--format mlx: field 'vocab' = {spec.vocab}: must be >= {TOKENIZER_TOKENS} (256 bytes and EOS)")
    common = {
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_experts_per_tok": spec.top_k,
        "vocab_size": spec.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": TOKENIZER_TOKENS - 1,
        "moesim_name": mlx_model_name(spec),
        SPEC_KEY: dataclasses.asdict(spec),
    }
    if spec.arch == "llama" and not spec.is_moe:  # a dense llama (the microbenchmark's dense twins)
        return {"model_type": "llama", "intermediate_size": spec.effective_dense_ff, "head_dim": spec.head_dim, **common}
    if spec.arch == "llama":
        return {"model_type": "mixtral", "num_local_experts": spec.experts, "intermediate_size": spec.expert_ff, **common}
    return {
        "model_type": "qwen3_moe",
        "num_experts": spec.experts,
        "moe_intermediate_size": spec.expert_ff,
        "intermediate_size": spec.effective_dense_ff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.context_length,
        "norm_topk_prob": True,
        **common,
    }


def tiny_mlx_model(spec: TinyModelSpec) -> tuple[Any, dict[str, Any]]:
    """mlx_lm's model of the spec in memory, with the spec's weights: (model, config)."""
    mx, _ = import_mlx()
    from mlx.utils import tree_flatten

    config = mlx_config(spec)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights([(name, mx.array(_values(name, tuple(v.shape), spec))) for name, v in tree_flatten(model.parameters())])
    mx.eval(model.parameters())
    return model, config


def _values(name: str, shape: tuple[int, ...], spec: TinyModelSpec) -> np.ndarray:
    """One tensor (module docstring): norms ones, matrices from the keyed streams, the output scaled."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    key = zlib.crc32(name.encode())
    slices = shape[0] if len(shape) == 3 else 1
    inner = shape[1:] if len(shape) == 3 else shape
    output = name == "lm_head.weight"
    scale = np.float32((spec.output_scale if output else 1.0) / math.sqrt(shape[-1]))
    parts = []
    for index in range(slices):
        values = _unit_uniform([spec.seed, key, index, 0], math.prod(inner))
        if spec.noise:
            values += np.float32(spec.noise) * _unit_uniform([spec.noise_seed, key, index, 1], values.size)
        parts.append((values * scale).reshape(inner))
    out = np.stack(parts) if len(shape) == 3 else parts[0]
    if output:
        out[TOKENIZER_TOKENS - 1 :] = 0.0
    return out


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: one token per byte, then EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(_BYTE_OF) | {EOS: TOKENIZER_TOKENS - 1}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(str(folder))


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _bytes_to_unicode()


def build_mlx_model(folder: str | Path, spec: TinyModelSpec, force: bool = False) -> Path:
    """Write `spec` as an MLX model folder (files renamed into place only when all are written)."""
    mx, _ = import_mlx()
    from mlx.utils import tree_flatten

    model, config = tiny_mlx_model(spec)
    tensors = dict(tree_flatten(model.parameters()))
    folder = Path(folder)
    with output_dir(folder, force) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), tensors, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        _write_tokenizer(staging)
    return folder


def read_mlx_spec(folder: str | Path) -> TinyModelSpec:
    """The spec of a moesim-built MLX model folder."""
    folder = Path(folder)
    config = read_config(folder)
    if not isinstance(config.get(SPEC_KEY), dict):
        raise InputError(f"{folder / 'config.json'}: field '{SPEC_KEY}' is missing: not a model written by `moesim trace tiny-model`")
    try:
        return TinyModelSpec(**config[SPEC_KEY])
    except TypeError as exc:
        raise InputError(f"{folder / 'config.json'}: field '{SPEC_KEY}': {exc}") from None


def write_tiny_mlx_model(out: Path, shape: dict[str, Any], draft_of: Path | None = None, noise: float | None = None) -> TinyModelSpec:
    """`trace tiny-model --format mlx`: a random MLX model of `shape` (TinyModelSpec fields but the
    weight format), or, with `draft_of`, a noisy copy of that moesim-built MLX folder; returns the spec."""
    if draft_of is not None:
        if shape:
            raise InputError(f"--draft-of takes the shape from {draft_of}; drop {option_name(TinyModelSpec, sorted(shape)[0])}")
        if noise is None:
            raise InputError("--draft-of needs --noise (0 gives an identical copy)")
        spec = dataclasses.replace(read_mlx_spec(draft_of), noise=float(noise), name="")
    elif noise is not None:
        raise InputError("--noise needs --draft-of TARGET")
    else:
        spec = TinyModelSpec(**shape)
    build_mlx_model(out, spec)
    return spec


def mlx_folder_bytes(folder: Path) -> int:
    """Bytes of the folder's weight files."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
