"""The MLX validation on this machine (issue 29; results in docs/validation.md).

Fits the profile of a `moesim microbench mlx` folder (default data/mlx-cpu: F32 rows, dense
twins), builds an MLX target on the calibrated expert shape and a noisy draft, measures
speculative runs through mlx_lm at several draft lengths and compares them with the predictions.
Writes into --out: profile.toml, target-preset.toml, prompts.txt, runs/spec-k*.arrow (contract 2,
per-step minimum over the repetitions), per_k.csv, from_source.csv, summary.json; and r_of_n.csv,
u(n) against r(n) of the calibration's gathered kernels (uniform routing).

    .venv/bin/python bench/validate_mlx_cpu.py --out data/mlx-cpu-validation
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl

from moesim.errors import MoesimError
from moesim.sim.validate.llamacpp_cpu import per_k_display
from moesim.sim.validate.mlx_cpu import MlxValidationConfig, analyze, measured_r, run_mlx_validation


def main() -> int:
    defaults = MlxValidationConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/mlx-cpu-validation"))
    parser.add_argument("--calibration", type=Path, default=Path("data/mlx-cpu"), help="a `moesim microbench mlx` folder")
    parser.add_argument("--models-dir", type=Path, default=None, help="where the temporary MLX folders go")
    parser.add_argument("--draft-lens", default=",".join(map(str, defaults.draft_lens)))
    parser.add_argument("--repetitions", type=int, default=defaults.repetitions)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--noise", type=float, default=defaults.noise)
    parser.add_argument("--analyze-only", action="store_true", help="only recompute the comparison from the files in --out")
    args = parser.parse_args()
    config = MlxValidationConfig(
        draft_lens=tuple(int(k) for k in args.draft_lens.split(",")),
        repetitions=args.repetitions,
        max_tokens=args.max_tokens,
        noise=args.noise,
    )
    say = lambda message: print(message, flush=True)  # noqa: E731
    try:
        if args.analyze_only:
            validation = analyze(args.out, config)
            summary = json.loads((args.out / "summary.json").read_text())
        else:
            validation, summary = run_mlx_validation(config, args.out, args.calibration, args.models_dir, progress=say)
        r_of_n = measured_r(args.calibration / "measurements.parquet")
    except MoesimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r_of_n.write_csv(args.out / "r_of_n.csv")
    with pl.Config(tbl_cols=-1, tbl_width_chars=250, float_precision=2, tbl_rows=-1):
        print(per_k_display(validation))
        print(r_of_n)
    print("best draft length:", summary["best_draft"])
    print("longest draft length that beats plain decoding:", summary["longest_paying_draft"])
    print("rank agreement (Spearman, measured vs predicted from the k = 16 run):", round(summary["rank_agreement_from_source"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
