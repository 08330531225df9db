"""The engine: the front of a running plan. Its I/O thread (`_Core`) runs the frontend's
program on the same loop every executor runs, reaches the executors through a transport
(processes or threads: transport.py), keeps the requests in flight, and restarts executors
that die. Callers talk to it through a command queue and a waker, and get their outputs
through per-request queues.

A request is admitted in the caller's thread (requests.py); then its `Start` goes to each
executor's start queue, which the executor reads only when the request's first chunk
reaches it (control.py), and its inputs go into the frontend loop, which chunks, adapts and
maps them onto their channels like any stage output. Chunks of the pipeline's outputs come
back through the frontend loop's sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.errors import OmniflowError
from omniflow.plan import FRONTEND, Plan
from omniflow.runtime import control, events
from omniflow.runtime.doorbells import Ending
from omniflow.runtime.gpu_timeline import ProfileError, gpu_executors
from omniflow.runtime.loading import LOAD_ORDERS
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.port_values import concat
from omniflow.runtime.preflight import preflight
from omniflow.runtime.prompts import prompt_limits
from omniflow.runtime.ray_transport import ray_plan
from omniflow.runtime.requests import Admitted, Check, RequestFailed, admit, stage_params
from omniflow.runtime.shm_ring import cleanup_stale_segments
from omniflow.runtime.transport import MODES, TICK_S, EngineError, transport_class
from omniflow.runtime.wakeup import Waker, wait


class RequestCancelled(OmniflowError):
    """The request was cancelled before it finished."""


@dataclass(frozen=True)
class Chunk:
    """One piece of one output of a request, in order; `end` marks the output's end, and
    `ending` says why its producing stage ended it and what it cost (if it says; one that
    says nothing passes on its input's: `Call.finish`)."""

    request_id: str
    output: str
    value: object
    index: int
    end: bool
    ending: Ending | None = None


@dataclass
class _Request:
    id: str
    admitted: Admitted
    deliver: Callable  # (item) -> None, thread-safe
    open_outputs: set[str] = field(default_factory=set)
    indexes: dict[str, int] = field(default_factory=dict)
    awaiting_stats: set[str] = field(default_factory=set)  # executors yet to send its tables
    arrived: int = 0  # monotonic ns when it reached the engine (profiled: events.ADMIT)
    admit_ns: int = 0  # how long checking it against the plan took
    stats: dict[str, dict] = field(default_factory=lambda: {"stages": {}, "edges": {}})


class _Core:
    """Everything the I/O thread owns: the frontend's program loop, the transport to the
    executors, and the requests in flight."""

    def __init__(
        self,
        plan: Plan,
        mode: str,
        backends: str,
        on_loaded: Callable[[control.StartupReport], None],
        on_stats: Callable[[control.RequestStats], None] | None,
        load: str,
    ):
        self.plan = plan
        self.on_loaded = on_loaded
        self.on_stats = on_stats
        self.waker = Waker()
        self.commands: deque = deque()
        self.requests: dict[str, _Request] = {}
        self.closed = False
        self.failure = ""  # why the I/O loop stopped, if it failed
        self.next_check = 0.0  # when check_executors runs next
        self.inspections: tuple[dict, queue.SimpleQueue] | None = None
        # (answers so far, reply queue, starting): every executor answers a Profile message
        self.profiles: tuple[dict, queue.SimpleQueue, bool] | None = None
        stats = on_stats is not None
        self.frontend = ProgramLoop(
            plan.program(FRONTEND), waker=self.waker, sink=self.deliver, request_stats=stats
        )
        self.frontend.report = lambda message: self.on_message(FRONTEND, message)
        self.transport = transport_class(mode)(
            plan, self.frontend, backends, self.on_message, stats, load
        )

    def start(self) -> None:
        cleanup_stale_segments()  # what an earlier engine that was killed left behind
        self.transport.start()

    # --- requests -------------------------------------------------------------------------------
    def submit(self, request: _Request) -> None:
        self.requests[request.id] = request
        scope = request.admitted.scope
        request.open_outputs = {o.name for o in self.plan.outputs}
        if scope is not None:  # only the outputs of the stages it runs
            request.open_outputs = {
                c.dst
                for c in self.plan.channels
                if c.dst in request.open_outputs and c.src in scope
            }
        if self.on_stats is not None:
            request.awaiting_stats = {p.name for p in self.plan.executors}
        # Before the inputs go out: an executor finds the Start queued when they reach it.
        # A stage outside the request's scope gets no parameters: it never starts it.
        for program in self.plan.executors:
            params = {
                s.name: stage_params(s, request.admitted)
                for s in program.stages
                if scope is None or s.name in scope
            }
            self.transport.send_start(program.name, control.Start(request.id, params))
        if self.frontend.recorder is not None:
            queued = time.monotonic_ns() - request.arrived
            self.frontend.recorder.add(
                events.ADMIT, None, request.id, request.arrived, queued, request.admit_ns
            )
        self.frontend.inject(request.id, request.admitted)

    def cancel(self, request_id: str, error: OmniflowError) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.transport.broadcast(control.Cancel(request_id))
        self.frontend.cancel(request_id)
        request.deliver(error)

    def deliver(
        self, request_id: str, output: str, value, end: bool, ending: Ending | None = None
    ) -> None:
        """The frontend loop's sink: a chunk of one of a request's outputs."""
        request = self.requests.get(request_id)
        if request is None:
            return
        index = request.indexes.get(output, 0)
        if value is not None or end:
            request.deliver(Chunk(request_id, output, value, index, end, ending))
            request.indexes[output] = index + 1
        if end:
            request.open_outputs.discard(output)
            self.maybe_done(request)

    def maybe_done(self, request: _Request) -> None:
        """Every output has ended and every executor has sent its tables (if asked for)."""
        if request.open_outputs or request.awaiting_stats:
            return
        del self.requests[request.id]
        if self.on_stats is not None:
            _merge(request.stats, self.frontend.tallies.take(request.id))
            self.on_stats(control.RequestStats(request.id, **request.stats))
        request.deliver(None)

    def on_message(self, executor: str, message: control.Message) -> None:
        if isinstance(message, control.StartupReport):
            self.on_loaded(message)
        elif isinstance(message, control.RequestStats):
            request = self.requests.get(message.request_id)
            if request is not None:
                _merge(request.stats, message)
                request.awaiting_stats.discard(executor)
                self.maybe_done(request)
        elif isinstance(message, control.Failed):
            # What an executor's stage sent before it failed is in the rings already (sent
            # before this message): it reaches the request before the failure does. (The
            # frontend's own stages report from inside its pump, their chunks delivered.)
            if executor != FRONTEND:
                self.frontend.pump()
            self.cancel(
                message.request_id,
                RequestFailed(f"stage '{message.stage}' failed: {message.error}"),
            )
        elif isinstance(message, control.Profiled) and self.profiles is not None:
            found, reply, on = self.profiles
            found[executor] = message
            if len(found) == len(self.transport.names):
                self.profiles = None
                reply.put(
                    [] if on else [*found.values(), self.frontend_profile(control.Profile(False))]
                )
        elif isinstance(message, control.Inspection) and self.inspections is not None:
            found, reply = self.inspections
            found[executor] = message
            if len(found) == len(self.transport.names):
                self.inspections = None
                frontend = self.frontend.inspect()
                frontend.calls = {FRONTEND: list(self.requests)}
                reply.put({**found, FRONTEND: frontend})

    def frontend_profile(self, ask: control.Profile) -> control.Profiled | None:
        recorded = self.frontend.profile(ask)
        return None if recorded is None else control.Profiled(FRONTEND, **vars(recorded))

    # --- supervision ----------------------------------------------------------------------------
    def check_executors(self) -> None:
        dead = self.transport.dead()
        if not dead:
            return
        for name, how in dead.items():
            error = RequestFailed(
                f"{self.transport.describe(name)} died ({how}); the request was lost"
            )
            for request_id in list(self.requests):
                self.cancel(request_id, error)
        self.transport.restart(set(dead))

    # --- the I/O loop ---------------------------------------------------------------------------
    def run_commands(self) -> None:
        while self.commands:
            command, arg = self.commands.popleft()
            if command == "submit":
                try:
                    self.submit(arg)
                except Exception as err:  # one request's own fault fails it, not the engine
                    why = f"the request could not start: {type(err).__name__}: {err}"
                    self.cancel(arg.id, RequestFailed(why))
            elif command == "cancel":
                self.cancel(arg, RequestCancelled(f"request {arg} was cancelled"))
            elif command == "inspect":
                self.inspections = ({}, arg[0])
                self.transport.broadcast(control.Inspect())
            elif command == "profile":
                ask, reply = arg
                on = ask.on
                self.transport.broadcast(ask)
                if on:
                    self.frontend_profile(ask)
                if self.transport.names:
                    self.profiles = ({}, reply, on)
                else:  # every stage runs in the frontend: nobody else to wait for
                    reply.put([] if on else [self.frontend_profile(control.Profile(False))])
            elif command == "close":
                self.closed = True

    def wait_for_work(self, timeout: float) -> None:
        if self.transport.pending():
            return
        ready = wait([*self.frontend.poll_fds(), *self.transport.poll_fds()], timeout)
        if self.waker.fd in ready:
            self.waker.drain()

    def serve(self) -> None:
        try:
            while not self.closed:
                self.run_commands()
                for name, message in self.transport.receive():
                    self.on_message(name, message)
                self.frontend.pump()
                if time.monotonic() >= self.next_check:  # not every turn: a syscall per executor
                    self.check_executors()
                    self.next_check = time.monotonic() + TICK_S
                if not self.commands:
                    self.wait_for_work(TICK_S)
        except Exception as err:  # no request may hang on a dead engine
            failed = EngineError(f"the engine failed: {type(err).__name__}: {err}")
            self.failure = str(failed)
            for request_id in list(self.requests):
                self.cancel(request_id, failed)
            self.fail_queued(failed)
            raise
        finally:
            self.closed = True
            self.shutdown()

    def fail_queued(self, error: EngineError) -> None:
        """Fail the requests submitted but not yet started (the I/O loop stopped first)."""
        for command, arg in [c for c in self.commands if c[0] == "submit"]:
            self.commands.remove((command, arg))
            arg.deliver(error)

    def shutdown(self) -> None:
        for request_id in list(self.requests):
            self.cancel(request_id, EngineError("the engine was closed"))
        self.fail_queued(EngineError("the engine was closed"))
        self.transport.broadcast(control.Shutdown())
        self.transport.close()
        self.frontend.close()
        self.waker.close()


def _merge(tables: dict[str, dict], stats: control.RequestStats) -> None:
    """One executor's share of a request's tables into the whole (a channel's row has a
    sending side and a receiving side, from two executors)."""
    for name, rows in (("stages", stats.stages), ("edges", stats.edges)):
        for key, row in rows.items():
            tables[name].setdefault(key, {}).update(row)


class Outputs(dict):
    """A request's outputs by name, whole; `seed` is the seed that replays it."""

    seed: int


class ChunkStream:
    """A submitted request's output chunks, as they are produced (`async for`); closing it
    before its last chunk cancels the request, iterated or not."""

    def __init__(self, engine: Engine, request_id: str, items: asyncio.Queue):
        self.engine = engine
        self.request_id = request_id
        self.items = items
        self.finished = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self.finished:
            raise StopAsyncIteration
        item = await self.items.get()
        if item is None or isinstance(item, BaseException):
            self.finished = True
            if item is None:
                raise StopAsyncIteration
            raise item
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.cancel(self.request_id)


class Engine:
    """A running plan. Use as a context manager; `generate`, `stream`, `cancel`, `close`.

    Before any executor starts, the plan is checked against this machine (`preflight`:
    devices, models, speakers, the families' own checks) unless the caller did so and
    passes its `checks`;
    `on_loaded` hears of each stage whose model has loaded (`control.Loaded`) and, from each
    executor process on a GPU, what its stages' loads left there (`control.Memory`). With `on_stats`, every executor
    keeps per-request tables (tallies.py) and each request's reach `on_stats` (from the I/O
    thread) before its last chunk reaches the caller. `load` is how each executor loads its
    stages: "sequential", "parallel" (a thread each) or "auto" (loading.py).
    """

    def __init__(
        self,
        plan: Plan,
        mode: str = "process",
        backends: str = "auto",
        checks: tuple[Check, ...] | None = None,
        on_loaded: Callable[[control.StartupReport], None] = lambda loaded: None,
        on_stats: Callable[[control.RequestStats], None] | None = None,
        load: str = "sequential",
    ):
        if mode not in MODES:
            raise EngineError(f"unknown mode '{mode}'; use {' or '.join(map(repr, MODES))}")
        if load not in LOAD_ORDERS:
            raise EngineError(f"unknown load '{load}'; use {' or '.join(map(repr, LOAD_ORDERS))}")
        if mode == "process" and ray_plan(plan.devices):
            mode = "ray"  # compiled for a Ray cluster: its executors run there
        self.plan = plan
        if checks is None:
            checks = () if backends == "standin" else preflight(plan)
        self.checks = checks
        self.prompt_limits = () if backends == "standin" else prompt_limits(plan)
        self._core = _Core(plan, mode, backends, on_loaded, on_stats, load)
        self._ids = itertools.count()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._core.start()
            except BaseException as err:  # reported to the constructor, which raises it
                failure.append(err)
                started.set()
                self._core.closed = True
                self._core.shutdown()
                return
            started.set()
            self._core.serve()

        self._thread = threading.Thread(target=run, name="omniflow-engine", daemon=True)
        self._thread.start()
        _exit_cleanly_on_sigterm()
        try:
            started.wait()
        except BaseException:  # Ctrl-C while the models load: stop the executors, then go
            self._core.closed = self._core.transport.closing = True
            self._core.waker.poke()
            self._thread.join()
            raise
        if failure:
            raise failure[0]

    # --- requests ------------------------------------------------------------------------------------
    def _submit(
        self, inputs: dict | Admitted, params: dict | None, request_id: str | None, deliver
    ) -> str:
        if self._core.closed:
            raise EngineError(
                f"the engine is closed ({self._core.failure})"
                if self._core.failure
                else "the engine is closed"
            )
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        arrived = time.monotonic_ns()
        admitted = inputs if isinstance(inputs, Admitted) else self.admit(inputs, params)
        admit_ns = time.monotonic_ns() - arrived
        request = _Request(request_id, admitted, deliver, arrived=arrived, admit_ns=admit_ns)
        self._command("submit", request)
        return request_id

    def admit(
        self, inputs: dict, params: dict | None = None, outputs: frozenset[str] | None = None
    ) -> Admitted:
        """The request checked against the plan (RequestError if it does not fit: its
        prompts' lengths too); its `params` hold every parameter, the seed included, so
        passing them back replays it. With `outputs`, it asks for those alone and runs
        only the stages they depend on (`requests.admit`)."""
        admitted = admit(self.plan, inputs, params, self.checks, outputs)
        for limit in self.prompt_limits:
            limit.check(admitted)
        return admitted

    def _command(self, command: str, arg) -> None:
        self._core.commands.append((command, arg))
        self._core.waker.poke()

    def stream_sync(
        self, inputs: dict | Admitted, params: dict | None = None, request_id: str | None = None
    ) -> Iterator[Chunk]:
        """Output chunks as they are produced, from this thread. `inputs` may be a request
        `admit` checked already (then `params` are its own)."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        self._submit(inputs, params, request_id, items.put)
        while (item := items.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def stream(
        self, inputs: dict | Admitted, params: dict | None = None, request_id: str | None = None
    ) -> AsyncIterator[Chunk]:
        """Output chunks as they are produced; cancelling the consumer cancels the request.
        `inputs` may be a request `admit` checked already (then `params` are its own)."""
        chunks = self.submit_stream(inputs, params, request_id)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def submit_stream(
        self, inputs: dict | Admitted, params: dict | None = None, request_id: str | None = None
    ) -> ChunkStream:
        """Submit the request now, from the event loop's thread: its output chunks as they
        are produced (`stream` submits only once iterated; a server submits a request as
        it admits it, before its reply's headers go out)."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def deliver(item) -> None:
            # (from the I/O thread; a consumer whose event loop has closed is gone: its
            # request's last words, a cancellation's error among them, go nowhere)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(items.put_nowait, item)

        rid = self._submit(inputs, params, request_id, deliver)
        return ChunkStream(self, rid, items)

    def generate(
        self, inputs: dict | Admitted, params: dict | None = None, request_id: str | None = None
    ) -> Outputs:
        """Run one request to the end; every output, whole, and its seed."""
        admitted = inputs if isinstance(inputs, Admitted) else self.admit(inputs, params)
        parts: dict[str, list] = {}
        types = {
            c.dst: c.type
            for c in self.plan.channels
            if c.dst in {o.name for o in self.plan.outputs}
        }
        for chunk in self.stream_sync(admitted, request_id=request_id):
            if chunk.value is not None:
                parts.setdefault(chunk.output, []).append(chunk.value)
        outputs = Outputs((name, concat(types[name], values)) for name, values in parts.items())
        outputs.seed = admitted.seed
        return outputs

    def cancel(self, request_id: str) -> None:
        self._command("cancel", request_id)

    def inspect(self, timeout: float = 10.0) -> dict[str, control.Inspection]:
        """Every executor's live state (and the frontend's): for tests, debugging, metrics."""
        return self._ask("inspect", (), "answer an inspection", timeout)

    # --- profiling -----------------------------------------------------------------------------------
    def start_profile(
        self,
        capacity: int = 1 << 16,
        gpu: bool = False,
        stages: list[str] | None = None,
        requests: list[str] | None = None,
    ) -> None:
        """Every executor (and the frontend) starts recording events: up to `capacity` each,
        the oldest overwritten beyond that. Returns once every executor records (a request
        submitted after it is recorded whole), so setting up the buffers costs no request.
        With `gpu`, executors whose stages run on CUDA add the torch profiler's kernel
        timeline (gpu_timeline.py); a plan with no such stage raises ProfileError.
        `stages` records only those stages (their steps, and the chunks on the channels
        into and out of them); `requests` only the requests whose ids start with one of
        these prefixes (a whole id is its own prefix). A stage the plan lacks is a
        ProfileError."""
        if stages is not None:
            known = [s.name for s in self.plan.stages]
            unknown = [s for s in stages if s not in known]
            if unknown:
                raise ProfileError(
                    f"no stage {', '.join(map(repr, unknown))} in pipeline "
                    f"'{self.plan.pipeline}'; its stages: {', '.join(known)}",
                    param="stages",
                )
        if gpu:
            gpu_executors(self.plan)  # raises when there is none
        start = control.Profile(True, capacity, gpu, stages, list(requests or ()))
        self._ask("profile", (start,), "start profiling")

    def stop_profile(self, timeout: float = 30.0) -> list[control.Profiled]:
        """Stop recording; what every executor and the frontend recorded (events.py)."""
        return self._ask("profile", (control.Profile(False),), "hand over their events", timeout)

    def _ask(self, command: str, arg: tuple, what: str, timeout: float = 10.0):
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._command(command, (*arg, reply))
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"executors did not {what} within {timeout} s") from None

    # --- lifetime --------------------------------------------------------------------------------------
    @property
    def stopped(self) -> str | None:
        """Why the engine no longer takes requests (its I/O loop failed, or it was closed),
        or None while it runs."""
        if not self._core.closed:
            return None
        return self._core.failure or "the engine is closed"

    @property
    def executor_pids(self) -> dict[str, int]:
        return self._core.transport.pids

    def close(self) -> None:
        if self._thread.is_alive():
            self._command("close", None)
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM kills a Python process without unwinding, which would leave the frontend's
    rings in /dev/shm; unless the program chose its own handler, make it a SystemExit."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def launch(source, mode: str = "process", devices: str = "cpu", backends: str = "auto") -> Engine:
    """An engine for a `.omni` file, a plan JSON file, a Graph, or a Plan."""
    from omniflow.compiler import compile_file, compile_graph
    from omniflow.ir.graph import Graph

    if isinstance(source, Plan):
        plan = source
    elif isinstance(source, Graph):
        plan = compile_graph(source, devices)
    elif str(source).endswith(".json"):
        plan = Plan.from_json(Path(source).read_bytes())
    else:
        plan = compile_file(source, devices)
    return Engine(plan, mode, backends)


__all__ = [
    "Chunk",
    "Engine",
    "EngineError",
    "Outputs",
    "RequestCancelled",
    "RequestFailed",
    "launch",
]
