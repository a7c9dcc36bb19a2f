"""The report's figures (matplotlib, no pyplot state): each function takes polars frames of sweep
rows (docs/sweeps.md) or validation predictions and returns a Figure.

Colours follow the kernel family everywhere (per_slot, dedup, dedup_grouped_gemm, ...), so a
family looks the same in every plot of a report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, ScalarFormatter

from moesim.hw_profiles.families import EXTRAPOLATION_TOLERANCE, extrapolated
from moesim.kernels.features import consecutive_runs

FAMILY_ORDER = ("per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIN_SHADE = "#2ca02c"


def color_of(name: str) -> str:
    """A stable colour per kernel family / engine name (`best` is black)."""
    if name == "best":
        return "black"
    if name in FAMILY_ORDER:
        return PALETTE[FAMILY_ORDER.index(name)]
    return PALETTE[4 + sum(map(ord, name)) % (len(PALETTE) - 4)]


def _ordered(names: list[str]) -> list[str]:
    known = [n for n in FAMILY_ORDER if n in names]
    return known + sorted(n for n in names if n not in known)


def win_window_figure(passes: pl.DataFrame, title: str) -> Figure:
    """u(n) and r(n) per dedup family, n where dedup is faster than per-slot shaded."""
    dedup = _ordered(passes.filter(pl.col("bandwidth_ratio").is_not_null())["engine"].unique().to_list())
    fig = Figure(figsize=(4.2 * max(len(dedup), 1), 3.8), layout="constrained")
    axes = fig.subplots(1, max(len(dedup), 1), sharey=True, squeeze=False)[0]
    for ax, family in zip(axes, dedup, strict=False):
        rows = passes.filter(pl.col("engine") == family).sort("n")
        n = rows["n"].to_numpy()
        wins = rows.filter(pl.col("dedup_wins"))["n"].to_list()
        for i, (lo, hi) in enumerate(consecutive_runs(wins)):
            ax.axvspan(lo - 0.5, hi + 0.5, color=WIN_SHADE, alpha=0.15, lw=0, label="dedup faster" if i == 0 else None)
        ax.plot(n, rows["byte_share"].to_numpy(), color="black", lw=1.8, label="u(n) = U / (n·K)")
        ax.plot(n, rows["bandwidth_ratio"].to_numpy(), color=color_of(family), lw=1.8, label=f"r(n), {family}")
        first = f"first win n = {wins[0]}" if wins else "never wins"
        ax.set_title(f"{family}: {first}", fontsize=10)
        ax.set_xlabel("tokens per pass n")
        ax.set_xlim(0.5, n.max() + 0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[0].set_ylabel("dedup / per-slot ratio")
    axes[0].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=11)
    return fig


def pass_time_figure(passes: pl.DataFrame, title: str) -> Figure:
    """T(n) per kernel family with its held-out error band; engine `best` dashed. A family slower
    everywhere than twice the slowest `best` time is left off the axis and named in the legend with its range."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    best = passes.filter(pl.col("engine") == "best")
    limit_us = 2.0 * float((best if best.height else passes)["time_us"].max())  # type: ignore[arg-type]
    top_us = 0.0
    for engine in _ordered(passes["engine"].unique().to_list()):
        rows = passes.filter(pl.col("engine") == engine).sort("n")
        n, time_ms = rows["n"].to_numpy(), rows["time_us"].to_numpy() / 1e3
        color = color_of(engine)
        if engine == "best":
            ax.plot(n, time_ms, color=color, lw=1.2, ls="--", label="best (cheapest family per n)")
            continue
        if 1e3 * time_ms.min() > limit_us:
            ax.plot([], [], color=color, lw=1.8, label=f"{engine} (off the axis: {time_ms.min():.3g}–{time_ms.max():.3g} ms)")
            continue
        top_us = max(top_us, float(rows["high_us"].max()))  # type: ignore[arg-type]
        ax.fill_between(n, rows["low_us"].to_numpy() / 1e3, rows["high_us"].to_numpy() / 1e3, color=color, alpha=0.18, lw=0)
        ax.plot(n, time_ms, color=color, lw=1.8, label=engine)
        beyond_range = extrapolated(rows["extrapolation"].to_numpy())
        if beyond_range.any():
            ax.plot(n[beyond_range], time_ms[beyond_range], "o", mfc="none", color=color, ms=4)
    ax.set_xlabel("tokens per pass n (per sequence)")
    ax.set_ylabel("pass time T(n), ms")
    ax.set_ylim(0, 1.05 * top_us / 1e3 if top_us else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="kernel family (band: ±held-out ε; o: extrapolated)", title_fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=11)
    return fig


