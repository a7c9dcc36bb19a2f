"""Whole passes of the H200 (data/h200/fulldepth): moesim leave-one-model-out against the naive
same-shape interpolation, per family, and their decisions per (trace, dedup family) curve
(issue 13; results in docs/validation.md; the method in `moesim.sim.validate.whole_passes`).

    .venv/bin/python bench/validate_whole_passes.py                 # ~10 s: the shipped profile
    .venv/bin/python bench/validate_whole_passes.py --unseen-shape  # + each model's shape left out of the calibration (fits: ~1 min)

moesim: every pass is the sum of its layers through the profile's lookup ladder (fitted on the
one-layer calibration only), with the pass-level terms fitted on the other model's passes
(applied only where that helps there). `--unseen-shape` also fits, for each model, a profile
without that model's calibration rows: the figure for a shape the table lacks (fitted rung only).
`--models` keeps some models, `--max-n` some pass sizes (a quicker subset); `--out` writes
predictions.parquet and summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.fitting.calibrate import fit_profile
from moesim.hw_profiles.fitting.ladder_fit import WholePasses, predict_whole_passes
from moesim.hw_profiles.ladder.rungs import RUNGS
from moesim.sim.validate.whole_passes import curve_table, curves, family_errors, lomo_predictions, naive_same_shape

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "data" / "h200" / "calibration.parquet"
PASSES = REPO / "data" / "h200" / "fulldepth" / "passes.parquet"
GOAL_MEDIAN, GOAL_P90 = 3.0, 8.0


def subset(passes: WholePasses, keep: np.ndarray) -> WholePasses:
    """The passes where `keep` holds."""
    return WholePasses(passes.frame.filter(pl.Series(keep)), passes.layers_us[keep], passes.rung_us[keep], passes.layers[keep])


def evaluate(profile: str, models: list[str] | None = None, max_n: int | None = None, unseen_shape: bool = False) -> dict[str, object]:
    """Predictions of both methods and their errors and decisions (the bench's numbers)."""
    families = load_profile(profile).expert_families
    passes = predict_whole_passes(PASSES, families)
    keep = np.ones(passes.frame.height, bool)
    if models:
        keep &= passes.frame["model"].is_in(models).to_numpy()
    if max_n:
        keep &= (passes.frame["n_tokens"] <= max_n).to_numpy()
    passes = subset(passes, keep)
    calibration = pl.read_parquet(CALIBRATION)
    moesim, bound = lomo_predictions(passes, families)
    frame = passes.frame.with_columns(
        pl.Series("moesim", moesim), pl.Series("moesim_bound", bound), pl.Series("naive", naive_same_shape(passes.frame, calibration))
    )
    frame = frame.with_columns(*(pl.Series(f"share_{r}", passes.rung_us[:, i] / passes.layers_us) for i, r in enumerate(RUNGS)))
    columns = ["moesim", "naive"]
    if unseen_shape:
        frame = frame.with_columns(pl.Series("moesim_unseen_shape", unseen_shape_predictions(frame, calibration)))
        columns.append("moesim_unseen_shape")
    return {"frame": frame, "columns": columns}


def unseen_shape_predictions(frame: pl.DataFrame, calibration: pl.DataFrame) -> np.ndarray:
    """Each model's passes with a profile fitted without that model's calibration rows."""
    out = np.full(frame.height, np.nan)
    with tempfile.TemporaryDirectory(prefix="moesim-whole-passes-") as folder:
        for model in frame["model"].unique(maintain_order=True).to_list():
            table = Path(folder) / f"without-{model}.parquet"
            calibration.filter(pl.col("model") != model).write_parquet(table)
            families = fit_profile(table, f"h200-without-{model}", device_json=CALIBRATION.parent / "device.json").profile.expert_families
            passes = predict_whole_passes(PASSES, families)
            rows = passes.frame.select("kernel", "trace", "window_start", "n_tokens").with_columns(pl.Series("_p", passes.layers_us))
            matched = (
                frame.select("kernel", "trace", "window_start", "n_tokens", "model")
                .with_row_index("_i")
                .join(rows, on=["kernel", "trace", "window_start", "n_tokens"], how="inner")
            )
            matched = matched.filter(pl.col("model") == model)
            out[matched["_i"].to_numpy()] = matched["_p"].to_numpy()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="nvidia-h200")
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--max-n", type=int)
    parser.add_argument("--unseen-shape", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = evaluate(args.profile, args.models, args.max_n, args.unseen_shape)
    frame: pl.DataFrame = result["frame"]  # type: ignore[assignment]
    columns: list[str] = result["columns"]  # type: ignore[assignment]
    summary: dict[str, object] = {}
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, float_precision=2):
        for label, by in (("per model", ("model",)), ("pooled (each model predicted without its own passes)", ())):
            table = family_errors(frame, columns, by)
            print(f"\nabsolute time error of whole passes, {label}:")
            print(table)
            summary[label] = table.to_dicts()
        pooled = family_errors(frame, ["moesim", "naive"])
        for row in pooled.iter_rows(named=True):
            meets = row["moesim_median_%"] <= GOAL_MEDIAN and row["moesim_p90_%"] <= GOAL_P90
            beats = row["moesim_median_%"] <= row["naive_median_%"] + 1e-9 and row["moesim_p90_%"] <= row["naive_p90_%"] + 1e-9
            print(f"{row['family']}: goal ≤ {GOAL_MEDIAN:g} / ≤ {GOAL_P90:g} % {'met' if meets else 'NOT met'}; "
                  f"{'no worse than' if beats else 'WORSE than'} naive at median and p90")  # fmt: skip
        shares = frame.group_by("kernel").agg(
            *(((pl.col(f"share_{r}") * pl.col("moesim")).sum() / pl.col("moesim").sum()).alias(r) for r in RUNGS)
        )
        print("\nshare of moesim's predicted time per rung:")
        print(shares.sort("kernel"))
        summary["rung_share"] = shares.to_dicts()
        for method, bound in (("moesim", "moesim_bound"), ("naive", None)):
            found = curves(frame, method, bound)
            table = curve_table(found)
            print(f"\ncurves of {method}: crossover within one pass size {sum(c.crossover_within_one for c in found)}/{len(found)}, "
                  f"whole win set right {sum(c.win_set_equal for c in found)}/{len(found)}"
                  + (f", right outside the tie band (the pair's bound) {sum(c.win_set_equal_outside_ties for c in found)}/{len(found)}"
                     if bound else ""))  # fmt: skip
            print(table)
            summary[f"curves_{method}"] = table.to_dicts()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        frame.write_parquet(args.out / "predictions.parquet")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
