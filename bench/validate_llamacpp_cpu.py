"""The llama.cpp validation on this machine (issue 8; results in docs/validation.md).

Builds a target with >= 1 GB of expert weights and a noisy draft, calibrates a CPU profile with
the llama.cpp microbenchmark on the target's expert shape (or reuses a calibration folder),
measures speculative runs at several draft lengths, and compares them with the predictions.
Writes into --out: calibration/ (the microbenchmark's table), profile.toml, target-preset.toml,
prompts.txt, runs/spec-k*.arrow (contract 2, per-step minimum over the repetitions), per_k.csv,
from_source.csv, isolated_passes.csv and summary.json.

    .venv/bin/python bench/validate_llamacpp_cpu.py --out data/cpu-validation
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl

from moesim.errors import MoesimError
from moesim.sim.validate.llamacpp_cpu import CpuValidationConfig, analyze, per_k_display, run_cpu_validation, run_isolated_check


def main() -> int:
    defaults = CpuValidationConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/cpu-validation"))
    parser.add_argument("--calibration", type=Path, default=None, help="reuse a microbenchmark folder instead of running it")
    parser.add_argument("--models-dir", type=Path, default=None, help="where the temporary GGUF files go")
    parser.add_argument("--draft-lens", default=",".join(map(str, defaults.draft_lens)))
    parser.add_argument("--repetitions", type=int, default=defaults.repetitions)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--threads", type=int, default=defaults.n_threads)
    parser.add_argument("--noise", type=float, default=defaults.noise)
    parser.add_argument("--bench-reps", type=int, default=defaults.bench_reps)
    parser.add_argument("--isolated-only", action="store_true", help="only re-time isolated passes against the runs already in --out")
    parser.add_argument("--analyze-only", action="store_true", help="only recompute the comparison from the files in --out")
    args = parser.parse_args()
    config = CpuValidationConfig(
        draft_lens=tuple(int(k) for k in args.draft_lens.split(",")),
        repetitions=args.repetitions,
        max_tokens=args.max_tokens,
        n_threads=args.threads,
        noise=args.noise,
        bench_reps=args.bench_reps,
    )
    say = lambda message: print(message, flush=True)  # noqa: E731
    try:
        if args.isolated_only:
            print(
                "median error of the prediction vs the minimum of back-to-back passes, % by pass size:",
                run_isolated_check(config, args.out, args.models_dir, say),
            )
            return 0
        if args.analyze_only:
            validation = analyze(args.out, config)
            summary = json.loads((args.out / "summary.json").read_text())
        else:
            result = run_cpu_validation(config, args.out, args.calibration, args.models_dir, progress=say)
            validation, summary = result.validation, result.summary
    except MoesimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with pl.Config(tbl_cols=-1, tbl_width_chars=250, float_precision=1):
        print(per_k_display(validation))
    print("best draft length:", summary["best_draft"])
    print("rank agreement (Spearman, measured vs predicted from the k = 16 run):", round(summary["rank_agreement_from_source"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
