"""llama.cpp Vulkan's matmul_id as its source runs it: each used expert's tokens in whole tiles of
BN columns, BN picked from the pass's token count (32, 64, else 128), the whole tiles first in the
fit's term order (`Kernel.tiles_first`), and the profile key that says so."""

from __future__ import annotations

import re
import tomllib

import numpy as np
import pytest

from moesim.errors import ConfigError
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.engines.kernels import Kernel
from moesim.hw_profiles.engines.llamacpp import LlamaCppVulkan
from moesim.hw_profiles.fitting.engine_builtins import fit_recipe, profile_frame, recipe_rows
from moesim.hw_profiles.fitting.engine_fit import fit_engine
from moesim.hw_profiles.fitting.engine_validation import all_recipes
from moesim.hw_profiles.schema import profile_from_dict, profile_to_toml


def _pipeline_columns(n_tokens: int) -> int:
    """ggml_vk_guess_matmul_id_pipeline without coopmat2, every pipeline available, m > 64 rows:
    small if n <= 32, medium if n <= 64, else large; their wg_denoms[1] are 32, 64 and 128."""
    if n_tokens <= 32:
        return 32
    if n_tokens <= 64:
        return 64
    return 128


def test_the_tile_is_the_pipeline_the_source_picks_from_the_pass_tokens() -> None:
    structure = ENGINES.create("llama.cpp Vulkan").kernel("dedup_matmul_id").structure
    n = np.arange(1, 5000)
    assert np.array_equal(structure.tile_width(n), [_pipeline_columns(int(k)) for k in n])
    cuda = ENGINES.create("llama.cpp CUDA").kernel("dedup_mmq").structure  # MMQ: multiples of 8 up to 128, as before
    assert np.array_equal(cuda.tile_width(n), np.minimum(128, 8 * np.ceil(n / 8)))


def _leave_one_model_out(engine: LlamaCppVulkan, name: str) -> np.ndarray:
    item = next(i for i in all_recipes() if i.name == name)
    fit = fit_engine(recipe_rows(item), engine, profile_frame(item))
    assert fit.split == "leave_one_shape_out"
    return np.abs(fit.heldout_us / np.array([r.time_us for r in fit.rows]) - 1.0)


class _UsefulFlopsFirst(LlamaCppVulkan):
    """The same engine with matmul_id's useful FLOPs before its whole tiles (the order before)."""

    kernels = tuple(
        Kernel(k.family, k.tokens_per_read, k.description, k.per_expert, k.tile_tokens, k.tile_step, k.tile_doubling)
        for k in LlamaCppVulkan.kernels
    )


def test_whole_tiles_price_a_model_the_fit_never_saw_on_one_pass_size() -> None:
    """The Radeon Pro VII's four rows, two models at n = 512 only: Qwen3-30B (128 experts, 32 tokens
    each) fills a quarter of its 128-column tiles, gpt-oss-20b (32 experts, 64 each) half. Priced by
    their whole tiles, each model predicts the other; by their useful FLOPs they miss both ways."""
    tiles = _leave_one_model_out(LlamaCppVulkan(), "amd-radeon-pro-vii-vulkan")
    useful = _leave_one_model_out(_UsefulFlopsFirst(), "amd-radeon-pro-vii-vulkan")
    assert np.median(tiles) < 0.05 and tiles.max() < 0.10
    assert np.median(useful) > 0.30


def test_the_shipped_vulkan_profile_prices_its_tiles() -> None:
    family = load_profile("amd-rx-7900-xtx-vulkan").expert_family("dedup_matmul_id")
    assert family.structure.tile_doubling and family.structure.tile_tokens == 128 and family.structure.tile_step == 32
    assert np.isfinite(family.tile_tflops)
    fitted = fit_recipe(next(i for i in all_recipes() if i.name == "amd-rx-7900-xtx-vulkan")).profile.expert_family("dedup_matmul_id")
    assert fitted.tile_tflops == pytest.approx(family.tile_tflops, rel=1e-9)


def test_the_key_round_trips_and_a_bad_value_is_one_line() -> None:
    text = profile_to_toml(load_profile("amd-rx-7900-xtx-vulkan"))
    assert "tile_doubling = true" in text
    again = profile_from_dict(tomllib.loads(text), "vk.toml")
    assert again.expert_family("dedup_matmul_id").structure.tile_doubling and profile_to_toml(again) == text
    for bad, fragment in (
        (re.sub(r"^tile_doubling = true$", 'tile_doubling = "yes"', text, count=1, flags=re.M), "got 'yes'"),
        (re.sub(r"^tile_step = 32$", "tile_step = 0", text, count=1, flags=re.M), "true only with a tile_step"),
    ):
        with pytest.raises(ConfigError, match=r"families\.dedup_matmul_id\.tile_doubling") as info:
            profile_from_dict(tomllib.loads(bad), "bad.toml")
        assert fragment in str(info.value) and "\n" not in str(info.value)
