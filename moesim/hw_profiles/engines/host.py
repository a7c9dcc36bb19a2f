"""What each serving engine spends beyond its kernels, as facts read in its source and docs (issue 24):
whether and up to which size it captures CUDA graphs, whether its verify pass runs in one, how it
scores drafts, which draft trees it builds. The fitted numbers (host time per forward, launches
per layer, the speculative path's terms) are `moesim.hw_profiles.speculative.SpecPath`; this
module says which engine a benchmark row ran (`engine_of`) and what its forwards look like.

    host = ENGINE_HOSTS["vllm-v1"]
    host.graph_max_tokens        # 512: wider forwards run eager and pay their launches
    engine_of("vLLM V1 (ROCm)", "0.23.1rc1")   # -> "vllm-v1"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moesim.hw_profiles.speculative import NO_GRAPH_LIMIT

SCORINGS = ("verify-pass", "batch-expansion")


@dataclass(frozen=True)
class EngineHost:
    """One engine (and version range): its forwards' graph capture and how it scores drafts (its
    trees, chains and draft heads are the drafters', `moesim.sim.cost.drafters`; the citation says which it builds)."""

    key: str
    name: str
    graph_max_tokens: int  # the widest forward it captures (0: none; every forward eager)
    verify_eager: bool  # verify passes run outside the graph
    scoring: str  # "verify-pass" (one forward over every draft), "batch-expansion" (vLLM V0: each draft a sequence)
    citation: str


ENGINE_HOSTS = {
    h.key: h
    for h in (
        EngineHost(
            "vllm-v0", "vLLM V0", 256, False, "batch-expansion",
            "vllm/worker/model_runner.py (V0): _BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + range(8, 257, 8); spec_decode/"
            "batch_expansion.py: BatchExpansionTop1Scorer, the V0 default (MQAScorer beside it from vllm-project/vllm#5691)",
        ),
        EngineHost(
            "vllm-v1", "vLLM V1", 512, False, "verify-pass",
            "vllm/config (V1): cudagraph_capture_sizes default [1, 2, 4] + range(8, 513, 8), piecewise graphs (attention "
            "outside); EAGLE drafter in piecewise graphs (vllm-project/vllm#21477); chain drafts (trees from late 2025)",
        ),
        EngineHost(
            "sglang", "SGLang", 160, False, "verify-pass",
            "sglang server_args: --cuda-graph-max-bs (160 by default on large GPUs, assumed); EAGLE verify captured per batch "
            "size and num_draft_tokens (docs.sglang.io speculative_decoding); draft-extend eager before sgl-project/sglang#6606",
        ),
        EngineHost(
            "llama.cpp", "llama.cpp", 1, True, "verify-pass",
            "ggml-org/llama.cpp#6766 (Apr 2024): CUDA graphs for single-token decode only (disabled for batch > 1); Metal "
            "and Vulkan encode every forward (no graphs); llama-speculative drafts chains",
        ),
        EngineHost(
            "mlx-lm", "MLX-LM", 0, True, "verify-pass",
            "ml-explore/mlx-examples#1155: mlx_lm speculative generation with a draft model, chains; MLX builds and "
            "evaluates each forward's graph lazily (no captured graphs)",
        ),
        EngineHost(
            "tensorrt-llm", "TensorRT-LLM", NO_GRAPH_LIMIT, False, "verify-pass",
            "NVIDIA TensorRT-LLM docs (speculative decoding: EAGLE, Medusa trees, draft-target); compiled engines, CUDA "
            "graphs optional (assumed: every forward priced as captured)",
        ),
    )
}  # fmt: skip

_PATTERNS = (
    (r"vllm v0\b", "vllm-v0"),
    (r"vllm v1\b", "vllm-v1"),
    (r"sglang", "sglang"),
    (r"tensorrt|trt-llm", "tensorrt-llm"),
    (r"llama\.cpp|llama-bench|llama-server|llama-cli", "llama.cpp"),
    (r"mlx", "mlx-lm"),
)


def engine_of(engine: str, engine_version: str = "") -> str | None:
    """The engine key of a benchmark row's `engine` text, None when it names none we know (vLLM without
    V0 or V1 in its name: V1 from version 0.8 on, by `engine_version`)."""
    text = engine.lower().replace("v0/v1", "")
    for pattern, key in _PATTERNS:
        if re.search(pattern, text):
            return key
    if "vllm" in text:
        match = re.search(r"v?0\.(\d+)", engine_version)
        if match:
            return "vllm-v1" if int(match.group(1)) >= 8 else "vllm-v0"
    return None
