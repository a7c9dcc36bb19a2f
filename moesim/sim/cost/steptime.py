"""Step time of a pass (docs/math.md; the map: docs/architecture.md):

    T(pass) = Σ_MoE layers time_us(family, routing features of that layer's pass)
              + dense(non-expert weights read once, shared experts, KV at the context length, LM head)
              + fixed time per pass.

The expert term comes from the profile's fitted family (`per_slot`, a `dedup*` family, or the
cheapest of them: family `best`); the dense term from the profile's `dense` family. Over several
devices (`moesim.sim.cost.parallel`) the times are one device's: tensor parallelism divides the
dense bytes and FLOPs and each expert's intermediate width by G, expert parallelism keeps the
experts whole on their rank and costs each MoE layer at its slowest rank, and the pass adds its
collectives. A dense target (no experts) has the dense and fixed terms only. Every
prediction keeps its parts apart so that each family's held-out error ε propagates into an
interval, and so that the share of time resting on calibrated vs datasheet or assumed numbers
can be stated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from moesim.errors import InputError
from moesim.hw_profiles.families import ExpertFamily, ExpertInputs, LayerSum
from moesim.hw_profiles.ladder.rungs import RUNGS, worst_rung
from moesim.hw_profiles.profile import HardwareProfile
from moesim.kernels.features import RoutingFeatures
from moesim.models import ExpertShape, ModelPreset, attention_work, bytes_per_weight, kv_read
from moesim.sim.cost.fast_pass import PassTables
from moesim.sim.cost.layer_tables import FamilyTables
from moesim.sim.cost.parallel import Parallelism

BEST = "best"
DISPATCH = "dispatch"  # the engine's own kernel choice per pass size (engine profiles with a [dispatch] table)
# Kernels a decoder layer launches outside the routed experts (norms, QKV, attention, output
# projection, router, shared expert or dense FFN), an assumed count for the dense family's
# per-kernel launch time.
DENSE_KERNELS_PER_LAYER = 8
SIGNS = (-1.0, 1.0)
ERROR_BOX_CORNERS = tuple(itertools.product(SIGNS, SIGNS))  # (expert sign, dense sign) of each corner
TIME_TABLES_KEPT = 256  # (family, tokens) layer-time tables the simulator's fast path keeps
TABLE_AFTER_PASSES = 8  # a pass size gets its (U, M) tables once this many passes of it were costed (by any model of the process)


def check_family(profile: HardwareProfile, family: str) -> str:
    """`per_slot`, any dedup family of the profile, `best`, or `dispatch` on an engine profile."""
    if family == BEST or family in profile.expert_families or (family == DISPATCH and profile.dispatch is not None):
        return family
    known = ", ".join([*profile.expert_families, BEST, *([DISPATCH] if profile.dispatch is not None else [])])
    why = " (it is not an engine profile: no [dispatch] table)" if family == DISPATCH else ""
    raise InputError(f"profile '{profile.name}' has no family '{family}'{why} (families: {known})")


def default_family(profile: HardwareProfile, family: str | None = None) -> str:
    """The family asked for, or by default: `dispatch` on an engine profile, else `per_slot`."""
    if family is not None:
        return check_family(profile, family)
    return DISPATCH if profile.dispatch is not None else check_family(profile, "per_slot")


@dataclass(frozen=True)
class PassCost:
    """Predicted pass times kept in parts (arrays of one shape, µs): expert, dense and fixed time,
    and over several devices the collectives (`comm_us`).

    `total_us(expert_sign, dense_sign)` moves each part by its family's bound, (1 ± ε): a corner
    of the error box; the collectives move with the dense part's sign by their own held-out factor
    (1 + ε)^±1 (both are the pass's non-expert time). Ratios of pass times (speedups, savings,
    crossovers) are bounded by their extremes over the corners and the nominal point, since a
    family's error is systematic, not per pass.
    """

    expert_us: np.ndarray
    dense_us: np.ndarray
    fixed_us: float
    expert_epsilon: np.ndarray
    dense_epsilon: float
    family: np.ndarray
    extrapolation: np.ndarray
    provenance_us: dict[str, np.ndarray] = field(default_factory=dict)
    expert_by_family_us: dict[str, np.ndarray] = field(default_factory=dict)
    rung_us: np.ndarray = field(default_factory=lambda: np.zeros((0, len(RUNGS))))  # (..., 4): expert time per rung
    bound_basis: str = "one-layer fit"
    comm_us: np.ndarray | float = 0.0
    comm_epsilon: np.ndarray | float = 0.0
    engine_parts_us: dict[str, np.ndarray] = field(default_factory=dict)  # the engine's time per forward by term (its [speculative] table)
    engine_ends: tuple[dict[str, float], dict[str, float]] = ({}, {})  # the terms' scales at the low and the high end

    def engine_us(self, scale: dict[str, float] | None = None) -> np.ndarray | float:
        """E = Σ the engine's terms' parts, each times scale[term] (default 1)."""
        s = scale or {}
        return sum((us * s.get(term, 1.0) for term, us in self.engine_parts_us.items()), 0.0)

    def total_us(self, expert_sign: float = 0.0, dense_sign: float = 0.0, engine_scale: dict[str, float] | None = None) -> np.ndarray:
        """T = expert·(1 + s_e·ε_e) + dense·(1 + s_d·ε_d) + comm·(1 + ε_c)^s_d + fixed + the engine's time
        per forward (the collectives' bound is a factor: their held-out errors span several-fold)."""
        kernels = (
            self.expert_us * (1.0 + expert_sign * self.expert_epsilon)
            + self.dense_us * (1.0 + dense_sign * self.dense_epsilon)
            + self.comm_us * (1.0 + np.asarray(self.comm_epsilon)) ** dense_sign
            + self.fixed_us
        )
        return kernels + self.engine_us(engine_scale) if self.engine_parts_us else kernels

    @property
    def low_us(self) -> np.ndarray:
        """Lower end of the interval: every family at −ε, the engine's terms at their low end."""
        return self.total_us(-1.0, -1.0, self.engine_ends[0])

    @property
    def high_us(self) -> np.ndarray:
        """Upper end of the interval: every family at +ε, the engine's terms at their high end."""
        return self.total_us(1.0, 1.0, self.engine_ends[1])

    def provenance_share(self) -> dict[str, float]:
        """Share of the summed predicted time resting on each provenance kind."""
        total = float(np.sum(self.total_us()))
        return {kind: float(np.sum(us)) / total for kind, us in self.provenance_us.items()} if total > 0 else {}

    def rung_share(self) -> dict[str, float]:
        """Share of the summed expert time produced by each rung of the lookup ladder (sums to 1)."""
        per_rung = self.rung_us.reshape(-1, len(RUNGS)).sum(axis=0)
        total = float(per_rung.sum())
        return {rung: float(us) / total for rung, us in zip(RUNGS, per_rung, strict=True)} if total > 0 else {}

    @property
    def rung(self) -> np.ndarray:
        """Per pass, the lowest rung any of its expert time needed."""
        return worst_rung(self.rung_us)


@dataclass(frozen=True)
class StepTimeModel:
    """A target model on a device: turns routing features of passes into pass times."""

    preset: ModelPreset
    profile: HardwareProfile
    family: str = "per_slot"  # a family of the profile, `best` or `dispatch` (check_family)
    weight_format: str = ""
    kv_bytes_per_element: float = 2.0
    parallel: Parallelism = field(default_factory=Parallelism)

    def __post_init__(self) -> None:
        check_family(self.profile, self.family)
        if not self.weight_format:
            object.__setattr__(self, "weight_format", self.preset.default_format)
        if self.family == DISPATCH and not self.families:
            raise InputError(f"profile '{self.profile.name}': the engine's dispatch has no kernel for weight format {self.weight_format}")
        self.parallel.check(self.preset)

    def _require_experts(self) -> None:
        if self.preset.kind != "moe":
            raise InputError(f"model '{self.preset.name}' has no experts; routing features do not apply to it")

    @cached_property
    def expert_shape(self) -> ExpertShape:
        """One device's share of a routed expert: the whole expert (one device, or expert
        parallel), or its intermediate columns split over the tensor-parallel devices."""
        shape = self.preset.expert_shape(self.weight_format)
        if self.parallel.devices == 1 or self.parallel.expert_parallel:
            return shape
        return ExpertShape(shape.hidden, -(-shape.intermediate // self.parallel.devices), shape.weight_format)

    @property
    def families(self) -> tuple[str, ...]:
        """The expert families the model may use (its family, all for `best`, the dispatched ones)."""
        if self.family == DISPATCH:
            return self.profile.dispatch.families_for(self.weight_format)  # type: ignore[union-attr]
        return tuple(self.profile.expert_families) if self.family == BEST else (self.family,)

    def dispatched(self, n_tokens: np.ndarray | float) -> np.ndarray:
        """The family the engine's dispatch runs for passes of n tokens (family `dispatch` only)."""
        p = self.preset
        return self.profile.dispatch.family_for(self.weight_format, n_tokens, p.experts, p.top_k)  # type: ignore[union-attr]

    def _pass_families(self, n_tokens: int) -> tuple[str, ...]:
        """The families a pass of n tokens may take: the dispatched one, else the engine's (all for `best`)."""
        if self.family != DISPATCH:
            return self.families
        names = self._dispatched_families.get(n_tokens)
        if names is None:
            names = self._dispatched_families[n_tokens] = (str(self.dispatched(n_tokens)),)
        return names

    @cached_property
    def _dispatched_families(self) -> dict[int, tuple[str, ...]]:
        return {}

    def dense_family_us(self, bytes_read: float, flops: float) -> float:
        """The profile's dense family for one kernel's bytes and FLOPs (drafters run through it)."""
        return float(self.profile.dense.time_us(bytes_read, flops))

    def dense_loads(
        self,
        total_tokens: np.ndarray | float,
        context_tokens: np.ndarray | float,
        sequences: np.ndarray | float = 1.0,
        span: np.ndarray | float = 1.0,
    ) -> tuple[np.ndarray | float, np.ndarray | float, int, np.ndarray | float | None]:
        """What a pass's dense part rests on, one device's share: bytes W + KV read (non-expert weights
        read once per pass plus every request's KV, `kv_read`), FLOPs 2·params·tokens, kernels, and
        attention's FLOPs (`attention_work`) / devices where the profile prices them (else None); a
        sliding-window layer reads and attends over its window's keys of each sequence's mean
        context, the queries' key counts over `span` values (`moesim.models.window_keys`)."""
        weight_bytes, kv_by_window, params, kernels = self._dense_inputs
        attention = None
        if np.isfinite(self.profile.dense.attention_tflops):
            flops = attention_work(self.preset.attention_flops_by_window, total_tokens, context_tokens, sequences, span)
            attention = flops / self.parallel.devices
        return weight_bytes + kv_read(kv_by_window, context_tokens, sequences, span), 2.0 * params * total_tokens, kernels, attention

    def dense_parts_us(
        self, total_tokens: np.ndarray, context_tokens: np.ndarray | float, sequences: np.ndarray | float = 1.0
    ) -> dict[str, np.ndarray]:
        """The dense family's time (`dense_loads`) by what it rests on: kernel launches (`launch_us`),
        bytes (`bandwidth_gbps`), FLOPs (`tflops`) and attention's FLOPs (`attention_tflops`)."""
        as_array = (np.asarray(v, np.float64) for v in (total_tokens, context_tokens, sequences))
        bytes_read, flops, kernels, attention = self.dense_loads(*as_array)
        dense = self.profile.dense
        parts = {
            "launch_us": dense.time_us(0.0, 0.0, kernels),
            "bandwidth_gbps": dense.time_us(bytes_read, 0.0, 0.0),
            "tflops": dense.time_us(0.0, flops, 0.0),
        }
        if attention is not None:
            parts["attention_tflops"] = dense.attention_us(attention)
        return parts

    @cached_property
    def _dense_inputs(self) -> tuple[float, tuple[tuple[int, float], ...], float, int]:
        """One device's non-expert weight bytes, KV bytes per context token (summed over the layers
        of each window) and non-expert params (their 1/G share over G tensor-parallel devices), dense kernels per pass."""
        p = self.preset
        devices = self.parallel.devices
        kv = self.parallel.kv_bytes_by_window(p, self.kv_bytes_per_element)
        return (
            p.non_expert_bytes_per_token(self.weight_format) / devices,
            kv,
            float(p.non_expert_params_per_token()) / devices,
            DENSE_KERNELS_PER_LAYER * p.layers,
        )

    def comm_us(self, n_tokens: float) -> float:
        """The pass's collectives over the devices (0 on one device)."""
        return self.parallel.comm_us(self.preset, n_tokens)

    def engine_us(self, n_tokens: float) -> float:
        """The engine's time per forward of n tokens beyond its kernels (`SpecPath.forward_us`; 0 without a [speculative] table)."""
        spec = self.profile.speculative
        return spec.forward_us(n_tokens, self.preset.layers) if spec is not None else 0.0  # type: ignore[arg-type]

    def engine_parts_us(self, total_tokens: np.ndarray) -> dict[str, np.ndarray]:
        """E by term for passes of these sizes: pass_us, and the launches of those that run eager."""
        spec = self.profile.speculative
        if spec is None:
            return {}
        n = np.asarray(total_tokens, np.float64)
        parts = {}
        for term in ("pass_us", "launch_us_per_layer"):
            unit = spec.unit(term)
            parts[term] = getattr(spec, term) * np.vectorize(lambda t, u=unit: u.forward_us(t, self.preset.layers), otypes=[float])(n)
        return parts

    def pass_cost(self, features: RoutingFeatures, context_tokens: np.ndarray | float = 0.0, sequences: float = 1.0) -> PassCost:
        """Pass times for features shaped (..., MoE layers): one union of windows per pass, e.g. a
        batch's verify pass; `context_tokens` is the KV length summed over the pass's `sequences`."""
        self._require_experts()
        n_layers = len(self.preset.moe_layers)
        if features.shape[-1] != n_layers:
            raise InputError(f"features cover {features.shape[-1]} MoE layers, model '{self.preset.name}' has {n_layers}")
        shape = self.expert_shape
        sums = {}
        for name in self.families:
            family = self.profile.expert_family(name).for_format(shape.weight_format)
            sums[name] = family.sum_layers(ExpertInputs.of(features, shape), whole_pass=True)
        return self.assemble(sums, features.n_tokens[..., 0], context_tokens, sequences)

    def ranked_pass_cost(
        self, distinct: np.ndarray, most: np.ndarray, slots: np.ndarray, n_tokens: np.ndarray, context_tokens: float, sequences: float = 1.0
    ) -> PassCost:
        """Pass costs from per-rank counts ((passes, ranks, MoE layers) arrays of distinct experts,
        max tokens per expert and slots, `moesim.kernels.unions.union_pass`): under each family every
        layer costs its slowest rank (the rank's slots / K as its tokens), kept in parts as `pass_cost`."""
        self._require_experts()
        shape, k = self.expert_shape, self.preset.top_k
        slots = np.asarray(slots, np.float64)
        sums = {}
        for name in self.families:
            family = self.profile.expert_family(name).for_format(shape.weight_format)
            times = family.time_us(RoutingFeatures(slots / k, slots, distinct, most), shape)
            slowest = np.argmax(times, axis=-2)[..., None, :]

            def at_slowest(a: np.ndarray, slowest: np.ndarray = slowest) -> np.ndarray:
                return np.take_along_axis(np.asarray(a, np.float64), slowest, axis=-2)[..., 0, :]

            chosen = RoutingFeatures(at_slowest(slots) / k, at_slowest(slots), at_slowest(distinct), at_slowest(most))
            sums[name] = family.sum_layers(ExpertInputs.of(chosen, shape), whole_pass=True)
        return self.assemble(sums, np.asarray(n_tokens, np.float64), context_tokens, sequences)

    def pass_time_us(self, features: RoutingFeatures, context_tokens: float, sequences: float = 1.0) -> float:
        """The nominal time of one pass (features shaped (MoE layers,), integer counts as the union
        counters give them) of `sequences` requests: the simulator's per-iteration call, without
        intervals, extrapolation factors or provenance (`counts_pass_us`)."""
        n_tokens = int(features.n_tokens.flat[0])
        return self.counts_pass_us(n_tokens, features.distinct_experts, features.max_tokens_per_expert, context_tokens, sequences)

    def counts_pass_us(self, n_tokens: int, distinct: np.ndarray, most: np.ndarray, context_tokens: float, sequences: float = 1.0) -> float:
        """`pass_time_us` from the per-layer distinct experts and max tokens per expert of a pass of
        n tokens. A pass size seen TABLE_AFTER_PASSES times (by any model of the process), or whose tables
        were built already (in this process or the disk cache, `moesim.sim.cost.layer_tables`), gets tables of every (U, M)
        (`layer_time_table`) and is looked up in them; rarer sizes are evaluated per family by
        `ExpertFamily.fast_time_us` (compiled where the family allows): the same numbers either way (tested)."""
        names = self._pass_families(n_tokens)
        if (names[0], n_tokens) not in self._time_tables:
            tables = self.pass_tables
            tables.ensure(n_tokens)
            passes = max(int(tables.seen[n_tokens]) + 1, self._family_tables(names[0]).count_pass(n_tokens))
            tables.seen[n_tokens] = passes  # over every model of the process (`layer_tables`)
            if passes < TABLE_AFTER_PASSES:
                slots = np.full(np.shape(distinct), float(n_tokens * self.preset.top_k))
                families, shape = self.profile.expert_families, self.expert_shape
                k = self.preset.top_k
                expert = min(float(families[name].fast_time_us(slots, distinct, most, shape, k).sum()) for name in names)
                return self._plus_dense(expert, n_tokens, context_tokens, sequences)
        u = np.asarray(distinct).astype(np.intp)
        m = np.asarray(most).astype(np.intp)
        expert = min(float(self.layer_time_table(name, n_tokens)[u, m].sum()) for name in names)
        return self._plus_dense(expert, n_tokens, context_tokens, sequences)

    @cached_property
    def pass_tables(self) -> PassTables:
        """What the compiled pass (`moesim.sim.cost.fast_pass`) needs of this model; it shares
        with `counts_pass_us` how often each pass size was costed."""
        shape, k = self.expert_shape, self.preset.top_k
        families = [self.profile.expert_family(name) for name in self.families]
        kernel_params = [f.compiled_params(shape, k) if f.compiled else None for f in families]  # None: its ladder, never the formula
        weight_bytes, kv_by_window, params, kernels = self._dense_inputs
        dense = self.profile.dense
        attention = bool(np.isfinite(dense.attention_tflops))
        flops_by_window = self.preset.attention_flops_by_window if attention else tuple((w, 0.0) for w, _ in kv_by_window)
        # µs per FLOP and per attention FLOP: the dense family's time of one FLOP, exactly its coefficient
        terms = [
            weight_bytes, kv_by_window[0][1], params, float(kernels), dense.launch_us, dense.bandwidth_gbps,
            float(dense.time_us(0.0, 1.0, 0.0)), float(attention), flops_by_window[0][1],
            float(dense.attention_us(1.0)), float(self.parallel.devices), self.profile.pass_fixed_us,
            float(self.profile.speculative is not None), float(len(kv_by_window) - 1),
        ]  # fmt: skip
        for (window, kv), (_, flops) in zip(kv_by_window[1:], flops_by_window[1:], strict=True):
            terms += [float(window), kv, flops]  # the windowed layers (`plus_dense`)
        ready = [self._family_tables(name).cached_sizes() for name in self.families]
        return PassTables(kernel_params, np.array(terms), k, TABLE_AFTER_PASSES, self._pass_choices, ready)

    def _pass_choices(self, n_max: int) -> tuple[np.ndarray, np.ndarray]:
        """Per pass size 0..n_max: which of `families` it may take, and its collectives (µs)."""
        select = np.ones((n_max + 1, len(self.families)), np.bool_)
        if self.family == DISPATCH:
            index = {name: i for i, name in enumerate(self.families)}
            chosen = [index[str(name)] for name in np.atleast_1d(self.dispatched(np.arange(1, n_max + 1)))]
            select[:] = False
            select[np.arange(1, n_max + 1), chosen] = True
            select[0] = select[1]
        comm = np.array([self.comm_us(n) for n in range(n_max + 1)]) if self.parallel.devices > 1 else np.zeros(n_max + 1)
        if self.profile.speculative is not None:  # the engine's time per forward, one constant per pass size
            comm = comm + np.array([self.engine_us(n) for n in range(n_max + 1)])
        return select, comm

    def table_pass_size(self, n_tokens: int) -> None:
        """Give the compiled pass the (U, M) tables of a pass size (`layer_time_table`, the same numbers)."""
        tables = self.pass_tables
        tables.ensure(n_tokens)
        tables.seen[n_tokens] += 1
        for f in tables.families_of(n_tokens):
            tables.add_table(int(f), n_tokens, self.layer_time_table(self.families[f], n_tokens))

    def _plus_dense(
        self,
        expert_us: float,
        n_tokens: float,
        context_tokens: float,
        sequences: float,
        logits: tuple[float, float] | None = None,
        span: float = 1.0,
    ) -> float:
        """A pass's expert time plus its dense part (attention's FLOPs where the profile prices
        them), fixed time and, over several devices, collectives; `logits`, `span` as `dense_pass_us`."""
        bytes_read, flops, kernels, attention = self.dense_loads(n_tokens, context_tokens, sequences, span)
        if logits is not None:
            head_bytes, head_flops = self._head_saved(n_tokens, *logits)
            bytes_read, flops = bytes_read - head_bytes, flops - head_flops
        dense = float(self.profile.dense.time_us(bytes_read, flops, kernels))
        if attention is not None:
            dense += float(self.profile.dense.attention_us(attention))
        total = expert_us + dense + self.profile.pass_fixed_us
        if self.profile.speculative is not None:
            return total + ((self.comm_us(n_tokens) if self.parallel.devices > 1 else 0.0) + self.engine_us(n_tokens))
        return total + self.comm_us(n_tokens) if self.parallel.devices > 1 else total

    def dense_pass_us(
        self,
        n_tokens: float,
        context_tokens: float,
        sequences: float = 1.0,
        logits: tuple[float, float] | None = None,
        span: float = 1.0,
    ) -> float:
        """A pass of a dense target (no experts) of `sequences` requests: dense family + fixed time + collectives.
        `logits` = (head_share, logit_rows): the share of such passes that run the output head and the
        rows it runs on (llama-bench's prompt tests: one head per n_batch chunk, on its last row;
        `moesim.hw_profiles.importers.rows.prompt_scope`); None: every pass, on every token (decode, verify).
        `span`: the consecutive key counts a query's keys run over (`moesim.models.window_keys`; 1: the mean context)."""
        return self._plus_dense(0.0, n_tokens, context_tokens, sequences, logits, span)

    def _head_saved(self, n_tokens: float, head_share: float, logit_rows: float) -> tuple[float, float]:
        """(bytes, FLOPs) the output head does not spend against every pass on every token:
        head bytes·(1 − share), 2·head params·(n − share·rows) (one device's share)."""
        p, devices = self.preset, self.parallel.devices
        head = p.lm_head_params() / devices
        return head * bytes_per_weight(self.weight_format) * (1.0 - head_share), 2.0 * head * (n_tokens - head_share * logit_rows)

    def rank_pass_us(
        self, distinct: np.ndarray, most: np.ndarray, slots: np.ndarray, n_tokens: int, context_tokens: float, sequences: float = 1.0
    ) -> float:
        """A pass from per-rank features ((ranks, MoE layers) arrays of distinct experts, max
        tokens per expert and slots, `moesim.kernels.unions.union_pass`: a mixed pass of chunked
        prefill, or expert parallel): each layer costs its slowest rank (`ExpertFamily.fast_layers_us`:
        `time_us` per rank and layer); one rank is a pass of n tokens like any other (`counts_pass_us`)."""
        if np.shape(distinct)[0] == 1:  # one rank: a pass of n tokens like any other (its tables once frequent)
            return self.counts_pass_us(n_tokens, np.asarray(distinct)[0], np.asarray(most)[0], context_tokens, sequences)
        shape = self.expert_shape
        families = self.profile.expert_families
        arrays = [np.ascontiguousarray(a, np.float64) for a in (slots, distinct, most)]
        k = self.preset.top_k
        expert = min(families[name].fast_layers_us(*arrays, shape, k) for name in self._pass_families(n_tokens))
        return self._plus_dense(expert, n_tokens, context_tokens, sequences)

    def layer_time_table(self, family: str, n_tokens: int) -> np.ndarray:
        """time_us of one MoE layer for every distinct-expert count U = 0..E and max tokens per
        expert M = 0..n at a pass of n tokens: shape (E + 1, n + 1), computed once per (family, n)."""
        key = (family, n_tokens)
        table = self._time_tables.get(key)
        if table is None:
            p = self.preset

            def build() -> np.ndarray:
                distinct = np.arange(p.experts + 1, dtype=np.float64)[:, None]
                most = np.arange(n_tokens + 1, dtype=np.float64)[None, :]
                features = RoutingFeatures(np.float64(n_tokens), np.float64(n_tokens * p.top_k), distinct, most)
                return self.profile.expert_family(family).time_us(features, self.expert_shape)

            table = self._family_tables(family).table(n_tokens, build)
            if len(self._time_tables) >= TIME_TABLES_KEPT:
                self._time_tables.clear()
            self._time_tables[key] = table
        return table

    @cached_property
    def _time_tables(self) -> dict[tuple[str, int], np.ndarray]:
        return {}

    def _family_tables(self, name: str) -> FamilyTables:
        """A family's tables, shared by every model of the process and kept on disk (`moesim.sim.cost.layer_tables`)."""
        tables = self._tables_by_family.get(name)
        if tables is None:
            p = self.preset
            tables = self._tables_by_family[name] = FamilyTables.of(self.profile.expert_family(name), self.expert_shape, p.experts, p.top_k)
        return tables

    @cached_property
    def _tables_by_family(self) -> dict[str, FamilyTables]:
        return {}

    def expected_pass_cost(
        self, distributions: list[tuple[RoutingFeatures, np.ndarray]], context_tokens: float = 0.0, sequences: float = 1.0
    ) -> PassCost:
        """Expected pass times over windows, one per pass size: `distributions[i]` lists every
        per-layer feature value of pass size i with its probability (pooled over MoE layers, so
        the expected expert time is layers · Σ p·time_us)."""
        self._require_experts()
        n_layers = len(self.preset.moe_layers)
        shape = self.expert_shape
        sums = {}
        for name in self.families:
            family = self.profile.expert_family(name).for_format(shape.weight_format)
            weighted = [_expected(family, ExpertInputs.of(f, shape), p) for f, p in distributions]
            summed = LayerSum(
                n_layers * np.array([w.time_us for w in weighted]),
                n_layers * np.array([w.low_us for w in weighted]),
                n_layers * np.array([w.high_us for w in weighted]),
                n_layers * np.stack([w.rung_us for w in weighted]),
                np.array([float(w.extrapolation) for w in weighted]),
            )
            sums[name] = family.transferred(summed, n_layers)
        tokens = np.array([float(f.n_tokens.flat[0]) for f, _ in distributions])
        return self.assemble(sums, tokens, context_tokens, sequences)

    def assemble(
        self, sums: dict[str, LayerSum], total_tokens: np.ndarray, context_tokens: np.ndarray | float, sequences: float = 1.0
    ) -> PassCost:
        """Choose the family (the engine's, the dispatched one, or the cheapest for `best`), add dense and fixed time."""
        per_family = np.stack([sums[name].time_us for name in self.families])
        if self.family == DISPATCH:
            index = {name: i for i, name in enumerate(self.families)}
            dispatched = self.dispatched(np.broadcast_to(total_tokens, per_family.shape[1:]))
            choice = np.vectorize(index.__getitem__, otypes=[np.intp])(dispatched)
        else:
            choice = np.argmin(per_family, axis=0)
        expert = np.take_along_axis(per_family, choice[None], axis=0)[0]
        dense_parts = self.dense_parts_us(total_tokens, np.broadcast_to(context_tokens, np.shape(total_tokens)), sequences)
        dense = sum(dense_parts.values())
        factor = np.ones(expert.shape)
        epsilon = np.zeros(expert.shape)
        rung_us = np.zeros((*expert.shape, len(RUNGS)))
        by_kind: dict[str, np.ndarray] = {}
        bases = []
        for i, name in enumerate(self.families):
            family = self.profile.expert_family(name)
            chosen = choice == i
            factor = np.where(chosen, sums[name].extrapolation, factor)
            epsilon = np.where(chosen, sums[name].epsilon, epsilon)
            rung_us = np.where(chosen[..., None], sums[name].rung_us, rung_us)
            if chosen.any():
                bases.append(family.bound_basis)
            kind = family.provenance.kind
            by_kind[kind] = by_kind.get(kind, 0.0) + np.where(chosen, expert, 0.0)
        for part, us in dense_parts.items():
            kind = self.profile.provenance_of(f"families.dense.{part}").kind
            by_kind[kind] = by_kind.get(kind, 0.0) + us
        comm: np.ndarray | float = 0.0
        if self.parallel.devices > 1:  # the collectives, on the fabric's calibrated terms (or the link's numbers)
            comm = self.comm_us(np.asarray(total_tokens, np.float64))
            kind = self.parallel.comm_kind
            by_kind[kind] = by_kind.get(kind, 0.0) + comm
        fixed_kind = self.profile.provenance_of("pass.fixed_us").kind
        by_kind[fixed_kind] = by_kind.get(fixed_kind, 0.0) + self.profile.pass_fixed_us
        engine = self.engine_parts_us(np.broadcast_to(total_tokens, expert.shape))
        if engine:
            kind = self.profile.speculative.provenance.kind  # type: ignore[union-attr]
            by_kind[kind] = by_kind.get(kind, 0.0) + sum(engine.values())
        return PassCost(
            expert_us=expert,
            dense_us=dense,
            fixed_us=self.profile.pass_fixed_us,
            expert_epsilon=epsilon,
            dense_epsilon=finite_or_zero(self.profile.dense.heldout_error.epsilon),
            family=np.asarray(self.families)[choice],
            extrapolation=factor,
            provenance_us=by_kind,
            expert_by_family_us={name: sums[name].time_us for name in self.families},
            rung_us=rung_us,
            bound_basis="; ".join(dict.fromkeys(bases)) or "one-layer fit",
            engine_parts_us=engine,
            engine_ends=(spec.extreme_scale(-1.0), spec.extreme_scale(1.0)) if (spec := self.profile.speculative) is not None else ({}, {}),
            comm_us=comm,
            comm_epsilon=self.parallel.comm_epsilon(self.preset, np.asarray(total_tokens, np.float64)),
        )


def _expected(family: ExpertFamily, x: ExpertInputs, probability: np.ndarray) -> LayerSum:
    """One layer of a whole pass: its expected time over a distribution of features (cells with probabilities)."""
    look = family.inputs_lookup(x, whole_pass=True)
    factor = float(family.calibrated_range.factor(x)[probability > 0].max(initial=1.0))
    weighted = probability * look.time_us
    spread = float(np.sum(weighted * np.where(np.isfinite(look.epsilon), look.epsilon, 0.0)))
    time = float(np.sum(weighted))
    rung_us = np.array([float(np.sum(np.where(look.rung == r, weighted, 0.0))) for r in range(len(RUNGS))])
    return LayerSum(np.float64(time), np.float64(time - spread), np.float64(time + spread), rung_us, np.float64(factor))


def finite_or_zero(value: float) -> float:
    """The value, or 0 where it is not finite (a family without a held-out error has no bound)."""
    return float(value) if np.isfinite(value) else 0.0
