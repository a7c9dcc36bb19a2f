"""Executors (a registry): run one function over a list of work units, yielding results as they
complete. `local` uses processes on this machine; `ray` sends the same units to a Ray cluster
(a local instance when no address is given). Adding one is adding one class with
`@EXECUTORS.register`.

A unit's `MoesimError` comes back as a value and is raised again in the driver, so a bad unit
ends the run with its one-line message whatever the executor.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from moesim.errors import ConfigError, MoesimError, first_line
from moesim.machine import usable_cpus
from moesim.registry import Registry

Unit = Any
Result = Any


class Executor(Protocol):
    """What every executor provides."""

    name: ClassVar[str]
    shares_filesystem: ClassVar[bool]  # workers see the driver's files (they may write results themselves)

    def map_unordered(self, fn: Callable[[Unit], Result], units: list[Unit]) -> Iterator[tuple[int, Result]]:
        """Yield (index into `units`, fn(unit)) as each unit completes; closing the iterator
        cancels the units not started."""
        ...


EXECUTORS: Registry[Executor] = Registry("executor")


@dataclass(frozen=True)
class _Failure:
    """A unit's MoesimError carried back as a value."""

    kind: type[MoesimError]
    message: str


def _call(fn: Callable[[Unit], Result], unit: Unit) -> Result:
    try:
        return fn(unit)
    except MoesimError as exc:
        return _Failure(type(exc), str(exc))


def _unwrap(result: Result) -> Result:
    if isinstance(result, _Failure):
        raise result.kind(result.message)
    return result


def _ignore_interrupts() -> None:
    """Worker processes leave Ctrl-C to the driver, which cancels the units not started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@EXECUTORS.register
@dataclass(frozen=True)
class LocalExecutor:
    """Processes on this machine (`workers`, 0 = one per core); one worker runs in this process."""

    name: ClassVar[str] = "local"
    shares_filesystem: ClassVar[bool] = True
    workers: int = 0
    address: str = ""

    def map_unordered(self, fn: Callable[[Unit], Result], units: list[Unit]) -> Iterator[tuple[int, Result]]:
        """Spawned worker processes (no fork: Numba and polars threads do not survive it) that ignore
        Ctrl-C; on an interruption the units running finish, the others are cancelled."""
        workers = min(self.workers or usable_cpus(), len(units))
        if workers <= 1:
            for i, unit in enumerate(units):
                yield i, fn(unit)
            return
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_interrupts)
        try:
            pending = {pool.submit(_call, fn, unit): i for i, unit in enumerate(units)}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), _unwrap(future.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@EXECUTORS.register
@dataclass(frozen=True)
class RayExecutor:
    """Tasks on a Ray cluster: `address` ("auto", "ray://host:port", ...) or, when empty, a local
    instance started for the sweep with `workers` CPUs (0 = all) and stopped after it. Workers
    need moesim installed (on a cluster: the same version, e.g. through a runtime_env)."""

    name: ClassVar[str] = "ray"
    shares_filesystem: ClassVar[bool] = False
    workers: int = 0
    address: str = ""

    def __post_init__(self) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ConfigError("executor 'ray' needs Ray: pip install 'moesim[ray]'")

    def map_unordered(self, fn: Callable[[Unit], Result], units: list[Unit]) -> Iterator[tuple[int, Result]]:
        """One task per unit (1 CPU each); results as they complete."""
        import ray

        started = not ray.is_initialized()
        if started:
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if self.address:
                options["address"] = self.address
            else:
                options["num_cpus"] = self.workers or usable_cpus()
            try:
                ray.init(**options)
            except (ConnectionError, RuntimeError, ValueError, OSError) as exc:
                where = f"join the Ray cluster at '{self.address}'" if self.address else "start a local Ray instance"
                reason = first_line(exc)
                raise ConfigError(f"executor 'ray': could not {where} ({reason})") from None
        pending: dict[Any, int] = {}
        try:
            task = ray.remote(num_cpus=1)(_call)
            fn_ref = ray.put(fn)
            pending = {task.remote(fn_ref, unit): i for i, unit in enumerate(units)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    yield pending.pop(ref), _unwrap(ray.get(ref))
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
            if started:
                ray.shutdown()


def make_executor(name: str, workers: int = 0, address: str = "") -> Executor:
    """An executor by name."""
    return EXECUTORS.create(name, workers=workers, address=address)
