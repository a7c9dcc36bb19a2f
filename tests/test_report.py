"""`moesim report`: every plot from a real sweep and a predictions table, the data each figure
draws, a self-contained HTML page, reproducible files, and one-line errors."""

from __future__ import annotations

import base64
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import assert_one_line_error
from matplotlib.collections import QuadMesh

from moesim.atomic import MANIFEST
from moesim.sim.report import plots
from moesim.sim.report.page import write_report
from moesim.sim.sweep.config import load_config
from moesim.sim.sweep.run import run_sweep

CONFIG = """
[sweep]
workers = 1
[grid]
models = ["deepseek-v2-lite"]
profiles = ["nvidia-h200"]
families = ["per_slot", "best"]
drafters = ["qwen3-0.6b"]
alpha = { start = 0.0, stop = 1.0, num = 41 }
max_draft = 8
max_pass = 16
batch = [1, 2, 8]
[[routing]]
name = "sticky"
generator = "sticky"
params = { keep_prob = 0.3 }
tokens = 400
seqs = 4
"""
FIGURES = {"win_window", "pass_time", "staircase", "speedup_heatmap", "speedup_batch", "predicted_vs_measured"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("report")
    (folder / "sweep.toml").write_text(CONFIG)
    sweep = run_sweep(load_config(folder / "sweep.toml"), folder / "sweep.parquet").out
    # a predictions.parquet as `moesim validate --out` writes it: measurement rows + predicted columns
    rng = np.random.default_rng(3)
    n = np.tile(np.arange(1, 13), 2)
    measured = np.where(np.arange(n.size) < 12, 40.0 + 9.0 * n, 55.0 + 4.0 * n)
    predicted = measured * (1 + rng.normal(0, 0.04, n.size))
    pl.DataFrame(
        {
            "kernel": ["per_slot"] * 12 + ["dedup"] * 12,
            "n_tokens": n,
            "time_us": measured,
            "device": "test",
            "predicted_us": predicted,
            "predicted_low_us": predicted * 0.95,
            "predicted_high_us": predicted * 1.05,
            "extrapolated": n > 10,
        }
    ).write_parquet(folder / "predictions.parquet")
    return sweep, folder / "predictions.parquet"


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.refs += [(tag, k, v or "") for k, v in attrs if k in ("src", "href", "srcset", "data")]


def test_report_writes_every_plot_and_a_self_contained_page(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    report = write_report(list(inputs), out)
    assert {f.key for f in report.figures} == FIGURES
    page = (out / "index.html").read_text()
    parser = _Refs()
    parser.feed(page)
    assert not parser.tags & {"script", "link", "iframe", "object"}
    assert "http:" not in page and "https:" not in page and "url(" not in page
    images = [v for tag, key, v in parser.refs if tag == "img"]
    assert len(images) == len(FIGURES) and all(v.startswith("data:image/png;base64,") for v in images)
    assert [(t, k) for t, k, _ in parser.refs if t != "img"] == []
    for figure, src in zip(report.figures, images, strict=True):
        png = (out / f"{figure.key}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and base64.b64decode(src.split(",", 1)[1]) == png
        assert (out / f"{figure.key}.svg").read_text().lstrip().startswith("<?xml")
        assert figure.caption in page.replace("&#x27;", "'").replace("&lt;", "<")
    assert "Best draft length k* and its speedup" in page and "k*_α=0.8" in page


def test_figures_draw_the_sweep_rows(inputs: tuple[Path, Path]) -> None:
    rows = pl.read_parquet(inputs[0])
    passes = rows.filter(pl.col("record") == "pass", pl.col("batch") == 1)
    fig = plots.win_window_figure(passes, "t")
    for ax in fig.axes:
        family = ax.get_title().split(":")[0]
        data = passes.filter(pl.col("engine") == family).sort("n")
        lines = {line.get_label().split(",")[0]: line for line in ax.get_lines()}
        np.testing.assert_allclose(lines["u(n) = U / (n·K)"].get_ydata(), data["byte_share"].to_numpy())
        np.testing.assert_allclose(lines["r(n)"].get_ydata(), data["bandwidth_ratio"].to_numpy())
        spans = [(p.get_x(), p.get_x() + p.get_width()) for p in ax.patches]
        covered = {int(n) for n in data["n"] if any(lo < n < hi for lo, hi in spans)}
        assert covered == set(data.filter(pl.col("dedup_wins"))["n"].to_list())
    points = rows.filter(pl.col("record") == "point", pl.col("batch") == 1, pl.col("engine") == "best")
    fig = plots.speedup_heatmap_figure(points, "t")
    mesh = next(c for c in fig.axes[0].collections if isinstance(c, QuadMesh))
    assert fig.axes[0].get_xscale() == "logit"  # the grid reaches α = 0.975: α = 0 and 1 are left out
    inner = points.filter(pl.col("alpha") > 0, pl.col("alpha") < 1).sort("alpha", "draft_len")
    np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(9, 39), inner["speedup"].to_numpy().reshape(39, 9).T)
    best = points.filter(pl.col("best_draft"))
    fig = plots.staircase_figure([("best", best)], "t")
    inner_best = best.filter(pl.col("alpha") > 0, pl.col("alpha") < 1).sort("alpha")
    np.testing.assert_array_equal(fig.axes[0].get_lines()[0].get_ydata(), inner_best["draft_len"].to_numpy())
    predictions = pl.read_parquet(inputs[1])
    fig = plots.predicted_measured_figure(predictions, "t")
    lines = {line.get_label().split(":")[0]: line for line in fig.axes[0].get_lines()}
    identity = lines["identity (predicted = measured)"]
    np.testing.assert_array_equal(identity.get_xdata(), identity.get_ydata())
    inside = predictions.filter(pl.col("kernel") == "dedup", ~pl.col("extrapolated"))
    np.testing.assert_allclose(lines["dedup"].get_xdata(), inside["time_us"].to_numpy())
    np.testing.assert_allclose(lines["dedup"].get_ydata(), inside["predicted_us"].to_numpy())
    assert len(lines["dedup (extrapolated)"].get_xdata()) == 2


def test_report_files_are_reproducible(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    write_report(list(inputs), tmp_path / "a")
    write_report(list(inputs), tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(names) == 2 * len(FIGURES) + 2 and MANIFEST in names  # PNG and SVG per figure, the page, the manifest
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_filter_and_alpha_select_what_is_drawn(cli, inputs: tuple[Path, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report = write_report([inputs[0]], tmp_path / "r", ["batch=2"])
    assert {f.key for f in report.figures} == FIGURES - {"speedup_batch", "predicted_vs_measured"}
    assert any("one batch size" in n for n in report.notes) and any("no predictions" in n for n in report.notes)
    only = write_report([inputs[1]], tmp_path / "p")
    assert [f.key for f in only.figures] == ["predicted_vs_measured"] and "Best draft" not in (tmp_path / "p" / "index.html").read_text()
    code, out, err = cli("report", inputs[0], "--out", tmp_path / "s", "--alpha", "0.5", "--alpha", "0.95")
    assert code == 0, err
    assert "k*_α=0.5" in (tmp_path / "s" / "index.html").read_text() and "5 figures" in out


def test_the_page_names_its_inputs_relative_to_itself(cli, inputs: tuple[Path, Path], tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "sweep.parquet").write_bytes(inputs[0].read_bytes())
    monkeypatch.chdir(tmp_path)
    for given, out, named in [
        ("results/sweep.parquet", "out/deep/report", "../../../results/sweep.parquet"),
        (str(tmp_path / "results" / "sweep.parquet"), "out/deep/report", "../../../results/sweep.parquet"),
        ("results/sweep.parquet", "results/report", "../sweep.parquet"),
    ]:
        (tmp_path / out).parent.mkdir(parents=True, exist_ok=True)
        code, _, err = cli("report", given, "--out", out)
        assert code == 0, err
        page = (tmp_path / out / "index.html").read_text()
        assert f"<li><code>{named}: sweep results, " in page
        assert str(tmp_path) not in page  # no machine path
        assert (tmp_path / out / named).resolve() == (tmp_path / "results" / "sweep.parquet").resolve()


def test_report_errors_are_one_line(cli, inputs: tuple[Path, Path], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "notes.txt").write_text("not parquet")
    (tmp_path / "cut.parquet").write_bytes(inputs[0].read_bytes()[:5000])
    pl.DataFrame({"a": [1]}).write_parquet(tmp_path / "other.parquet")
    out = tmp_path / "r"
    cases = [
        ((tmp_path / "missing.parquet",), "no such results file"),
        ((tmp_path / "notes.txt",), "not a readable Parquet file"),
        ((tmp_path / "cut.parquet",), "not a readable Parquet file"),
        ((tmp_path / "other.parquet",), "neither sweep results"),
        ((inputs[0], "--filter", "colour=red"), "--filter column 'colour'"),
        ((inputs[0], "--filter", "batch=five"), "'five' is not a"),
        ((inputs[0], "--filter", "batch=3"), "no rows left after --filter batch=3 (values of 'batch': 1, 2, 8)"),
        ((inputs[1], "--filter", "batch=1"), "no sweep results were given"),
        ((inputs[0], "--alpha", "1.5"), "--alpha must lie in [0, 1], got 1.5"),
    ]
    for args, fragment in cases:
        code, _, err = cli("report", *args, "--out", out)
        assert_one_line_error(code, err, fragment)
        assert not out.exists()
