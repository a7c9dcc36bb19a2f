"""Behaviour snapshot: run the installed `moesim` CLI on fixed inputs and seeds, record every output.

    .venv/bin/python bench/compare_outputs.py OUT_DIR                       # record OUT_DIR/manifest.json
    .venv/bin/python bench/compare_outputs.py OUT_DIR --against OLD/manifest.json   # record, then compare

What runs (in OUT_DIR/run, a copy of examples/ and of the data files used, relative paths only):

- `moesim demo --out demo` (every file of the folder, stdout);
- every `examples/*.toml` through `moesim simulate --json`, every `examples/sweeps/*.toml` through
  `moesim sweep --json` and `moesim report`;
- on a small synthetic trace made with `moesim trace synth`: `trace info`, `bytes` (B = 1 and 4),
  `predict`, `best-draft`, `crossover`, `batch`, `profile list`, `profile show` (every built-in),
  `validate` (H200 table, one model), each with `--json`; `trace fit`, `trace synth --params`,
  `profile derive`, `profile fit`, `trace tiny-model`, `trace record`, `trace import` and
  `microbench import-backend-ops` (their files);
- `--help` of every command (informational: listed, not counted as a difference).

The manifest holds, per command, its argv, exit code, stdout and stderr, and the sha256 of every
file it wrote. `--against` prints every difference and exits 1 on any.

Substitutions (the only ones; each for something random by construction, issue 17):

1. The demo's report page names the temporary staging folder its sweep was written in
   (`.demo.XXXXXXXX.part`, a `tempfile.mkdtemp` name): replaced by `.demo.STAGING.part` before
   hashing `demo/report/index.html`.
2. Wall-clock times and rates (seconds, points/s, positions/s, iterations/s, cells/s) in the
   stdout of `demo`, `sweep`, `trace record` and in `sweep --json` (`elapsed_s`, `points_per_s`,
   `seconds`, `simulated_iterations_per_s`): replaced by `<t>`; in those stdouts whitespace runs
   are then collapsed to one space (a number of another width re-wraps a table caption).
3. `examples/cascade-reproduction.toml` (5 minutes as shipped) runs with `requests = 2` and
   `output_tokens = 256`, and `examples/moesd-reproduction.toml` (5 minutes) with batches 1 and 16
   and 1 s of simulated time per cell (same code paths; the copies are in the run folder).

Commands that print renamed options use the spelling the installed CLI offers (the new one when
`--help` lists it), so old and new trees run the same thing.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIME = r"[0-9][0-9,]*(?:\.[0-9]+)?"
TIMING_PATTERNS = (re.compile(rf"{TIME}(?= ?(?:s\b|points/s|positions/s|iterations/s|cells/s))"),)
JSON_TIMING_KEYS = ("elapsed_s", "points_per_s", "seconds", "simulated_iterations_per_s")
STAGING = re.compile(r"\.demo\.[A-Za-z0-9_]+\.part")


def moesim_bin() -> str:
    """The CLI installed beside this interpreter (else the one on PATH)."""
    local = Path(sys.executable).parent / "moesim"
    return str(local) if local.is_file() else "moesim"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalise_timings(text: str) -> str:
    """Substitution 2: wall-clock figures to <t>, then whitespace runs to one space."""
    for pattern in TIMING_PATTERNS:
        text = pattern.sub("<t>", text)
    return " ".join(text.split()) + "\n"


def normalise_json_timings(text: str) -> str:
    payload = json.loads(text)

    def walk(value: object) -> object:
        if isinstance(value, dict):
            return {k: "<t>" if k in JSON_TIMING_KEYS else walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return json.dumps(walk(payload), sort_keys=True) + "\n"


class Runner:
    """Runs commands in the run folder and records them."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.commands: list[dict[str, object]] = []
        self.help: dict[str, str] = {}
        self.exe = moesim_bin()
        self.env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
        self.env.pop("FORCE_COLOR", None)

    def run(self, name: str, *args: object, timings: str = "", files: tuple[str, ...] = ()) -> str:
        """Run `moesim ARGS`; `timings` = "text" or "json" applies substitution 2 to stdout."""
        argv = [str(a) for a in args]
        started = time.perf_counter()
        done = subprocess.run([self.exe, *argv], cwd=self.run_dir, env=self.env, capture_output=True, text=True, check=False)
        stdout = done.stdout
        if timings == "text":
            stdout = normalise_timings(stdout)
        elif timings == "json" and done.returncode == 0:
            stdout = normalise_json_timings(stdout)
        record = {"name": name, "argv": argv, "rc": done.returncode, "stdout": stdout, "stderr": done.stderr}
        record["files"] = {f: self.hash_tree(f) for f in files}
        self.commands.append(record)
        print(f"{time.perf_counter() - started:6.1f} s  rc {done.returncode}  {name}", flush=True)
        return done.stdout

    def hash_tree(self, relative: str) -> dict[str, str]:
        """sha256 of a file, or of every file below a folder (substitution 1 on the demo's page)."""
        root = self.run_dir / relative
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        out = {}
        for path in paths:
            data = path.read_bytes()
            rel = str(path.relative_to(self.run_dir))
            if rel == "demo/report/index.html":
                data = STAGING.sub(".demo.STAGING.part", data.decode()).encode()
            out[rel] = sha256(data)
        if not paths:
            out[relative] = "missing"
        return out

    def help_of(self, *command: str) -> str:
        done = subprocess.run([self.exe, *command, "--help"], cwd=self.run_dir, env=self.env, capture_output=True, text=True, check=False)
        self.help[" ".join(command) or "moesim"] = done.stdout
        return done.stdout


