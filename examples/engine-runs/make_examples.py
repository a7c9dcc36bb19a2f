"""Write the example engine outputs of this folder from stated engine terms: NOT measurements.

Every number is the engine-time model `moesim profile fit-engine` fits (`moesim.sim.engine.fit`),
run forwards: a forward's kernels are the device's datasheet dense family
(`moesim.sim.engine.user_runs.forward_model`), the engine adds its host time per forward `pass_us`;
a speculative iteration of a draft model of k steps is its draft forwards, the verify forward of
k + 1 tokens, k + 1 host times and `iteration_us`. Each engine's terms are in `CASES` (no
launches: every forward as the engine captures it); the files are printed in each tool's own
layout (read in the tools' source), rounded as the tools print, and a `vllm bench latency` batch
is its prefill forward plus output_len − 1 decode forwards. `tests/test_engine_runs.py` fits them
back and recovers the terms.

    python examples/engine-runs/make_examples.py [FOLDER]     # default: this folder
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesim.models import load_preset
from moesim.sim.cost.drafters import draft_steps, draft_us, make_drafter
from moesim.sim.engine.user_runs import forward_model

NOTE = "synthetic: written by examples/engine-runs/make_examples.py from stated engine terms, not a measurement"
TARGET, DRAFTER = "opt-30b", "opt-350m"


@dataclass(frozen=True)
class Case:
    """One engine on one profile: the terms the files are written from."""

    folder: str
    profile: str
    device_key: str
    weight_format: str
    pass_us: float
    iteration_us: float
    engine_version: str


CASES = (
    Case("vllm", "nvidia-h200-vllm", "nvidia-h200", "BF16", 1800.0, 900.0, "0.11.0"),
    Case("sglang", "nvidia-h200-vllm", "nvidia-h200", "BF16", 700.0, 500.0, "0.5.4"),
    Case("llamacpp", "nvidia-rtx-4090-llamacpp", "nvidia-rtx-4090", "Q4_0", 300.0, 200.0, "b6800"),
    Case("mlx", "apple-m3-ultra-mlx", "apple-m3-ultra", "BF16", 2500.0, 0.0, "0.28.0"),
)


class Engine:
    """The case's kernels and the times its terms add."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.model = forward_model(TARGET, case.device_key, case.weight_format, 1)
        self.drafter = make_drafter(DRAFTER, load_preset(TARGET), case.weight_format)

    def step_us(self, batch: int, context: float, tokens_per_sequence: int = 1) -> float:
        """One forward of `tokens_per_sequence` tokens per sequence at a context per sequence: kernels + pass_us."""
        return self.model.dense_pass_us(batch * tokens_per_sequence, batch * context, batch) + self.case.pass_us

    def iteration_us(self, batch: int, context: float, draft_len: int) -> float:
        """Draft forwards + verify of k + 1 tokens + (1 + steps) · pass_us + iteration_us (a draft model's forwards are whole forwards)."""
        drafted = draft_us(self.drafter, np.full(batch, draft_len), context, self.model.dense_family_us)
        hosts = draft_steps(self.drafter, draft_len) * self.case.pass_us
        return drafted + self.step_us(batch, context, draft_len + 1) + hosts + self.case.iteration_us


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _serve_record(batch: int, input_len: int, output_len: int, tpot_ms: float, ttft_ms: float) -> dict[str, object]:
    completed = 4 * batch
    e2el_ms = ttft_ms + (output_len - 1) * tpot_ms
    return {
        "completed": completed,
        "max_concurrency": batch,
        "total_input_tokens": completed * input_len,
        "total_output_tokens": completed * output_len,
        "output_throughput": round(batch * output_len / (e2el_ms / 1000.0), 2),
        "mean_ttft_ms": round(ttft_ms, 3),
        "mean_tpot_ms": round(tpot_ms, 4),
    }


