"""MLX-LM's generation statistics: `mlx_lm.generate --verbose` (one sequence; with
`--draft-model` a speculative run) and `mlx_lm.benchmark` (a batch of sequences).

    mlx_lm.generate:   Prompt: 12 tokens, 95.123 tokens-per-sec
                       Generation: 100 tokens, 45.678 tokens-per-sec
                       Peak memory: 4.567 GB
    mlx_lm.benchmark:  Timing with prompt_tokens=512, generation_tokens=1024, batch_size=4.
                       Averages: prompt_tps=..., generation_tps=..., peak_memory=...

generate's generation rate is one sequence's tokens per second; benchmark's, at a batch above 1,
counts every sequence's tokens (its batch generator's statistics), at batch 1 the one sequence's.
generate prints no draft statistics: a speculative run's draft length is --draft-len and its
acceptance is unknown (NA) unless the caller gives it.
"""

from __future__ import annotations

import re

from moesim.errors import InputError
from moesim.hw_profiles.engine_runs.rows import NA, DecodeStep, EngineRows, RunContext, rate_run, rate_step

ENGINE = "MLX-LM"
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT = re.compile(rf"^Prompt:\s*(\d+)\s*tokens,\s*{_NUMBER}\s*tokens-per-sec", re.MULTILINE)
_GENERATION = re.compile(rf"^Generation:\s*(\d+)\s*tokens,\s*{_NUMBER}\s*tokens-per-sec", re.MULTILINE)
_TIMING = re.compile(r"^Timing with prompt_tokens=(\d+), generation_tokens=(\d+), batch_size=(\d+)\.", re.MULTILINE)
_AVERAGES = re.compile(rf"^Averages:\s*prompt_tps={_NUMBER},\s*generation_tps={_NUMBER}", re.MULTILINE)


def looks_like_generate(text: str) -> bool:
    """Whether the text holds mlx_lm.generate's statistics."""
    return bool(_GENERATION.search(text)) and "tokens-per-sec" in text


def looks_like_benchmark(text: str) -> bool:
    """Whether the text is mlx_lm.benchmark's console."""
    return bool(_TIMING.search(text)) and bool(_AVERAGES.search(text))


def _line(text: str, position: int) -> int:
    return text[:position].count("\n") + 1


def parse_generate(text: str, where: str, context: RunContext) -> EngineRows:
    """One row per `Generation:` line: plain decoding, or a speculative run with --draft/--draft-len."""
    steps, runs = [], []
    prompts = list(_PROMPT.finditer(text))
    for match in _GENERATION.finditer(text):
        at = f"{where}: line {_line(text, match.start())}"
        tokens, rate = int(match[1]), float(match[2])
        if not rate > 0 or tokens < 1:
            raise InputError(f"{at}: field 'Generation' must be tokens >= 1 at a rate > 0, got {match[0]!r}")
        prompt = next((p for p in reversed(prompts) if p.start() < match.start()), None)
        shared = {
            "source_url": at,
            "engine": ENGINE,
            "engine_version": context.engine_version or NA,
            "device": context.device or NA,
            "batch": 1,
            "input_len": int(prompt[1]) if prompt else None,
            "output_len": tokens,
        }
        if context.draft or context.draft_len:
            runs.append(
                rate_run(context.model or NA, context, rate, None, "mlx_lm.generate with a draft model (acceptance not printed)", shared)
            )
        else:
            steps.append(rate_step(context, rate, "mlx_lm.generate: generation tokens-per-sec of one sequence", shared))
    return EngineRows(tuple(steps), tuple(runs))


def parse_benchmark(text: str, where: str, context: RunContext) -> EngineRows:
    """One row per `Timing with ...` block, from its `Averages:` line."""
    steps = []
    timings = list(_TIMING.finditer(text))
    for index, timing in enumerate(timings):
        end = timings[index + 1].start() if index + 1 < len(timings) else len(text)
        averages = _AVERAGES.search(text, timing.end(), end)
        at = f"{where}: line {_line(text, timing.start())}"
        if averages is None:
            raise InputError(f"{at}: no 'Averages:' line after 'Timing with ...' (the run did not finish?)")
        batch, rate = int(timing[3]), float(averages[2])
        if batch < 1 or not rate > 0:
            raise InputError(f"{at}: field 'generation_tps' must be > 0 at batch_size >= 1, got {rate} at {batch}")
        steps.append(
            DecodeStep(
                **context.step_fields(at, ENGINE),
                batch=batch,
                value=rate,
                unit="t/s (batch total)" if batch > 1 else "t/s",
                input_len=int(timing[1]),
                output_len=int(timing[2]),
                notes="mlx_lm.benchmark: mean generation_tps over the trials",
            )
        )
    return EngineRows(steps=tuple(steps))
