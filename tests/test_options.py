"""Every documented option of predict, best-draft, batch, crossover and simulate, in combinations,
on the built-in trace against one built-in profile of every kind (lab, each engine's published
profiles, the datasheet-scaled ones, MLX): each run exits 0 with its output read back, or where the
combination cannot be priced, one line on stderr and exit code 2. The options exercised are checked
against each command's --help and the README, so a new option fails here until it is run."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moesim.cli.options import RENAMED
from moesim.hw_profiles import builtin_names, load_profile
from moesim.hw_profiles.catalog import device_of_profile

TRACE = "esft-vanilla-lite"
TREE = "eagle3,paths=[[0],[0,0],[0,1]]"
REPO = Path(__file__).resolve().parents[1]
# One built-in profile of each kind: (engine, or "lab" without a dispatch; status) -> profile, weight format.
KINDS = {
    ("lab", "calibrated"): ("nvidia-h200", None),
    ("vLLM fused_moe", "published-calibrated"): ("nvidia-h200-vllm", None),
    ("vLLM fused_moe", "datasheet-scaled"): ("nvidia-h100-sxm-vllm", None),
    ("llama.cpp CUDA", "published-calibrated"): ("nvidia-rtx-3090-llamacpp", "Q4_K"),
    ("llama.cpp CUDA", "datasheet-scaled"): ("nvidia-rtx-4090-llamacpp", "Q4_K"),
    ("llama.cpp Metal", "published-calibrated"): ("apple-m2-ultra-metal", "Q4_K"),
    ("llama.cpp Metal", "datasheet-scaled"): ("apple-m3-max-metal", None),
    ("llama.cpp Vulkan", "published-calibrated"): ("amd-rx-7900-xtx-vulkan", "Q4_0"),
    ("MLX", "published-calibrated"): ("apple-m3-ultra-mlx", None),
}
COMMANDS = ("predict", "best-draft", "batch", "crossover", "simulate")
Cli = Callable[..., tuple[int, str, str]]


def peer_link(profile: str) -> str:
    """The catalog's peer link of the profile's device ('' where it has none: --link names one)."""
    hw = load_profile(profile)
    device = device_of_profile(hw.name, hw.device.name)
    return device.peer_link if device is not None else ""


def kind_of(name: str) -> tuple[str, str]:
    profile = load_profile(name)
    return ("lab" if profile.dispatch is None else profile.device.engine, profile.status)


def test_every_kind_of_builtin_profile_is_covered() -> None:
    assert {kind_of(name) for name in builtin_names()} == set(KINDS)
    assert all(kind_of(name) == kind for kind, (name, _) in KINDS.items())


def runs(profile: str, fmt: str | None, accept_run: Path) -> list[list[str]]:
    """The combinations run on one profile: the issue's (--batch with --verdict, a tree drafter with
    --json and --verdict, several devices) on every kind, the other options spread over them."""
    base = ["--trace", TRACE, "--profile", profile, *(["--format", fmt] if fmt else [])]
    hw = load_profile(profile)
    family = ["--family", "best"] if hw.dispatch is None else ["--family", "dispatch"]
    link = [] if peer_link(profile) else ["--link", "pcie4-x16"]
    dedup = ["--dedup-family", hw.dedup_families[0]] if hw.dedup_families else []
    return [
        ["predict", *base, "--max-pass", "3", "--json", *family, "--expert-parallel", "4", *link, "--all-reduce", "auto"],
        ["predict", *base, "--pass-sizes", "1,4", "--tensor-parallel", "2", *link, "--context-tokens", "256",
         "--model", "deepseek-v2-lite", "--batch", "4"],
        ["predict", *base, "--max-pass", "2", "--tensor-parallel", "2", *link, "--out", str(accept_run.parent / f"plan-{profile}"),
         "--force"],
        ["best-draft", *base, "--alpha", "0.6", "--batch", "4", "--verdict", "--max-draft", "2"],
        ["best-draft", *base, "--drafter", TREE, "--alpha", "0.7", "--max-draft", "2", "--json", "--verdict", "--batch", "2"],
        ["best-draft", *base, "--drafter", "qwen3-0.6b", "--accept-len", "2.2@2", "--depth-rates", "0.8,0.6", "--max-draft", "2",
         "--accept-run", str(accept_run), "--expert-parallel", "2", *link, "--json"],
        ["best-draft", *base, "--alpha", "0.9", "--max-draft", "1", "--tensor-parallel", "2", *link, "--all-reduce", "nccl", *family,
         "--context-tokens", "64", "--model", "deepseek-v2-lite", "--verdict"],
        ["batch", *base, "--alpha", "0.8", "--draft-len", "2", "--batch", "1,4", "--json", "--tensor-parallel", "2", "--expert-parallel",
         "2", *link, "--all-reduce", "nccl"],
        ["batch", *base, "--alpha", "0.5", "--draft-len", "1", "--batch", "3", "--moesd-slots", "--routing", "uniform", "--drafter",
         "ngram:20", *family, "--context-tokens", "128", "--model", "deepseek-v2-lite"],
        ["crossover", *base, "--max-pass", "4", "--json", *dedup, "--expert-parallel", "2", *link],
        ["crossover", *base, "--pass-sizes", "2,8", "--model", "deepseek-v2-lite", "--tensor-parallel", "2", *link, "--all-reduce", "auto",
         "--batch", "3"],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def accept_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run") / "accepted.csv"
    path.write_text("seq,accepted\n0,2\n0,1\n0,0\n1,2\n1,2\n")
    return path


def check_output(args: list[str], code: int, out: str, err: str) -> None:
    """Exit 0 and an answer that reads back; or the one combination a profile cannot price: one line, exit 2."""
    command = args[0]
    hw = load_profile(args[args.index("--profile") + 1])
    if command == "crossover" and not (hw.dedup_families and "per_slot" in hw.expert_families):  # nothing to compare
        assert code == 2 and err.count("\n") == 1 and ("no dedup family" in err or "no family 'per_slot'" in err), err
        return
    assert code == 0, f"{' '.join(args)}: {err}"
    assert "Traceback" not in err
    if "--json" not in args:
        assert out.strip()
        return
    result = json.loads(out)
    if command == "predict":
        times = [p["time_us"] for p in result["passes"]]
        assert all(np.isfinite(times)) and all(p["low_us"] <= p["time_us"] <= p["high_us"] for p in result["passes"])
    elif command == "best-draft":
        assert all(p["speedup_low"] <= p["speedup"] <= p["speedup_high"] for p in result["points"])
        assert result.get("batch", 1) == (int(args[args.index("--batch") + 1]) if "--batch" in args else 1)
        assert ("verdict" in result) == ("--verdict" in args)
        assert ("verify_tokens" in result) == ("--drafter" in args and args[args.index("--drafter") + 1] == TREE)
    elif command == "batch":
        rows = result["batches"]
        assert [r["batch"] for r in rows] == [int(b) for b in args[args.index("--batch") + 1].split(",")]
        assert all(r["speedup"] > 0 and np.isfinite(r["speedup"]) for r in rows)
    else:
        assert len(result["byte_share"]) == len(result["per_slot_us"]) > 0


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda kind: f"{kind[0]}-{kind[1]}".replace(" ", "_"))
def test_analysis_options_on_every_kind_of_profile(kind: tuple[str, str], cli: Cli, accept_run: Path) -> None:
    profile, fmt = KINDS[kind]
    for args in runs(profile, fmt, accept_run):
        check_output(args, *cli(*args))


def test_several_devices_price_collectives_and_need_a_link(cli: Cli) -> None:
    """TP 2 adds the collectives (a comm_us column) to every pass; a device without a peer link in
    the catalog needs --link; EP over devices the experts do not split over, or a custom all-reduce
    on PCIe, is one line."""
    base = ["predict", "--trace", TRACE, "--max-pass", "2", "--json"]
    code, out, err = cli(*base, "--profile", "nvidia-h200", "--tensor-parallel", "2")
    assert code == 0, err
    passes = json.loads(out)["passes"]
    assert all(p["comm_us"] > 0 for p in passes)
    code, out, err = cli(*base, "--profile", "nvidia-h200")
    assert code == 0 and "comm_us" not in json.loads(out)["passes"][0]
    for extra, message in (
        (("--profile", "apple-m3-ultra-mlx", "--tensor-parallel", "2"), "no peer link"),
        (("--profile", "nvidia-h200", "--expert-parallel", "3"), "do not split over 3"),
        (("--profile", "nvidia-h200", "--tensor-parallel", "2", "--expert-parallel", "4"), "--expert-parallel 4 takes"),
        (("--profile", "nvidia-l40s-vllm", "--tensor-parallel", "2", "--all-reduce", "custom"), "no custom all-reduce"),
        (("--profile", "nvidia-h200", "--tensor-parallel", "2", "--link", "warp"), "unknown link 'warp'"),
    ):
        code, _, err = cli(*base, *extra)
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_old_engine_spelling_still_works_with_a_note(cli: Cli) -> None:
    args = ["predict", "--trace", TRACE, "--profile", "nvidia-h200", "--max-pass", "2", "--json"]
    old, new = cli(*args, "--engine", "best"), cli(*args, "--family", "best")
    assert old[0] == new[0] == 0 and old[1] == new[1] and json.loads(old[1])["family"] == "best"
    assert "--engine is deprecated, use --family" in old[2] and old[2].count("\n") == 1
    assert "--engine" not in cli("predict", "--help")[1]


def test_tree_drafter_beyond_its_depth(cli: Cli) -> None:
    """A --max-draft deeper than a static tree is one line naming the depth; without it the tree's depth is the default."""
    args = ("best-draft", "--trace", TRACE, "--profile", "nvidia-h200", "--drafter", TREE, "--alpha", "0.7")
    code, _, err = cli(*args, "--max-draft", "3")
    assert code == 2 and err.count("\n") == 1 and "reaches depth 2" in err, err
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["verify_tokens"] == [1, 2, 4] and 0 <= result["points"][0]["best_draft"] <= 2


