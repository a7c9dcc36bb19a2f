"""llama.cpp's expert matmul (GGML_OP_MUL_MAT_ID) per backend, build era and device class.

Read in ggml-org/ggml (llama.cpp's `ggml/src` as `src/`), HEAD d99724f2b141fed9e1a9f402213506c081433465
(2026-08-21); llama.cpp PR numbers are those of the ggml sync commits (`(llama/NNNNN)`).

CUDA (`ggml_cuda_mul_mat_id`, src/ggml-cuda/ggml-cuda.cu): quantized weights up to
`get_mmvq_mmid_max_batch(type, cc)` tokens go through MMVQ with ids (`mul_mat_vec_q_moe`: one warp
per token slot reads that slot's expert: per-slot); above, MMQ with ids (tokens sorted by expert on
the device, each used expert read once per tile of up to 128 token columns: `mul_mat_q_switch_J`).
F16/BF16/F32 run MMF with ids (tensor cores, deduplicating; `ggml_cuda_should_use_mmf`: up to 512
tokens for expert rows <= 1024, 128 otherwise: moesim takes 128) and past that a host-synchronising
per-expert cuBLAS loop; Pascal has no MMF (no MMA) and takes the loop at every n. History:
#13199 (2025-04-30, ggml b5ed2968) MMQ with ids from 2 tokens, MMVQ / MMVF at 1; #15767
(2025-09-09, 0ac013c9) MMF with ids for float weights (before: the cuBLAS loop); #18958
(2026-02-03, 0622f36a) MMVQ up to 4 tokens, float weights never MMVF on NVIDIA; #20905
(2026-03-29, e79ce97d) the per-architecture, per-type table below.

Vulkan (`ggml_vk_mul_mat_id`, src/ggml-vulkan/ggml-vulkan.cpp): `ggml_vk_use_mul_mat_vec_id`
takes the mat-vec-id shader (one dispatch per token over its slots: per-slot) when
`src2->ne[1] <= 8` and the type is F32, F16 or quantized (BF16 never), else `matmul_id` over
experts; before #18918 (2026-01-21, 960ee54f) only for one token. `matmul_id` dispatches
{rows, tokens, experts} workgroups of BM x BN tiles, each expert's tokens in tiles of BN columns
(a workgroup past its expert's token count returns early), every column of a tile computed; its
pipeline is picked from the pass's token count `nei1`, not the tokens per expert
(`ggml_vk_guess_matmul_id_pipeline`: small, BN = 32, up to 32 tokens; medium, 64, up to 64; large,
128, above; `wg_denoms` {32, 32}, {64, 64}, {128, 128}), so 32 tokens of an expert in a pass of 512
cost a whole tile of 128. An expert's weights are read once per row tile and tile of columns.

Metal (`ggml_metal_op_mul_mat_id`, src/ggml-metal/ggml-metal-ops.cpp): `kernel_mul_mm_id` over
32-token x 64-row tiles of each expert (threadgroups z = experts) when the device has simdgroup
matrices, ne00 >= 64 and tokens >= `ne21_mm_id_min` = 32 (since #13388, 2025-05-09, 878a093f);
`kernel_mul_mv_id` (threadgroups z = slots x tokens: per-slot) otherwise. Before #13388
(`ggml-metal.m` at 878a093f~1) mul_mm_id ran when the slots exceeded the experts and its row map
fitted in threadgroup memory: slots <= (memory / 2 - 8192) / 4, 2048 slots for 32 KiB (assumed).
"""

from __future__ import annotations

from moesim.hw_profiles.dispatch import DispatchRule
from moesim.hw_profiles.engines.kernels import FLOAT, QUANTIZED, Engine, Era, Kernel

GGML = "ggml-org/ggml @ d99724f2b141fed9e1a9f402213506c081433465"

# get_mmvq_mmid_max_batch (src/ggml-cuda/mmvq.cu, since llama.cpp #20905): largest n run by MMVQ.
_MMVQ_MAX = {
    "volta-ada-hopper-blackwell": {},
    "turing-ampere": {"MXFP4": 7, "Q2_K": 7, "Q3_K": 5},
    "pascal": {"Q4_0": 6, "Q4_K": 5, "Q5_K": 5, "Q6_K": 4, "Q8_0": 4, "MXFP4": 4, "Q2_K": 4, "Q3_K": 4},
    "rdna3": {"Q4_K": 4, "Q5_K": 4, "Q6_K": 4},
    "cdna": {},  # CDNA has its own table in mmvq.cu, not read here: the default 8 (the public CDNA rows run >= 16 tokens)
}
_MMVQ_DEFAULT = 8
MMF_MAX_TOKENS = 128


