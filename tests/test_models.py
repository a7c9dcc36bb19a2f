"""Model presets: published totals, byte accounting, user presets and their errors."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from moesim.errors import ConfigError, InputError
from moesim.models import builtin_names, bytes_per_weight, draft_for, load_preset, load_target

# Published totals (billions) from the issue's table and the models' own cards.
PUBLISHED = {
    "deepseek-v2-lite": 15.7,
    "deepseekmoe-16b": 16.4,
    "qwen1.5-moe-a2.7b": 14.3,
    "qwen2-57b-a14b": 57.4,
    "qwen3-30b-a3b": 30.5,
    "mixtral-8x7b": 46.7,
    "phi-3.5-moe": 41.9,
    "olmoe-1b-7b": 6.9,
    "gpt-oss-20b": 20.9,
    "deepseek-v3": 671.0,
    "qwen2-0.5b": 0.494,
    "qwen3-0.6b": 0.596,
    "glm-4.5-air": 106.0,
    "opt-30b": 30.0,
    "opt-350m": 0.331,
    "llama-2-7b": 6.74,
    "vicuna-7b": 6.74,
    "llama-3.1-8b": 8.03,
    "llama-3.3-70b": 70.6,
    "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21,
    "codellama-34b": 33.7,
    "qwen2.5-0.5b": 0.494,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-32b": 32.5,
    "qwen2.5-72b": 72.7,
    "qwen3-8b": 8.19,
}
# Presets without a published total found first-hand: the figure in the model's name.
NAMED = {
    "gemma-4-26b-a4b": (26.0, 3.8),
    "granite-3.1-3b-a800m": (3.3, 0.8),
    "glm-4.7-flash": (30.0, 3.0),
    "qwen3.5-35b-a3b": (35.0, 3.0),
    "qwen3-next-80b-a3b": (80.0, 3.0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_params_match_published_within_2_percent(name: str) -> None:
    preset = load_preset(name)
    assert preset.total_params() / 1e9 == pytest.approx(PUBLISHED[name], rel=0.02)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_total_and_active_params_match_the_name_within_5_percent(name: str) -> None:
    preset = load_preset(name)
    total, active = NAMED[name]
    assert preset.published_total_params_b == 0.0
    assert preset.total_params() / 1e9 == pytest.approx(total, rel=0.05)
    assert preset.active_params() / 1e9 == pytest.approx(active, rel=0.35)  # "A3B" is rounded to a billion


def test_every_builtin_preset_is_checked() -> None:
    assert set(builtin_names("moe")) | set(builtin_names("dense")) == set(PUBLISHED) | set(NAMED)


def test_alternate_attention_layers_by_hand() -> None:
    gemma = load_preset("gemma-4-26b-a4b")
    h = 2816
    sliding = h * 16 * 256 + 2 * h * 8 * 256 + 16 * 256 * h + 2 * 256  # q, k, v, o, q/k norms
    full = h * 16 * 512 + h * 2 * 512 + 16 * 512 * h + 2 * 512  # keys double as values: no v
    assert gemma.attention_params(0) == sliding and gemma.attention_params(5) == full
    assert gemma.kv_cache_bytes_per_token() == 25 * 2 * 8 * 256 * 2 + 5 * 2 * 512 * 2
    qwen = load_preset("qwen3.5-35b-a3b")
    linear = 2048 * (2 * 16 * 128 + 2 * 32 * 128 + 2 * 32) + 32 * 128 * 2048 + 4 * (2 * 16 * 128 + 32 * 128) + 2 * 32 + 128
    gated = 2048 * 16 * 256 * 2 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048 + 2 * 256
    assert qwen.attention_params(0) == linear and qwen.attention_params(3) == gated
    assert qwen.kv_cache_bytes_per_token() == 10 * 2 * 2 * 256 * 2  # only the 10 full-attention layers cache keys and values


@pytest.mark.parametrize(
    ("name", "layers", "dense", "hidden", "experts", "top_k", "intermediate"),
    [
        ("deepseek-v2-lite", 27, 1, 2048, 64, 6, 1408),
        ("deepseekmoe-16b", 28, 1, 2048, 64, 6, 1408),
        ("qwen1.5-moe-a2.7b", 24, 0, 2048, 60, 4, 1408),
        ("qwen2-57b-a14b", 28, 0, 3584, 64, 8, 2560),
        ("qwen3-30b-a3b", 48, 0, 2048, 128, 8, 768),
        ("mixtral-8x7b", 32, 0, 4096, 8, 2, 14336),
        ("phi-3.5-moe", 32, 0, 4096, 16, 2, 6400),
        ("olmoe-1b-7b", 16, 0, 2048, 64, 8, 1024),
        ("gpt-oss-20b", 24, 0, 2880, 32, 4, 2880),
        ("deepseek-v3", 61, 3, 7168, 256, 8, 2048),
    ],
)
def test_geometry_matches_issue_table(name: str, layers: int, dense: int, hidden: int, experts: int, top_k: int, intermediate: int) -> None:
    p = load_preset(name)
    assert (p.layers, len(p.dense_layers), p.hidden, p.experts, p.top_k, p.expert_intermediate) == (
        layers, dense, hidden, experts, top_k, intermediate,
    )  # fmt: skip
    assert p.moe_layers == tuple(range(dense, layers))


def test_bytes_per_weight_real_block_sizes() -> None:
    assert bytes_per_weight("Q4_K") == Fraction(144, 256)
    assert bytes_per_weight("q8_0") == Fraction(34, 32)
    assert bytes_per_weight("MXFP4") == Fraction(17, 32)
    assert bytes_per_weight("Q6_K") == Fraction(210, 256)
    with pytest.raises(InputError, match="unknown weight format 'Q3'"):
        bytes_per_weight("Q3")


def test_byte_accounting_is_consistent() -> None:
    p = load_preset("deepseek-v2-lite")
    # one expert: 3 SwiGLU matrices of hidden x intermediate, 2 bytes each in BF16
    assert p.expert_bytes("BF16") == 3 * 2048 * 1408 * 2
    assert p.routed_expert_bytes_per_layer("Q4_K") == pytest.approx(64 * 3 * 2048 * 1408 * 144 / 256)
    # a batch-1 step reads the non-expert weights plus K experts per MoE layer = active params
    # minus the embedding table (all but one row)
    active_bytes = p.non_expert_bytes_per_token("BF16") + len(p.moe_layers) * p.top_k * p.expert_bytes("BF16")
    assert active_bytes == pytest.approx(2 * (p.active_params() - (p.vocab - 1) * p.hidden))
    assert p.active_params() < p.total_params()


def test_draft_presets() -> None:
    target = load_preset("mixtral-8x7b")
    assert load_preset("qwen3-0.6b").kind == "dense"
    head = draft_for("eagle-head", target)
    assert head.kind == "dense" and head.layers == 1 and head.hidden == target.hidden
    # one decoder layer is a small fraction of the target
    assert head.total_params() < 0.02 * target.total_params()
    with pytest.raises(InputError, match="not a dense model"):
        draft_for("olmoe-1b-7b", target)
    with pytest.raises(InputError, match="draft head") as error:
        load_preset("eagle-head")
    assert "draft_for" not in str(error.value)  # the user's words, not a function's name


def test_a_target_is_a_moe_preset_and_a_wrong_one_lists_them(tmp_path: Path) -> None:
    assert [load_target(name).name for name in builtin_names("moe")] == builtin_names("moe")
    moe = ", ".join(builtin_names("moe"))
    for name in ("qwen2-0.5b", "eagle-head"):
        with pytest.raises(InputError, match=f"'{name}' is a draft model, not a MoE target") as error:
            load_target(name)
        assert moe in str(error.value)
    with pytest.raises(InputError) as error:
        load_target("nope")
    assert str(error.value).startswith(f"unknown MoE model preset 'nope' (built-in: {moe}; or a preset .toml")
    dense = tmp_path / "small.toml"
    dense.write_text(
        'kind = "dense"\nlayers = 2\nhidden = 64\nvocab = 300\ndense_intermediate = 128\n'
        '[attention]\nkind = "mha"\nheads = 4\nkv_heads = 4\nhead_dim = 16\n'
    )
    with pytest.raises(InputError, match=r"small\.toml: model 'small' has no routed experts"):
        load_target(dense)


def test_preset_from_hf_config_equals_builtin(tmp_path: Path) -> None:
    # Field names and values as in mistralai/Mixtral-8x7B-v0.1's config.json
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "tie_word_embeddings": False, "rms_norm_eps": 1e-05,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    from_hf = load_preset(path)
    assert from_hf.total_params() == load_preset("mixtral-8x7b").total_params()
    assert from_hf.moe_layers == tuple(range(32))


def test_preset_from_deepseek_hf_config(tmp_path: Path) -> None:
    # Field names as in deepseek-ai/DeepSeek-V2-Lite's config.json
    config = {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400, "tie_word_embeddings": False,
    }  # fmt: skip
    path = tmp_path / "v2lite.json"
    path.write_text(json.dumps(config))
    assert load_preset(path).total_params() == load_preset("deepseek-v2-lite").total_params()


def test_preset_from_opt_hf_config(tmp_path: Path) -> None:
    # Field names as in facebook/opt-350m's config.json (a 512-wide embedding projected to 1024)
    config = {
        "model_type": "opt", "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "vocab_size": 50272, "word_embed_proj_dim": 512,
        "max_position_embeddings": 2048, "enable_bias": True, "activation_function": "relu",
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    from_hf = load_preset(path)
    assert from_hf.total_params() == load_preset("opt-350m").total_params()
    # by hand: tied 50272 x 512 table, two 1024 x 512 projections, 24 layers of MHA with biases,
    # two LayerNorm-sized vectors and a ReLU FFN of two 1024 x 4096 matrices
    layer = 4 * 1024 * 1024 + 4 * 1024 + 2 * 1024 + 2 * 1024 * 4096
    assert from_hf.total_params() == 50272 * 512 + 2 * 1024 * 512 + 24 * layer + 1024


def test_user_toml_preset_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "mine.toml"
    good.write_text(
        'kind = "moe"\nlayers = 4\nhidden = 64\nvocab = 300\nexperts = 8\ntop_k = 2\nexpert_intermediate = 32\n'
        '[attention]\nkind = "gqa"\nheads = 4\nkv_heads = 2\nhead_dim = 16\n'
    )
    preset = load_preset(good)
    assert preset.name == "mine" and preset.moe_layers == (0, 1, 2, 3)
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("top_k = 2", "top_k = 9"))
    with pytest.raises(ConfigError, match="key 'top_k': must be <= experts \\(8\\), got 9"):
        load_preset(bad)
    bad.write_text(good.read_text().replace("hidden = 64", "hidden = -1"))
    with pytest.raises(ConfigError, match=r"key 'hidden': must be in 1\.\.1048576, got -1"):
        load_preset(bad)
    with pytest.raises(InputError, match="unknown model preset 'nope'"):
        load_preset("nope")
