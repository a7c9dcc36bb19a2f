"""An engine's kernel families and the shape of its dispatch, shared by every engine module."""

from __future__ import annotations

from dataclasses import dataclass

from moesim.errors import InputError
from moesim.hw_profiles.dispatch import Dispatch, DispatchRule
from moesim.hw_profiles.families import ExpertStructure

QUANTIZED = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "MXFP4", "Q3_K", "Q2_K")
FLOAT = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Kernel:
    """One kernel family of an engine: its profile name, how it reads experts (tokens per weight
    read: 1 per slot, T per tile of T tokens, 0 once per distinct expert), whether each distinct
    expert costs a launch of its own, and the token tile its compute runs in (`ExpertStructure`)."""

    family: str
    tokens_per_read: int
    description: str
    per_expert: bool = False
    tile_tokens: int = 0
    tile_step: int = 0
    tile_doubling: bool = False
    tiles_first: bool = False  # where the rows do not tell its useful FLOPs from its whole tiles', the whole tiles carry them

    @property
    def structure(self) -> ExpertStructure:
        """The read structure of the profile family."""
        return ExpertStructure(self.tokens_per_read, (), self.tile_tokens, self.tile_step, tile_doubling=self.tile_doubling)


@dataclass(frozen=True)
class Era:
    """A span of builds with one dispatch: from which change (PR, commit, date) it holds."""

    key: str
    since: str


class Engine:
    """An engine: its kernels, its build eras and device classes, its dispatch per era and class."""

    name = ""
    kernels: tuple[Kernel, ...] = ()
    eras: tuple[Era, ...] = ()
    architectures: tuple[str, ...] = ("any",)
    citation = ""

    def kernel(self, family: str) -> Kernel:
        """A kernel by its family name."""
        for kernel in self.kernels:
            if kernel.family == family:
                return kernel
        raise InputError(f"engine '{self.name}' runs no kernel '{family}' (kernels: {', '.join(k.family for k in self.kernels)})")

    def era(self, key: str) -> Era:
        """An era by key (its starting date); one line when unknown."""
        for era in self.eras:
            if era.key == key:
                return era
        raise InputError(f"engine '{self.name}' has no build era '{key}' (eras: {', '.join(e.key for e in self.eras)})")

    def check_architecture(self, architecture: str) -> str:
        """The architecture class, checked."""
        if architecture not in self.architectures:
            raise InputError(f"engine '{self.name}' knows no device class '{architecture}' (known: {', '.join(self.architectures)})")
        return architecture

    def rules(self, era: str, architecture: str) -> list[DispatchRule]:
        """The dispatch rules of a build era on a device class, in order."""
        raise NotImplementedError

    def dispatch(self, era: str | None = None, architecture: str = "any", source: str = "engine-source") -> Dispatch:
        """The engine's dispatch in an era (default: the newest) on a device class."""
        key = self.era(era).key if era else self.eras[-1].key
        return Dispatch(tuple(self.rules(key, self.check_architecture(architecture))), source)

    def families(self) -> tuple[str, ...]:
        """The family names of the engine's kernels."""
        return tuple(k.family for k in self.kernels)
