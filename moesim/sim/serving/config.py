"""The simulation config: frozen dataclasses parsed from TOML (`moesim simulate CONFIG.toml`).

Every section is a frozen dataclass whose fields are its keys (reference: docs/simulator.md).
Paths are relative to the config file. Errors are one line naming the file and the key,
raised before anything runs or is written:

    [run]         seed, requests, duration_s, compare_off
    [workload]    prompt_tokens, output_tokens | file
    [arrivals]    kind = "closed" (concurrency) | "poisson" (rate_per_s)
    [batching]    max_batch, chunked_prefill, token_budget
    [memory]      optional KV-cache pages: block_tokens, pages, utilization, reserve_gb, kv_bytes_per_element, preemption
    [parallel]    tensor_parallel, expert_parallel, link                  (the target over several devices)
    [trace]       path | synth (+ synth_params, tokens, seqs, seed); offset_stride
    [cost]        kind = "table" (target_us, draft_step_us, prefill_us_per_token) | "steptime"; prefill_chunk, moesd_slots
    [target]      model, weight_format, profile, family, device     (the step-time model's target)
    [drafter]     kind = "ngram" | "preset" (model) | "eagle" | "fixed" (time_us) | any drafter spec; tree
    [acceptance]  model = "geometric" | "position" | "regime" | "recorded" | "tree", and its keys
    [policy]      name = "off" | "static" | "oracle" | "cascade", and its keys
    [study]       optional grid: models, batches, [[study.devices]], [study.drafters], [study.workloads.NAME]
                  acceptance tables, [[study.policies]]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from moesim.errors import ConfigError, MoesimError
from moesim.fields import Checked, FieldError, build, build_entry, checked, field_checked, renamed_keys, require
from moesim.hw_profiles import load_profile
from moesim.hw_profiles.catalog import DeviceSpec, device_of_profile, device_spec, link_spec
from moesim.models import load_preset
from moesim.sim.cost.drafters import DenseModelDrafter, DrafterSection
from moesim.sim.cost.parallel import ALL_REDUCES, Parallelism, parallelism_on
from moesim.sim.cost.steptime import default_family
from moesim.sim.serving import cascade  # noqa: F401 (registers the cascade policy)
from moesim.sim.serving.acceptance import ACCEPTANCE_MODELS, AcceptanceModel, Tree
from moesim.sim.serving.memory import KVBudget, MemorySection, check_longest_request, check_sizes, kv_budget
from moesim.sim.serving.policies import POLICIES, Policy
from moesim.sim.serving.workload import Arrivals, Workload
from moesim.tomlfile import check_run_header, read_toml
from moesim.tracegen.formats.builtin import config_trace, resolve_trace
from moesim.tracegen.routing.synth import MAX_POSITIONS, MAX_SEED, make_generator

MODEL_PLACEHOLDER = "{model}"
MAX_REQUESTS = 1 << 24
MAX_DURATION_S = 1e7  # simulated seconds of one run (116 days)


@dataclass(frozen=True)
class RunSection(Checked):
    """Stop condition, seed, and whether to rerun with speculation off for comparison."""

    seed: int = checked(0, ge=0, le=MAX_SEED)
    requests: int = checked(16, ge=0, le=MAX_REQUESTS)
    duration_s: float = checked(0.0, ge=0.0, le=MAX_DURATION_S)
    compare_off: bool = True

    def __post_init__(self) -> None:
        require(self.requests > 0 or self.duration_s > 0, "requests", "give a request count > 0 or a duration_s > 0")


@dataclass(frozen=True)
class Batching(Checked):
    """Continuous batching up to `max_batch` requests at once; with `chunked_prefill`, prompts are
    prefilled in chunks beside the decode and verify tokens of each pass, under `token_budget`
    tokens per iteration (vLLM v1's max_num_batched_tokens; 2048 is one of Sarathi-Serve's budgets)."""

    max_batch: int = checked(1, ge=1, le=1 << 20)
    chunked_prefill: bool = False
    token_budget: int = checked(2048, ge=1, le=1 << 31)

    def __post_init__(self) -> None:
        require(
            self.token_budget >= self.max_batch,
            "token_budget",
            f"must be >= max_batch ({self.max_batch}: every decoding request gets a token), got {self.token_budget}",
        )


@dataclass(frozen=True)
class ParallelSection(Checked):
    """The target over `tensor_parallel` devices of the target's kind, tensor parallel, or with the
    routed experts partitioned over them (`expert_parallel`), joined by `link` (a link profile of
    the device catalog; default: the device's own peer link), its all-reduces by `all_reduce`
    (auto: the engines' custom all-reduce where the link has it, else NCCL; `moesim.sim.cost.parallel`)."""

    tensor_parallel: int = checked(1, ge=1, le=1 << 16)
    expert_parallel: bool = False
    link: str = ""
    all_reduce: str = checked("auto", choices=ALL_REDUCES)

    def __post_init__(self) -> None:
        require(not self.expert_parallel or self.tensor_parallel > 1, "expert_parallel", "needs tensor_parallel > 1 devices")
        if self.link:
            with field_checked("link"):
                link_spec(self.link)


@dataclass(frozen=True)
class TraceSection(Checked):
    """The routing trace requests decode over: a file (`path`, may contain {model} in a study)
    or one synthesised for the target model (`synth` = a routing generator's name)."""

    path: Path | None = None
    synth: str | None = None
    synth_params: dict[str, Any] = field(default_factory=dict)
    tokens: int = checked(2048, ge=1, le=MAX_POSITIONS)
    seqs: int = checked(4, ge=1, le=MAX_POSITIONS)
    seed: int = checked(0, ge=0, le=MAX_SEED)
    offset_stride: int = checked(0, ge=0, lt=1 << 32)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.synth is None):
            raise FieldError("path", "give exactly one of 'path' (a trace file) or 'synth' (a routing generator)")
        if self.path is not None and MODEL_PLACEHOLDER not in str(self.path):
            require(resolve_trace(self.path).is_file(), "path", f"no such trace file {self.path}")
            object.__setattr__(self, "path", config_trace(Path(self.path)))

    def path_for(self, model: str | None) -> Path | None:
        """The trace file of `model` ({model} replaced)."""
        if self.path is None:
            return None
        return Path(str(self.path).replace(MODEL_PLACEHOLDER, model or ""))


@dataclass(frozen=True)
class CostSection:
    """Where pass times come from: a pass-cost table, or the trace-driven step-time model."""

    KINDS: ClassVar[tuple[str, ...]] = ("table", "steptime")
    kind: str = "table"
    target_us: tuple[float, ...] | None = None
    draft_step_us: float = 0.0
    prefill_us_per_token: float = 0.0
    prefill_chunk: int = 512
    moesd_slots: bool = False

    def __post_init__(self) -> None:
        require(self.kind in self.KINDS, "kind", f"unknown cost kind '{self.kind}' (known: {', '.join(self.KINDS)})")
        if self.kind == "table":
            table = self.target_us or ()
            require(len(table) > 0, "target_us", "a table cost needs target_us = [pass time of 1 token, of 2 tokens, ...] (µs)")
            require(all(math.isfinite(t) and t > 0 for t in table), "target_us", "pass times must be positive")
        require(math.isfinite(self.draft_step_us) and self.draft_step_us >= 0, "draft_step_us", f"must be >= 0, got {self.draft_step_us}")
        require(
            math.isfinite(self.prefill_us_per_token) and self.prefill_us_per_token >= 0,
            "prefill_us_per_token",
            f"must be >= 0, got {self.prefill_us_per_token}",
        )
        require(self.prefill_chunk >= 1, "prefill_chunk", f"must be >= 1, got {self.prefill_chunk}")


@dataclass(frozen=True)
class TargetSection:
    """The target model on a hardware profile (used by the step-time model and trace synthesis)."""

    model: str | None = None
    weight_format: str | None = None
    profile: str | None = None
    family: str | None = None  # the expert kernel family; default: the engine's dispatch on an engine profile, per_slot otherwise
    device: str = ""

    def __post_init__(self) -> None:
        if self.device:
            with field_checked("device"):
                device_spec(self.device)


@dataclass(frozen=True)
class StudyDevice:
    """`[[study.devices]]`: a device setting of a study: a profile (and its catalog entry) over
    `tensor_parallel` devices."""

    name: str
    profile: str
    device: str = ""
    tensor_parallel: int = 1
    expert_parallel: bool = False
    link: str = ""

    def __post_init__(self) -> None:
        ParallelSection(self.tensor_parallel, self.expert_parallel, self.link)

    def apply(self, target: TargetSection) -> tuple[TargetSection, ParallelSection]:
        """The target and parallel sections of a cell on this device."""
        return dataclasses.replace(target, profile=self.profile, device=self.device), ParallelSection(
            self.tensor_parallel, self.expert_parallel, self.link
        )


@dataclass(frozen=True)
class StudySection:
    """A grid of runs: every model × device × batch × workload × policy (each cell compared with
    speculation off); a model may bring its own drafter."""

    models: tuple[str, ...] = ()
    workloads: tuple[tuple[str, AcceptanceModel], ...] = ()
    policies: tuple[Policy, ...] = ()
    batches: tuple[int, ...] = ()
    devices: tuple[StudyDevice, ...] = ()
    drafters: tuple[tuple[str, DrafterSection], ...] = ()

    @property
    def serving(self) -> bool:
        """Whether the grid has serving axes (batches or devices): its rows carry them and the target efficiency."""
        return bool(self.batches or self.devices)

    def drafter_for(self, model: str | None, default: DrafterSection) -> DrafterSection:
        """The model's drafter in this study, else the config's."""
        return dict(self.drafters).get(model or "", default)


@dataclass(frozen=True)
class SimConfig:
    """A whole simulation config."""

    source: str
    run: RunSection
    workload: Workload
    arrivals: Arrivals
    batching: Batching
    trace: TraceSection | None
    cost: CostSection
    target: TargetSection
    drafter: DrafterSection
    acceptance: AcceptanceModel
    policy: Policy
    study: StudySection | None = None
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)  # one line per renamed key the config used

    def models(self) -> tuple[str | None, ...]:
        """The target models this config runs (a study's list, else the target's)."""
        if self.study is not None and self.study.models:
            return self.study.models
        return (self.target.model,)

    def with_cell(
        self,
        model: str | None,
        acceptance: AcceptanceModel,
        policy: Policy,
        device: StudyDevice | None = None,
        batch: int | None = None,
    ) -> SimConfig:
        """This config with another target model (and its drafter in the study), acceptance model
        and policy, optionally on another device and at another batch size (one study cell: a
        closed loop of `batch` requests in flight)."""
        target = dataclasses.replace(self.target, model=model) if model is not None else self.target
        drafter = self.study.drafter_for(model, self.drafter) if self.study is not None else self.drafter
        parallel = self.parallel
        if device is not None:
            target, parallel = device.apply(target)
        batching, arrivals = self.batching, self.arrivals
        if batch is not None:
            batching = dataclasses.replace(batching, max_batch=batch, token_budget=max(batching.token_budget, batch))
            arrivals = dataclasses.replace(arrivals, concurrency=batch)
        return dataclasses.replace(
            self,
            target=target,
            drafter=drafter,
            parallel=parallel,
            batching=batching,
            arrivals=arrivals,
            acceptance=acceptance,
            policy=policy,
            study=None,
        )