def write_vllm(engine: Engine, folder: Path) -> None:
    """bench serve at batch 1, 4, 16, 64; bench latency (PyTorch-benchmark form) at batch 8; one speculative serve run."""
    input_len, output_len = 512, 256
    context = input_len + output_len / 2
    for batch in (1, 4, 16, 64):
        tpot_ms = engine.step_us(batch, context) / 1000.0
        ttft_ms = engine.step_us(batch, input_len / 2, input_len) / 1000.0
        record = {"moesim_note": NOTE, "backend": "vllm", "model_id": "facebook/opt-30b"}
        record |= _serve_record(batch, input_len, output_len, tpot_ms, ttft_ms)
        record["mean_e2el_ms"] = round(ttft_ms + (output_len - 1) * tpot_ms, 3)
        _write(folder / f"serve-c{batch}.json", json.dumps(record, indent=2) + "\n")
    batch, prompt, output = 8, 32, 128
    latency_s = (engine.step_us(batch, prompt / 2, prompt) + (output - 1) * engine.step_us(batch, prompt + output / 2)) / 1e6
    args = {"model": "facebook/opt-30b", "batch_size": batch, "input_len": prompt, "output_len": output, "tensor_parallel_size": 1}
    record = {
        "benchmark": {"name": "vLLM benchmark", "extra_info": {"args": {**args, "enforce_eager": False}}},
        "model": {"name": "facebook/opt-30b"},
        "metric": {"name": "latency", "benchmark_values": [round(latency_s, 6)] * 3, "extra_info": {"avg_latency": round(latency_s, 6)}},
        "moesim_note": NOTE,
    }
    _write(folder / "latency-b8.pytorch.json", json.dumps([record], indent=2) + "\n")
    batch, k, accepted_length = 4, 4, 3.0
    iteration = engine.iteration_us(batch, context, k)
    tpot_ms = iteration / accepted_length / 1000.0
    ttft_ms = engine.step_us(batch, input_len / 2, input_len) / 1000.0
    drafts = 1000
    record = {"moesim_note": NOTE, "backend": "vllm", "model_id": "facebook/opt-30b"}
    record |= _serve_record(batch, input_len, output_len, tpot_ms, ttft_ms)
    record["mean_e2el_ms"] = round(ttft_ms + (output_len - 1) * tpot_ms, 3)
    record |= {
        "spec_decode_acceptance_rate": 100.0 * (accepted_length - 1) / k,
        "spec_decode_acceptance_length": accepted_length,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": drafts * k,
        "spec_decode_accepted_tokens": int(drafts * (accepted_length - 1)),
    }
    _write(folder / "serve-c4-spec.json", json.dumps(record, indent=2) + "\n")


def write_sglang(engine: Engine, folder: Path) -> None:
    """bench_one_batch's console at batch 1, 8, 32 (after a warmup block), and bench_serving JSONL with one speculative line."""
    input_len, output_len = 256, 128
    context = input_len + output_len / 2
    lines = [
        f"# {NOTE}",
        "Warmup ...",
        "Prefill. latency: 0.50000 s, throughput:    512.00 token/s",
        "Decode 0. Batch size: 1, latency: 0.30000 s, throughput:      3.33 token/s",
        "Decode.  median latency: 0.30000 s, median throughput:      3.33 token/s",
        "Total. latency:  9.000 s, throughput:     42.67 token/s",
        "Benchmark ...",
    ]
    for batch in (1, 8, 32):
        prefill_s = engine.step_us(batch, input_len / 2, input_len) / 1e6
        step_s = engine.step_us(batch, context) / 1e6
        total_s = prefill_s + (output_len - 1) * step_s
        lines.append(f"Prefill. latency: {prefill_s:.5f} s, throughput: {batch * input_len / prefill_s:9.2f} token/s")
        for i in range(5):
            lines.append(f"Decode {i}. Batch size: {batch}, latency: {step_s:.5f} s, throughput: {batch / step_s:9.2f} token/s")
        lines.append(f"Decode.  median latency: {step_s:.5f} s, median throughput: {batch / step_s:9.2f} token/s")
        lines.append(f"Total. latency: {total_s:6.3f} s, throughput: {(input_len + output_len) * batch / total_s:9.2f} token/s")
    _write(folder / "bench-one-batch.log", "\n".join(lines) + "\n")
    records = []
    for batch in (2, 16):
        tpot_ms = engine.step_us(batch, context) / 1000.0
        ttft_ms = engine.step_us(batch, input_len / 2, input_len) / 1000.0
        records.append(
            {
                "moesim_note": NOTE,
                "backend": "sglang",
                "mean_e2e_latency_ms": round(ttft_ms + (output_len - 1) * tpot_ms, 3),
                **_serve_record(batch, input_len, output_len, tpot_ms, ttft_ms),
                "accept_length": None,
            }
        )
    batch, k, accepted_length = 2, 3, 2.5
    tpot_ms = engine.iteration_us(batch, context, k) / accepted_length / 1000.0
    ttft_ms = engine.step_us(batch, input_len / 2, input_len) / 1000.0
    records.append(
        {
            "moesim_note": NOTE,
            "backend": "sglang",
            "mean_e2e_latency_ms": round(ttft_ms + (output_len - 1) * tpot_ms, 3),
            **_serve_record(batch, input_len, output_len, tpot_ms, ttft_ms),
            "accept_length": accepted_length,
        }
    )
    _write(folder / "bench-serving.jsonl", "".join(json.dumps(r) + "\n" for r in records))


