"""Sweeps (`moesim sweep CONFIG.toml`): grids of models × profiles × engines × drafters × routing ×
batch × context × n × k × α, far beyond a measured grid, written as one Parquet file.

Work is split into units, one per (model, routing, batch). A unit does the expensive part once:
the routing features of every pass size n = 1..N (the exact distribution over the trace's
windows at B = 1, the unions of B lockstep lanes at B > 1), then the pass costs of every
profile × context × engine through the step-time model. The analytic (α, k) grid of each
engine × drafter is then one vectorised evaluation of S(k, α) = τ(k, α)/C(k) at the nominal
point and the four corners of the error box.

Resumable: each finished unit is written (atomically) to a partial-results folder named by the
config's digest beside the output; a rerun of the same config skips the units found there.
The output is assembled from the unit files in plan order and renamed into place, so it is
either complete or absent, and the same config gives the same bytes however often it was
interrupted. The rows and columns are documented in docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moesim.atomic import atomic_path, check_writable
from moesim.sim.sweep.cells import SimulationTally
from moesim.sim.sweep.config import RUN_CONFIG_KEY, SWEEP_FORMAT, SweepConfig, points_per_unit
from moesim.sim.sweep.executors import make_executor
from moesim.sim.sweep.plan import WorkUnit, plan_units
from moesim.sim.sweep.schema import SCHEMA, TALLY_KEY
from moesim.sim.sweep.unit import compute_unit
from moesim.tomlfile import toml_document

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SweepSummary:
    """What a sweep did."""

    out: Path
    units: int
    resumed: int
    rows: int
    points: int
    elapsed_s: float
    digest: str
    simulation: SimulationTally = field(default_factory=SimulationTally)

    @property
    def points_per_s(self) -> float:
        """Analytic points of the units computed in this run, per second of this run."""
        computed = self.points * (self.units - self.resumed) / self.units if self.units else 0
        return computed / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def simulated_iterations_per_s(self) -> float:
        """The SimPy cells' own rate: engine iterations simulated per second of their wall time (all units, resumed ones too)."""
        return self.simulation.iterations / self.simulation.seconds if self.simulation.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, object]:
        """JSON form."""
        return {
            **dataclasses.asdict(self),
            "out": str(self.out),
            "points_per_s": self.points_per_s,
            "simulated_iterations_per_s": self.simulated_iterations_per_s,
        }


def partial_dir(config: SweepConfig, out: Path) -> Path:
    """The partial-results folder of this config and output: `.OUT.DIGEST16.partial` beside it."""
    return out.parent / f".{out.name}.{config.digest[:16]}.partial"


def default_out(config_path: Path) -> Path:
    """The output when none is given: the config's name with .parquet, beside it."""
    return config_path.with_suffix(".parquet")


def kept_units(config: SweepConfig, out: Path) -> tuple[Path, int]:
    """The partial-results folder of an interrupted sweep and the unit files it keeps."""
    folder = partial_dir(config, out)
    return folder, len(list(folder.glob("unit-*.parquet")))


def _write_unit(path: Path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _compute_to_file(config: SweepConfig, task: tuple[WorkUnit, Path]) -> None:
    """A worker that sees the driver's filesystem writes its unit file itself (no table through a pipe)."""
    unit, path = task
    _write_unit(path, compute_unit(config, unit))


def _assemble(config: SweepConfig, out: Path, files: list[Path]) -> tuple[int, SimulationTally]:
    """Stream the unit files, in plan order, into the output (atomically); returns its rows and
    the SimPy cells' tally summed over the units."""
    metadata = {
        "moesim.format": SWEEP_FORMAT,
        "moesim.config": json.dumps(config.identity, sort_keys=True, default=str),
        RUN_CONFIG_KEY: toml_document(config.table()),
    }
    schema = SCHEMA.with_metadata(metadata)
    rows, tallies = 0, []
    with atomic_path(out) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for path in files:
            table = pq.read_table(path, schema=SCHEMA)
            tallies.append(json.loads((pq.read_schema(path).metadata or {}).get(TALLY_KEY, b"{}")))
            writer.write_table(table.replace_schema_metadata(metadata))
            rows += table.num_rows
    total = SimulationTally(*(sum(t.get(f.name, 0) for t in tallies) for f in dataclasses.fields(SimulationTally)))
    return rows, total


def _run_units(
    config: SweepConfig, runner: Any, units: list[WorkUnit], files: list[Path], todo: list[int], progress: Progress | None
) -> None:
    """Compute the units not yet in the partial folder, each written there as it finishes."""
    done = len(units) - len(todo)
    if progress:
        progress(done, len(units))
    if runner.shares_filesystem:
        finished = runner.map_unordered(functools.partial(_compute_to_file, config), [(units[i], files[i]) for i in todo])
    else:
        finished = runner.map_unordered(functools.partial(compute_unit, config), [units[i] for i in todo])
    for j, table in finished:
        if table is not None:
            _write_unit(files[todo[j]], table)
        done += 1
        if progress:
            progress(done, len(units))


def run_sweep(
    config: SweepConfig,
    out: Path,
    executor: str | None = None,
    workers: int | None = None,
    fresh: bool = False,
    progress: Progress | None = None,
) -> SweepSummary:
    """Run (or resume) the sweep and write `out`; `executor` and `workers` override the config's."""
    out = Path(out)
    check_writable(out)
    units = plan_units(config)
    runner = make_executor(
        executor or config.sweep.executor, config.sweep.workers if workers is None else workers, config.sweep.ray_address
    )
    folder = partial_dir(config, out)
    if fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(exist_ok=True)
    files = [folder / WorkUnit.file_name(i) for i in range(len(units))]
    todo = [i for i, path in enumerate(files) if not path.is_file()]
    resumed = len(units) - len(todo)
    start = time.perf_counter()
    try:
        _run_units(config, runner, units, files, todo, progress)
        rows, tally = _assemble(config, out, files)
    except KeyboardInterrupt:
        raise  # Ctrl-C or SIGTERM: the finished units stay, a rerun resumes from them
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # an error: no partial results left behind
        raise
    elapsed = time.perf_counter() - start
    shutil.rmtree(folder)
    return SweepSummary(out, len(units), resumed, rows, points_per_unit(config) * len(units), elapsed, config.digest, tally)
