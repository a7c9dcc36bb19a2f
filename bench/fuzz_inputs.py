"""The longer run of issue 15's fuzz suite: random (not derandomised) corruptions of every input
kind through its boundary, in-process, with the same assertions as tests/test_input_fuzz.py.

    python bench/fuzz_inputs.py [--cases 5000] [--kinds preset,profile] [--seed 0]

Prints, per kind, the cases run, how many were read and how many refused, and the first
failures (an exception that is not a one-line MoesimError naming the file, a file changed, a
temporary left); exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fuzzing import check_boundary, corrupted, corrupted_table, kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5000, help="cases per kind")
    parser.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, kind in kinds(folder).items():
            if args.kinds and name not in args.kinds.split(","):
                continue
            outcomes: Counter[str] = Counter()
            failures: Counter[str] = Counter()
            strategy = corrupted_table(kind.doc) if name == "measurements" else corrupted(kind.doc, kind.json_like)

            @seed(args.seed)
            @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(doc=strategy)
            def case(doc: object) -> None:
                try:
                    outcomes[check_boundary(kind, folder / kind.file, doc)] += 1  # noqa: B023 (run at once)
                except Exception as exc:
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    failures[f"{type(exc).__name__}: {str(exc)[:160]} at {Path(where.filename).name}:{where.lineno}"] += 1  # noqa: B023

            start = time.perf_counter()
            case()
            seconds = time.perf_counter() - start
            runs = sum(outcomes.values()) + sum(failures.values())
            bad = sum(failures.values())
            print(f"{name}: {runs} cases in {seconds:.0f} s, {outcomes['ok']} read, {outcomes['refused']} refused, {bad} failed")
            for text, count in failures.most_common(8):
                print(f"    {count} x {text}")
            failed += bad
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
