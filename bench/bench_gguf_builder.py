"""GGUF builder throughput: writing a 1.1 GB F16 MoE model against writing the same bytes raw.

The builder draws every slice from its own counter-based stream, converts and streams it; the
reference writes one preallocated buffer of the same size repeatedly (disk and page-cache bound).

    .venv/bin/python bench/bench_gguf_builder.py
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_tiny_model, expert_weight_bytes, model_bytes

SPEC = TinyModelSpec(layers=4, experts=32, top_k=4, hidden=1024, expert_ff=1408, heads=8, kv_heads=4, vocab=512, weight_type="F16")


def main() -> None:
    total = model_bytes(SPEC)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        build_tiny_model(Path(tmp) / "big.gguf", SPEC)
        build_s = time.perf_counter() - started
        (Path(tmp) / "big.gguf").unlink()
        chunk = np.ones(32 * 1024 * 1024, np.uint8)
        started = time.perf_counter()
        with open(Path(tmp) / "raw.bin", "wb") as sink:
            for _ in range(total // chunk.size):
                chunk.tofile(sink)
        raw_s = time.perf_counter() - started
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    print(f"model: {total / 1e9:.2f} GB ({expert_weight_bytes(SPEC) / 1e9:.2f} GB of experts), peak RSS {rss_mb:.0f} MB")
    print(f"builder {build_s:.2f} s ({total / build_s / 1e9:.2f} GB/s); raw write {raw_s:.2f} s; ratio {build_s / raw_s:.1f}x")


if __name__ == "__main__":
    main()
