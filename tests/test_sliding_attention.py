"""Attention through sliding windows: the keys and KV a pass's queries read, per layer, against a
count through a causal mask with the window's band (numpy, one row per query position), for decode
and prompt passes of the two presets with windowed layers; presets without windows as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.dispatch import Dispatch
from moesim.hw_profiles.fitting.whole_pass import KV_BYTES_PER_ELEMENT, PassRow
from moesim.hw_profiles.importers.rows import decode_scope, prompt_scope
from moesim.models import ModelPreset, builtin_names, load_preset, window_keys
from moesim.sim.cost.drafters import make_drafter
from moesim.sim.cost.pass_table import PrefillChunks
from moesim.sim.cost.steptime import TABLE_AFTER_PASSES, StepTimeModel
from moesim.sim.cost.trace_batch import TraceBatchCost
from moesim.tracegen.routing.synth import Sticky, synthesize

WINDOWED = ("gpt-oss-20b", "gemma-4-26b-a4b")


def masked_keys(first_query: int, queries: int, window: int) -> np.ndarray:
    """Keys each query attends over: query positions first_query .. + queries − 1 of one sequence,
    key j visible to query q where j <= q and (no window or j > q − W)."""
    q = np.arange(first_query, first_query + queries)[:, None]
    j = np.arange(first_query + queries)[None, :]
    visible = (j <= q) & ((window == 0) | (j > q - window))
    return visible.sum(axis=1)


def reference(preset: ModelPreset, first_query: int, queries: int, passes: int, sequences: int = 1) -> tuple[float, float]:
    """(KV bytes read, attention FLOPs) of one pass, mean over `passes`, by layer through the mask:
    each sequence reads its queries' mean keys' KV, each query attends over its own keys."""
    kv, flops = 0.0, 0.0
    for layer in range(preset.layers):
        shape = preset.attention_of(layer)
        keys = masked_keys(first_query, queries, shape.sliding_window)
        kv += shape.kv_cache_bytes_per_token(KV_BYTES_PER_ELEMENT) * sequences * keys.mean()
        flops += shape.flops_per_context_token() * sequences * keys.sum() / passes
    return kv, flops


def test_gpt_oss_alternates_windowed_and_full_layers_and_keeps_its_parameters() -> None:
    gpt = load_preset("gpt-oss-20b")
    assert [gpt.attention_of(i).sliding_window for i in range(4)] == [128, 0, 128, 0]
    assert all(gpt.attention_of(i).sinks for i in range(gpt.layers))
    assert gpt.total_params() / 1e9 == pytest.approx(20.91, abs=0.01)  # the published 20.9 B, as before the split
    gemma = load_preset("gemma-4-26b-a4b")
    assert sum(gemma.attention_of(i).sliding_window == 1024 for i in range(gemma.layers)) == 25
    others = [name for name in builtin_names("moe") + builtin_names("dense") if name not in WINDOWED]
    assert not any(load_preset(n).attention_of(i).sliding_window for n in others for i in range(load_preset(n).layers))


def test_hf_config_layer_types_put_full_attention_on_their_layers(tmp_path: Path) -> None:
    # Field names and values as in openai/gpt-oss-20b's config.json
    config = {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    from_hf, builtin = load_preset(path), load_preset("gpt-oss-20b")
    assert [from_hf.attention_of(i) for i in range(24)] == [builtin.attention_of(i) for i in range(24)]
    assert from_hf.total_params() == builtin.total_params()


@pytest.mark.parametrize("window", [1, 7, 128])
def test_window_keys_is_the_mean_of_the_masked_counts(window: int) -> None:
    for depth, queries in ((0, 1), (0, 300), (50, 100), (126, 5), (400, 64), (0, 128), (3, 129)):
        keys = masked_keys(depth, queries, window)
        assert window_keys(depth + (queries + 1) / 2, window, queries) == pytest.approx(keys.mean(), rel=1e-12)
        decode = masked_keys(depth + queries - 1, 1, window)[0]  # one query at context depth + queries
        assert window_keys(float(depth + queries), window) == decode
    assert window_keys(1000.5, 0, 17) == 1000.5


@pytest.mark.parametrize("name", WINDOWED)
@pytest.mark.parametrize(("tokens", "ubatch", "depth"), [(512, 512, 0), (2048, 512, 0), (512, 512, 4096), (64, 64, 1000)])
def test_prompt_passes_read_and_attend_as_the_mask_counts(name: str, tokens: int, ubatch: int, depth: int) -> None:
    preset = load_preset(name)
    scope = prompt_scope(tokens, ubatch, depth)
    row = _row(preset, scope.n_tokens, scope.passes, scope.context_tokens, scope.sequences)
    kv, flops = reference(preset, depth, scope.n_tokens * scope.passes, scope.passes)
    assert preset.kv_bytes_read(scope.context_tokens, 1.0, tokens, KV_BYTES_PER_ELEMENT) == pytest.approx(kv, rel=1e-12)
    assert row.dense_work()[2] == pytest.approx(flops, rel=1e-12)
    weights = _row(preset, 1, 1, 0.0, 1).dense_work()[0]  # no context: the weights alone
    assert row.dense_work()[0] - weights == pytest.approx(kv, rel=1e-12)


DECODES = [(128, 0, 1, 0), (128, 4096, 1, 0), (64, 0, 4, 1000), (2000, 0, 1, 0)]  # (tgN, depth, sequences, prompt)


@pytest.mark.parametrize("name", WINDOWED)
@pytest.mark.parametrize(("generated", "depth", "sequences", "prompt"), DECODES)
def test_decode_passes_read_and_attend_as_the_mask_counts(name: str, generated: int, depth: int, sequences: int, prompt: int) -> None:
    preset = load_preset(name)
    scope = decode_scope(generated, depth, sequences, prompt)
    row = _row(preset, scope.n_tokens, scope.passes, scope.context_tokens, scope.sequences)
    kv, flops = reference(preset, prompt + depth, generated, generated, sequences)  # a sequence's N queries, one a pass
    assert row.dense_work()[2] == pytest.approx(flops, rel=1e-12)
    assert preset.kv_bytes_read(scope.context_tokens, sequences, generated, KV_BYTES_PER_ELEMENT) == pytest.approx(kv, rel=1e-12)
    # one decode pass at context c: each layer's min(c, W) keys
    c = prompt + depth + generated
    one_kv, one_flops = reference(preset, c - 1, 1, 1, sequences)
    assert preset.kv_bytes_read(float(sequences * c), sequences, 1.0, KV_BYTES_PER_ELEMENT) == pytest.approx(one_kv, rel=1e-12)
    assert preset.attention_flops(sequences, float(sequences * c), sequences) == pytest.approx(one_flops, rel=1e-12)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v2-lite", "qwen3.5-35b-a3b", "opt-30b"])
def test_a_preset_without_windows_reads_and_attends_over_its_whole_context_as_before(name: str) -> None:
    preset = load_preset(name)
    attention = float(sum(preset.attention_of(i).flops_per_context_token() for i in range(preset.layers)))
    for tokens, context, sequences, span in ((1, 7.0, 1, 1.0), (512, 256.5, 1, 512.0), (16, 4 * 1003.5, 4, 128.0)):
        assert preset.kv_bytes_read(context, sequences, span) == context * preset.kv_cache_bytes_per_token()
        assert preset.attention_flops(tokens, context, sequences, span) == attention * tokens / sequences * context
    assert _row(preset, 512, 4, 1024.5, 1).dense_work()[2] == attention * 512 / 1 * 1024.5


@pytest.mark.parametrize("name", WINDOWED)
def test_the_compiled_pass_prices_windows_as_the_python_pass(name: str) -> None:
    preset = load_preset(name)
    trace = synthesize(preset, Sticky(keep_prob=0.3), 256, 4, 0)
    profile = load_profile("nvidia-rtx-3090-llamacpp")
    assert np.isfinite(profile.dense.attention_tflops)  # attention priced
    drafter = make_drafter("ngram", preset)
    costs = [TraceBatchCost(StepTimeModel(preset, profile, "dispatch"), trace, drafter, compiled=c) for c in (True, False)]
    rng = np.random.default_rng(1)
    for _ in range(TABLE_AFTER_PASSES + 4):
        seqs, starts = rng.integers(0, trace.n_seqs, 3), rng.integers(0, 200, 3)
        n_tokens = np.full(3, 3, np.int64)
        context = rng.integers(1, 3000, 3)
        assert costs[0].verify_us(seqs, starts, n_tokens, context) == costs[1].verify_us(seqs, starts, n_tokens, context)
        chunks = PrefillChunks(rng.integers(0, trace.n_seqs, 1), rng.integers(0, 100, 1), rng.integers(1, 50, 1))
        assert costs[0].mixed_us(seqs, starts, n_tokens, context, chunks) == costs[1].mixed_us(seqs, starts, n_tokens, context, chunks)
    # past every window only the full layers' keys grow: a pass at 8192 adds less over 4096 than without windows
    alt = preset.alt_attention and dataclasses.replace(preset.alt_attention, sliding_window=0)
    full = dataclasses.replace(preset, attention=dataclasses.replace(preset.attention, sliding_window=0), alt_attention=alt)
    growth = [m.dense_pass_us(1, 8192.0) - m.dense_pass_us(1, 4096.0) for m in (costs[1].model, StepTimeModel(full, profile, "dispatch"))]
    assert 0.0 < growth[0] < growth[1]


def _row(preset: ModelPreset, n_tokens: int, passes: int, context: float, sequences: int) -> PassRow:
    shape = preset.expert_shape("BF16")
    return PassRow("pass", n_tokens, 1.0, shape, preset.experts, preset.top_k, Dispatch((), ""), preset, "BF16", context,
                   sequences=sequences, passes=passes)  # fmt: skip
