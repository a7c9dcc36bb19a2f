"""Measurement plans: the passes a prediction priced from fitted or extrapolated rungs, to measure.

`moesim predict --out` and `moesim validate --out` write `plan.toml` (docs/microbench.md, "Plans"):
one `[[passes]]` table per expert shape, kernel family, pass size n and routing features (distinct
experts U, tokens of the busiest expert M) whose time the lookup ladder did not take from measured
points, with the rung it came from and the share of the answer resting on it. `moesim microbench
torch --plan FILE` measures exactly those passes (routing `planned`: `routing.planned_ids`), each
with the runner's engines of the pass's family; `--dry-run` lists them without a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesim.atomic import output_dir, write_text_atomic
from moesim.errors import InputError
from moesim.fields import Checked, build, checked, require
from moesim.hw_profiles.microbench.routing import MAX_PASS_SIZE, format_pass_sizes, planned_problem
from moesim.hw_profiles.microbench.table import MoeShape
from moesim.tomlfile import read_toml, toml_section

PLAN_FORMAT = "moesim-measurement-plan"
PLAN_NAME = "plan.toml"
GAP_RUNGS = ("fitted", "extrapolated")  # the rungs a plan measures: priced without a measured point nearby
MAX_EXPERTS = 1 << 16
MAX_WIDTH = 1 << 20  # hidden size or expert width


@dataclass(frozen=True)
class PlannedPass(Checked):
    """`[[passes]]`: one pass to measure, its expert shape, family, size and routing features."""

    model: str
    hidden: int = checked(ge=1, le=MAX_WIDTH)
    expert_intermediate: int = checked(ge=1, le=MAX_WIDTH)
    experts: int = checked(ge=1, le=MAX_EXPERTS)
    top_k: int = checked(ge=1, le=MAX_EXPERTS)
    weight_format: str = "BF16"
    family: str = "per_slot"
    n_tokens: int = checked(1, ge=1, le=MAX_PASS_SIZE)
    distinct_experts: int = checked(1, ge=1, le=MAX_EXPERTS)
    max_tokens_per_expert: int = checked(1, ge=1, le=MAX_PASS_SIZE)
    rung: str = checked("fitted", choices=GAP_RUNGS)
    time_share: float = checked(0.0, ge=0.0, le=1.0)  # of the predicted time of the pass (or row) it belongs to

    def __post_init__(self) -> None:
        require(bool(self.model), "model", "must name the shape (a preset's name)")
        require(bool(self.family), "family", "must name a kernel family")
        require(self.top_k <= self.experts, "top_k", f"must be <= experts ({self.experts}), got {self.top_k}")
        problem = planned_problem(self.n_tokens, self.experts, self.top_k, self.distinct_experts, self.max_tokens_per_expert)
        require(problem is None, "distinct_experts" if problem and problem.startswith("distinct") else "max_tokens_per_expert",
                f"{problem} (n_tokens {self.n_tokens}, top_k {self.top_k}, experts {self.experts})")  # fmt: skip

    @property
    def shape(self) -> MoeShape:
        """The routed-expert shape the pass runs."""
        return MoeShape(self.model, self.hidden, self.expert_intermediate, self.experts, self.top_k, self.weight_format.upper())


@dataclass(frozen=True)
class Plan(Checked):
    """A plan file: what wrote it, the share of its answer resting on the planned passes, the passes."""

    format: str = checked(choices=(PLAN_FORMAT,))
    version: int = checked(1, ge=1, le=1)
    source: str = ""  # the command and inputs whose answer the passes come from
    profile: str = ""
    answer_share: float = checked(0.0, ge=0.0, le=1.0)  # of the whole answer's predicted time
    notes: tuple[str, ...] = ()
    passes: tuple[PlannedPass, ...] = ()


def read_plan(path: Path) -> Plan:
    """A checked plan file (one line naming the file and key otherwise); a plan with no pass is refused."""
    plan = build(Plan, read_toml(path, "measurement plan"), "", str(path), path.parent)
    if not plan.passes:
        raise InputError(f"{path}: key 'passes': the plan has no pass to measure (its answer rests on measured points only)")
    return plan


def plan_text(plan: Plan) -> str:
    """The plan as TOML (passes in the order given)."""
    head = {"format": plan.format, "version": plan.version, "source": plan.source, "profile": plan.profile,
            "answer_share": plan.answer_share, "notes": list(plan.notes)}  # fmt: skip
    if not plan.passes:
        head["passes"] = []
    lines: list[str] = []
    toml_section(lines, None, head)
    for p in plan.passes:
        toml_section(lines, "[passes]", {name: getattr(p, name) for name in PlannedPass.__dataclass_fields__})
    return "\n".join(lines).rstrip("\n") + "\n"


def write_plan(path: Path, plan: Plan) -> None:
    """Write a plan file atomically."""
    write_text_atomic(path, plan_text(plan))


def write_plan_dir(out_dir: Path, plan: Plan, force: bool = False) -> Path:
    """Write `out_dir`/plan.toml (an output folder: `moesim.atomic.output_dir`)."""
    with output_dir(out_dir, force) as staging:
        write_plan(staging / PLAN_NAME, plan)
    return out_dir / PLAN_NAME


def merged_passes(passes: Sequence[PlannedPass]) -> list[PlannedPass]:
    """Passes of equal shape, family, n, U and M as one: the largest share, the worst rung (first-seen order)."""
    groups: dict[tuple[Any, ...], list[PlannedPass]] = {}
    for p in passes:
        groups.setdefault((p.shape, p.family, p.n_tokens, p.distinct_experts, p.max_tokens_per_expert), []).append(p)
    return [
        dataclasses.replace(max(group, key=lambda p: p.time_share), rung=max((p.rung for p in group), key=GAP_RUNGS.index))
        for group in groups.values()
    ]


def plan_shapes(plan: Plan) -> list[MoeShape]:
    """The expert shapes of a plan's passes, first-seen order (each in its first pass's weight
    format); one name is one shape (one line otherwise)."""
    shapes: dict[str, MoeShape] = {}
    for p in plan.passes:
        kept = shapes.setdefault(p.model, p.shape)
        if dataclasses.replace(kept, weight_format=p.shape.weight_format) != p.shape:
            raise InputError(f"plan: model '{p.model}' has two expert shapes ({kept} and {p.shape})")
    return list(shapes.values())


# A runner's engines: name -> the family it runs, or a function of the pass giving them (llama.cpp's family depends on n).
Engines = Mapping[str, str] | Callable[[PlannedPass], Mapping[str, str]]


def planned_rows(plan: Plan, engines: Engines) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows a runner measures for a plan, given its engines (name -> the family it runs; or,
    for a runner whose family depends on the pass, a function of the pass giving them): every pass
    with each engine of its family, in the plan's order; and a note per family no engine measures."""
    rows, missing = [], {}
    for p in plan.passes:
        offered = engines(p) if callable(engines) else engines
        chosen = [name for name, family in offered.items() if family == p.family]
        if not chosen:
            missing.setdefault(p.family, []).append(p.n_tokens)
        for engine in chosen:
            rows.append({"engine": engine, "kernel": p.family, "model": p.model, "hidden": p.hidden,
                         "expert_intermediate": p.expert_intermediate, "experts": p.experts, "top_k": p.top_k,
                         "dtype": p.weight_format.lower(), "n_tokens": p.n_tokens, "distinct_experts": p.distinct_experts,
                         "max_tokens_per_expert": p.max_tokens_per_expert, "rung": p.rung, "time_share": p.time_share})  # fmt: skip
    notes = [f"{len(sizes)} planned pass(es) of family {family} (n = {format_pass_sizes(tuple(sizes))}): no engine of this runner "
             "measures it there" for family, sizes in missing.items()]  # fmt: skip
    return rows, notes


def measured_passes(plan: Plan, engines: Engines) -> Plan:
    """The plan with only the passes some engine of the runner measures."""

    def kept(p: PlannedPass) -> bool:
        return p.family in (engines(p) if callable(engines) else engines).values()

    return dataclasses.replace(plan, passes=tuple(p for p in plan.passes if kept(p)))
