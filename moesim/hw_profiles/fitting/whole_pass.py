"""A measured row in the terms of an engine profile: what its passes did, and what a profile predicts for it.

A whole pass (scope `pass`) times every op of the model, so it is split with the preset's own
accounting (the step-time model's, `moesim.sim.cost.steptime`):

    T(pass) = (L − 1)·t_f(n)(n) + h·t_f(R)(R)        the MoE layers: the last one routes only the R
                                                     rows that need logits, in the share h of passes
                                                     that compute them (llama-bench: one per batch)
            + (W_body + h·W_head)·b_dense / BW        non-expert weights once per pass, the head when it ran
            + Σ_l kv_l·S·k_l(C/S) / BW                 the KV of every sequence's context C / S
            + (2·W_body·n + 2·W_head·R·h) / F         their FLOPs
            + Σ_l A_l·n·k_l(C/S) / F                  attention's FLOPs over the context
            + fixed

k_l(c) is the mean of the keys a query of layer l attends over, c on a full-attention layer, and
on a layer with a sliding window W the mean of min(k, W) over the key counts k of the row's
queries, the P·n/S consecutive counts centred on c of its P passes (`moesim.models.window_keys`:
a ppN test's tokens D + 1 .. D + U·P through the causal mask, a tgN test's contexts D + 1 .. D + N).

t_f(m) is the expert time of the family f the engine's dispatch runs for m tokens (profile
families, `families.ExpertFamily`), on the features uniform routing gives m tokens in expectation
over the experts the tokens route to: U = e·(1 − (1 − K/e)^m), S = m·K. A kernel benchmark routes
its tokens uniformly over all E experts (e = E); llama-bench feeds the model random token ids,
which its router sends to fewer experts than real text: uniformly over a share ρ of them,
e = max(K, ρ·E) (`PassRow.routed_over`; ρ = 1 for the built-ins, `engine_builtins.BENCH_ROUTED_SHARE`;
at m = 1 every share gives U = K).
A kernel benchmark's row (scope `op`) is one MoE layer's t_f(n)(n). Every term is linear in one
coefficient (1/BW, 1/F, a fixed time), so the rows' columns (`columns`) make a least-squares design.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from moesim.errors import InputError
from moesim.hw_profiles.dispatch import Dispatch
from moesim.hw_profiles.families import ExpertInputs, ExpertStructure, base_columns
from moesim.hw_profiles.profile import HardwareProfile
from moesim.kernels.features import RoutingFeatures, uniform_distinct_experts
from moesim.models import ExpertShape, ModelPreset, bytes_per_weight, load_preset

KV_BYTES_PER_ELEMENT = 2.0  # llama.cpp's default f16 KV cache
EXPERT_TERMS = ("bytes", "fixed", "compute", "tile", "per_expert", "per_slot")


def uniform_features(n_tokens: float, experts: int, top_k: int, share: float = 1.0) -> RoutingFeatures:
    """Expected features of n tokens routed uniformly over e = max(K, share·E) of the E experts:
    U = e·(1 − (1 − K/e)^n) (max tokens per expert: the mean S/U)."""
    routed = experts if share >= 1.0 else max(float(top_k), share * experts)
    distinct = float(uniform_distinct_experts(n_tokens, routed, top_k))
    slots = float(n_tokens * top_k)
    return RoutingFeatures(np.float64(n_tokens), np.float64(slots), np.float64(distinct), np.float64(max(1.0, slots / distinct)))


@dataclass(frozen=True)
class PassRow:
    """One measured row: what ran (shape, formats, dispatch), how its passes ran, its time."""

    scope: str
    n_tokens: int
    time_us: float
    shape: ExpertShape
    experts: int
    top_k: int
    dispatch: Dispatch
    preset: ModelPreset | None = None
    dense_format: str = ""
    context_tokens: float = 0.0
    head_share: float = 1.0
    logit_rows: int = 1
    sequences: int = 1
    passes: int = 1
    model: str = ""
    device: str = ""
    source_row: int = 0
    source: str = ""
    variant: str = ""
    era: str = ""
    test: str = ""
    routed_share: float = 1.0  # the share of the experts the row's tokens route to (module docstring)

    @property
    def takes_share(self) -> bool:
        """Whether the row's tokens are random ids a routed share describes: the whole passes of one
        sequence (llama-bench's); a kernel benchmark routes over every expert, and llama-batched-bench
        decodes one token id in every sequence (a routing this share does not describe)."""
        return self.scope == "pass" and self.sequences == 1

    def routed_over(self, share: float) -> PassRow:
        """The row with a benchmark's routed share where its tokens are random ids (`takes_share`)."""
        return dataclasses.replace(self, routed_share=share) if self.takes_share else self

    def layer_runs(self) -> list[tuple[int, float]]:
        """(tokens, count) of the MoE layer evaluations of one pass."""
        if self.scope == "op" or self.preset is None:
            return [(self.n_tokens, 1.0)]
        layers = len(self.preset.moe_layers)
        if self.logit_rows == self.n_tokens and self.head_share == 1.0:
            return [(self.n_tokens, float(layers))]
        runs = [(self.n_tokens, float(layers - 1))]
        if self.head_share > 0 and self.logit_rows > 0:
            runs.append((self.logit_rows, self.head_share))
        return runs

    def family_at(self, n_tokens: int) -> str:
        """The family the row's engine build runs for n tokens."""
        return str(self.dispatch.family_for(self.shape.weight_format, n_tokens, self.experts, self.top_k))

    def dense_work(self) -> tuple[float, float, float]:
        """(bytes, FLOPs, attention FLOPs) of the pass outside the routed experts (0 for an op)."""
        if self.scope == "op" or self.preset is None:
            return 0.0, 0.0, 0.0
        p = self.preset
        head = p.lm_head_params()
        body = p.non_expert_params_per_token() - head
        per_weight = float(bytes_per_weight(self.dense_format or self.shape.weight_format))
        weight_bytes = (body + self.head_share * head) * per_weight
        span = self.passes * self.n_tokens / self.sequences  # the key counts of the row's queries (module docstring)
        kv = p.kv_bytes_read(self.context_tokens, self.sequences, span, KV_BYTES_PER_ELEMENT)
        flops = 2.0 * body * self.n_tokens + 2.0 * head * self.logit_rows * self.head_share
        attention = p.attention_flops(self.n_tokens, self.context_tokens, self.sequences, span)
        return weight_bytes + kv, flops, attention


def expert_columns(row: PassRow, structures: dict[str, ExpertStructure]) -> dict[str, float]:
    """The expert terms of the row, as `<family>.<term>` columns (term: EXPERT_TERMS; fixed time per
    build era `@<era>`; the bytes again as `bytes[<format>]`, for a format's own dequantisation cost)."""
    columns: dict[str, float] = {}
    for tokens, count in row.layer_runs():
        family = row.family_at(tokens)
        if family not in structures:
            raise InputError(f"row {row.source_row}: the dispatch names '{family}', which the engine does not run")
        x = ExpertInputs.of(uniform_features(tokens, row.experts, row.top_k, row.routed_share), row.shape)
        terms, _ = base_columns(x, structures[family], 0.0)
        values = {
            "bytes": terms["hbm"] + terms["cache"],
            "compute": terms["compute"],
            "tile": terms.get("tile", 0.0),
            "fixed": terms["fixed"],
            "per_expert": terms["per_expert"],
            "per_slot": terms["per_slot"],
        }
        if count < 1:  # the logit rows' last layer: under one layer a pass, only its rates (bytes, FLOPs) count
            values = {term: values[term] for term in ("bytes", "compute", "tile")}
        else:
            values[f"bytes[{row.shape.weight_format}]"] = values["bytes"]
        for term, value in values.items():
            name = f"{family}.{term}" + (f"@{row.era}" if term == "fixed" else "")
            columns[name] = columns.get(name, 0.0) + count * float(value)
    return columns


def run_family(row: PassRow, tokens: int, families: dict[str, object]) -> str:
    """The family a layer run of the row uses in a profile: the dispatched one; for the logit rows'
    last layer (under one layer a pass), the main layers' family where the profile lacks it."""
    family = row.family_at(tokens)
    return family if family in families or tokens == row.n_tokens else row.family_at(row.n_tokens)


def predicts(row: PassRow, profile: HardwareProfile) -> bool:
    """Whether the profile has the family the row's main layers run."""
    return row.family_at(row.n_tokens) in profile.expert_families


def predict_us(row: PassRow, profile: HardwareProfile) -> float:
    """The profile's time for the row (families with their roofline floor, dense, fixed)."""
    total = 0.0
    for tokens, count in row.layer_runs():
        family = profile.expert_family(run_family(row, tokens, profile.expert_families))
        total += count * float(family.time_us(uniform_features(tokens, row.experts, row.top_k, row.routed_share), row.shape))
    if row.scope == "op":
        return total
    weight_bytes, flops, attention = row.dense_work()
    dense = profile.dense
    return total + float(dense.time_us(weight_bytes, flops, 0.0)) + float(dense.attention_us(attention)) + profile.pass_fixed_us


def extrapolation_x(row: PassRow, profile: HardwareProfile) -> float:
    """How far the row's main layers lie beyond their family's calibrated range: max over its inputs
    of max(x / high, low / x), 1 inside (`families.CalibratedRange.factor`)."""
    family = profile.expert_family(run_family(row, row.n_tokens, profile.expert_families))
    features = uniform_features(row.n_tokens, row.experts, row.top_k, row.routed_share)
    return float(family.extrapolation_factor(features, row.shape))


def predicted_by_era(rows: Sequence[PassRow], profile_at: Callable[[str], HardwareProfile]) -> np.ndarray:
    """Each row's `predict_us` by its era's profile (`profile_at(era)`, built once an era); NaN where
    that profile lacks the row's family."""
    profiles: dict[str, HardwareProfile] = {}
    predicted = np.full(len(rows), np.nan)
    for i, row in enumerate(rows):
        if row.era not in profiles:
            profiles[row.era] = profile_at(row.era)
        if predicts(row, profiles[row.era]):
            predicted[i] = predict_us(row, profiles[row.era])
    return predicted


def pass_rows(frame: pl.DataFrame, dispatches: list[Dispatch], eras: list[str] | None = None, share: float = 1.0) -> list[PassRow]:
    """The rows of a measurement table of one device (importers' columns), each with its build's
    dispatch and build era (fixed times are fitted per era: kernel overheads change between builds),
    and the benchmark's routed share (`PassRow.routed_over`)."""
    rows = []
    for i, (record, dispatch) in enumerate(zip(frame.iter_rows(named=True), dispatches, strict=True)):
        scope = record.get("scope") or "op"
        preset = load_preset(record["model"]) if scope == "pass" else None
        fmt = str(record["dtype"]).upper()
        rows.append(
            PassRow(
                scope=scope,
                n_tokens=int(record["n_tokens"]),
                time_us=float(record["time_us"]),
                shape=ExpertShape(int(record["hidden"]), int(record["expert_intermediate"]), fmt),
                experts=int(record["experts"]),
                top_k=int(record["top_k"]),
                dispatch=dispatch,
                preset=preset,
                dense_format=str(record.get("dense_format") or fmt).upper(),
                context_tokens=float(record.get("context_tokens") or 0.0),
                head_share=float(record["head_share"]) if record.get("head_share") is not None else 1.0,
                logit_rows=int(record.get("logit_rows") or 1),
                sequences=int(record.get("sequences") or 1),
                passes=int(record.get("passes") or 1),
                model=str(record.get("model") or ""),
                device=str(record.get("device") or ""),
                source_row=int(record.get("source_row") or 0),
                source=str(record.get("source") or ""),
                variant=str(record.get("variant") or ""),
                era=eras[i] if eras else "",
                test=str(record.get("test") or ""),
            ).routed_over(share)
        )
    return rows