def option(runner: Runner, command: tuple[str, ...], new: str, old: str) -> str:
    """The spelling of a renamed option the installed CLI offers."""
    return new if new in runner.help_of(*command) else old


def prepare(run_dir: Path) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    shutil.copytree(REPO / "examples", run_dir / "examples")
    reproduction = run_dir / "examples" / "cascade-reproduction.toml"  # substitution 3
    text = reproduction.read_text()
    text = re.sub(r"(?m)^requests = 16\b", "requests = 2", text)
    text = re.sub(r"(?m)^output_tokens = 1024\b", "output_tokens = 256", text)
    reproduction.write_text(text)
    moesd = run_dir / "examples" / "moesd-reproduction.toml"
    if moesd.is_file():
        text = re.sub(r"(?m)^batches = \[.*\]", "batches = [1, 16]", moesd.read_text())
        moesd.write_text(re.sub(r"(?m)^duration_s = [0-9.]+", "duration_s = 1.0", text))
    (run_dir / "data").mkdir()
    shutil.copy(REPO / "data" / "h200" / "calibration.parquet", run_dir / "data" / "h200.parquet")
    shutil.copy(REPO / "data" / "h200" / "device.json", run_dir / "data" / "device.json")
    (run_dir / "prompts.txt").write_text("The quick brown fox.\nExperts route tokens.\n1, 2, 3, 5, 8\n")
    # a routing table for `trace import` (olmoe-1b-7b: 16 MoE layers, top-8 of 64), made-up ids
    rows = ["seq,token,layer,slot,expert,weight"]
    for seq in range(2):
        for token in range(5):
            for layer in range(16):
                for slot in range(8):
                    rows.append(f"{seq},{token},{layer},{slot},{(7 * token + 3 * layer + 8 * slot + seq) % 64},{0.125:.3f}")
    (run_dir / "routing.csv").write_text("\n".join(rows) + "\n")
    # test-backend-ops console output (made-up times, the printer's layout)
    case = "  MUL_MAT_ID(type_a={t},type_b=f32,n_mats=64,n_used=8,b=0,m=1024,n={n},k=2048):   1000 runs - {us:8.2f} us/run"
    log = ["Backend 1/2: CUDA0", "  Device description: NVIDIA GeForce RTX 4090"]
    log += [case.format(t=t, n=n, us=10.0 + n * (3.0 if t == "f16" else 1.5)) for t in ("f16", "q4_0") for n in (1, 2, 4, 8, 16, 32)]
    (run_dir / "backend-ops.log").write_text("\n".join(log) + "\n")


