"""The dense family and the fixed time per pass of a profile, from the dense twins that the llama.cpp
microbenchmark times beside its MoE models (`llama_cpp.py`): measured, not assumed.

For every pass of n tokens the runner times dense models with L and 2L layers (the MoE models'
attention and norms, a 16-wide FFN) and keeps every repetition (`reps_us_dense_L`,
`reps_us_dense_2L`). With s the run's per-model statistic (min or median):

    layer_us(n)   = (s(T_2L) − s(T_L)) / L     one dense layer: attention, norms, the small FFN
    outside_us(n) = s(T_L) − L·layer_us(n)     the rest of a pass: embedding row, output norm,
                                               LM head, logits copy, the call into llama.cpp

The dense family is fitted to layer_us(n) = bytes_layer / bandwidth + 2·params_layer·n / rate
(non-negative least squares on relative residuals, `fit.solve_relative`), bytes and parameters
counted from the twin's tensors. Its `launch_us` is 0: every twin layer has the same bytes, so a
per-kernel overhead cannot be told apart from the bandwidth; on a CPU (no kernel launches) it is
folded into the effective bandwidth. The fixed time per pass is the median over all rows of
outside_us(n) minus the fitted dense time of the LM head and output norm, which the step-time
model counts in its dense part. The dense family's error is held out by routing (the runner times
the same twins once per routing, so this measures repeatability and misfit) and, with several
twin shapes, by shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.families import DenseFamily
from moesim.hw_profiles.fitting.family_fit import solve_relative
from moesim.hw_profiles.heldout import ErrorStats, HeldoutError, relative_errors
from moesim.hw_profiles.measurements.table import PROVENANCE_NAME, STATISTICS
from moesim.hw_profiles.provenance import Provenance, file_sha256
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, tensor_plans

REPS_COLUMNS = ("reps_us_dense_L", "reps_us_dense_2L")
NOTE = (
    "fitted to the microbenchmark's dense twins (llama.cpp or MLX): layer time = bytes / bandwidth + FLOPs / rate (launch folded into the "
    "bandwidth: every twin layer reads the same bytes); fixed time per pass = the twins' time outside their layers minus the LM head"
)


@dataclass(frozen=True)
class TwinBytes:
    """Bytes and parameters of one dense twin layer and of its LM head with the output norm."""

    layer_bytes: float
    layer_params: float
    head_bytes: float
    head_params: float

    @classmethod
    def of(cls, spec: TinyModelSpec) -> TwinBytes:
        """Count the twin's tensors (the builder's plans: exact bytes per tensor)."""
        plans = tensor_plans(spec)
        layer = [p for p in plans if p.name.startswith("blk.0.")]
        head = [p for p in plans if p.name in ("output.weight", "output_norm.weight")]
        width = 2 if spec.weight_type == "F16" else 4  # vectors (norms) are written as F32

        def size(plans: list[Any]) -> tuple[float, float]:
            elements = [math.prod(p.shape) for p in plans]
            return float(sum(e * (4 if len(p.shape) == 1 else width) for e, p in zip(elements, plans, strict=True))), float(sum(elements))

        (layer_bytes, layer_params), (head_bytes, head_params) = size(layer), size(head)
        return cls(layer_bytes, layer_params, head_bytes, head_params)


@dataclass(frozen=True)
class DenseTwinFit:
    """The fitted dense family, the fixed time per pass, and the evidence."""

    dense: DenseFamily
    pass_fixed_us: float
    rows: pl.DataFrame  # per row: shape, routing, n, layer_us measured and fitted, outside_us


def _runs(table: Path) -> list[dict[str, Any]]:
    path = table.parent / PROVENANCE_NAME
    if not path.is_file():
        raise InputError(f"{table}: the dense twins' shapes are in {PROVENANCE_NAME} beside the table, which is missing")
    try:
        runs = json.loads(path.read_text())["runs"]
        return [
            {"model": r["config"]["shape"]["model"], "statistic": r["config"]["statistic"], "spec": r["models"]["dense_L"]} for r in runs
        ]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: no dense-twin specs under 'runs' ({exc.__class__.__name__}: {exc})") from None


def has_dense_twins(frame: pl.DataFrame) -> bool:
    """Whether a table carries the dense twins' repetitions (written by the llama.cpp runner)."""
    return all(c in frame.columns for c in (*REPS_COLUMNS, "layers_differenced")) and frame[REPS_COLUMNS[0]].null_count() == 0