SECTIONS = (
    "run", "workload", "arrivals", "batching", "memory", "parallel", "trace", "cost", "target", "drafter", "acceptance",
    "policy", "study",
)  # fmt: skip


def acceptance_from_table(table: Any, section: str, source: str, base_dir: Path) -> AcceptanceModel:
    """An acceptance model from its table (`model` selects it)."""
    return build_entry(ACCEPTANCE_MODELS, "model", table, section, source, base_dir)


def policy_from_table(table: Any, section: str, source: str, base_dir: Path) -> Policy:
    """A policy from its table (`name` selects it)."""
    return build_entry(POLICIES, "name", table, section, source, base_dir)


def _check_cap(acceptance: AcceptanceModel, policy: Policy, section: str, source: str) -> None:
    try:
        acceptance.check_cap(policy.k_cap)
    except FieldError as exc:
        raise ConfigError(f"{source}: key '{section}.{exc.field}': {exc.detail}") from None


def resolve_path(value: str | None, base_dir: Path) -> str | None:
    """A preset or profile given as a file is relative to the config; names stay names."""
    if value is None or not value.endswith((".toml", ".json")):
        return value
    path = Path(value)
    return str(path if path.is_absolute() else base_dir / path)


def _check_profile(profile_name: str, family: str | None, key: str, source: str) -> None:
    """The profile loads and has the family (the dispatch by default on an engine profile)."""
    try:
        profile = load_profile(profile_name)
    except MoesimError as exc:
        raise ConfigError(f"{source}: key '{key}': {exc}") from None
    try:
        default_family(profile, family)
    except MoesimError as exc:
        raise ConfigError(f"{source}: key 'target.family': {exc}") from None


