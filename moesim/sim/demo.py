"""`moesim demo`: the main job on embedded defaults only (a preset, the built-in real routing
trace of that model's layout, and a tiny model recorded on the fly).

Each section is a titled polars table whose caption names its source; the CLI renders them, and
every table is also written to the report folder as CSV. Nothing here reaches outside the package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from moesim.atomic import check_out_dir, output_dir
from moesim.models import load_preset
from moesim.sim.cost.passbytes import pass_bytes_table, tokens_per_expert_table
from moesim.sim.report.page import write_report
from moesim.tracegen.formats.builtin import resolve_trace
from moesim.tracegen.formats.trace import Trace, read_trace, write_trace


@dataclass(frozen=True)
class DemoConfig:
    """Embedded defaults of the demo."""

    model: str = "deepseek-v2-lite"
    weight_format: str = "BF16"
    trace: str = "esft-vanilla-lite"  # the built-in real trace of the model's routing layout
    batch: int = 4
    seed: int = 0
    max_pass: int = 16
    drafter: str = "qwen3-0.6b"
    max_draft: int = 8


@dataclass(frozen=True)
class DemoSection:
    """One titled table of the demo, with a sentence on how to read it."""

    key: str
    title: str
    caption: str
    table: pl.DataFrame


@dataclass
class DemoResult:
    """What the demo computed and where it wrote it."""

    out_dir: Path
    sections: list[DemoSection] = field(default_factory=list)
    html_report: Path | None = None


def routing_source(trace: Trace) -> str:
    """One line naming where a trace's routing comes from (for every caption)."""
    provenance = trace.meta.provenance
    if "source" in provenance:
        groups = " and ".join(f"{g.name} ({g.seqs} sequences)" for g in trace.meta.groups)
        return (
            f"Routing: real, recorded from {provenance.get('model', trace.meta.geometry.model).split(' (')[0]} on {groups}, "
            f"{trace.n_tokens:,} tokens; {provenance['source']}, {provenance.get('licence', 'licence unknown').split(' ')[0]} licence."
        )
    return f"Routing: {trace.meta.backend}, {trace.meta.prompts}."


def _bytes_section(trace: Trace, max_pass: int) -> DemoSection:
    table = (
        pass_bytes_table(trace, max_pass)
        .with_columns(
            (pl.col("per_slot_bytes") / 1e6).alias("per_slot_MB"),
            (pl.col("dedup_bytes") / 1e6).alias("dedup_MB"),
        )
        .select("n", "mean_distinct_experts", "uniform_distinct_experts", "byte_share", "per_slot_MB", "dedup_MB")
    )
    g = trace.meta.geometry
    return DemoSection(
        key="bytes",
        title=f"Expert bytes per pass, {g.model} {g.weight_format} ({len(g.moe_layers)} MoE layers, top-{g.top_k} of {g.experts})",
        caption=f"{routing_source(trace)} Distinct experts per layer in a window of n tokens (trace vs uniform routing); "
        "byte share u(n) = distinct / (n·k) is what dedup reads relative to per-slot",
        table=table,
    )


def _speculation_section(config: DemoConfig, trace: Trace) -> DemoSection:
    """Static draft lengths against Cascade at batch 1 on two workloads, simulated on the
    trace-driven step-time model (the demo's trace on the calibrated H200 profile)."""
    from moesim.sim.serving.config import config_from_dict
    from moesim.sim.serving.run import run_study

    study = config_from_dict(
        {
            "run": {"seed": config.seed, "requests": 8},
            "workload": {"prompt_tokens": 128, "output_tokens": 256},
            "trace": {"path": config.trace},
            "target": {"model": config.model, "weight_format": config.weight_format, "profile": "nvidia-h200", "family": "best"},
            "drafter": {"kind": "ngram"},
            "cost": {"kind": "steptime"},
            "acceptance": {"model": "geometric", "alpha": 0.5},
            "policy": {"name": "off"},
            "study": {
                "workloads": {
                    "low": {"model": "geometric", "beta": [3.0, 7.0]},
                    "high": {"model": "geometric", "beta": [8.0, 2.0]},
                },
                "policies": [{"name": "static", "k": k} for k in (1, 2, 3)] + [{"name": "cascade"}],
            },
        },
        "demo",
        Path("."),
    )
    table = run_study(study).select("workload", "policy", "speedup", "worst_slowdown", "mean_draft_len", "tokens_per_pass")
    return DemoSection(
        key="speculation",
        title=f"Simulated speculative decoding, {config.model} {config.weight_format} on the H200 profile, batch 1, "
        "n-gram drafter: static k vs Cascade",
        caption=f"{routing_source(trace)} Acceptance α per request ~ Beta(3, 7) (low) or Beta(8, 2) (high); pass times from the "
        "step-time model on that trace (cheapest expert kernel per pass); speedup = throughput / throughput with speculation off; "
        "worst_slowdown = the slowest request's time per output token relative to speculation off (> 1: slower)",
        table=table,
    )


