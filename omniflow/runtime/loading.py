"""Loading an executor's stages: one after another, or all at once, a thread each.

An executor runs every stage placed on its GPU, so its start waits for all of their loads
(weights read and placed, caches sized, CUDA graphs captured). Loaded one after another
("sequential") the start is their sum; loaded at once ("parallel") it is about the longest,
as when each stage had a process of its own. The order is the engine's `load` setting,
"sequential" by default until loads at once are measured on a GPU (docs/benchmarks.md,
"Cold start"); "auto" loads at once where two or more of the executor's stages run on a CUDA
stream here, else one after another (on a CPU machine a load is host work on few cores:
nothing to gain).

In both, each stage loads on its own stream (streams.py) and is held to its own budget
(budgets.py: measured as a difference when alone, in an allocator pool of its own when not).
Loaded at once, the executor's thread waits for the loads and hears each as it ends: it says
`Loaded` for each (with how long the load ran beside the executor's other loads), and on the
first that fails it waits for the others, closes those that loaded and raises that failure,
naming its stage. A failure says its stage in either order. While they load at once, one
thread imports at a time, and a device-wide synchronize waits for a CUDA-graph capture in
flight (load_pools.py).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import NoReturn

import torch

from omniflow.backends.registry import load_backend
from omniflow.devices import local_name
from omniflow.errors import OmniflowError
from omniflow.plan import Program, StagePlan
from omniflow.runtime import control
from omniflow.runtime.budgets import load_in_own_pool, load_within_budget
from omniflow.runtime.load_pools import LoadPool, between_captures
from omniflow.runtime.stage import Backend, StageSpec
from omniflow.runtime.streams import CudaStageStream, StageStream

LOAD_ORDERS = ("auto", "sequential", "parallel")


class StageLoadFailed(OmniflowError):
    """A stage of the executor could not load; the message names it."""


@dataclass
class LoadedStage:
    spec: StageSpec
    backend: Backend
    pool: LoadPool | None  # holds the stage's memory when it loaded beside others on a GPU
    began: float  # time.monotonic()
    ended: float


def load_order(program: Program, streams: dict[str, StageStream], asked: str) -> str:
    """What `asked` (one of LOAD_ORDERS) means for `program`: "sequential" or "parallel"."""
    if asked not in LOAD_ORDERS:
        raise OmniflowError(f"unknown load order '{asked}'; use one of {', '.join(LOAD_ORDERS)}")
    if asked != "auto":
        return asked
    on_gpu = sum(isinstance(streams[s.name], CudaStageStream) for s in program.stages)
    return "parallel" if on_gpu > 1 else "sequential"


def load_stages(
    program: Program,
    backends: str,
    streams: dict[str, StageStream],
    order: str,
    on_loaded: Callable[[control.Loaded], None],
) -> dict[str, LoadedStage]:
    """Every stage of `program` loaded, by name, in `order` (see the module docstring)."""
    channels = [*program.inbound, *program.outbound, *program.local]
    specs = {s.name: StageSpec.from_channels(s, channels) for s in program.stages}

    def load(stage: StagePlan, alongside: bool) -> LoadedStage:
        began = time.monotonic()
        spec = specs[stage.name]
        device = local_name(stage.devices[0]) if stage.devices else "cpu"
        make = partial(load_backend, spec, device, backends)
        # Its weights are made on the stream its steps read them on.
        with streams[stage.name].active():
            if alongside:
                backend, pool = load_in_own_pool(stage, device, make, _close)
            else:
                backend, pool = load_within_budget(stage, device, make), None
        return LoadedStage(spec, backend, pool, began, time.monotonic())

    if order == "parallel" and len(program.stages) > 1:
        return _at_once(program.stages, partial(load, alongside=True), on_loaded)
    loaded: dict[str, LoadedStage] = {}
    try:
        for stage in program.stages:
            try:
                loaded[stage.name] = done = load(stage, alongside=False)
            except Exception as err:
                _raise_naming(stage.name, err)
            on_loaded(_message(done, 0.0))
    except BaseException:
        for done in loaded.values():
            _close(done.backend)
        raise
    return loaded


def _at_once(
    stages: list[StagePlan],
    load: Callable[[StagePlan], LoadedStage],
    on_loaded: Callable[[control.Loaded], None],
) -> dict[str, LoadedStage]:
    """Each stage loaded on a thread of its own; their `Loaded` said from this thread."""
    ended: queue.SimpleQueue = queue.SimpleQueue()  # (stage, LoadedStage or its exception)

    def run(stage: StagePlan) -> None:
        try:
            ended.put((stage.name, load(stage)))
        except BaseException as err:  # the executor's thread raises it
            ended.put((stage.name, err))

    began = time.monotonic()
    threads = [
        threading.Thread(target=run, args=(stage,), name=f"omniflow-load-{stage.name}")
        for stage in stages
    ]
    loaded: dict[str, LoadedStage] = {}
    failure: tuple[str, BaseException] | None = None
    with _while_loading_at_once():
        for thread in threads:
            thread.start()
        try:
            for _ in stages:
                name, outcome = ended.get()
                if isinstance(outcome, BaseException):
                    failure = failure or (name, outcome)
                    continue
                loaded[name] = outcome
                if failure is None:
                    others = [(d.began, d.ended) for n, d in loaded.items() if n != name]
                    others += [(began, outcome.ended)] * (len(stages) - len(loaded))
                    alongside = _overlap((outcome.began, outcome.ended), others)
                    on_loaded(_message(outcome, alongside))
        finally:  # a failure, or the executor told to stop while its stages load
            for thread in threads:
                thread.join()
    if failure is not None:
        for done in loaded.values():
            _close(done.backend)
        _raise_naming(*failure)
    return loaded


# Libraries' modules import each other in cycles (transformers' lazy modules), and two threads
# importing them at once can each hold a module the other needs: Python then hands one of
# them a module half made ("cannot import name ..."). While stages load at once, one thread
# of the process imports at a time. Loads import what they need as they begin, so this costs
# them little; their reading weights and capturing graphs still overlap.
_IMPORTING = threading.RLock()


def _one_at_a_time(do_import: Callable) -> Callable:
    def imported(*args, **kwargs):
        with _IMPORTING:
            return do_import(*args, **kwargs)

    return imported


@contextlib.contextmanager
def _while_loading_at_once() -> Iterator[None]:
    """While any executor of the process loads its stages at once: imports one at a time, and
    a device-wide synchronize or empty_cache waits for a capture in flight (load_pools.py)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(builtins, "__import__", _one_at_a_time))
        stack.enter_context(_patched(importlib, "import_module", _one_at_a_time))
        stack.enter_context(_patched(torch.cuda, "synchronize", between_captures))
        stack.enter_context(_patched(torch.cuda, "empty_cache", between_captures))
        yield


