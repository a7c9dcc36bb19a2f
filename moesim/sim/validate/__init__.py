"""Predicted vs measured (`moesim validate`, issue 8): every measured row predicted with a hardware
profile and compared (`predictions`, `rows`, `runs`, `result`; the metrics in `metrics`), and the
llama.cpp CPU validation of draft lengths (`draft_lengths`, run by `llamacpp_cpu`).

Inputs are measurement tables (contract 3, Parquet or CSV) and measured speculative runs
(contract 2, Arrow IPC), several at once. Each row is predicted the way it was measured:

- **expert rows** (the default scope): one kernel family's expert operation. A row with routing
  features (`distinct_experts`, `slots`, `max_tokens_per_expert`; expert shape from `hidden`,
  `expert_intermediate` and `expert_bytes` or `dtype`, else from the `model` preset or
  `--model`) is predicted from them, times `layers` (default 1: one MoE layer). A row with
  `window_start` and `n_tokens` is the pass over positions [window_start, window_start +
  n_tokens) of sequence `seq` (default 0) of its trace (`trace`, relative to the table, or
  `--trace`) through the first `layers` MoE layers (default all), features from the counter.
- **pass rows** (`scope` = `pass`; implied by `draft_len` + `accepted_mean` + `tokens_per_s`;
  every verify step of a speculative run): a whole forward pass through the step-time model
  (the row's family in every MoE layer, the dense part at the pass's KV length, the fixed time),
  the target preset from `--model`, the row's `model` or the trace's.

A row's `kernel` names its family. Every prediction carries the family's held-out bound ε
(`predicted_low_us`, `predicted_high_us`) and `extrapolated` (an input outside the family's
calibrated range: pass size, routing features, or an expert shape the profile was not fitted on).
"""