SIM_CONFIG = """
[run]
seed = 1
requests = 4

[workload]
prompt_tokens = 16
output_tokens = 24

[batching]
max_batch = 2

[trace]
path = "{trace}"

[target]
model = "deepseek-v2-lite"
profile = "{profile}"
{format}
[parallel]
tensor_parallel = {devices}
expert_parallel = {ep}
{link}
[drafter]
kind = "preset"
model = "qwen3-0.6b"

[cost]
kind = "steptime"

[acceptance]
model = "geometric"
alpha = 0.7

[policy]
name = "static"
k = 2
"""


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda kind: f"{kind[0]}-{kind[1]}".replace(" ", "_"))
def test_simulate_options_on_every_kind_of_profile(kind: tuple[str, str], cli: Cli, tmp_path: Path) -> None:
    """simulate's --out, --json and --force on every kind, over two devices (EP on the lab profile)."""
    profile, fmt = KINDS[kind]
    link = "" if peer_link(profile) else 'link = "pcie4-x16"'
    ep = "true" if kind[0] == "lab" else "false"
    text = SIM_CONFIG.format(trace=TRACE, profile=profile, format=f'weight_format = "{fmt}"\n' if fmt else "", devices=2, ep=ep, link=link)
    config = tmp_path / "c.toml"
    config.write_text(text)
    out = tmp_path / "run"
    code, stdout, err = cli("simulate", config, "--out", out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["requests_completed"] == 4 and summary["parallel"].startswith("EP 2" if ep == "true" else "TP 2")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    code, _, err = cli("simulate", config, "--out", mine)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    code, stdout, err = cli("simulate", config, "--out", mine, "--force")
    assert code == 0 and "speedup" in stdout and (mine / "notes.txt").read_text() == "a user's file"


def documented(text: str) -> set[str]:
    """The long options a --help lists (each row of its options box; not those its help texts name)."""
    return set(re.findall(r"^│ (?:\*  |   )?(--[a-z][a-z0-9-]+)", text, re.MULTILINE)) - {"--help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_option_is_exercised(command: str, cli: Cli, tmp_path: Path) -> None:
    """The options this file runs are every option --help and the README document (and only those)."""
    code, help_text, _ = cli(command, "--help")
    assert code == 0
    options = documented(help_text)
    every_run = [args for profile, fmt in KINDS.values() for args in runs(profile, fmt, tmp_path / "r.csv")]
    exercised = {a for args in every_run if args[0] == command for a in args if a.startswith("--")}
    if command == "simulate":
        exercised = {"--out", "--json", "--force"}
    assert options == exercised, (options - exercised, exercised - options)
    renamed = set(RENAMED.get((command,), {}))
    readme = (REPO / "README.md").read_text()
    for line in re.findall(rf"moesim {command} .*", readme):
        named = set(re.findall(r"(--[a-z][a-z0-9-]+)", line.split("#")[0]))
        assert named <= options, (line, named - options - renamed)


def test_batch_sizes_up_to_what_the_trace_allows(cli: Cli) -> None:
    """The built-in trace has 160 sequences: B = 160 batches whole sequences, B = 200 cuts each into
    segments (the longest still holds a verify pass of 2); a batch whose lanes cannot hold the
    verify pass is one line."""
    code, out, err = cli("predict", "--trace", TRACE, "--profile", "nvidia-h200", "--pass-sizes", "1,2", "--json", "--batch", "160")
    assert code == 0 and json.loads(out)["batch"] == 160, err
    one = json.loads(cli("predict", "--trace", TRACE, "--profile", "nvidia-h200", "--pass-sizes", "1,2", "--json")[1])
    assert all(b["time_us"] > a["time_us"] for a, b in zip(one["passes"], json.loads(out)["passes"], strict=True))
    code, out, err = cli("crossover", "--trace", TRACE, "--profile", "nvidia-h200", "--pass-sizes", "1,4", "--json", "--batch", "160")
    assert code == 0, err
    share = json.loads(out)["byte_share"]
    assert share[0] < 1.0 / 6  # 160 requests' slots land on at most 64 experts: u <= 64 / (160·6)
    base = ["--trace", TRACE, "--profile", "nvidia-h200", "--alpha", "0.7", "--json"]
    code, out, err = cli("best-draft", *base, "--batch", "160", "--verdict", "--max-draft", "1")
    assert code == 0, err
    assert json.loads(out)["batch"] == 160 and json.loads(out)["verdict"][0]["draft_len"] == 1
    code, out, err = cli("batch", *base, "--draft-len", "1", "--batch", "200")
    assert code == 0 and json.loads(out)["batches"][0]["batch"] == 200, err
    code, out, err = cli("batch", *base, "--draft-len", "1", "--batch", "160", "--routing", "uniform")
    assert code == 0 and json.loads(out)["batches"][0]["batch"] == 160, err
    code, _, err = cli("best-draft", *base, "--batch", "161", "--verdict", "--max-draft", "3")
    assert code == 2 and err.count("\n") == 1 and "too short for a batch of 161" in err, err