class LlamaCppCuda(Engine):
    """llama.cpp's CUDA (and HIP) backend."""

    name = "llama.cpp CUDA"
    citation = f"{GGML}: src/ggml-cuda/ggml-cuda.cu ggml_cuda_mul_mat_id, mmvq.cu get_mmvq_mmid_max_batch, mmq.cu, mmf.cu"
    kernels = (
        Kernel("per_slot", 1, "MMVQ with ids (mul_mat_vec_q_moe; MMVF for float weights before #18958): one read per token slot"),
        Kernel(
            "dedup_mmq",
            128,
            "MMQ with ids: tokens sorted by expert, each used expert read and computed in tiles of J token columns, "
            "J the multiple of 8 that holds the pass's tokens, at most 128 (mul_mat_q_switch_J)",
            tile_tokens=128,
            tile_step=8,
        ),
        Kernel("dedup_mmf", 0, "MMF with ids (tensor cores, float weights): each used expert read once per pass"),
        Kernel("dedup_cublas", 0, "host-synchronising per-expert cuBLAS loop: one launch and sync per used expert", per_expert=True),
    )
    eras = (
        Era("2025-04-30", "llama.cpp #13199 (ggml b5ed2968): MMQ with ids from 2 tokens; MMVQ / MMVF at 1; float weights: cuBLAS loop"),
        Era("2025-09-09", "llama.cpp #15767 (ggml 0ac013c9): MMF with ids for float weights"),
        Era("2026-02-03", "llama.cpp #18958 (ggml 0622f36a): MMVQ up to 4 tokens; float weights never MMVF on NVIDIA"),
        Era("2026-03-29", "llama.cpp #20905 (ggml e79ce97d): MMVQ up to a per-architecture, per-type limit (<= 8)"),
    )
    architectures = tuple(_MMVQ_MAX)

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rules of the era on the device class (module docstring)."""
        rules = []
        if era >= "2026-03-29":
            limits = {fmt: _MMVQ_MAX[architecture].get(fmt, _MMVQ_DEFAULT) for fmt in QUANTIZED}
            for limit in sorted(set(limits.values())):
                formats = tuple(fmt for fmt in QUANTIZED if limits[fmt] == limit)
                rules.append(DispatchRule("per_slot", formats, max_tokens=limit, note="MMVQ with ids (get_mmvq_mmid_max_batch)"))
        else:
            limit = 4 if era >= "2026-02-03" else 1
            rules.append(DispatchRule("per_slot", QUANTIZED, max_tokens=limit, note="MMVQ with ids"))
        rules.append(DispatchRule("dedup_mmq", QUANTIZED, note="MMQ with ids (dp4a on Pascal, int8 MMA from Turing)"))
        if era < "2026-02-03":
            rules.append(DispatchRule("per_slot", FLOAT, max_tokens=1, note="MMVF at one token"))
        if architecture != "pascal" and era >= "2025-09-09":
            rules.append(DispatchRule("dedup_mmf", FLOAT, max_tokens=MMF_MAX_TOKENS, note="MMF with ids"))
        rules.append(DispatchRule("dedup_cublas", FLOAT, note="host-synchronising cuBLAS loop over used experts"))
        return rules


class LlamaCppVulkan(Engine):
    """llama.cpp's Vulkan backend."""

    name = "llama.cpp Vulkan"
    citation = f"{GGML}: src/ggml-vulkan/ggml-vulkan.cpp ggml_vk_mul_mat_id, ggml_vk_use_mul_mat_vec_id"
    kernels = (
        Kernel("per_slot", 1, "mul_mat_vec_id shader: one dispatch per token, one read per token slot"),
        Kernel(
            "dedup_matmul_id",
            128,
            "matmul_id over experts (count_experts first): each used expert read and computed in whole tiles of J token "
            "columns, J picked from the pass's tokens: 32, 64, else 128 (ggml_vk_guess_matmul_id_pipeline)",
            tile_tokens=128,
            tile_step=32,
            tile_doubling=True,
            tiles_first=True,
        ),
    )
    eras = (
        Era("2024-11-01", "ggml 813a12ce: mat-vec-id for one token only"),
        Era("2026-01-21", "llama.cpp #18918 (ggml 960ee54f): mat-vec-id up to 8 tokens"),
    )

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rules of the era on the device class (module docstring)."""
        limit = 8 if era >= "2026-01-21" else 1
        return [
            DispatchRule("per_slot", ("F32", "F16", *QUANTIZED), max_tokens=limit, note="ggml_vk_use_mul_mat_vec_id (never BF16)"),
            DispatchRule("dedup_matmul_id", note="ggml_vk_mul_mat_id_q_f16"),
        ]


class LlamaCppMetal(Engine):
    """llama.cpp's Metal backend (Apple7+ GPUs: simdgroup matrices)."""

    name = "llama.cpp Metal"
    citation = f"{GGML}: src/ggml-metal/ggml-metal-ops.cpp ggml_metal_op_mul_mat_id (ne21_mm_id_min = 32)"
    kernels = (
        Kernel("per_slot", 1, "kernel_mul_mv_id: threadgroups over slots x tokens, one read per token slot"),
        Kernel("dedup_mul_mm_id", 32, "kernel_mul_mm_id: each used expert read and computed in tiles of 32 of its tokens", tile_tokens=32),
    )
    eras = (
        Era("2025-03-28", "before llama.cpp #13388: mul_mm_id when slots exceed experts and fit the threadgroup map (32 KiB assumed)"),
        Era("2025-05-09", "llama.cpp #13388 (ggml 878a093f): mul_mm_id from 32 tokens"),
    )

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The rules of the era on the device class (module docstring)."""
        if era < "2025-05-09":  # ggml-metal.m before 878a093f: dst_rows = slots > experts, <= (32 KiB / 2 - 8192) / 4
            return [
                DispatchRule(
                    "dedup_mul_mm_id", min_slots_per_expert=1.000001, max_slots=2048, note="slots > experts, map in threadgroup memory"
                ),
                DispatchRule("per_slot", note="kernel_mul_mv_id"),
            ]
        return [
            DispatchRule("dedup_mul_mm_id", min_tokens=32, note="simdgroup matrices, ne00 >= 64, tokens >= ne21_mm_id_min"),
            DispatchRule("per_slot", note="kernel_mul_mv_id"),
        ]
