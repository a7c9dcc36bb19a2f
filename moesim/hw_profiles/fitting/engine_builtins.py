"""The built-in engine profiles: which rows of the shared public table each is fitted on, and which
devices are scaled from which calibration of the same engine.

A recipe names its device (catalog key), engine, device class and the groups of rows it fits:
each group is one build of the engine (its dispatch era, and a date-prefixed label that keeps its
fixed times apart from other builds'). The profile describes the engine's current dispatch
(`Engine.dispatch()`, newest era) with the newest build's fixed times. A scaled profile is a
calibrated one moved to another device's datasheet (`derive.scaled_engine_profile`).

    python -m moesim.hw_profiles.fitting.regenerate      # rewrites every engine built-in from the table
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from moesim.hw_profiles.catalog import DeviceSpec, catalog
from moesim.hw_profiles.engines import ENGINES
from moesim.hw_profiles.families import DenseFamily, Roofline
from moesim.hw_profiles.fitting.engine_fit import EngineFit, ProfileFrame, fit_engine
from moesim.hw_profiles.fitting.whole_pass import PassRow, pass_rows
from moesim.hw_profiles.heldout import HeldoutError
from moesim.hw_profiles.importers import ImportOptions, import_table
from moesim.hw_profiles.profile import DeviceFacts, HardwareProfile
from moesim.hw_profiles.provenance import FittedRow, Provenance, file_sha256

PUBLIC_TABLE = Path("data") / "public-bench" / "moe_pass_times.csv"
DENSE_SHARE, DENSE_COMPUTE_SHARE = 0.9, 0.7
# The share of the experts a whole-pass benchmark's random tokens route to, per engine (`whole_pass`);
# an engine not named here routes over every expert. None is shipped: a share chosen without the
# rows it is judged on (`pooled.routing_share.choose_share`, nested in bench/validate_engine_transfer.py)
# predicts held-out rows worse than every expert does (docs/validation.md, issue 25's third pass),
# so the built-ins route over all; a user's fit may set one (`profile fit --routed-share`).
BENCH_ROUTED_SHARE: dict[str, float] = {}


@dataclass(frozen=True)
class Group:
    """Rows of one engine build: their numbers in the public table, dispatch era, build label."""

    rows: tuple[int, ...]
    era: str
    build: str
    intermediate: int = 0  # the expert width the rows ran, where the table's stated one contradicts the roofline


@dataclass(frozen=True)
class Recipe:
    """A built-in engine profile fitted on published rows."""

    name: str
    device: str
    engine: str
    architecture: str
    groups: tuple[Group, ...]
    partial: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scaled:
    """A built-in engine profile scaled from a calibration of the same engine to another device."""

    name: str
    device: str
    base: str
    architecture: str = "any"
    notes: tuple[str, ...] = ()


def _every_other(first: int, last: int) -> tuple[int, ...]:
    return tuple(range(first, last + 1, 2))


_CUDA_FLOAT = "float weights run the cuBLAS loop above 128 tokens (MMF's limit for wide experts; moesim takes it for every shape)"
RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "nvidia-rtx-3090-llamacpp",
        "nvidia-rtx-3090",
        "llama.cpp CUDA",
        "turing-ampere",
        (
            Group(_every_other(32, 48), "2025-04-30", "2025-08-25 #15525 cuda-mmq-moe-device-4"),
            Group(_every_other(50, 64), "2025-04-30", "2025-09-08 #15767 b0d52998b"),
            Group(_every_other(51, 65), "2025-09-09", "2025-09-08 #15767 184e42d5d"),
            Group((*_every_other(106, 120), 122), "2026-03-29", "2026-04-23 #22298 14293fbb9"),
            Group((201, 205, 209), "2026-03-29", "2026-09 #29152 a3cec6ab6"),
        ),
        notes=(_CUDA_FLOAT,),
    ),
    Recipe(
        "nvidia-p40-llamacpp",
        "nvidia-p40",
        "llama.cpp CUDA",
        "pascal",
        (
            Group(_every_other(2, 14), "2025-04-30", "2025-04-29 #13199 PR"),
            Group(_every_other(17, 29), "2025-04-30", "2025-08-25 #15525 cuda-mmq-moe-device-4"),
        ),
        notes=(
            "the rows are builds of 2025 (MMVQ at one token only): the current dispatch's MMVQ limits on Pascal "
            "(6 tokens for Q4_0, 5 for Q4_K, 4 for Q6_K/Q8_0/MXFP4) come from the source, not from these rows",
        ),
    ),
    Recipe(
        "nvidia-a100-80gb-vllm",
        "nvidia-a100-80gb",
        "vLLM fused_moe",
        "any",
        (Group(_every_other(484, 496), "2024-06-01", "2026-04-21 #40542"),),
    ),
    Recipe("nvidia-h200-vllm", "nvidia-h200", "vLLM fused_moe", "any", (Group(_every_other(498, 532), "2024-06-01", "2026-06-08 #44818"),)),
    Recipe(
        "nvidia-h20-vllm",
        "nvidia-h20",
        "vLLM fused_moe",
        "any",
        (Group(_every_other(474, 482), "2024-06-01", "2026-06-01 #44152", intermediate=7168),),
        notes=(
            "the table states Mixtral's full expert (N=14336, K=4096) but its times are below the H20's roofline for it (1 token: "
            "2 experts = 704 MB in 99 µs = 7.1 TB/s on a 4.0 TB/s device): read as the tensor-parallel-2 shard (N=7168), the "
            "widest shape the roofline allows (an inference, not stated in the source)",
        ),
    ),
    Recipe(
        "amd-rx-7900-xtx-vulkan",
        "amd-rx-7900-xtx",
        "llama.cpp Vulkan",
        "any",
        (Group(tuple(range(331, 341)), "2026-01-21", "2026-08-27 #25356 stock"),),
    ),
    Recipe(
        "apple-m2-ultra-metal",
        "apple-m2-ultra",
        "llama.cpp Metal",
        "any",
        (Group((254, 255, 256, 257), "2025-05-09", "2025-08-27 #15616"),),
        partial=True,
        notes=("partial: one model, one per-slot point (tg128) and three mul_mm_id passes (512 and 2048 tokens)",),
    ),
    Recipe(
        "apple-m3-ultra-mlx",
        "apple-m3-ultra",
        "MLX",
        "any",
        (Group((463, 467), "2025-09-19", "2026-09-14 #4509 chained"),),
        partial=True,
        notes=(
            "partial: two timings of one MoE layer (1 and 4 tokens, 42 layers chained), both gather_qmv; the sorted "
            "gather_qmm was not timed with a token count: not calibrated; the dense family and the fixed time per pass are assumed",
        ),
    ),
)
SCALED: tuple[Scaled, ...] = (
    Scaled("nvidia-h100-sxm-vllm", "nvidia-h100-sxm", "nvidia-h200-vllm"),
    Scaled("nvidia-h800-sxm-vllm", "nvidia-h800-sxm", "nvidia-h200-vllm"),
    Scaled("nvidia-a800-80gb-vllm", "nvidia-a800-80gb", "nvidia-a100-80gb-vllm"),
    Scaled("nvidia-l40s-vllm", "nvidia-l40s", "nvidia-a100-80gb-vllm"),
    Scaled("nvidia-l40-vllm", "nvidia-l40", "nvidia-a100-80gb-vllm"),
    Scaled("nvidia-rtx-6000-ada-vllm", "nvidia-rtx-6000-ada", "nvidia-a100-80gb-vllm"),
    Scaled("nvidia-rtx-4090-llamacpp", "nvidia-rtx-4090", "nvidia-rtx-3090-llamacpp", "volta-ada-hopper-blackwell"),
    Scaled("apple-m3-max-metal", "apple-m3-max", "apple-m2-ultra-metal"),
    Scaled("apple-m4-max-metal", "apple-m4-max", "apple-m2-ultra-metal"),
)


def recipe(name: str) -> Recipe:
    """A recipe by its profile name."""
    return next(r for r in RECIPES if r.name == name)


def _fitted_rows(frame: pl.DataFrame) -> tuple[FittedRow, ...]:
    return tuple(FittedRow(int(r["source_row"]), r["source"], r["variant"], int(r["n_tokens"])) for r in frame.iter_rows(named=True))


def _assumed_dense(spec: DeviceSpec) -> tuple[DenseFamily, Provenance]:
    note = (
        f"not calibrated (kernel timings only): dense work streams at {100 * DENSE_SHARE:.0f} % of the datasheet bandwidth and "
        f"computes at {100 * DENSE_COMPUTE_SHARE:.0f} % of its tensor peak; no fixed time per pass; relative uncertainty 20 %"
    )
    source = Provenance("assumed", note=note)
    dense = DenseFamily(
        bandwidth_gbps=DENSE_SHARE * spec.peak_bandwidth_gbps,
        tflops=DENSE_COMPUTE_SHARE * spec.tensor_tflops,
        launch_us=0.0,
        provenance=source,
        heldout_error=HeldoutError(transfer=0.2, transfer_note="assumed"),
        note="assumed from the datasheet",
    )
    return dense, source


def device_facts(spec: DeviceSpec, engine: str, engine_version: str) -> DeviceFacts:
    """A catalog device running an engine build."""
    return DeviceFacts(spec.name, spec.backend, spec.memory_gb, spec.l2_cache_bytes, spec.compute_units, engine, engine_version, "", "")


def _recipe_table(item: Recipe, table: Path) -> tuple[pl.DataFrame, list[PassRow]]:
    """The recipe's rows of the public table, as a measurement table and as the fit's rows."""
    engine = ENGINES.create(item.engine)
    frames, dispatches, builds = [], [], []
    for group in item.groups:
        _, frame = import_table(table, "public-bench", ImportOptions(rows=group.rows))
        if group.intermediate:
            frame = frame.with_columns(expert_intermediate=pl.lit(group.intermediate, pl.Int64))
        frames.append(frame)
        dispatches += [engine.dispatch(group.era, item.architecture)] * frame.height
        builds += [group.build] * frame.height
    frame = pl.concat(frames, how="diagonal_relaxed")
    return frame, pass_rows(frame, dispatches, builds, BENCH_ROUTED_SHARE.get(item.engine, 1.0))


def profile_frame(item: Recipe, table: Path = PUBLIC_TABLE) -> ProfileFrame:
    """Everything of the recipe's profile but its fitted numbers: device, roofline, dispatch, sources."""
    engine = ENGINES.create(item.engine)
    spec = catalog()[item.device]
    frame, _ = _recipe_table(item, table)
    dense, assumed = _assumed_dense(spec)
    era = engine.eras[-1]
    builds = "; ".join(g.build for g in item.groups)
    sources = {
        "public-bench": Provenance(
            "calibrated",
            PUBLIC_TABLE.as_posix(),
            file_sha256(table),
            note=f"{frame.height} published rows of {engine.name} on the {spec.name}; builds {builds}",
            rows=_fitted_rows(frame),
        ),
        "engine-source": Provenance("published", citation=f"{engine.citation}; dispatch of builds since {era.key}: {era.since}"),
        "datasheet": Provenance("datasheet", citation=spec.citation),
        "assumed-dense": assumed,
    }
    builds_text = ", ".join(sorted({g.build for g in item.groups}))
    return ProfileFrame(
        name=item.name,
        description=f"{engine.name} on the {spec.name}: fitted on published rows ({builds_text})" + (" (partial)" if item.partial else ""),
        device=device_facts(spec, engine.name, f"dispatch of builds since {era.key} ({era.since}); kernels fitted on builds {builds_text}"),
        roofline=Roofline(spec.peak_bandwidth_gbps, spec.tensor_tflops),
        dispatch=engine.dispatch(era.key, item.architecture, "engine-source"),
        sources=sources,
        section_sources={"device": "datasheet", "roofline": "datasheet", "pass": "assumed-dense", "families.dense": "assumed-dense"},
        calibration="public-bench",
        dense_fallback=dense,
        era=max(g.build for g in item.groups),
        notes=item.notes,
        partial=item.partial,
    )


def recipe_rows(item: Recipe, table: Path = PUBLIC_TABLE) -> list[PassRow]:
    """The recipe's rows as the fit sees them (each with its build's dispatch)."""
    return _recipe_table(item, table)[1]


def fit_recipe(item: Recipe, table: Path = PUBLIC_TABLE) -> EngineFit:
    """Fit one built-in on its rows of the public table."""
    rows = recipe_rows(item, table)
    fit = fit_engine(rows, ENGINES.create(item.engine), profile_frame(item, table))
    fit.profile = used_sources(fit.profile)
    return fit


def used_sources(profile: HardwareProfile) -> HardwareProfile:
    """The profile without the sources none of its numbers names."""
    used = {*profile.section_sources.values(), *profile.field_sources.values()}
    if profile.dispatch is not None:
        used.add(profile.dispatch.source)
    return dataclasses.replace(profile, sources={k: v for k, v in profile.sources.items() if k in used})