def _tokens_per_expert_section(trace: Trace, max_pass: int, batch: int) -> DemoSection:
    return DemoSection(
        key="tokens_per_expert",
        title=f"Tokens per expert per pass: one sequence vs a batch of {batch} sequences",
        caption=f"{routing_source(trace)} "
        "byte_share u(n) = distinct experts / (n·k); slots_per_expert = n·k / mean distinct experts (tokens an expert "
        "read by a dedup engine serves on average); max_tokens_per_expert = tokens of the busiest expert (mean, p90) per layer; "
        f"_B{batch}: the union of {batch} sequences' n tokens each (MoESD-style batch verification; lanes at staggered positions)",
        table=tokens_per_expert_table(trace, max_pass, batch),
    )


def _profile_section(config: DemoConfig) -> DemoSection:
    """Per-slot vs dedup time per pass size on the calibrated H200 profile (hardware profiles, issue 5)."""
    from moesim.hw_profiles import load_profile
    from moesim.hw_profiles.report import dedup_comparison

    profile = load_profile("nvidia-h200")
    preset = load_preset(config.model)
    families = ("dedup", "dedup_grouped_gemm")
    table = dedup_comparison(profile, preset.expert_shape(config.weight_format), preset.experts, preset.top_k, seed=config.seed,
                             dedup_families=families).select("n", "byte_share_u", "per_slot_us", "dedup_us", "dedup_grouped_gemm_us",
                                                             "r_dedup", "r_dedup_grouped_gemm", "fastest", "extrapolated")  # fmt: skip
    per_slot = profile.expert_family("per_slot").heldout_error
    dedup = profile.expert_family("dedup").heldout_error
    return DemoSection(
        key="perslot_vs_dedup_h200",
        title=f"Per-slot vs dedup time of one MoE layer per pass size, {preset.name} {config.weight_format} experts, "
        f"calibrated {profile.device.name} profile",
        caption=f"Routing: uniform (independent top-k draws), mean over 64 seeded samples; times: the {profile.device.name} "
        f"profile calibrated from measurements (data/h200). dedup = hand-written kernel, dedup_grouped_gemm = torch grouped GEMM; "
        "r = BW_dedup / BW_per_slot = u·T_per_slot / T_dedup, dedup faster where u < r; held-out ε (p90): "
        f"per_slot {100 * per_slot.epsilon:.0f} %, dedup {100 * dedup.epsilon:.0f} %",
        table=table,
    )


DEMO_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models send every token to a few of their experts.",
    "Speculative decoding drafts several tokens and verifies them in one pass.",
    "def add(a, b):\n    return a + b",
    "Routing traces record which experts each token selects in every layer.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89",
)


def _recorded_section() -> DemoSection:
    """A tiny MoE model built on the fly, prompts run through llama.cpp, its routing per layer."""
    import tempfile

    from moesim.kernels.features import uniform_distinct_experts
    from moesim.kernels.locality import mean_distinct_experts
    from moesim.tracegen.formats.summary import summarize_trace
    from moesim.tracegen.formats.trace import read_trace
    from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_tiny_model
    from moesim.tracegen.llamacpp.prompts import prompts_from_texts
    from moesim.tracegen.llamacpp.recorder import RecordConfig, record_trace

    spec = TinyModelSpec(arch="qwen3moe", layers=4, experts=16, top_k=4, hidden=64, expert_ff=32)
    with tempfile.TemporaryDirectory(prefix="moesim-demo-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny.gguf", spec)
        prompts = prompts_from_texts(list(DEMO_PROMPTS), "demo prompts")
        result = record_trace(model, prompts, Path(tmp) / "t.arrow", RecordConfig(max_tokens=48, n_threads=1))
        trace = read_trace(Path(tmp) / "t.arrow")
    summary = summarize_trace(trace)
    distinct = mean_distinct_experts(trace.experts, trace.seq_starts, spec.experts, 8)
    uniform = [float(uniform_distinct_experts(n, spec.experts, spec.top_k)) for n in (4, 8)]
    table = pl.DataFrame(
        {
            "layer": summary.moe_layers,
            "experts_used": summary.experts_used_per_layer,
            "reuse_d1": summary.reuse_per_layer,
            "distinct_n4": distinct[:, 3],
            "uniform_n4": [uniform[0]] * len(summary.moe_layers),
            "distinct_n8": distinct[:, 7],
            "uniform_n8": [uniform[1]] * len(summary.moe_layers),
        }
    )
    return DemoSection(
        key="recorded",
        title=f"Routing recorded through llama.cpp: {spec.model_name}, built on the fly "
        f"({trace.n_seqs} prompts, {trace.n_tokens} positions, top-{spec.top_k} of {spec.experts})",
        caption=f"Routing: recorded now through llama.cpp from a random-weight tiny model on {len(DEMO_PROMPTS)} demo prompts, "
        f"at {result.tokens_per_s:.0f} positions/s with routing capture; reuse_d1 = mean |S_t ∩ S_t+1| / k; "
        "distinct_nN = mean distinct experts in a window of N tokens (uniform routing for comparison)",
        table=table,
    )


