"""The one registry type of moesim's pluggable families (docs/architecture.md, "Adding one").

Acceptance models, speculation policies, drafters, executors, routing generators, routing
importers and torch microbenchmark kernels are each a `Registry` of classes with a class
attribute `name`; adding one is adding one class with `@REGISTRY.register`. Every lookup of a
name that is not there fails with the same one-line message:

    unknown <noun> '<name>' (known: a, b, c)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from moesim.errors import ConfigError, MoesimError

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one family by their `name`, in registration order."""

    def __init__(self, noun: str, error: type[MoesimError] = ConfigError) -> None:
        self.noun = noun
        self.error = error
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: make `cls` available by its `name`."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes:
            raise ValueError(f"{self.noun} '{name}' is registered twice")
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._classes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def unknown(self, name: object, *also: str) -> str:
        """The one message for a name that is not registered (`also`: names accepted besides the classes')."""
        return f"unknown {self.noun} '{name}' (known: {', '.join([*also, *self._classes])})"

    def get(self, name: str) -> type[T]:
        """The class registered as `name`."""
        try:
            return self._classes[name]
        except KeyError:
            raise self.error(self.unknown(name)) from None

    def first(self, test: Callable[[T], bool], refusal: str) -> str:
        """The first name (in registration order) whose default instance passes `test`; `refusal` as the
        registry's error when none does."""
        for name in self._classes:
            if test(self.create(name)):
                return name
        raise self.error(refusal)

    def create(self, name: str, **params: Any) -> T:
        """An instance of the class registered as `name`; a parameter it has no field for is one line."""
        cls = self.get(name)
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()  # type: ignore[arg-type]
        unknown = sorted(set(params) - known)
        if unknown:
            raise self.error(f"{self.noun} '{name}' has no parameter '{unknown[0]}'")
        return cls(**params)
