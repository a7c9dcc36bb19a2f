"""How benchmark tables name models and weight formats, resolved to moesim's presets and formats.

llama.cpp prints a model as `llama_model_desc` (`qwen3moe 30B.A3B Q4_K - Medium`, `deepseek2 16B
Q4_0`), PR tables paste it by hand (`gemma4 26B.A4B Q4_K_M`), kernel benchmarks give the expert
shape (`E=128, N=704, K=2816, top_k=8`). A file recipe such as Q4_K_M is not one tensor type: its
experts are taken as Q4_K throughout (llama.cpp's recipe keeps some ffn_down tensors at Q6_K, up
to ≈ 8 % more expert bytes, absorbed by the fitted bandwidth) and so are the other weights.
gpt-oss's `MXFP4 MoE` files hold the experts in MXFP4 and the other weights at 8 bits (assumed
Q8_0, consistent with the published file size).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moesim.errors import InputError
from moesim.models import WEIGHT_FORMATS, builtin_names

# Model descriptions (case-insensitive regular expressions) -> built-in preset.
MODEL_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"deepseek[- ]?2 16b|deepseek-coder-v2-lite|deepseek-v2-lite", "deepseek-v2-lite"),
    (r"deepseek2 671b|deepseek-(?:r1|v3)", "deepseek-v3"),
    (r"qwen3-omni-30b-a3b|qwen3moe 30b|qwen3-30b-a3b", "qwen3-30b-a3b"),
    (r"gpt-oss[- ]20b", "gpt-oss-20b"),
    (r"gemma-?4 26b", "gemma-4-26b-a4b"),
    (r"granitemoe 3b|granite-3\.[01]-3b-a800m", "granite-3.1-3b-a800m"),
    (r"glm[- ]4\.7[- ]flash", "glm-4.7-flash"),
    (r"glm4moe 106b|glm-4\.5-air", "glm-4.5-air"),
    (r"qwen35moe 35b|qwen3\.[56][- ]35b-a3b", "qwen3.5-35b-a3b"),
    (r"qwen3-next-80b", "qwen3-next-80b-a3b"),
    (r"mixtral", "mixtral-8x7b"),
)

# Quantisation names as printed or pasted -> (expert format, format of the other weights).
_RECIPES: dict[str, tuple[str, str]] = {
    "q4_k_m": ("Q4_K", "Q4_K"),
    "q4_k - medium": ("Q4_K", "Q4_K"),
    "q2_k_m": ("Q2_K", "Q2_K"),
    "q2_k - medium": ("Q2_K", "Q2_K"),
    "q3_k_s": ("Q3_K", "Q3_K"),
    "q3_k - small": ("Q3_K", "Q3_K"),
    "mxfp4 moe": ("MXFP4", "Q8_0"),
    "4-bit affine g64": ("AFFINE4", "AFFINE4"),
    "affine 4-bit g64": ("AFFINE4", "AFFINE4"),
    "4bit": ("AFFINE4", "AFFINE4"),
    "oq6 (6-bit affine)": ("AFFINE6", "AFFINE6"),
    "8-bit": ("AFFINE8", "AFFINE8"),
}


@dataclass(frozen=True)
class ExpertGeometry:
    """An expert shape named by a kernel benchmark (no preset needed)."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int


def resolve_model(text: str, where: str) -> str:
    """The built-in preset a model description names; one line when none does."""
    if text in builtin_names("moe"):
        return text
    for pattern, preset in MODEL_PATTERNS:
        if re.search(pattern, text, re.IGNORECASE):
            return preset
    raise InputError(f"{where}: unknown model {text!r}: no preset matches it (give --model PRESET, a name, .toml or config.json)")


def resolve_formats(text: str, where: str) -> tuple[str, str]:
    """(expert format, other weights' format) of a quantisation name; one line when unknown."""
    key = text.strip().lower()
    if key in _RECIPES:
        return _RECIPES[key]
    for suffix in (" - medium", "_m", " moe"):
        key = key.removesuffix(suffix)
    if key.upper() in WEIGHT_FORMATS:
        return key.upper(), key.upper()
    known = ", ".join([*WEIGHT_FORMATS, *sorted(_RECIPES)])
    raise InputError(f"{where}: unknown weight format {text!r} (known: {known})")


def format_in_description(text: str) -> str | None:
    """The quantisation at the end of a llama.cpp model description, e.g. 'Q4_K - Medium'."""
    match = re.search(r"\b((?:I?Q\d\w*|MXFP4|[BF]F?16|F32)(?: - \w+| MoE)?)\s*$", text.strip(), re.IGNORECASE)
    return match.group(1) if match else None


_SHAPE_FIELDS = {
    "experts": (r"\bE=(\d+)", r"(\d+) experts"),
    "intermediate": (r"\bN=(\d+)", r"intermediate (\d+)", r"\bF=(\d+)"),
    "hidden": (r"\bK=(\d+)", r"hidden (\d+)", r"\bH=(\d+)"),
    "top_k": (r"top_?k[= ](\d+)", r"topk=(\d+)", r"top-(\d+)", r"\bA=(\d+)"),
}


def expert_geometry(text: str) -> ExpertGeometry | None:
    """The expert shape a kernel benchmark's description gives (E, N or intermediate, K or hidden,
    top-k), or None when it does not give all four."""
    values = {}
    for name, patterns in _SHAPE_FIELDS.items():
        for pattern in patterns:
            if match := re.search(pattern, text, re.IGNORECASE):
                values[name] = int(match.group(1))
                break
    return ExpertGeometry(**values) if len(values) == 4 else None
