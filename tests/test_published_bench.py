"""The published llama-bench tables kept for judging (`data/validation/llama-bench-published/`)
import as their README states: each series its number of rows, on a catalog device, of a preset,
in both builds of the table; and every stored table is described there."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from moesim.hw_profiles import load_profile
from moesim.hw_profiles.catalog import lookup_device
from moesim.hw_profiles.importers import ImportOptions, choose_variant, import_table
from moesim.hw_profiles.importers.names import resolve_formats
from moesim.models import builtin_names

FOLDER = REPO / "data" / "validation" / "llama-bench-published"
PR15631 = "llama.cpp-pr15631-fuse-adds.md"

# (file, device, preset, expert format) -> rows, as README.md states them
STATED = {
    (PR15631, "P40", "qwen3-30b-a3b", "Q3_K"): 9,
    (PR15631, "RTX 3090", "gpt-oss-20b", "MXFP4"): 1,
    (PR15631, "RTX 4090", "gpt-oss-20b", "MXFP4"): 3,
    (PR15631, "RTX 4090", "qwen3-30b-a3b", "Q4_0"): 7,
}


@pytest.mark.parametrize(("key", "rows"), list(STATED.items()), ids=[f"{k[1]}-{k[2]}" for k in STATED])
def test_each_series_imports_as_stated(key: tuple[str, str, str, str], rows: int) -> None:
    name, device, model, weight_format = key
    path = FOLDER / name
    selected = ImportOptions(filters=(f"device={device}", f"model={model}"))
    options, note = choose_variant(path, None, selected)
    assert "b64ba1cc8" in note  # the table's two builds: the last is the default
    _, frame = import_table(path, None, options)
    assert frame.height == rows
    assert lookup_device(device) is not None and model in builtin_names("moe")
    assert set(frame["dtype"]) == {weight_format} and (frame["scope"] == "pass").all()
    assert frame["n_tokens"].n_unique() == rows
    _, other = import_table(path, None, ImportOptions(filters=(*selected.filters, "variant=5a0e3ef6f")))
    assert other["n_tokens"].to_list() == frame["n_tokens"].to_list()


def test_every_stored_table_is_described_and_judged() -> None:
    readme = (FOLDER / "README.md").read_text()
    tables = sorted(p.name for p in FOLDER.glob("*.md") if p.name != "README.md")
    assert tables == sorted({key[0] for key in STATED})
    assert all(f"`{name}`" in readme for name in tables)
    public = (REPO / "data" / "public-bench" / "moe_pass_times.csv").read_text()
    assert "llama.cpp/pull/15631," not in public  # held out: the shared table does not hold the source


@pytest.mark.parametrize("name", ["Q3_K_S", "Q3_K - Small", "q3_k_s"])
def test_llama_cpp_small_recipe_is_q3_k(name: str) -> None:
    assert resolve_formats(name, "here") == ("Q3_K", "Q3_K")


def test_rows_beyond_a_profiles_range_are_flagged(cli) -> None:  # type: ignore[no-untyped-def]
    """The P40 built-in was fitted on passes of at most 128 tokens: each published row's factor is at
    least its pass size over that bound (the factor is the largest ratio over the family's inputs),
    and validate counts and says the rows beyond."""
    code, stdout, err = cli("validate", FOLDER / PR15631, "--profile", "nvidia-p40-llamacpp", "--filter", "device=P40", "--json")
    assert code == 0, err
    checked = json.loads(stdout)
    high = load_profile("nvidia-p40-llamacpp").expert_family("dedup_mmq").calibrated_range.bounds["n_tokens"][1]
    rows = checked["rows_predicted"]
    assert all(r["extrapolated_x"] >= max(1.0, r["n_tokens"] / high) * (1 - 1e-12) for r in rows)
    assert checked["extrapolated_rows"] == sum(r["extrapolated_x"] > 1 + 1e-9 for r in rows) > 0
    code, stdout, err = cli("validate", FOLDER / PR15631, "--profile", "nvidia-p40-llamacpp", "--filter", "device=P40")
    assert code == 0 and f"{checked['extrapolated_rows']} of them lie beyond the calibrated range" in " ".join(stdout.split()), err
