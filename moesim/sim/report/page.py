"""`moesim report RESULTS... --out DIR`: plots (PNG and SVG) and one self-contained HTML page
(images embedded, no network) from sweep results and validation predictions.

A sweep may hold many models, profiles, routings and batch sizes; the report draws one focus:
after the `--filter COLUMN=VALUE` filters, the first model, profile, routing and context in the
file, at the smallest batch (the batch plot spans all batches), engine `best` when swept (else
the first) and the first drafter. Every figure's title names what it shows; the page lists the
values left out and how to select them.
"""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.figure import Figure

from moesim.atomic import output_dir
from moesim.errors import InputError, first_line
from moesim.filters import apply_filters, parse_filters
from moesim.sim.report import plots
from moesim.sim.sweep.config import SWEEP_FORMAT

PREDICTION_COLUMNS = ("time_us", "predicted_us")
DEFAULT_BATCH_ALPHAS = (0.6, 0.8, 0.9)
FOCUS_KEYS = ("model", "profile", "routing", "context_tokens")
RC = {"svg.hashsalt": "moesim", "svg.fonttype": "none", "font.size": 9}


@dataclass(frozen=True)
class ReportFigure:
    """One figure: where it was written and what it shows."""

    key: str
    title: str
    caption: str
    png: bytes


