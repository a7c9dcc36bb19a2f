"""The tiny GGUF builder: files llama.cpp loads, deterministic bytes, noisy drafts, geometry from metadata."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from moesim.errors import ConfigError, InputError
from moesim.tracegen.llamacpp.gguf_builder import (
    ARCHITECTURES,
    MIN_VOCAB,
    TinyModelSpec,
    build_draft_model,
    build_tiny_model,
    expert_weight_bytes,
    model_bytes,
)
from moesim.tracegen.llamacpp.gguf_reader import read_gguf_geometry, read_gguf_info, read_tiny_spec

SPECS = {
    "qwen3moe": TinyModelSpec(),
    "llama": TinyModelSpec(arch="llama", experts=4, top_k=2, weight_type="F16"),
    "qwen2moe": TinyModelSpec(arch="qwen2moe", experts=6, top_k=3, shared_ff=24),
    "olmoe": TinyModelSpec(arch="olmoe", kv_heads=4, experts=8, top_k=4),
    "deepseek2": TinyModelSpec(arch="deepseek2", layers=3, leading_dense=1, shared_experts=2),
}


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_loads_and_routes_in_llama_cpp(arch: str, tmp_path: Path) -> None:
    import llama_cpp

    spec = SPECS[arch]
    path = build_tiny_model(tmp_path / f"{arch}.gguf", spec)
    geometry = read_gguf_geometry(path)
    dense = spec.leading_dense
    assert geometry.layers == spec.layers and geometry.moe_layers == tuple(range(dense, spec.layers))
    assert (geometry.experts, geometry.top_k, geometry.hidden) == (spec.experts, spec.top_k, spec.hidden)
    assert geometry.expert_intermediate == spec.expert_ff and geometry.weight_format == spec.weight_type
    assert geometry.expert_bytes == 3 * spec.hidden * spec.expert_ff * (2 if spec.weight_type == "F16" else 4)
    if arch == "qwen2moe":
        assert geometry.shared_intermediate == 24 and geometry.shared_experts == 0
    if arch == "deepseek2":
        assert geometry.shared_experts == 2
    assert path.stat().st_size == pytest.approx(model_bytes(spec), rel=0.2)
    llm = llama_cpp.Llama(str(path), n_ctx=128, verbose=False, logits_all=True)  # scores of every token, not only the last
    tokens = llm.tokenize(b"moe routing")
    assert tokens[0] == 1 and len(tokens) > 3  # BOS, then pieces / byte fallback
    llm.eval(tokens)
    assert np.isfinite(llm.scores[: llm.n_tokens]).all()


def test_same_spec_same_bytes_and_seed_matters(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=2)
    a = build_tiny_model(tmp_path / "a.gguf", spec)
    b = build_tiny_model(tmp_path / "b.gguf", spec)
    c = build_tiny_model(tmp_path / "c.gguf", dataclasses.replace(spec, seed=1))
    assert _sha(a) == _sha(b)
    ta, tc = _tensors(a), _tensors(c)
    assert not np.array_equal(ta["blk.0.ffn_up_exps.weight"], tc["blk.0.ffn_up_exps.weight"])


def test_weights_have_the_documented_distribution(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=1, experts=16, hidden=64, heads=4, expert_ff=64)
    tensors = _tensors(build_tiny_model(tmp_path / "m.gguf", spec))
    up = tensors["blk.0.ffn_up_exps.weight"]
    assert up.shape == (16, 64, 64)  # numpy shape: reverse of ggml {hidden, ff, experts}
    # uniform with variance 1/fan_in: bounded by sqrt(3/fan_in), variance within 3% over 65536 draws
    assert np.abs(up).max() <= math.sqrt(3 / 64) + 1e-6
    assert up.var() == pytest.approx(1 / 64, rel=0.03) and abs(up.mean()) < 0.003
    output = tensors["output.weight"]
    assert np.all(output[:3] == 0)  # control tokens never win greedy decoding
    assert output[3:].std() == pytest.approx(spec.output_scale / math.sqrt(64), rel=0.05)
    assert np.all(tensors["blk.0.ffn_norm.weight"] == 1.0)


def test_noisy_draft_adds_noise_of_the_given_size(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=2, hidden=64, expert_ff=64)
    target = _tensors(build_tiny_model(tmp_path / "t.gguf", spec))
    same = _tensors(build_draft_model(spec, 0.0, tmp_path / "d0.gguf"))
    noisy = _tensors(build_draft_model(spec, 0.25, tmp_path / "d1.gguf"))
    for name in target:
        assert np.array_equal(target[name], same[name]), name
    diff = (noisy["blk.1.ffn_gate_exps.weight"] - target["blk.1.ffn_gate_exps.weight"]) * math.sqrt(64)
    assert diff.std() == pytest.approx(0.25, rel=0.03)
    assert read_tiny_spec(tmp_path / "d1.gguf") == dataclasses.replace(spec, noise=0.25)


def test_large_models_stream_with_bounded_memory(tmp_path: Path) -> None:
    # 25 MB of experts written slice by slice; the size formula is exact for the tensor data
    spec = TinyModelSpec(layers=2, experts=32, hidden=256, expert_ff=512, heads=8, weight_type="F16")
    path = build_tiny_model(tmp_path / "big.gguf", spec)
    assert expert_weight_bytes(spec) == 2 * 3 * 32 * 256 * 512 * 2
    assert model_bytes(spec) <= path.stat().st_size <= model_bytes(spec) + 64 * 1024
    info = read_gguf_info(path)
    assert info.expert_types == ("F16",) and info.geometry.expert_bytes == 3 * 256 * 512 * 2


def test_bad_specs_are_rejected_with_one_line() -> None:
    cases = [
        ({"arch": "gpt2"}, "arch"),
        ({"top_k": 9}, "top_k"),
        ({"arch": "olmoe", "kv_heads": 2}, "kv_heads"),
        ({"vocab": MIN_VOCAB - 1}, "vocab"),
        ({"experts": 0}, "experts"),
        ({"weight_type": "Q4_K"}, "weight_type"),
        ({"noise": -1.0}, "noise"),
    ]
    for fields, name in cases:
        with pytest.raises(ConfigError, match=f"field '{name}'"):
            TinyModelSpec(**fields)


def test_geometry_rejects_dense_missing_and_garbage_files(tmp_path: Path) -> None:
    dense = build_tiny_model(tmp_path / "dense.gguf", TinyModelSpec(arch="llama", experts=0))
    with pytest.raises(InputError, match="no routed experts"):
        read_gguf_geometry(dense)
    with pytest.raises(InputError, match="no such GGUF file"):
        read_gguf_geometry(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InputError, match="not a readable GGUF file"):
        read_gguf_geometry(junk)
    assert read_tiny_spec(dense).experts == 0