_PATCHING = threading.Lock()
_patches: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [original, users]


@contextlib.contextmanager
def _patched(owner: object, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """`owner.name` is `wrap(original)` while any thread is inside (engines of one process
    may load at once in threads of their own: the last one out puts the original back)."""
    key = (id(owner), name)
    with _PATCHING:
        patch = _patches.get(key)
        if patch is None:
            original = getattr(owner, name)
            patch = _patches[key] = [original, 0]
            setattr(owner, name, wrap(original))
        patch[1] += 1
    try:
        yield
    finally:
        with _PATCHING:
            patch[1] -= 1
            if patch[1] == 0:
                setattr(owner, name, patch[0])
                del _patches[key]


def _overlap(own: tuple[float, float], others: list[tuple[float, float]]) -> float:
    """Seconds of `own` during which at least one of `others` ran too."""
    clipped = sorted((max(b, own[0]), min(e, own[1])) for b, e in others)
    total, reach = 0.0, own[0]
    for b, e in clipped:
        if e > max(b, reach):
            total += e - max(b, reach)
            reach = e
    return total


def _message(done: LoadedStage, alongside: float) -> control.Loaded:
    backend = done.backend
    return control.Loaded(
        done.spec.plan.name,
        done.ended - done.began,
        backend.capture_seconds,
        backend.captures,
        backend.capture_work,
        alongside,
    )


def _close(backend: Backend) -> None:
    backend.close()


def _raise_naming(stage: str, err: BaseException) -> NoReturn:
    """Raise `err`, raised by `stage`'s load, as an error that names the stage."""
    if f"'{stage}'" in str(err):
        raise err
    if isinstance(err, OmniflowError):
        raise StageLoadFailed(f"stage '{stage}' could not load: {err}") from err
    err.add_note(f"(raised while stage '{stage}' loaded)")  # its traceback says where
    raise err