def write_llamacpp(engine: Engine, folder: Path) -> None:
    """llama-bench tg320 @ d32 and tg128 @ d2048 (markdown), and one llama-speculative run."""
    header = "| model                          |       size |     params | backend    | ngl |            test |                  t/s |"
    rule = "| ------------------------------ | ---------: | ---------: | ---------- | --: | --------------: | -------------------: |"
    rows = [NOTE, "", header, rule]
    for depth, generated in ((32, 320), (2048, 128)):  # the first at the speculative run's prompt and length: its baseline
        rate = 1e6 / engine.step_us(1, depth + generated / 2)
        test = f"tg{generated} @ d{depth}"
        rows.append(f"| opt 30B Q4_0                   |  16.80 GiB |    29.97 B | CUDA       |  99 | {test:>15} | {rate:14.2f} ± 0.05 |")
    rows += ["", "build: 1a2b3c4 (6800)"]
    _write(folder / "llama-bench.md", "\n".join(rows) + "\n")
    k, accepted, iterations, prompt = 8, 0.5, 64, 32
    tau = 1.0 + accepted * k
    predicted = round(iterations * tau)
    seconds = iterations * engine.iteration_us(1, prompt + predicted / 2, k) / 1e6
    text = "\n".join(
        [
            f"# {NOTE}",
            "build: 6800 (1a2b3c4) with cc (GCC) for x86_64-linux-gnu",
            "",
            f"encoded {prompt:4d} tokens in    0.100 seconds, speed:  320.000 t/s",
            f"decoded {predicted:4d} tokens in {seconds:8.3f} seconds, speed: {predicted / seconds:8.3f} t/s",
            "",
            f"n_draft   = {k}",
            f"n_predict = {predicted}",
            f"n_drafted = {iterations * k}",
            f"n_accept  = {round(accepted * iterations * k)}",
            f"accept    = {100 * accepted:.3f}%",
            "",
        ]
    )
    _write(folder / "llama-speculative.log", text + "\n")


def write_mlx(engine: Engine, folder: Path) -> None:
    """mlx_lm.benchmark at batch 1, 4, 8, and one mlx_lm.generate run."""
    prompt, generated = 512, 256
    lines = [f"# {NOTE}"]
    for batch in (1, 4, 8):
        rate = batch * 1e6 / engine.step_us(batch, prompt + generated / 2)
        lines += ["Running warmup..", f"Timing with prompt_tokens={prompt}, generation_tokens={generated}, batch_size={batch}."]
        lines += [f"Trial {i + 1}:  prompt_tps=1000.000, generation_tps={rate:.3f}, peak_memory=62.000" for i in range(2)]
        lines.append(f"Averages: prompt_tps=1000.000, generation_tps={rate:.3f}, peak_memory=62.000")
    _write(folder / "benchmark.log", "\n".join(lines) + "\n")
    rate = 1e6 / engine.step_us(1, 100 + 300 / 2)
    generate = [f"# {NOTE}", "==========", "Prompt: 100 tokens, 800.000 tokens-per-sec"]
    generate += [f"Generation: 300 tokens, {rate:.3f} tokens-per-sec", "Peak memory: 61.500 GB"]
    _write(folder / "generate.log", "\n".join(generate) + "\n")


WRITERS = {"vllm": write_vllm, "sglang": write_sglang, "llamacpp": write_llamacpp, "mlx": write_mlx}


def main(folder: Path) -> None:
    """Every case's files into folder/CASE."""
    for case in CASES:
        WRITERS[case.folder](Engine(case), folder / case.folder)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
