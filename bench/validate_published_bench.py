"""Engine profiles and `profile fit` judged on published llama-bench tables the team does not have
(`data/validation/llama-bench-published/`, never fitted on; docs/validation.md prints its tables).

    .venv/bin/python bench/validate_published_bench.py

Per stored series: (a) the built-in profile of its device and engine against every row, as `moesim
validate` does (`check_bench_output`): median / max |error| of the time per pass and of T(n)/T(n0)
within the series; (b) a user's run: `profile fit` on every other pass size (both ways), the other
half predicted, at the routed share the fitted half chose and at every expert (share 1), with the
per-slot limit it kept against the engine source's; (c) where a built-in's family has the FLOP rate
its engine reaches on other devices as a floor (`floor_tflops`), the series with and without it, per
pass size. Errors in %.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesim.hw_profiles.builtin import load_profile
from moesim.hw_profiles.fitting.bench_fit import check_bench_output, fit_bench_output, predicted_rows
from moesim.hw_profiles.importers import ImportOptions, choose_variant, import_table
from moesim.hw_profiles.profile import HardwareProfile

FOLDER = Path(__file__).resolve().parents[1] / "data" / "validation" / "llama-bench-published"
WITHIN = 5.0  # the acceptance: a half predicted within 5 % at the median


@dataclass(frozen=True)
class Series:
    """One device and model of a stored table, and the built-in engine profile of its device (None: none)."""

    file: str
    device: str
    model: str
    builtin: str | None

    @property
    def options(self) -> ImportOptions:
        """The rows of this series (the table's last variant, as `profile fit` takes it)."""
        options = ImportOptions(filters=(f"device={self.device}", f"model={self.model}"))
        return choose_variant(FOLDER / self.file, None, options)[0]

    def rows(self) -> pl.DataFrame:
        """The series' rows by pass size."""
        return import_table(FOLDER / self.file, None, self.options)[1].sort("n_tokens")

    def label(self) -> str:
        """Device, model, weight format and the microbatch sizes."""
        rows = self.rows()
        sizes = sorted({rows["n_tokens"].min(), rows["n_tokens"].max()})
        return f"{self.device}, {self.model} {rows['dtype'][0]}, microbatch {'–'.join(map(str, sizes))}"


SERIES = (
    Series("llama.cpp-pr15631-fuse-adds.md", "P40", "qwen3-30b-a3b", "nvidia-p40-llamacpp"),
    Series("llama.cpp-pr15631-fuse-adds.md", "RTX 4090", "qwen3-30b-a3b", "nvidia-rtx-4090-llamacpp"),
    Series("llama.cpp-pr15631-fuse-adds.md", "RTX 4090", "gpt-oss-20b", "nvidia-rtx-4090-llamacpp"),
    Series("llama.cpp-pr15631-fuse-adds.md", "RTX 3090", "gpt-oss-20b", "nvidia-rtx-3090-llamacpp"),
)


def _ratio_errors(table: pl.DataFrame) -> np.ndarray:
    """Relative errors of T(n)/T(n0) along the series (n0 its smallest pass size)."""
    table = table.drop_nulls("predicted_ms").sort("n_tokens")
    measured, predicted = table["measured_ms"].to_numpy(), table["predicted_ms"].to_numpy()
    return (predicted[1:] / predicted[0]) / (measured[1:] / measured[0]) - 1.0 if len(measured) > 1 else np.array([])


def _pct(values: np.ndarray) -> str:
    values = np.abs(values[np.isfinite(values)]) * 100
    return "–" if values.size == 0 else f"{np.median(values):.1f} / {np.max(values):.1f}"


def _half_file(series: Series, keep: set[int], folder: Path) -> Path:
    """The stored file without the series' rows outside `keep` (line numbers): a user's run of half the sizes."""
    dropped = set(series.rows()["source_row"].to_list()) - keep
    lines = (FOLDER / series.file).read_text().splitlines(keepends=True)
    path = folder / series.file
    path.write_text("".join(line for number, line in enumerate(lines, 1) if number not in dropped))
    return path


def _without_floors(profile: HardwareProfile) -> HardwareProfile:
    """The profile as fitted on its own rows alone: no family floored at its engine's FLOP rate."""
    families = {name: dataclasses.replace(family, floor_tflops=math.inf) for name, family in profile.expert_families.items()}
    return dataclasses.replace(profile, expert_families=families)


def floor_tables() -> None:
    """(c): each series whose built-in floors a family at its engine's FLOP rate, with and without that floor."""
    print("\n#### The engine's FLOP rate as a floor: each row without it and with it\n")
    for series in SERIES:
        profile = load_profile(series.builtin) if series.builtin else None
        floors = {n: f.floor_tflops for n, f in profile.expert_families.items() if f.floor_tflops < math.inf} if profile else {}
        if not floors:
            continue
        rates = ", ".join(f"{name} {rate:.3g} TFLOP/s" for name, rate in floors.items())
        checks = [check_bench_output(FOLDER / series.file, p, series.options) for p in (_without_floors(profile), profile)]
        print(f"{series.label()}, `{series.builtin}` (floor: {rates}):\n")
        print("| n | measured ms | without floor: ms, error % | with floor: ms, error % |")
        print("|---|---|---|---|")
        before, after = (c.table.sort("n_tokens") for c in checks)
        for old, new in zip(before.iter_rows(named=True), after.iter_rows(named=True), strict=True):
            cells = " | ".join(f"{r['predicted_ms']:.1f}, {r['error_%']:+.1f}" for r in (old, new))
            print(f"| {old['n_tokens']} | {old['measured_ms']:.1f} | {cells} |")
        print(f"\nmedian / max |error| %: {_pct(checks[0].errors())} without the floor, {_pct(checks[1].errors())} with it\n")


def main() -> None:
    print("#### The built-in profiles against every row of the published series\n")
    print("| series | profile | rows | time per pass: median / max \\|error\\| % | T(n)/T(n0): median / max % |")
    print("|---|---|---|---|---|")
    for series in SERIES:
        label = series.label()
        if series.builtin is None:
            print(f"| {label} | none for this device and engine | – | – | – |")
            continue
        check = check_bench_output(FOLDER / series.file, load_profile(series.builtin), series.options)
        rows = f"{check.errors().size}/{check.table.height}"
        print(f"| {label} | `{series.builtin}` | {rows} | {_pct(check.errors())} | {_pct(_ratio_errors(check.table))} |")

    print("\n#### A user's run: every other size fitted, the other half predicted\n")
    print(
        "| series | fitted sizes | predicted sizes | per-slot limit (source's) | chosen share: share, median / max \\|error\\| % "
        "| every expert: median / max % |"
    )
    print("|---|---|---|---|---|---|")
    halves: list[tuple[float, float]] = []
    for series in SERIES:
        frame = series.rows()
        if frame.height < 4:
            print(f"| {series.label()} | – | – | – | too few sizes to halve ({frame.height}) | – |")
            continue
        for first in (0, 1):
            fitted, held = frame[first::2], frame[1 - first :: 2]
            with tempfile.TemporaryDirectory() as folder:
                path = _half_file(series, set(fitted["source_row"].to_list()), Path(folder))
                chosen = fit_bench_output(path, "mine", series.options)
                every = fit_bench_output(path, "mine", series.options, share=1.0)
            errors = [np.abs(predicted_rows(held, fit.fit.profile)["error_%"].drop_nulls().to_numpy()) for fit in (chosen, every)]
            halves.append((float(np.median(errors[0])), float(np.median(errors[1]))))
            sizes = [",".join(str(n) for n in part["n_tokens"].to_list()) for part in (fitted, held)]
            cells = " | ".join(f"{np.median(e):.1f} / {np.max(e):.1f}" for e in errors)
            limits = f"{chosen.learned_limit} ({chosen.source_limit})"
            print(f"| {series.label()} | {sizes[0]} | {sizes[1]} | {limits} | {chosen.share.share:g}, {cells} |")
    within = [sum(1 for h in halves if h[i] <= WITHIN) for i in (0, 1)]
    medians = [np.median([h[i] for h in halves]) for i in (0, 1)]
    print(
        f"\nHalves within {WITHIN:g} % at the median: chosen share {within[0]} of {len(halves)}, every expert {within[1]}; "
        f"median over the halves {medians[0]:.1f} % (chosen) / {medians[1]:.1f} % (every expert)."
    )
    floor_tables()


if __name__ == "__main__":
    main()