def _check_target(config: SimConfig, steptime: bool) -> None:
    """Every target model is a preset, its drafter resolves against it (when the step-time model
    runs), every profile loads and has the engine's family, and every cell's placement (devices,
    link, KV pages) holds: a target whose weights do not fit is a one-line error."""
    target, source = config.target, config.source
    study = config.study
    for model in config.models():
        if model is None:
            continue
        try:
            preset = load_preset(model)
        except MoesimError as exc:
            key = "target.model" if model == target.model else "study.models"
            raise ConfigError(f"{source}: key '{key}': {exc}") from None
        drafter = study.drafter_for(model, config.drafter) if study is not None else config.drafter
        if steptime:
            try:
                drafter.make(preset)
            except MoesimError as exc:
                key = "study.drafters" if drafter is not config.drafter else f"drafter.{'model' if drafter.kind == 'preset' else 'kind'}"
                raise ConfigError(f"{source}: key '{key}': {exc}") from None
    if target.profile is not None:
        _check_profile(target.profile, target.family, "target.profile", source)
    devices = study.devices if study is not None and study.devices else (None,)
    for i, device in enumerate(devices):
        if device is not None:
            _check_profile(device.profile, target.family, f"study.devices[{i}].profile", source)
        for model in config.models():
            placement(config.with_cell(model, config.acceptance, config.policy, device))


