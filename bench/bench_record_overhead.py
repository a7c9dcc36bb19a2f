"""Recording overhead: positions/s of the same greedy decodes with and without routing capture.

Builds two random qwen3moe models (a 0.3 MB test model and a ~100 MB one), runs the same prompts
through llama.cpp once with the eval callback reading `ffn_moe_topk`/weights (writing a trace) and
once without it, best of three each, on one thread, and prints the ratio.

    .venv/bin/python bench/bench_record_overhead.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_tiny_model, model_bytes
from moesim.tracegen.llamacpp.prompts import prompts_from_texts
from moesim.tracegen.llamacpp.recorder import RecordConfig, record_trace

MODELS = {
    "test model": TinyModelSpec(),
    "100 MB model": TinyModelSpec(layers=8, experts=32, top_k=4, hidden=256, expert_ff=384, heads=8, kv_heads=4, weight_type="F16"),
}
PROMPTS = [f"Prompt number {i}: mixture-of-experts routing on the CPU, recorded through llama.cpp." for i in range(8)]


def best_rate(model: Path, out: Path | None, capture: bool) -> float:
    """Best of three runs: positions (prompt + generated) per second."""
    config = RecordConfig(max_tokens=64, n_threads=1, capture=capture)
    return max(record_trace(model, prompts_from_texts(PROMPTS, "bench"), out, config).tokens_per_s for _ in range(3))


def main() -> None:
    print(f"{'model':<14} {'MB':>7} {'without capture':>16} {'with capture':>13} {'overhead':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model = build_tiny_model(Path(tmp) / "m.gguf", spec)
            plain = best_rate(model, None, capture=False)
            captured = best_rate(model, Path(tmp) / "t.arrow", capture=True)
            print(f"{name:<14} {model_bytes(spec) / 1e6:7.1f} {plain:12.0f} t/s {captured:9.0f} t/s {plain / captured:8.2f}x")


if __name__ == "__main__":
    main()
