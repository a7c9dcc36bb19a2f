"""Recorded acceptance from a real speculative run (contract 2) measured through llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_server

from moesim.sim.cost.pass_table import TablePassCost
from moesim.sim.serving.acceptance import Recorded
from moesim.sim.serving.policies import Static
from moesim.sim.serving.workload import Arrivals, Workload
from moesim.tracegen.formats.specrun import read_spec_run
from moesim.tracegen.llamacpp.gguf_builder import TinyModelSpec, build_draft_model, build_tiny_model
from moesim.tracegen.llamacpp.prompts import prompts_from_texts
from moesim.tracegen.llamacpp.speculate import SpeculateConfig, speculative_run

SPEC = TinyModelSpec(layers=2, experts=8, top_k=2, hidden=64, expert_ff=32, seed=5)
DRAFT_LEN = 3


@pytest.fixture(scope="module")
def run_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("recorded")
    target = build_tiny_model(folder / "target.gguf", SPEC)
    draft = build_draft_model(SPEC, 0.05, folder / "draft.gguf")
    prompts = prompts_from_texts(["Experts route tokens in turn.", "abc abc abc"], "test prompts")
    out = folder / "run.arrow"
    speculative_run(target, draft, prompts, out, SpeculateConfig(draft_len=DRAFT_LEN, max_tokens=40, n_threads=1, baseline=False))
    return out


def test_recorded_run_file_replays_its_steps(run_file: Path) -> None:
    run = read_spec_run(run_file)
    model = Recorded(file=run_file)
    assert model.draft_len == DRAFT_LEN
    per_seq = [run.steps.filter(run.steps["seq"] == s)["accepted"].to_numpy() for s in range(len(model.sequences))]
    assert [s.tolist() for s in model.sequences] == [s.tolist() for s in per_seq]
    assert 0 < run.steps["accepted"].mean() < DRAFT_LEN  # type: ignore[operator]  # accepted and rejected drafts both occur
    # a static run at the recorded draft length walks the recorded steps exactly
    for rid in range(2):
        counts = per_seq[rid]
        server = make_server(
            cost=TablePassCost(np.array([100.0, 120.0, 140.0, 160.0])),
            policy=Static(k=DRAFT_LEN),
            acceptance=model,
            workload=Workload(prompt_tokens=0, output_tokens=int(np.sum(counts + 1)) + 1),
            arrivals=Arrivals(),
            max_batch=1,
            requests=rid + 1,
            seed=0,
        )
        record = server.run()
        replayed = record.step_accepted[record.step_request == rid]
        assert replayed.tolist() == counts.tolist()