def target_device(target: TargetSection) -> DeviceSpec | None:
    """The catalog entry of the target's device: `device`, else the one its profile describes."""
    if target.device:
        return device_spec(target.device)
    if target.profile is None:
        return None
    profile = load_profile(target.profile)
    return device_of_profile(profile.name, profile.device.name)


def placement(config: SimConfig) -> tuple[Parallelism, KVBudget | None]:
    """Where the config's target runs: its devices and the link between them (the catalog's
    peer link of the device unless `parallel.link` names one), and its KV pages (None without
    [memory]). Errors are one line naming the key."""
    target, section, source = config.target, config.parallel, config.source
    try:
        device = target_device(target)
    except MoesimError as exc:
        raise ConfigError(f"{source}: key 'target.device': {exc}") from None
    try:
        parallel = parallelism_on(device, section.tensor_parallel, section.expert_parallel, section.link, section.all_reduce)
    except ConfigError as exc:
        raise ConfigError(f"{source}: key 'parallel.{'link' if 'need a link' in str(exc) else 'all_reduce'}': {exc}") from None
    preset = load_preset(target.model) if target.model is not None else None
    if preset is not None:
        try:
            parallel.check(preset)
        except ConfigError as exc:
            raise ConfigError(f"{source}: key 'parallel.expert_parallel': {exc}") from None
    if config.memory is None:
        return parallel, None
    fmt = target.weight_format or (preset.default_format if preset is not None else "BF16")
    drafter = config.drafter.make(preset) if preset is not None and config.cost.kind == "steptime" else None
    draft = drafter.model if isinstance(drafter, DenseModelDrafter) else None
    host = link_spec(device.host_link) if device is not None and device.host_link else None
    try:
        budget = kv_budget(config.memory, preset, fmt, draft, device, parallel, host)
    except ConfigError as exc:
        raise ConfigError(f"{source}: key 'memory': {exc}") from None
    try:
        batching, batches = config.batching, config.study.batches if config.study else ()
        chunk = max((batching.token_budget, *batches)) if batching.chunked_prefill else 0  # a study's batch raises the budget
        check_longest_request(budget, config.workload, [config.policy, *(config.study.policies if config.study else ())], chunk)
    except ConfigError as exc:
        raise ConfigError(f"{source}: key 'memory.pages': {exc}") from None
    return parallel, budget


