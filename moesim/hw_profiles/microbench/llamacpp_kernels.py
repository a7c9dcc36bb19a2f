"""Which kernel family llama.cpp's expert matmul (GGML_OP_MUL_MAT_ID) is, per backend and pass size.

Read in the ggml sources (ggml-org/llama.cpp, 2025–2026); it changes between versions, so every
runner lets the user override the per-slot cut-off:

- CPU (`ggml_compute_forward_mul_mat_id`): rows are grouped by expert (`matrix_row_counts`), then
  each used expert's matrix is multiplied with its rows in 16×16 blocks: each distinct expert is
  streamed once per pass (once per 16 of its tokens): a deduplicating kernel at every n.
- CUDA (`ggml_cuda_mul_mat_id`): up to MMVQ's `mul_mat_id` batch limit (8 tokens by default, less
  for some quantized types on older GPUs) quantized weights go through MMVQ with ids, a
  matrix-vector kernel per token slot (per-slot); above it, MMQ / MMF over tokens grouped by expert
  on the device, or a host-synchronising per-expert cuBLAS fallback (deduplicating).
- Metal (`ggml_metal_op_mul_mat_id`): below `ne21_mm_id_min` = 32 tokens `kernel_mul_mv_id`, one
  matrix-vector product per token slot (per-slot); from 32 tokens `kernel_mul_mm_id` over an
  expert → token map (deduplicating).
- Vulkan (`ggml_vk_mul_mat_id`, since llama.cpp PR #18918, 2026-01-21): up to 8 tokens the
  mat-vec-id shader, one dispatch per token over its slots (per-slot); above, `matmul_id` over
  experts (deduplicating).

The engine profiles' dispatch (`moesim.hw_profiles.engines`) has these rules per build and weight
format, with their sources; these defaults are its current builds for a quantized type.
"""

from __future__ import annotations

from moesim.errors import InputError

LLAMACPP_BACKENDS = ("cpu", "cuda", "metal", "vulkan")

# Largest pass size the backend runs with a per-slot kernel (0: never).
DEFAULT_PER_SLOT_MAX_TOKENS = {"cpu": 0, "cuda": 8, "metal": 31, "vulkan": 8}


def llamacpp_family(backend: str, n_tokens: int, per_slot_max_tokens: int | None = None) -> str:
    """Kernel family of llama.cpp's MUL_MAT_ID on `backend` for an n-token pass."""
    if backend not in LLAMACPP_BACKENDS:
        raise InputError(f"unknown llama.cpp backend '{backend}' (known: {', '.join(LLAMACPP_BACKENDS)})")
    limit = DEFAULT_PER_SLOT_MAX_TOKENS[backend] if per_slot_max_tokens is None else per_slot_max_tokens
    return "per_slot" if n_tokens <= limit else f"dedup_llamacpp_{backend}"