def _twin_rows(frame: pl.DataFrame, table: Path) -> pl.DataFrame:
    """Per row: the twin's layer and outside times, bytes and parameters."""
    runs = {run["model"]: run for run in _runs(table)}
    rows = []
    for row in frame.iter_rows(named=True):
        run = runs.get(row["model"])
        if run is None:
            raise InputError(f"{table}: model '{row['model']}' has no run in {PROVENANCE_NAME}")
        if run["statistic"] not in STATISTICS:
            raise InputError(f"{table.parent / PROVENANCE_NAME}: unknown statistic '{run['statistic']}'")
        try:
            twin = TwinBytes.of(TinyModelSpec(**run["spec"]))
        except TypeError as exc:
            raise InputError(f"{table.parent / PROVENANCE_NAME}: malformed dense twin spec ({exc})") from None
        stat = STATISTICS[run["statistic"]]
        layers = row["layers_differenced"]
        t_l, t_2l = stat(np.asarray(row["reps_us_dense_L"])), stat(np.asarray(row["reps_us_dense_2L"]))
        layer = (t_2l - t_l) / layers
        rows.append(
            {
                "model": row["model"],
                "routing": row.get("routing") or "",
                "n_tokens": row["n_tokens"],
                "layer_us": layer,
                "outside_us": t_l - layers * layer,
                "layer_bytes": twin.layer_bytes,
                "layer_flops": 2.0 * twin.layer_params * row["n_tokens"],
                "head_bytes": twin.head_bytes,
                "head_flops": 2.0 * twin.head_params * row["n_tokens"],
            }
        )
    out = pl.DataFrame(rows)
    bad = (out["layer_us"] <= 0).arg_true()
    if bad.len():
        i = int(bad[0])
        raise InputError(f"{table}: row {i}: the dense twins' layer difference is {out['layer_us'][i]:.1f} us, not above the noise")
    return out


def _fit(rows: pl.DataFrame) -> tuple[float, float]:
    """(µs per byte, µs per FLOP) fitted to the twins' layer times."""
    design = rows.select("layer_bytes", "layer_flops").to_numpy().astype(np.float64)
    theta = solve_relative(design, rows["layer_us"].to_numpy().astype(np.float64))
    if theta[0] <= 0:
        raise InputError("the dense twins' layer time does not rest on its bytes: no dense bandwidth can be fitted")
    return float(theta[0]), float(theta[1])


def _predict(rows: pl.DataFrame, theta: tuple[float, float]) -> np.ndarray:
    return rows["layer_bytes"].to_numpy() * theta[0] + rows["layer_flops"].to_numpy() * theta[1]


def _held_out(rows: pl.DataFrame, column: str) -> ErrorStats | None:
    labels = rows[column].to_numpy()
    if len(np.unique(labels)) < 2:
        return None
    errors = []
    for label in np.unique(labels):
        held = labels == label
        theta = _fit(rows.filter(pl.Series(~held)))
        part = rows.filter(pl.Series(held))
        errors.append(relative_errors(_predict(part, theta), part["layer_us"].to_numpy()))
    return ErrorStats.from_errors(np.concatenate(errors))


def fit_dense_twins(frame: pl.DataFrame, table: str | Path, provenance: Provenance) -> DenseTwinFit:
    """The dense family and fixed time per pass from a llama.cpp microbenchmark table's dense twins."""
    table = Path(table)
    rows = _twin_rows(frame, table)
    theta = _fit(rows)
    rate = math.inf if theta[1] <= 0 else 1.0 / (theta[1] * 1e6)
    in_sample = ErrorStats.from_errors(relative_errors(_predict(rows, theta), rows["layer_us"].to_numpy()))
    heldout = HeldoutError(
        leave_one_shape_out=_held_out(rows, "model"), leave_one_routing_out=_held_out(rows, "routing"), in_sample=in_sample
    )
    sources = Provenance(
        provenance.kind,
        provenance.file,
        provenance.sha256,
        note=f"{provenance.note}; dense twins' specs from {PROVENANCE_NAME} (sha256 {file_sha256(table.parent / PROVENANCE_NAME)[:16]}...)",
    )
    dense = DenseFamily(
        bandwidth_gbps=1.0 / (theta[0] * 1e3), tflops=rate, launch_us=0.0, provenance=sources, heldout_error=heldout, note=NOTE
    )
    head_us = dense.time_us(rows["head_bytes"].to_numpy(), rows["head_flops"].to_numpy(), 0.0)
    fixed = rows["outside_us"].to_numpy() - head_us
    evidence = rows.with_columns(pl.Series("layer_fitted_us", _predict(rows, theta)), pl.Series("fixed_us", fixed))
    return DenseTwinFit(dense, max(0.0, float(np.median(fixed))), evidence)