def _study(table: Any, source: str, base_dir: Path, cost: CostSection) -> StudySection:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: key 'study' must be a table")
    known = ("batches", "devices", "drafters", "models", "policies", "workloads")
    unknown = set(table) - set(known)
    if unknown:
        raise ConfigError(f"{source}: key 'study.{sorted(unknown)[0]}': unknown key (known: {', '.join(known)})")
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{source}: key 'study.models' must be a list of model preset names")
    if models and cost.kind != "steptime":
        raise ConfigError(f"{source}: key 'study.models': a study over models needs cost.kind = 'steptime'")
    workloads_table = table.get("workloads", {})
    if not isinstance(workloads_table, dict) or not workloads_table:
        raise ConfigError(f"{source}: key 'study.workloads' must hold at least one [study.workloads.NAME] acceptance table")
    workloads = tuple((name, acceptance_from_table(t, f"study.workloads.{name}", source, base_dir)) for name, t in workloads_table.items())
    policy_tables = table.get("policies", [])
    if not isinstance(policy_tables, list) or not policy_tables:
        raise ConfigError(f"{source}: key 'study.policies' must hold at least one [[study.policies]] table")
    policies = tuple(policy_from_table(t, f"study.policies[{i}]", source, base_dir) for i, t in enumerate(policy_tables))
    for name, acceptance in workloads:
        for policy in policies:
            _check_cap(acceptance, policy, f"study.workloads.{name}", source)
    batches = table.get("batches", [])
    if not isinstance(batches, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches):
        raise ConfigError(f"{source}: key 'study.batches' must be a list of batch sizes >= 1")
    device_tables = table.get("devices", [])
    if not isinstance(device_tables, list):
        raise ConfigError(f"{source}: key 'study.devices' must hold [[study.devices]] tables")
    devices = []
    for i, entry in enumerate(device_tables):
        device = build(StudyDevice, entry, f"study.devices[{i}]", source, base_dir)
        devices.append(dataclasses.replace(device, profile=resolve_path(device.profile, base_dir)))
    drafter_tables = table.get("drafters", {})
    if not isinstance(drafter_tables, dict):
        raise ConfigError(f"{source}: key 'study.drafters' must be a table of model = drafter table")
    drafters = tuple((model, build(DrafterSection, t, f"study.drafters.{model}", source, base_dir)) for model, t in drafter_tables.items())
    return StudySection(tuple(models), workloads, policies, tuple(batches), tuple(devices), drafters)


# Renamed [target] keys: old -> new. The old one still works for one release, with a note.
RENAMED_TARGET_KEYS = {"engine": "family"}