@dataclass
class Report:
    """What `write_report` wrote."""

    out_dir: Path
    figures: list[ReportFigure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- inputs -------------------------------------------------------------------------------------------


def load_results(paths: list[Path], out_dir: Path) -> tuple[pl.DataFrame | None, pl.DataFrame | None, list[str]]:
    """(sweep rows, prediction rows, sources): each file is recognised by its content; a source
    names its file relative to the report folder `out_dir`."""
    sweeps, predictions, sources = [], [], []
    if not paths:
        raise InputError("report: give at least one results file (sweep Parquet or predictions.parquet)")
    for path in paths:
        if not path.is_file():
            raise InputError(f"{path}: no such results file")
        try:
            meta = pq.read_schema(path).metadata or {}
            frame = pl.read_parquet(path)
        except (OSError, pa.ArrowException, pl.exceptions.PolarsError) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({first_line(exc)})") from None
        if meta.get(b"moesim.format", b"").decode() == SWEEP_FORMAT:
            sweeps.append(frame)
            sources.append(f"{relative_to(path, out_dir)}: sweep results, {frame.height:,} rows")
        elif set(PREDICTION_COLUMNS) <= set(frame.columns):
            predictions.append(frame)
            sources.append(f"{relative_to(path, out_dir)}: predictions, {frame.height:,} rows")
        else:
            raise InputError(
                f"{path}: neither sweep results ({SWEEP_FORMAT}) nor predictions (columns {', '.join(PREDICTION_COLUMNS)} missing)"
            )
    sweep = pl.concat(sweeps, how="vertical") if sweeps else None
    prediction = pl.concat(predictions, how="diagonal_relaxed") if predictions else None
    return sweep, prediction, sources


def relative_to(path: Path, folder: Path) -> str:
    """`path` as a link from inside `folder` reads it (both taken from the working directory, no
    symlinks resolved): what a report names, unchanged when a folder holding both is moved."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(folder))).as_posix()


def _first(frame: pl.DataFrame, column: str) -> object:
    return frame[column].drop_nulls().unique(maintain_order=True)[0]


# ---- figures ------------------------------------------------------------------------------------------


def _render(fig: Figure, out_dir: Path, key: str) -> bytes:
    """Write KEY.png and KEY.svg (reproducible: no dates, fixed SVG ids); returns the PNG bytes."""
    fig.savefig(out_dir / f"{key}.png", dpi=110, metadata={"Software": None})
    fig.savefig(out_dir / f"{key}.svg", metadata={"Date": None, "Creator": None})
    return (out_dir / f"{key}.png").read_bytes()


def _nearest_alphas(available: np.ndarray, wanted: list[float]) -> list[float]:
    picked = [float(available[np.argmin(np.abs(available - a))]) for a in wanted]
    return list(dict.fromkeys(picked))


def _sweep_figures(sweep: pl.DataFrame, alphas: list[float], out_dir: Path, report: Report) -> None:
    focus = {key: _first(sweep, key) for key in FOCUS_KEYS}
    for key, value in focus.items():
        others = sweep[key].drop_nulls().unique(maintain_order=True).to_list()
        if len(others) > 1:
            rest = ", ".join(map(str, others[1:6])) + (", ..." if len(others) > 6 else "")
            report.notes.append(f"the report shows {key} = {value}; the results also hold {rest} (select with --filter {key}=VALUE)")
    rows = sweep.filter(*(pl.col(k) == v for k, v in focus.items()))
    batch = int(rows["batch"].min())  # type: ignore[arg-type]
    where = f"{focus['model']} on {focus['profile']}, routing {focus['routing']}, context {focus['context_tokens']}"
    passes = rows.filter(pl.col("record") == "pass", pl.col("batch") == batch)
    points = rows.filter(pl.col("record") == "point")

    def add(key: str, title: str, caption: str, fig: Figure) -> None:
        report.figures.append(ReportFigure(key, title, caption, _render(fig, out_dir, key)))

    if passes.filter(pl.col("bandwidth_ratio").is_not_null()).height:
        add(
            "win_window",
            "Byte share u(n) and bandwidth ratio r(n)",
            "Dedup reads u(n) = U/(n·K) of the per-slot engine's expert bytes at r(n) = BW_dedup/BW_per_slot of its bandwidth "
            "(from the profile's expert times); dedup is faster exactly where u(n) < r(n), shaded.",
            plots.win_window_figure(passes, f"u(n) vs r(n), {where}, B = {batch}"),
        )
    if passes.height:
        add(
            "pass_time",
            "Pass time T(n) per kernel family",
            "Expected time of one target pass of n tokens per sequence (expert families + dense + fixed), over the routing's windows; "
            "bands: each family's held-out error ε; hollow markers: beyond the calibrated range (extrapolated).",
            plots.pass_time_figure(passes, f"T(n), {where}, B = {batch}"),
        )
    if points.is_empty():
        report.notes.append("the results hold no (α, k) points: no staircase, heatmap or batch plot")
        return
    engines = points["engine"].unique(maintain_order=True).to_list()
    engine = "best" if "best" in engines else engines[0]
    drafter = _first(points, "drafter")
    best = points.filter(pl.col("best_draft"))
    at_batch = best.filter(pl.col("batch") == batch)
    series = [
        (f"{e}, drafter {d}", at_batch.filter(pl.col("engine") == e, pl.col("drafter") == d))
        for e in engines
        for d in at_batch["drafter"].unique(maintain_order=True).to_list()
    ][: len(plots.PALETTE)]
    add(
        "staircase",
        "Best draft length over α",
        "k*(α) = argmax_k S(k, α) (ties to the larger k) is a non-decreasing staircase; below, the speedup at k* with its range "
        "over the corners of the error box (expert and dense families at ±ε).",
        plots.staircase_figure(series, f"best draft k*(α), {where}, B = {batch}"),
    )
    chosen = points.filter(pl.col("engine") == engine, pl.col("drafter") == drafter)
    add(
        "speedup_heatmap",
        "Speedup over (α, k)",
        f"S(k, α) = τ(k, α)·T(1)/(T_draft(k) + T(k+1)), engine {engine}, drafter {drafter}: blue where speculation pays, red where it "
        "slows decoding; black line S = 1, gold line the best draft length.",
        plots.speedup_heatmap_figure(chosen.filter(pl.col("batch") == batch), f"S(k, α), engine {engine}, drafter {drafter}, B = {batch}"),
    )
    batches = best["batch"].unique().to_list()
    if len(batches) > 1:
        picked = _nearest_alphas(np.unique(best["alpha"].to_numpy()), alphas or list(DEFAULT_BATCH_ALPHAS))
        add(
            "speedup_batch",
            "Speedup vs batch size",
            f"Speedup at the best draft length k* (written at each point) as B sequences are verified together, engine {engine}, "
            f"drafter {drafter}: the union of B·(k+1) tokens activates more experts, so verification gets relatively cheaper "
            "(MoESD) until the pass turns compute-bound; band: error box; hollow: the verify pass lies beyond the calibrated range.",
            plots.speedup_batch_figure(
                best.filter(pl.col("engine") == engine, pl.col("drafter") == drafter), picked, f"speedup vs B, {where}"
            ),
        )
    else:
        report.notes.append("the results hold one batch size: no speedup-vs-batch plot")


def _prediction_figure(predictions: pl.DataFrame, out_dir: Path, report: Report) -> None:
    rows = predictions.filter(pl.col("time_us").is_finite() & pl.col("predicted_us").is_finite() & (pl.col("time_us") > 0))
    if rows.is_empty():
        report.notes.append("the predictions hold no row with a positive measured and a finite predicted time")
        return
    error = ((rows["predicted_us"] - rows["time_us"]).abs() / rows["time_us"] * 100).to_numpy()
    title = f"predicted vs measured, {rows.height} rows: median |error| {np.median(error):.1f} %, p90 {np.percentile(error, 90):.1f} %"
    if {"predicted_low_us", "predicted_high_us"} <= set(rows.columns):
        inside = rows.filter(pl.col("time_us").is_between(pl.col("predicted_low_us"), pl.col("predicted_high_us"))).height
        title += f"\nmeasured inside the predicted interval: {100 * inside / rows.height:.0f} % of rows"
    fig = plots.predicted_measured_figure(rows, title)
    report.figures.append(
        ReportFigure(
            "predicted_vs_measured",
            "Predicted vs measured",
            "Each measured row against moesim's prediction from its routing features (error bars: the predicted interval from held-out "
            "error; hollow: extrapolated beyond the calibrated range); points on the dashed identity line are exact.",
            _render(fig, out_dir, "predicted_vs_measured"),
        )
    )


# ---- the page -----------------------------------------------------------------------------------------

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>moesim report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 980px; margin: 2em auto; color: #222; line-height: 1.45; }}
figure {{ margin: 2em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-size: 0.92em; color: #444; }} code, td {{ font-size: 0.9em; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
</style></head><body>
<h1>moesim report</h1>
<p>Inputs (paths relative to this page's folder):</p><ul>{sources}</ul>
{notes}
{table}
{figures}
<p style="font-size:0.85em;color:#666">Written by moesim {version}. Images are embedded; each is also in this folder as PNG and SVG.</p>
</body></html>
"""


def best_draft_summary(sweep: pl.DataFrame, alphas: list[float] = ()) -> pl.DataFrame:  # type: ignore[assignment]
    """Best draft length and its speedup per engine × drafter × batch at a few α (default: the grid
    values nearest 0.6, 0.8, 0.9), for the focus model, profile, routing and context."""
    points = sweep.filter(pl.col("record") == "point", pl.col("best_draft"))
    if points.is_empty():
        return pl.DataFrame()
    focus = points.filter(*(pl.col(k) == _first(points, k) for k in FOCUS_KEYS))
    picked = _nearest_alphas(np.unique(focus["alpha"].to_numpy()), list(alphas) or list(DEFAULT_BATCH_ALPHAS))
    rows = focus.filter(pl.col("alpha").is_in(picked))
    columns = [
        expr
        for a in picked
        for expr in (
            pl.col("draft_len").filter(pl.col("alpha") == a).first().alias(f"k*_α={a:.3g}"),
            pl.col("speedup").filter(pl.col("alpha") == a).first().alias(f"speedup_α={a:.3g}"),
        )
    ]
    return rows.group_by(["engine", "drafter", "batch"], maintain_order=True).agg(columns).sort("engine", "drafter", "batch")


def verdict_summary(sweep: pl.DataFrame, alphas: list[float] = ()) -> pl.DataFrame:  # type: ignore[assignment]
    """Does speculation pay, per engine × drafter × batch at the α of the best-draft table: the best
    k >= 1, its speedup and interval, the break-even acceptance length C(k) (tokens per pass), the
    term of C(k) − 1 that decides (verify bytes, draft cost or spec overhead: C·T(1) − T_draft −
    T(width)), and the smallest α of the grid from which some k >= 1 pays."""
    points = sweep.filter(pl.col("record") == "point")
    if points.is_empty():
        return pl.DataFrame()
    focus = points.filter(*(pl.col(k) == _first(points, k) for k in FOCUS_KEYS))
    keys = ["engine", "drafter", "batch"]
    plain = focus.filter(pl.col("draft_len") == 0).group_by(keys).agg(pl.col("verify_us").first().alias("plain_us"))
    spec = focus.filter(pl.col("draft_len") >= 1).join(plain, on=keys)
    if spec.is_empty():
        return pl.DataFrame()
    pays_from = spec.filter(pl.col("speedup") > 1.0).group_by(keys).agg(pl.col("alpha").min().alias("pays_from_alpha"))
    picked = _nearest_alphas(np.unique(focus["alpha"].to_numpy()), list(alphas) or list(DEFAULT_BATCH_ALPHAS))
    best = (
        spec.filter(pl.col("alpha").is_in(picked))
        .sort("speedup", "draft_len", descending=True)
        .group_by([*keys, "alpha"], maintain_order=True)
        .first()
    )
    verify = (pl.col("verify_us") - pl.col("plain_us")) / pl.col("plain_us")
    draft = pl.col("draft_us") / pl.col("plain_us")
    terms = pl.concat_list(verify, draft, pl.col("relative_cost") - 1.0 - verify - draft)
    names = pl.Series(["verify bytes", "draft cost", "spec overhead"])
    table = best.with_columns(
        verdict=pl.when(pl.col("speedup_low") > 1.0).then(pl.lit("pays")).when(pl.col("speedup_high") < 1.0).then(pl.lit("loses")),
        decided_by=terms.list.arg_max().map_elements(lambda i: names[i], return_dtype=pl.String),
    ).join(pays_from, on=keys, how="left")
    return table.select(
        *keys,
        "alpha",
        pl.col("verdict").fill_null("uncertain"),
        pl.col("draft_len").alias("k"),
        "speedup",
        "speedup_low",
        "speedup_high",
        pl.col("relative_cost").alias("break_even_tokens"),
        "decided_by",
        "pays_from_alpha",
    ).sort(*keys, "alpha")


def simulation_summary(sweep: pl.DataFrame) -> pl.DataFrame:
    """The SimPy cells of the focus model, profile and routing: one row per engine × drafter × batch × α × policy."""
    cells = sweep.filter(pl.col("record") == "simulation")
    if cells.is_empty():
        return pl.DataFrame()
    focus = cells.filter(*(pl.col(k) == _first(cells, k) for k in ("model", "profile", "routing")))
    shown = ["engine", "drafter", "batch", "alpha", "policy", "speedup", "worst_slowdown", "mean_draft_len", "tokens_per_pass"]
    return focus.select(shown).sort("engine", "drafter", "batch", "alpha", maintain_order=True)


def _html_table(frame: pl.DataFrame, title: str) -> str:
    if frame.is_empty():
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in frame.columns)
    cells = (
        "<tr>" + "".join(f"<td>{v:.3f}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in frame.iter_rows()
    )
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{''.join(cells)}</table>"


def _page(report: Report, sources: list[str], table: str) -> str:
    from moesim import __version__

    figures = "\n".join(
        f'<figure id="{f.key}"><h2>{html.escape(f.title)}</h2>'
        f'<img alt="{html.escape(f.title)}" src="data:image/png;base64,{base64.b64encode(f.png).decode()}">'
        f"<figcaption>{html.escape(f.caption)} Files: <code>{f.key}.png</code>, <code>{f.key}.svg</code>.</figcaption></figure>"
        for f in report.figures
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.notes)
    return PAGE.format(
        sources="".join(f"<li><code>{html.escape(s)}</code></li>" for s in sources),
        notes=f"<p>Notes:</p><ul>{notes}</ul>" if notes else "",
        table=table,
        figures=figures,
        version=__version__,
    )


def write_report(paths: list[Path], out_dir: Path, filters: list[str] = (), alphas: list[float] = (), force: bool = False) -> Report:  # type: ignore[assignment]
    """Read the results, draw every figure they support, write DIR/index.html and the images (atomically)."""
    sweep, predictions, sources = load_results([Path(p) for p in paths], Path(out_dir))
    if sweep is not None:
        sweep = apply_filters(sweep, parse_filters(list(filters)), "sweep results")
    elif filters:
        raise InputError("--filter selects sweep rows, but no sweep results were given")
    bad = [a for a in alphas if not 0.0 <= a <= 1.0]
    if bad:
        raise InputError(f"--alpha must lie in [0, 1], got {bad[0]}")
    report = Report(out_dir=Path(out_dir))
    with matplotlib.rc_context(RC), output_dir(out_dir, force) as staging:
        if sweep is not None:
            _sweep_figures(sweep, list(alphas), staging, report)
        if predictions is not None:
            _prediction_figure(predictions, staging, report)
        else:
            report.notes.append(
                "no predictions given: no predicted-vs-measured plot (moesim validate --out DIR writes predictions.parquet)"
            )
        table = ""
        if sweep is not None:
            table = (
                _html_table(best_draft_summary(sweep, alphas), "Best draft length k* and its speedup")
                + _html_table(
                    verdict_summary(sweep, alphas), "Does speculation pay? The best k >= 1, break-even acceptance length, deciding term"
                )
                + _html_table(simulation_summary(sweep), "Simulated policies (SimPy): speedup over speculation off")
            )
        (staging / "index.html").write_text(_page(report, sources, table))
    return report