DEMO_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def _best_draft_section(trace: Trace, config: DemoConfig) -> DemoSection:
    """Best draft length and speedup at a few acceptance rates on the calibrated H200 profile (issue 6)."""
    from moesim.hw_profiles import load_profile
    from moesim.sim.analysis.scenario import Scenario
    from moesim.sim.analysis.speculation import best_draft_analysis
    from moesim.sim.cost.drafters import make_drafter
    from moesim.sim.cost.steptime import StepTimeModel

    preset = load_preset(config.model)
    profile = load_profile("nvidia-h200")
    columns: dict[str, list[object]] = {"alpha": list(DEMO_ALPHAS)}
    staircases = []
    for engine in ("per_slot", "best"):
        scenario = Scenario(StepTimeModel(preset, profile, engine, config.weight_format), trace, make_drafter(config.drafter, preset))
        result = best_draft_analysis(scenario, list(DEMO_ALPHAS), config.max_draft)
        columns[f"{engine}_k"] = result.best_draft.tolist()
        columns[f"{engine}_speedup"] = result.speedup.tolist()
        columns[f"{engine}_interval"] = [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(result.speedup_low, result.speedup_high, strict=True)]
        staircases.append(f"{engine}: " + ", ".join(f"k={k} from α={a:.2f}" for a, k in result.steps))
    return DemoSection(
        key="best_draft_h200",
        title=f"Best draft length and speedup over plain decoding, {preset.name} on the calibrated H200 profile, drafter {config.drafter}",
        caption=f"{routing_source(trace)} "
        "Engine per_slot, or best (the cheapest kernel family at each pass size); interval from the families' held-out ε. "
        "Staircase " + "; ".join(staircases),
        table=pl.DataFrame(columns),
    )


DEMO_SWEEP = """# The demo's sweep (issue 8): rerun with `moesim sweep sweep.toml`, plot with `moesim report sweep.parquet --out report`.
# Passes of up to 16 tokens per sequence, as the other sections (Numba compiles one counter for them all).
[sweep]
workers = 1

[grid]
models = ["{model}"]
profiles = ["nvidia-h200"]
engines = ["per_slot", "best"]
drafters = ["{drafter}"]
alpha = {{ start = 0.0, stop = 1.0, num = 201 }}
max_draft = 15
max_pass = 16
batch = [1, 4, 16, 64]
context = [512]
weight_format = "{weight_format}"

[[routing]]
name = "{trace}"
trace = "{trace}"  # the built-in real trace, by name
"""


def _sweep_section(config: DemoConfig, trace: Trace, folder: Path) -> DemoSection:
    """A sweep beyond the measured grid (issue 8) on the demo's model and routing: sweep.toml and sweep.parquet in `folder`."""
    from moesim.sim.report.page import best_draft_summary
    from moesim.sim.sweep.config import load_config
    from moesim.sim.sweep.run import run_sweep

    path = folder / "sweep.toml"
    path.write_text(DEMO_SWEEP.format(**dataclasses.asdict(config)))
    summary = run_sweep(load_config(path), folder / "sweep.parquet")
    return DemoSection(
        key="sweep",
        title=f"Sweep: {summary.points:,} (α, k) points of {config.model} on the calibrated H200 profile, batch 1-64, "
        f"drafter {config.drafter}",
        caption=f"{routing_source(trace)} "
        f"{summary.units} units in {summary.elapsed_s:.1f} s; best draft length k* and speedup at three α per engine and batch "
        "size B (B sequences verified together); all rows in sweep.parquet, plots in report/index.html",
        table=best_draft_summary(pl.read_parquet(summary.out)),
    )


def run_demo(out_dir: Path, config: DemoConfig = DemoConfig(), force: bool = False) -> DemoResult:
    """Build the demo's inputs on the fly, compute every section, write the report folder (`force`:
    into a folder holding files moesim did not write)."""
    check_out_dir(out_dir, force)
    trace = read_trace(config.trace)
    result = DemoResult(out_dir=out_dir)
    result.sections.append(_bytes_section(trace, config.max_pass))
    result.sections.append(_tokens_per_expert_section(trace, config.max_pass, config.batch))
    result.sections.append(_profile_section(config))
    result.sections.append(_best_draft_section(trace, config))
    result.sections.append(_recorded_section())
    result.sections.append(_speculation_section(config, trace))
    with output_dir(out_dir, force) as staging:
        write_trace(staging / "trace.arrow", trace, compression="zstd")  # the routing the tables used, with its provenance
        for licence in sorted(resolve_trace(config.trace).parent.glob("LICENSE*")):  # a copy of a shipped trace keeps its notice
            (staging / licence.name).write_bytes(licence.read_bytes())
        result.sections.append(_sweep_section(config, trace, staging))
        for section in result.sections:
            section.table.write_csv(staging / f"{section.key}.csv")
        write_report([staging / "sweep.parquet"], staging / "report")
    result.html_report = out_dir / "report" / "index.html"
    return result