def config_from_dict(data: dict[str, Any], source: str, base_dir: Path) -> SimConfig:
    """A SimConfig from parsed TOML (a written config's `[moesim]` table checked: its inputs unchanged;
    its paths are from the working folder)."""
    if "moesim" in data:
        check_run_header(data["moesim"], source, "simulate")
        base_dir = Path(".")  # its paths are as the run named them, from its working folder
        data = {k: v for k, v in data.items() if k != "moesim"}
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"{source}: key '{key}': unknown section (known: {', '.join(SECTIONS)})")

    def section(cls: type, name: str) -> Any:
        return build(cls, data.get(name, {}), name, source, base_dir)

    cost = section(CostSection, "cost")
    target_table, notes = renamed_keys(data.get("target", {}), "target", RENAMED_TARGET_KEYS, "the kernel family", source)
    target = build(TargetSection, target_table, "target", source, base_dir)
    target = dataclasses.replace(target, model=resolve_path(target.model, base_dir), profile=resolve_path(target.profile, base_dir))
    trace = section(TraceSection, "trace") if "trace" in data else None
    if trace is not None and trace.synth is not None:
        if target.model is None:
            raise ConfigError(f"{source}: key 'target.model' is required to synthesise a trace (trace.synth)")
        try:
            make_generator(trace.synth, trace.synth_params)
        except FieldError as exc:
            key = f"trace.synth_params.{exc.field}" if exc.field else "trace.synth"
            raise ConfigError(f"{source}: key '{key}': {exc.detail}") from None
    if cost.kind == "steptime":
        for key in ("model", "profile"):
            if getattr(target, key) is None:
                raise ConfigError(f"{source}: key 'target.{key}' is required with cost.kind = 'steptime'")
    if "acceptance" not in data:
        raise ConfigError(f"{source}: key 'acceptance' is required (a table with 'model')")
    if "policy" not in data:
        raise ConfigError(f"{source}: key 'policy' is required (a table with 'name')")
    acceptance = acceptance_from_table(data["acceptance"], "acceptance", source, base_dir)
    policy = policy_from_table(data["policy"], "policy", source, base_dir)
    _check_cap(acceptance, policy, "acceptance", source)
    config = SimConfig(
        source=source,
        run=section(RunSection, "run"),
        workload=section(Workload, "workload"),
        arrivals=section(Arrivals, "arrivals"),
        batching=section(Batching, "batching"),
        trace=trace,
        cost=cost,
        target=target,
        drafter=section(DrafterSection, "drafter"),
        acceptance=acceptance,
        policy=policy,
        study=_study(data["study"], source, base_dir, cost) if "study" in data else None,
        parallel=section(ParallelSection, "parallel"),
        memory=section(MemorySection, "memory") if "memory" in data else None,
        notes=notes,
    )
    if cost.kind == "steptime" and trace is None and any(m is not None and load_preset(m).kind == "moe" for m in config.models()):
        raise ConfigError(f"{source}: key 'trace' is required with cost.kind = 'steptime' and a MoE target (the routing the passes replay)")
    _check_target(config, cost.kind == "steptime")
    config = _with_drafter_tree(config)
    if trace is not None and trace.path is not None and MODEL_PLACEHOLDER in str(trace.path):
        for model in config.models():
            path = trace.path_for(model)
            if model is None or not path.is_file():  # type: ignore[union-attr]
                raise ConfigError(f"{source}: key 'trace.path': no such trace file {path} (model {model})")
    check_sizes(config)
    return config


def _with_drafter_tree(config: SimConfig) -> SimConfig:
    """A draft tree needs the step-time cost and an acceptance that knows trees: `tree` (given the
    drafter's tree family here) or a recorded run of a static tree (`paths`)."""
    tree = config.drafter.tree_spec()
    for model, drafter in config.study.drafters if config.study else ():
        if drafter.tree_spec() != tree:
            raise ConfigError(
                f"{config.source}: key 'study.drafters.{model}': its draft tree ({drafter.tree_spec().label()}) is not the "
                f"[drafter]'s ({tree.label()}); a study's drafters verify one tree"
            )
    workloads = [("acceptance", config.acceptance)] + [
        (f"study.workloads.{n}", a) for n, a in (config.study.workloads if config.study else ())
    ]
    policies = [("policy", config.policy)] + [
        (f"study.policies[{i}]", p) for i, p in enumerate(config.study.policies if config.study else ())
    ]
    for section, policy in policies:
        try:
            tree.check_depth(policy.k_cap)
        except ConfigError as exc:
            raise ConfigError(f"{config.source}: key '{section}': {exc}") from None
    if not tree.is_chain:
        if config.cost.kind != "steptime":
            raise ConfigError(
                f"{config.source}: key 'drafter.tree': a draft tree needs cost.kind = 'steptime' (the verify width is priced)"
            )
        for section, acceptance in workloads:
            if not isinstance(acceptance, Tree) and (acceptance.name != "recorded" or not tree.paths):
                raise ConfigError(
                    f"{config.source}: key '{section}.model': the drafter verifies a tree ({tree.label()}); give model = 'tree' "
                    "(or 'recorded' for a static tree of paths)"
                )
    shaped = {id(a): a.with_shape(tree) for _, a in workloads if isinstance(a, Tree)}
    if not shaped:
        return config
    study = config.study
    if study is not None:
        study = dataclasses.replace(study, workloads=tuple((n, shaped.get(id(a), a)) for n, a in study.workloads))
    return dataclasses.replace(config, acceptance=shaped.get(id(config.acceptance), config.acceptance), study=study)


def load_config(path: str | Path) -> SimConfig:
    """Read and validate a simulation config file."""
    path = Path(path)
    return config_from_dict(read_toml(path, "config"), str(path), path.parent)