LOGIT_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999)


def _uses_logit(alphas: np.ndarray) -> bool:
    """A logit α axis when the grid reaches past 0.95 (where best draft lengths crowd)."""
    inner = alphas[(alphas > 0) & (alphas < 1)]
    return inner.size > 1 and float(inner.max()) > 0.95


def _inner(rows: pl.DataFrame, logit: bool) -> pl.DataFrame:
    """Without α = 0 and α = 1 on a logit axis (they lie at infinity there)."""
    return rows.filter((pl.col("alpha") > 0) & (pl.col("alpha") < 1)) if logit else rows


def _alpha_axis(ax: Any, alphas: np.ndarray, logit: bool, onset: float) -> None:
    """Linear α axis over the grid, or logit from half the first α where anything drafts."""
    inner = alphas[(alphas > 0) & (alphas < 1)]
    if not logit:
        ax.set_xlim(float(alphas.min()), float(alphas.max()))
        ax.set_xlabel("acceptance rate α")
        return
    low, high = max(float(inner.min()), 0.5 * onset), float(inner.max())
    ax.set_xscale("logit")
    ax.set_xlim(low, high)
    ax.xaxis.set_major_locator(FixedLocator([t for t in LOGIT_TICKS if low <= t <= high]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("acceptance rate α (logit scale)")


def _onset(best: pl.DataFrame) -> float:
    """The first α where the best draft length is above 0 (1 when never)."""
    drafting = best.filter(pl.col("draft_len") > 0)["alpha"]
    return float(drafting.min()) if drafting.len() else 1.0  # type: ignore[arg-type]


def staircase_figure(series: list[tuple[str, pl.DataFrame]], title: str) -> Figure:
    """k*(α) as a staircase (top) and the speedup at k* with its interval (bottom), one line per series."""
    alphas = np.unique(np.concatenate([rows["alpha"].to_numpy() for _, rows in series]))
    logit = _uses_logit(alphas)
    fig = Figure(figsize=(7.5, 6.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    for i, (label, rows) in enumerate(series):
        rows = _inner(rows, logit).sort("alpha")
        alpha = rows["alpha"].to_numpy()
        color = PALETTE[i % len(PALETTE)]
        top.step(alpha, rows["draft_len"].to_numpy(), where="post", color=color, lw=1.8, label=label)
        bottom.fill_between(alpha, rows["speedup_low"].to_numpy(), rows["speedup_high"].to_numpy(), color=color, alpha=0.18, lw=0)
        bottom.plot(alpha, rows["speedup"].to_numpy(), color=color, lw=1.8, label=label)
    _alpha_axis(bottom, alphas, logit, min(_onset(rows) for _, rows in series))
    top.set_ylabel("best draft length k*")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="upper left")
    top.set_title(title, fontsize=11)
    bottom.axhline(1.0, color="grey", lw=1, ls=":")
    bottom.set_ylabel("speedup at k* (band: error box)")
    bottom.grid(alpha=0.3)
    return fig


def speedup_heatmap_figure(points: pl.DataFrame, title: str) -> Figure:
    """S(k, α) over the grid, diverging at 1 (red: slower than plain decoding), S = 1 contour, k*(α) line."""
    logit = _uses_logit(np.unique(points["alpha"].to_numpy()))
    ordered = _inner(points, logit).sort("alpha", "draft_len")
    alphas = np.unique(ordered["alpha"].to_numpy())
    ks = np.unique(ordered["draft_len"].to_numpy())
    speedup = ordered["speedup"].to_numpy().reshape(alphas.size, ks.size).T
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    low, high = float(np.nanmin(speedup)), float(np.nanmax(speedup))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(low, 0.999), vmax=max(high, 1.001))
    edges = np.clip(_edges(alphas), 1e-9, 1 - 1e-9) if logit else _edges(alphas)
    mesh = ax.pcolormesh(edges, _edges(ks.astype(float)), speedup, cmap="RdBu", norm=norm, shading="flat", rasterized=True)
    drafting = ks >= 1  # S = 1 exactly at k = 0 (plain decoding): no contour there
    if low < 1.0 < high and alphas.size > 1 and drafting.sum() > 1:
        ax.contour(alphas, ks[drafting], speedup[drafting], levels=[1.0], colors="black", linewidths=1.0)
    beyond = ordered.filter(pl.col("extrapolation") > 1.0 + EXTRAPOLATION_TOLERANCE)["draft_len"]
    if beyond.len():
        first = int(beyond.min())  # type: ignore[arg-type]
        ax.axhline(first - 0.5, color="grey", lw=1.2, ls="--", label=f"k >= {first}: verify pass beyond the calibrated range")
    best = ordered.filter(pl.col("best_draft"))
    ax.step(best["alpha"].to_numpy(), best["draft_len"].to_numpy(), where="mid", color="gold", lw=1.6, label="best draft k*(α)")
    _alpha_axis(ax, np.unique(points["alpha"].to_numpy()), logit, _onset(best))
    fig.colorbar(mesh, ax=ax, label="speedup S(k, α) over plain decoding")
    ax.set_ylabel("draft length k")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=11)
    return fig


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres (half-way between neighbours)."""
    if centers.size == 1:
        return np.array([centers[0] - 0.5, centers[0] + 0.5])
    mid = 0.5 * (centers[1:] + centers[:-1])
    return np.concatenate([[centers[0] - (mid[0] - centers[0])], mid, [centers[-1] + (centers[-1] - mid[-1])]])


def speedup_batch_figure(best: pl.DataFrame, alphas: list[float], title: str) -> Figure:
    """Speedup at the best draft length vs batch size B, one line per α, k* written at each point."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, alpha in enumerate(alphas):
        rows = best.filter(pl.col("alpha") == alpha).sort("batch")
        b = rows["batch"].to_numpy()
        color = PALETTE[i % len(PALETTE)]
        ax.fill_between(b, rows["speedup_low"].to_numpy(), rows["speedup_high"].to_numpy(), color=color, alpha=0.15, lw=0)
        ax.plot(b, rows["speedup"].to_numpy(), "-", color=color, lw=1.8, label=f"α = {alpha:.3g}")
        beyond = extrapolated(rows["extrapolation"].to_numpy())
        ax.plot(b[~beyond], rows["speedup"].to_numpy()[~beyond], "o", color=color, ms=5)
        ax.plot(b[beyond], rows["speedup"].to_numpy()[beyond], "o", mfc="white", color=color, ms=5)
        for x, y, k in zip(b, rows["speedup"].to_numpy(), rows["draft_len"].to_numpy(), strict=True):
            ax.annotate(f"k={k}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(best["batch"].unique().to_list()))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    ax.set_xlabel("batch size B (sequences verified together)")
    ax.set_ylabel("speedup at the best draft length")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=11)
    return fig


def predicted_measured_figure(rows: pl.DataFrame, title: str) -> Figure:
    """Predicted vs measured time per row, the predicted interval as error bars, identity line;
    hollow markers where the prediction extrapolates; each family's median |error| in the legend."""
    fig = Figure(figsize=(6.0, 5.6), layout="constrained")
    ax = fig.subplots()
    groups = _ordered(rows["kernel"].unique().to_list()) if "kernel" in rows.columns else [""]
    dense = rows.height > 200
    size, shade = (3, 0.6) if dense else (4.5, 1.0)
    for name in groups:
        part = rows.filter(pl.col("kernel") == name) if name else rows
        measured, predicted = part["time_us"].to_numpy(), part["predicted_us"].to_numpy()
        hollow_rows = part["extrapolated"].to_numpy().astype(bool) if "extrapolated" in part.columns else np.zeros(part.height, bool)
        color = color_of(name) if name else PALETTE[0]
        if {"predicted_low_us", "predicted_high_us"} <= set(part.columns):
            errors = np.vstack([predicted - part["predicted_low_us"].to_numpy(), part["predicted_high_us"].to_numpy() - predicted])
            ax.errorbar(measured, predicted, yerr=np.maximum(errors, 0), fmt="none", ecolor=color, alpha=0.25 if dense else 0.4, lw=0.7)
        label = f"{name or 'rows'}: {part.height} rows, median |error| {100 * np.median(np.abs(predicted / measured - 1)):.1f} %"
        ax.plot(measured[~hollow_rows], predicted[~hollow_rows], "o", color=color, ms=size, alpha=shade, mec="none", label=label)
        if hollow_rows.any():
            hollow = f"{name} (extrapolated)".strip()
            ax.plot(measured[hollow_rows], predicted[hollow_rows], "o", mfc="none", color=color, ms=size + 1, label=hollow)
    values = np.concatenate([rows["time_us"].to_numpy(), rows["predicted_us"].to_numpy()])
    values = values[np.isfinite(values) & (values > 0)]
    low, high = float(values.min()) / 1.15, float(values.max()) * 1.15
    if high / low > 10:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.plot([low, high], [low, high], color="grey", lw=1, ls="--", label="identity (predicted = measured)")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.set_xlabel("measured time, µs")
    ax.set_ylabel("predicted time, µs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    ax.set_title(title, fontsize=10)
    return fig
