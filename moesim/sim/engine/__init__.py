"""Engine time beyond the kernels (issue 24): an engine's terms (`moesim.hw_profiles.speculative.SpecPath`,
the `[speculative]` table: host time per forward, launches per layer when eager, the speculative
path's terms) fitted from benchmark rows, judged leaving one source out, and written into the
built-in engine profiles.

The stable API (other commands and importers call it; kept as is):

    fit_engine_terms(decode_rows: pl.DataFrame, spec_rows: pl.DataFrame, engine: str, *,
                     source_file: str = "", sha256: str = "") -> EngineFit
        engine: a key of moesim.hw_profiles.engines.host.ENGINE_HOSTS ("vllm-v0", "vllm-v1",
        "sglang", "llama.cpp", "mlx-lm", "tensorrt-llm"); returns EngineFit(spec: SpecPath,
        equations, runs): spec.provenance.rows lists exactly the rows used (row number, source,
        "decode step" | "speculative run" | "baseline of run", tokens per forward).

    decode_rows columns (one forward each; `rows.STEP_COLUMNS`):
        row (int, its number in its file), source_url (str), engine (str, as the source wrote it),
        engine_key (str), device_key (a catalog device: hw_profiles/data/devices.toml), preset (a
        moesim preset), weight_format, tp (int), batch (requests), sequences (sequences the forward
        attends for: batch, or every token under batch expansion), tokens_per_forward (int),
        context_tokens (mean KV length per sequence), eager (bool: ran outside a CUDA graph),
        verified_tokens (tokens a batch-expansion scorer expands, else 0), time_us (measured).
    spec_rows columns (one speculative run with its plain baseline each; `rows.RUN_COLUMNS`):
        row, source_url, engine, engine_key, device_key, preset, weight_format, tp, batch,
        context_tokens, drafter (a moesim drafter spec, e.g. "eagle3,topk=8,tokens=64" or a
        preset), draft_format, draft_len (int), tau (tokens per iteration per request, bonus
        included), token_us (measured µs per output token with speculation), baseline_token_us
        (without).

    moesim.sim.engine.rows.describe() gives both frames for the shared engine-overheads tables
    (`forward_time_us`, `token_time_us` convert the sources' units).
"""

from moesim.sim.engine.fit import EngineFit, fit_engine_terms
from moesim.sim.engine.rows import describe

__all__ = ["EngineFit", "describe", "fit_engine_terms"]
