"""Leave-one-shape-out validation on the H200 table (issue 8; results in docs/validation.md).

For each of the four model shapes: fit a profile on the other three (`profile fit`, the same
procedure as the shipped profile), then predict the held-out shape's rows with `moesim validate`
(the same code path), per family. Writes into --out `summary.csv` (per fold and family: rows,
median and p90 absolute error, mean signed error, Pearson r, share inside the bound; per dedup
family: savings inside the bound, crossovers within one pass size, equal win sets),
`pooled.csv` (per family over all held-out rows), `summary.json` (everything `validate --json`
says per fold) and `predictions.parquet` (every row predicted by the fold that held its shape
out: the input of `moesim report`'s predicted-vs-measured plot); the folds' tables and profiles
go to a temporary folder.

    .venv/bin/python bench/validate_h200_shapes.py --out data/validation/h200-shapes

The commands it runs, for one held-out shape S:

    moesim profile fit fit-S.parquet --device-json data/h200/device.json --name h200-without-S --out h200-without-S.toml
    moesim validate heldout-S.parquet --profile h200-without-S.toml --json --out predictions-S
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

from moesim.hw_profiles.fitting.calibrate import fit_profile
from moesim.hw_profiles.schema import write_profile
from moesim.sim.validate.metrics import errors_by
from moesim.sim.validate.result import ValidateOptions, validate

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "data" / "h200" / "calibration.parquet"
DEVICE = REPO / "data" / "h200" / "device.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "data" / "validation" / "h200-shapes")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    table = pl.read_parquet(TABLE)
    with tempfile.TemporaryDirectory(prefix="moesim-h200-shapes-") as folder:
        rows, folds, predictions = folds_of(table, Path(folder))
    frame = pl.DataFrame(rows)
    frame.write_csv(out / "summary.csv")
    held_out = pl.concat(predictions)
    held_out.write_parquet(out / "predictions.parquet")
    pooled = pl.DataFrame([{"family": family, **errors} for family, errors in errors_by(held_out, "kernel").items()])
    pooled.write_csv(out / "pooled.csv")
    (out / "summary.json").write_text(json.dumps(folds, indent=1, sort_keys=True) + "\n")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, float_precision=2):
        print(frame)
        print(pooled)
    return 0


def folds_of(table: pl.DataFrame, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[pl.DataFrame]]:
    """Fit without each shape, validate on it: per-family rows, `validate --json` per fold, predictions."""
    rows, folds, predictions = [], {}, []
    for shape in sorted(set(table["model"].to_list())):
        fit_rows, held = work / f"fit-{shape}.parquet", work / f"heldout-{shape}.parquet"
        table.filter(pl.col("model") != shape).write_parquet(fit_rows)
        table.filter(pl.col("model") == shape).write_parquet(held)
        profile_path = work / f"h200-without-{shape}.toml"
        write_profile(profile_path, fit_profile(fit_rows, f"h200-without-{shape}", device_json=DEVICE).profile)
        result = validate([held], ValidateOptions(str(profile_path)))
        result.write(work / f"predictions-{shape}")
        predictions.append(result.predictions)
        summary = result.to_dict()
        folds[shape] = summary
        for family, errors in summary["per_family"].items():
            dedup = summary["families"].get(family, {})
            part = result.predictions.filter(pl.col("kernel") == family)
            rows.append(
                {
                    "held_out": shape,
                    "family": family,
                    "rows": errors["rows"],
                    "median_abs_pct": errors["median_abs_pct_error"],
                    "p90_abs_pct": errors["p90_abs_pct_error"],
                    "mean_signed_pct": errors["mean_signed_pct_error"],
                    "pearson_r": errors["pearson_r"],
                    "inside_bound": errors["time_inside_bound_fraction"],
                    "extrapolated_rows": int(part["extrapolated"].sum()),
                    "saving_inside_bound": dedup.get("saving_inside_bound_fraction"),
                    "crossover_within_one": dedup.get("crossover_within_one_fraction"),
                    "win_set_equal": dedup.get("win_set_equal_fraction"),
                }
            )
        print(f"held out {shape}: {summary['rows']} rows, median {summary['median_abs_pct_error']:.1f} %", flush=True)
    return rows, folds, predictions


if __name__ == "__main__":
    sys.exit(main())
