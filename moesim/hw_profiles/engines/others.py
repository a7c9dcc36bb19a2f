"""MLX (through mlx-lm) and vLLM's fused MoE: their expert kernels and dispatch.

MLX: mlx-lm's `SwitchGLU` (ml-explore/mlx-lm mlx_lm/models/switch_layers.py @ d78bf58e217c904ec282ed8da9b947491f78c022)
turns every (token, slot) into an M = 1 row and sorts them by expert when tokens x top-k >= 64;
MLX's `GatherQMM::eval_gpu` (ml-explore/mlx mlx/backend/metal/quantized.cpp @ 846d176227a0ac13d2667e58d2bb68b322109ab0)
then runs `gather_qmm_rhs` (sorted, each expert's weights reused over its rows: deduplicating)
when M = 1, B >= 16, the indices are sorted and B / E >= 4 (B = tokens x top-k; 8 before mlx
#2609, v0.29.2), else `gather_qmv`, one mat-vec per row (per-slot).

MLX on the CPU backend (ml-explore/mlx mlx/backend/cpu/masked_mm.cpp `GatherMM::eval_cpu`,
quantized.cpp `GatherQMM::eval_cpu` @ 846d176227a0ac13d2667e58d2bb68b322109ab0): every (token, slot)
row is its own matrix product (`cblas_sgemm`, float32 only; `_qmm` per row for quantised weights)
and `sorted_indices` is not read; what sorting changes is the order of the rows, so an expert's
rows follow one another and its weights are read from memory once per pass (then from the cache).
mlx-lm sorts when tokens x top-k >= 64 (`SwitchGLU.__call__`, `do_sort = indices.size >= 64`).

vLLM: `fused_moe_kernel` (vllm-project/vllm vllm/model_executor/layers/fused_moe/fused_moe.py @
13cb3e44373beb1c8b9d2c017f565af6f7a1b601) computes BLOCK_SIZE_M x BLOCK_SIZE_N tiles of one
expert's slots after `moe_align_block_size` pads each expert's slots to a multiple of BLOCK_SIZE_M:
an expert's weights are read once per BLOCK_SIZE_M of its slots. Without a tuned config file for
the (E, N, device) `get_default_config` takes BLOCK_SIZE_M 16 for M <= E and 64 above (64 always
for block-quantized FP8 w8a8); a tuned file's nearest entry otherwise (its sizes are per file).
"""

from __future__ import annotations

from moesim.hw_profiles.dispatch import DispatchRule
from moesim.hw_profiles.engines.kernels import Engine, Era, Kernel


class Mlx(Engine):
    """MLX on Apple GPUs, through mlx-lm's SwitchGLU."""

    name = "MLX"
    citation = "ml-explore/mlx-lm switch_layers.py @ d78bf58e; ml-explore/mlx backend/metal/quantized.cpp GatherQMM::eval_gpu @ 846d1762"
    kernels = (
        Kernel("per_slot", 1, "gather_qmv: one mat-vec per (token, slot) row"),
        Kernel("dedup_gather_qmm", 0, "gather_qmm_rhs on rows sorted by expert: each used expert read once per pass"),
    )
    eras = (
        Era("2025-04-17", "mlx #2082 (v0.25.0): sorted gather_qmm when B / E >= 8"),
        Era("2025-09-19", "mlx #2609 (v0.29.2): sorted gather_qmm when B / E >= 4"),
    )

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rules of the era (module docstring)."""
        per_expert = 4.0 if era >= "2025-09-19" else 8.0
        return [
            DispatchRule("dedup_gather_qmm", min_slots=64, min_slots_per_expert=per_expert, note="sorted rows (mlx-lm), B/E threshold"),
            DispatchRule("per_slot", note="gather_qmv"),
        ]


class MlxCpu(Engine):
    """MLX's CPU backend, through mlx-lm's SwitchGLU."""

    name = "MLX CPU"
    citation = "ml-explore/mlx-lm switch_layers.py @ d78bf58e; ml-explore/mlx backend/cpu/masked_mm.cpp, quantized.cpp @ 846d1762"
    kernels = (
        Kernel("per_slot", 1, "gather_mm / gather_qmm rows in token order: one matrix product per (token, slot) row"),
        Kernel("dedup_gather_sorted", 0, "rows sorted by expert (mlx-lm's _gather_sort): each used expert streamed once"),
    )
    eras = (Era("2025-04-17", "mlx-lm SwitchGLU sorts rows when tokens x top-k >= 64; the CPU kernels ignore sorted_indices"),)

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rule of the era (module docstring)."""
        return [
            DispatchRule("dedup_gather_sorted", min_slots=64, note="mlx-lm sorts rows by expert (indices.size >= 64)"),
            DispatchRule("per_slot", note="rows in token order"),
        ]


class VllmFusedMoe(Engine):
    """vLLM's Triton fused MoE (SGLang's is adapted from it)."""

    name = "vLLM fused_moe"
    citation = "vllm-project/vllm fused_moe.py get_default_config, moe_align_block_size.py @ 13cb3e44 / 05be9924"
    kernels = (
        Kernel(
            "dedup_fused_bm16", 16, "fused_moe_kernel, BLOCK_SIZE_M 16: an expert read and computed per 16 of its slots", tile_tokens=16
        ),
        Kernel(
            "dedup_fused_bm64", 64, "fused_moe_kernel, BLOCK_SIZE_M 64: an expert read and computed per 64 of its slots", tile_tokens=64
        ),
    )
    eras = (Era("2024-06-01", "get_default_config: BLOCK_SIZE_M 16 for M <= E, else 64 (unchanged at 000d1458 and 13cb3e44)"),)

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rules of the era (module docstring)."""
        return [
            DispatchRule("dedup_fused_bm64", ("FP8",), note="fp8_w8a8 with block_shape: BLOCK_SIZE_M 64"),
            DispatchRule("dedup_fused_bm16", ("BF16", "F16"), max_tokens_per_expert=1.0, note="default config, M <= E"),
            DispatchRule("dedup_fused_bm64", ("BF16", "F16"), note="default config, M > E"),
        ]