def record(out_dir: Path) -> dict[str, object]:
    run_dir = out_dir / "run"
    prepare(run_dir)
    r = Runner(run_dir)
    draft_len = option(r, ("batch",), "--draft-len", "--draft")
    context = option(r, ("predict",), "--context-tokens", "--context")
    where = option(r, ("report",), "--filter", "--where")
    expert_width = option(r, ("trace", "tiny-model"), "--expert-intermediate", "--expert-ff")

    r.run("demo", "demo", "--out", "demo", timings="text", files=("demo",))

    for config in sorted((run_dir / "examples").glob("*.toml")):
        out = f"sim-{config.stem}"
        r.run(f"simulate {config.name}", "simulate", f"examples/{config.name}", "--out", out, "--json", files=(out,))
    for config in sorted((run_dir / "examples" / "sweeps").glob("*.toml")):
        out = f"sweep-{config.stem}.parquet"
        r.run(f"sweep {config.name}", "sweep", f"examples/sweeps/{config.name}", "--out", out, "--workers", 2, "--json",
              timings="json", files=(out,))  # fmt: skip
        r.run(f"report {config.name}", "report", out, "--out", f"report-{config.stem}", files=(f"report-{config.stem}",))
    r.run("report filtered", "report", "sweep-h200.parquet", "--out", "report-h200-filter", where, "model=qwen3-30b-a3b",
          "--alpha", 0.7, files=("report-h200-filter",))  # fmt: skip

    trace = "t.arrow"
    r.run("trace synth sticky", "trace", "synth", "--model", "deepseek-v2-lite", "--sticky", 0.3, "--tokens", 256, "--seqs", 4,
          "--seed", 1, "--format", "BF16", "--out", trace, files=(trace,))  # fmt: skip
    r.run("trace synth uniform", "trace", "synth", "--model", "olmoe-1b-7b", "--uniform", "--tokens", 64, "--seqs", 2,
          "--out", "u.arrow", files=("u.arrow",))  # fmt: skip
    r.run("trace synth zipf", "trace", "synth", "--model", "olmoe-1b-7b", "--zipf", 1.2, "--tokens", 64, "--out", "z.arrow",
          files=("z.arrow",))  # fmt: skip
    r.run("trace info", "trace", "info", trace, "--json")
    r.run("trace info table", "trace", "info", trace)
    r.run("bytes", "bytes", trace, "--max-pass", 12, "--json")
    r.run("bytes table", "bytes", trace, "--max-pass", 8)
    r.run("bytes batch", "bytes", trace, "--max-pass", 8, "--batch", 4, "--format", "F16", "--json")
    common = ("--trace", trace, "--profile", "nvidia-h200")
    r.run("predict", "predict", *common, "--family", "best", "--max-pass", 12, context, 256, "--json")
    r.run("predict table", "predict", *common, "--max-pass", 6)
    r.run("best-draft", "best-draft", *common, "--family", "best", "--drafter", "qwen3-0.6b", "--alpha", 0.6, "--alpha", 0.9,
          "--max-draft", 6, "--json")  # fmt: skip
    r.run("best-draft table", "best-draft", *common, "--drafter", "eagle", "--alpha", 0.8, "--max-draft", 5)
    r.run("crossover", "crossover", *common, "--max-pass", 24, "--json")
    r.run("crossover table", "crossover", *common, "--dedup-family", "dedup_grouped_gemm", "--max-pass", 16)
    r.run("batch", "batch", *common, "--alpha", 0.8, draft_len, 3, "--batch", "1,2,4", "--family", "best", "--json")
    r.run("batch uniform", "batch", *common, "--alpha", 0.7, draft_len, 2, "--batch", "1,4", "--routing", "uniform",
          "--moesd-slots", "--drafter", "fixed:50", "--json")  # fmt: skip
    r.run("batch table", "batch", *common, "--alpha", 0.8, draft_len, 3, "--batch", "1,2")
    r.run("profile list", "profile", "list", "--json")
    r.run("profile list table", "profile", "list")
    names = [entry["name"] for entry in json.loads(r.commands[-2]["stdout"])]  # type: ignore[arg-type]
    for name in names:
        r.run(f"profile show {name}", "profile", "show", name, "--json")
    r.run("profile show table", "profile", "show", "nvidia-h200", "--model", "qwen3-30b-a3b")
    r.run("profile derive", "profile", "derive", "nvidia-h200", "--bandwidth-scale", 0.5, "--compute-scale", 0.8, "--out", "slow.toml",
          files=("slow.toml",))  # fmt: skip
    r.run("profile fit", "profile", "fit", "data/h200.parquet", "--out", "fitted.toml", "--filter", "model=deepseek-v2-lite",
          files=("fitted.toml",))  # fmt: skip
    r.run("validate", "validate", "data/h200.parquet", "--profile", "nvidia-h200", "--filter", "model=qwen3-30b-a3b",
          "--out", "validation", "--json", files=("validation",))  # fmt: skip
    r.run("validate table", "validate", "data/h200.parquet", "--profile", "nvidia-h200", "--filter", "model=deepseek-v2-lite")
    r.run("trace fit", "trace", "fit", trace, "--out", "params.toml", "--max-positions", 512, files=("params.toml",))
    r.run("trace synth params", "trace", "synth", "--model", "qwen3-30b-a3b", "--params", "params.toml", "--tokens", 64,
          "--out", "p.arrow", files=("p.arrow",))  # fmt: skip
    r.run("trace tiny-model", "trace", "tiny-model", "--out", "tiny.gguf", "--hidden", 64, expert_width, 32, files=("tiny.gguf",))
    r.run("trace tiny-model draft", "trace", "tiny-model", "--out", "draft.gguf", "--draft-of", "tiny.gguf", "--noise", 0.05,
          files=("draft.gguf",))  # fmt: skip
    r.run("trace record", "trace", "record", "tiny.gguf", "--prompts", "prompts.txt", "--max-tokens", 8, "--threads", 1,
          "--out", "rec.arrow", timings="text", files=("rec.arrow",))  # fmt: skip
    r.run("trace import", "trace", "import", "routing.csv", "--model", "olmoe-1b-7b", "--out", "imported.arrow", files=("imported.arrow",))
    r.run("trace info imported", "trace", "info", "imported.arrow", "--json")
    r.run("microbench import-backend-ops", "microbench", "import-backend-ops", "backend-ops.log", "--out", "backend-ops",
          files=("backend-ops",))  # fmt: skip
    r.run("trace info recorded", "trace", "info", "rec.arrow", "--json")
    r.run("error: unknown profile", "predict", *common[:2], "--profile", "no-such-profile")
    r.run("error: bad batch", "batch", *common, "--alpha", 0.8, draft_len, 3, "--batch", "1,x")

    top = r.help_of()
    groups = ("trace", "profile", "microbench")
    for line in top.splitlines():
        match = re.match(r"^│ (\S+)\s", line)
        if match and match.group(1) not in ("--help",):
            name = match.group(1)
            if name in groups:
                for sub in re.findall(r"^│ (\S+)\s", r.help_of(name), flags=re.M):
                    if not sub.startswith("-"):
                        r.help_of(name, sub)
            elif not name.startswith("-"):
                r.help_of(name)
    manifest = {"commands": r.commands, "help": r.help}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def compare(new: dict[str, object], old: dict[str, object]) -> int:
    """Print every difference between two manifests; the number of differences (help pages aside)."""
    differences = 0
    old_commands = {c["name"]: c for c in old["commands"]}  # type: ignore[union-attr]
    new_commands = {c["name"]: c for c in new["commands"]}  # type: ignore[union-attr]
    for name in sorted(set(old_commands) | set(new_commands)):
        a, b = old_commands.get(name), new_commands.get(name)
        if a is None or b is None:
            print(f"DIFF {name}: only in the {'new' if a is None else 'old'} manifest")
            differences += 1
            continue
        if a["rc"] != b["rc"]:
            print(f"DIFF {name}: exit code {a['rc']} -> {b['rc']}")
            differences += 1
        for stream in ("stdout", "stderr"):
            if a[stream] != b[stream]:
                differences += 1
                print(f"DIFF {name}: {stream}")
                diff = difflib.unified_diff(a[stream].splitlines(), b[stream].splitlines(), "old", "new", lineterm="", n=1)
                print("\n".join(list(diff)[:60]))
        files_a = {p: h for tree in a["files"].values() for p, h in tree.items()}
        files_b = {p: h for tree in b["files"].values() for p, h in tree.items()}
        for path in sorted(set(files_a) | set(files_b)):
            if files_a.get(path) != files_b.get(path):
                differences += 1
                print(f"DIFF {name}: file {path}: {files_a.get(path, 'absent')} -> {files_b.get(path, 'absent')}")
    help_a, help_b = old.get("help", {}), new.get("help", {})
    changed = sorted(k for k in set(help_a) | set(help_b) if help_a.get(k) != help_b.get(k))  # type: ignore[union-attr]
    for key in changed:
        print(f"note (help page, informational): 'moesim {key} --help' changed" if key != "moesim" else "note: 'moesim --help' changed")
    files = sum(len(t) for c in new["commands"] for t in c["files"].values())  # type: ignore[union-attr]
    verdict = "identical" if not differences else f"{differences} difference(s)"
    print(f"{len(new_commands)} commands, {files} files: {verdict}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the run and manifest.json")
    parser.add_argument("--against", type=Path, default=None, help="an earlier manifest.json to compare with")
    args = parser.parse_args()
    started = time.perf_counter()
    manifest = record(args.out)
    print(f"recorded {args.out / 'manifest.json'} in {time.perf_counter() - started:.0f} s")
    if args.against is None:
        return 0
    return 1 if compare(manifest, json.loads(args.against.read_text())) else 0


if __name__ == "__main__":
    sys.exit(main())
