"""Speed of a sweep sent to a local Ray cluster against the same sweep in this process (a benchmark, not a test).

tests/test_sweep.py holds the two executors to the same bytes; how long Ray takes (its cluster
started, the units shipped to two workers and back) depends on the machine and its load, so it is
measured here, against the local executor in the same run, instead of asserted in a test. The grid
is the test's, read from tests/sweep_base.toml: DeepSeek-V2-Lite on the H200 profile, two
families, two drafters, seven α, batch 1 and 3, a sticky trace of 4 sequences x 300 tokens.

    .venv/bin/python bench/bench_ray_sweep.py

Prints the wall time of each executor (Ray's includes starting its cluster), their ratio, and
last `ray_over_local: X`. Needs the ray extra (pip install 'moesim[ray]').
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from moesim.sim.sweep.config import load_config
from moesim.sim.sweep.run import run_sweep

CONFIG = Path(__file__).parents[1] / "tests" / "sweep_base.toml"  # the sweep tests/test_sweep.py checks


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        config = load_config(CONFIG)
        start = time.perf_counter()
        local = run_sweep(config, Path(folder) / "local.parquet")
        local_s = time.perf_counter() - start
        start = time.perf_counter()
        remote = run_sweep(config, Path(folder) / "ray.parquet", executor="ray", workers=2)
        ray_s = time.perf_counter() - start
        assert remote.out.read_bytes() == local.out.read_bytes(), "ray and local sweeps differ"
    print(f"local executor, 1 worker:  {local_s:8.2f} s wall")
    print(f"ray executor, 2 workers:   {ray_s:8.2f} s wall (cluster start included)")
    print(f"ray_over_local: {ray_s / local_s:.2f}")


if __name__ == "__main__":
    main()
