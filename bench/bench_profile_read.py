"""Speed of reading a hardware profile (a benchmark, not a test).

Every command and many tests read a profile: `read_profile` of a TOML file is `tomllib`'s parse,
the nesting and integer checks of `moesim.parsing.load_toml`, then every table's fields checked
(`moesim.fields.build`: the ladder's grids are columns of hundreds of knots). Reference in the
same run: `tomllib.loads` of the same text alone (the floor no check can go under). Uncached:
`read_profile` itself, not `load_profile`'s per-process cache.

    .venv/bin/python bench/bench_profile_read.py [--profile NAME] [--repeats N]

Times are CPU time of this process (`time.process_time`, best of --repeats runs of 10 reads).
Prints ms per read, the parse alone and the whole read, and their ratio.
"""

from __future__ import annotations

import argparse
import time
import tomllib
from collections.abc import Callable

from moesim.hw_profiles.builtin import profiles_dir
from moesim.hw_profiles.schema import read_profile

READS = 10


def best_of(repeats: int, run: Callable[[], object]) -> float:
    """Least CPU time of `repeats` runs of READS calls, per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(READS):
            run()
        best = min(best, (time.process_time() - start) / READS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="nvidia-h200", help="a built-in profile's name")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = profiles_dir() / f"{args.profile}.toml"
    text = path.read_text()
    read_profile(path)  # imports and first-call caches out of the timing
    parse_s = best_of(args.repeats, lambda: tomllib.loads(text))
    read_s = best_of(args.repeats, lambda: read_profile(path))
    print(f"{args.profile} ({len(text):,} bytes): tomllib parse {parse_s * 1e3:.1f} ms, read_profile {read_s * 1e3:.1f} ms "
          f"({read_s / parse_s:.2f}x the parse alone)")


if __name__ == "__main__":
    main()
