"""Measurement tables (contract 3): the real H200 table loads; malformed tables give one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
import pytest
from conftest import DATA

from moesim.errors import InputError
from moesim.hw_profiles.measurements.table import is_dedup_family, load_measurements

H200 = DATA / "h200" / "calibration.parquet"


def test_h200_table_loads_with_unknown_columns_kept() -> None:
    assert hashlib.sha256(H200.read_bytes()).hexdigest() == "5b07a0ea8a77e39f59397b42226ea8ae9aed973aa5309e116fce357087d9fd1b"
    frame = load_measurements(H200)
    assert set(frame["kernel"].unique()) == {"per_slot", "dedup", "dedup_grouped_gemm", "dedup_loop"}
    assert frame["n_tokens"].dtype == pl.Int64 and frame["time_us"].min() > 0
    assert "queue_ahead" in frame.columns  # not in the contract: kept and ignored
    assert is_dedup_family("dedup_grouped_gemm") and not is_dedup_family("per_slot")


def _csv(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("kernel,time_us\nper_slot,3\n", ["column 'n_tokens' is missing"]),
        ("kernel,n_tokens,time_us\nper_slot,2,-1\n", ["row 0", "'time_us'", "-1"]),
        ("kernel,n_tokens,time_us\nper_slot,2,5\nmystery,2,5\n", ["row 1", "'kernel'", "mystery"]),
        ("kernel,n_tokens,time_us\nper_slot,2.5,5\n", ["row 0", "'n_tokens'", "2.5"]),
        ("kernel,n_tokens,time_us\nper_slot,two,5\n", ["row 0", "'n_tokens'", "two"]),
        ("kernel,n_tokens,time_us\nper_slot,,5\n", ["row 0", "'n_tokens'", "empty"]),
        ("kernel,n_tokens,time_us,distinct_experts\ndedup,2,5,0\n", ["row 0", "'distinct_experts'", "> 0"]),
    ],
)
def test_malformed_tables(tmp_path: Path, text: str, fragments: list[str]) -> None:
    with pytest.raises(InputError) as info:
        load_measurements(_csv(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_wrong_suffix_and_missing(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"must be \.parquet or \.csv"):
        load_measurements(_csv(tmp_path, "x").rename(tmp_path / "m.txt"))
    with pytest.raises(InputError, match="no such measurement table"):
        load_measurements(tmp_path / "none.csv")
