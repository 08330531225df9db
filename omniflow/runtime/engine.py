"""The engine: the front of a running plan. It launches the executors, links their channels,
accepts requests, streams their outputs back, cancels, and survives executor deaths.

One I/O thread (`_Core`) owns every socket, ring end and process handle; callers talk to it
through a queue and a waker, and get their outputs through per-request queues. The same
`Engine` runs the plan's executors as processes (`mode="process"`: shared-memory rings,
zmq control) or as threads of this process (`mode="inprocess"`: in-process channels).

A request's `Start` goes to each executor's start queue, which the executor reads only when
the request's first chunk reaches it (protocol.py): queued before the request's input enters
a ring, it is there by the time the executor needs it, and it wakes no one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from omniflow.errors import ChannelError, OmniflowError
from omniflow.ir.kinds import SEED_PARAM
from omniflow.plan import ChannelPlan, Plan
from omniflow.runtime import protocol
from omniflow.runtime.executor import STARTUP_ERROR, ZMQ_POLLIN, Executor, serve
from omniflow.runtime.links import Inbound, Outbound, Waker, link_fds, wait
from omniflow.runtime.preflight import preflight
from omniflow.runtime.requests import Admitted, RequestFailed, Voice, admit, stage_params
from omniflow.runtime.shm_ring import (
    ShmConsumer,
    ShmProducer,
    cleanup_stale_segments,
    local_channel,
)
from omniflow.runtime.values import concat

FRONTEND = "frontend"
LINK_TIMEOUT_S = 300.0
TICK_S = 0.05


class EngineError(OmniflowError):
    """The engine cannot run the plan (an executor failed to start, or the engine is closed)."""


class RequestCancelled(OmniflowError):
    """The request was cancelled before it finished."""


@dataclass(frozen=True)
class Chunk:
    """One piece of one output of a request, in order; `final` marks the output's end."""

    request_id: str
    output: str
    value: object
    index: int
    final: bool


@dataclass
class _Request:
    id: str
    admitted: Admitted
    deliver: object  # callable(item) -> None, thread-safe
    open_outputs: set[str] = field(default_factory=set)
    indexes: dict[str, int] = field(default_factory=dict)


class _ThreadControl:
    """An in-process executor's end of the control plane: a queue in, a callback out, and the
    start queue (appended to without a poke)."""

    def __init__(self, name: str, to_engine):
        self.name = name
        self.inbox: deque = deque()
        self.starts: deque = deque()
        self.waker = Waker()
        self.to_engine = to_engine

    def fileno(self) -> int:
        return self.waker.fd

    def pending(self) -> bool:
        return bool(self.inbox)

    def receive(self) -> list:
        messages = []
        while self.inbox:
            messages.append(self.inbox.popleft())
        return messages

    def queued_starts(self) -> Iterator[protocol.Start]:
        while self.starts:
            yield self.starts.popleft()

    def send(self, message) -> None:
        self.to_engine(self.name, message)

    def put(self, message) -> None:
        self.inbox.append(message)
        self.waker.poke()

    def close(self) -> None:
        self.waker.close()


class _Core:
    """Everything the I/O thread owns."""

    def __init__(
        self, plan: Plan, mode: str, backends: str, on_loaded: Callable[[protocol.Loaded], None]
    ):
        self.plan = plan
        self.mode = mode
        self.backends = backends
        self.on_loaded = on_loaded
        self.waker = Waker()
        self.commands: deque = deque()
        self.requests: dict[str, _Request] = {}
        self.inbound: dict[str, Inbound] = {}
        self.outbound: dict[str, Outbound] = {}
        self.executors = [x.name for x in plan.executors]
        self.stages_of = {x.name: x.stages for x in plan.executors}
        self.input_channels = [c for c in plan.channels if c.src_executor == FRONTEND]
        self.output_channels = [c for c in plan.channels if c.dst_executor == FRONTEND]
        self.ring_names: dict[str, str] = {}
        self.closed = False
        self.log_dir = Path(tempfile.mkdtemp(prefix="omniflow-logs-"))
        self.processes: dict[str, subprocess.Popen] = {}
        self.start_queues: dict[str, socket.socket] = {}  # process mode: our end of each
        self.next_check = 0.0  # when check_executors runs next
        self.threads: dict[str, tuple[threading.Thread, _ThreadControl]] = {}
        self.replies: deque = deque()  # (executor, message) from in-process executors
        self.inspections: tuple[dict, queue.SimpleQueue] | None = None
        if mode == "process":
            self.context = zmq.Context()
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.address = f"ipc://{self.log_dir}/control"
            self.router.bind(self.address)
            self.router_fd = self.router.getsockopt(zmq.FD)

    # --- control plane ------------------------------------------------------------------------
    def send(self, executor: str, message: protocol.Message) -> None:
        if self.mode == "process":
            self.router.send_multipart([executor.encode(), protocol.encode(message)])
        else:
            self.threads[executor][1].put(message)

    def broadcast(self, message: protocol.Message) -> None:
        for name in self.executors:
            self.send(name, message)

    def send_start(self, executor: str, message: protocol.Start) -> None:
        """Queue a Start where the executor looks when the request's first chunk reaches it;
        one that does not fit goes over zmq, which wakes the executor as any message does."""
        if self.mode == "inprocess":
            self.threads[executor][1].starts.append(message)
            return
        data = protocol.encode(message)
        if len(data) <= protocol.QUEUED_START_MAX_BYTES:
            try:
                self.start_queues[executor].send(data)
                return
            except OSError:  # full (or the executor is gone: check_executors sees to that)
                pass
        self.send(executor, message)

    def _thread_reply(self, executor: str, message) -> None:
        self.replies.append((executor, message))
        self.waker.poke()

    def receive(self) -> list[tuple[str, protocol.Message]]:
        got = []
        if self.mode == "process":
            while self.router.getsockopt(zmq.EVENTS) & ZMQ_POLLIN:
                identity, data = self.router.recv_multipart()
                got.append((identity.decode(), protocol.decode(data)))
        else:
            while self.replies:
                got.append(self.replies.popleft())
        return got

    # --- launching and linking ------------------------------------------------------------------
    def start(self) -> None:
        cleanup_stale_segments()  # what an earlier engine that was killed left behind
        if self.mode == "process":
            self.link(set(self.executors))
        else:
            self.start_threads()

    def spawn(self, name: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)  # a full queue must not stall the engine: send_start falls back
        old = self.start_queues.pop(name, None)
        if old is not None:
            old.close()
        self.start_queues[name] = ours
        config = {
            "plan": self.plan.to_json(indent=0),
            "executor": name,
            "control": self.address,
            "backends": self.backends,
            "start_queue_fd": theirs.fileno(),
        }
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "omniflow.runtime.executor"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            log.close()
            theirs.close()
        proc.stdin.write(json.dumps(config).encode())
        proc.stdin.close()
        self.processes[name] = proc

    def startup_failure(self, name: str, code: int) -> str:
        what = f"executor '{name}' (stages {', '.join(self.stages_of[name])})"
        for line in reversed(self.log_tail(name).splitlines()):
            if line.startswith(STARTUP_ERROR):
                return f"{what} could not start: {line.removeprefix(STARTUP_ERROR)}"
        return f"{what} exited with code {code} while starting:\n{self.log_tail(name)}"

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def link(self, fresh: set[str]) -> None:
        """Start the executors in `fresh` and (re)connect every channel that touches them."""
        survivors = [n for n in self.executors if n not in fresh]
        for dead in fresh:
            if survivors:
                for name in survivors:
                    self.send(name, protocol.Reset(dead))
        self.frontend_reset(fresh)
        for name in fresh:
            self.spawn(name)
        waiting = set(
            self.executors
        )  # every executor answers Hello: the fresh on start, survivors on Reset
        self.await_replies(waiting, protocol.Hello, fresh)
        connects = {}
        for name in self.executors:
            rings = {
                c.name: self.ring_names[c.name]
                for c in self.plan.channels
                if c.src_executor == name
                and c.dst_executor != name
                and (name in fresh or c.dst_executor in fresh)
            }
            if rings or name in fresh:
                connects[name] = rings
        for name, rings in connects.items():
            self.send(name, protocol.Connect(rings))
        for channel in self.input_channels:
            if channel.dst_executor in fresh:
                old = self.outbound.pop(channel.name, None)
                if old is not None:
                    old.close()
                self.outbound[channel.name] = Outbound(
                    channel, ShmProducer.attach(self.ring_names[channel.name])
                )
        self.await_replies(set(connects), protocol.Linked, fresh)

    def frontend_reset(self, fresh: set[str]) -> None:
        """Re-create the rings that executors in `fresh` feed into the frontend."""
        for channel in self.output_channels:
            if channel.src_executor in fresh:
                old = self.inbound.pop(channel.name, None)
                if old is not None:
                    old.close()
                ring = ShmConsumer.create(channel.slots, channel.slot_bytes)
                self.inbound[channel.name] = Inbound(channel, ring)
                self.ring_names[channel.name] = ring.name
        for channel in self.input_channels:
            if channel.dst_executor in fresh and channel.name in self.outbound:
                self.outbound.pop(channel.name).close()

    def await_replies(self, names: set[str], kind: type, fresh: set[str]) -> None:
        deadline = time.monotonic() + LINK_TIMEOUT_S
        pending = set(names)
        while pending:
            for name, message in self.receive():
                if isinstance(message, protocol.Hello):
                    self.ring_names.update(message.rings)
                if isinstance(message, kind):
                    pending.discard(name)
                else:
                    self.on_message(name, message)
            for name in fresh:
                proc = self.processes.get(name)
                if proc is not None and proc.poll() is not None:
                    raise EngineError(self.startup_failure(name, proc.returncode))
            if time.monotonic() > deadline:
                raise EngineError(
                    f"executors {', '.join(sorted(pending))} did not answer within {LINK_TIMEOUT_S:.0f} s"
                )
            if self.closed:
                raise EngineError("the engine was closed while its executors started")
            if pending:
                self.wait_for_work(TICK_S)

    def start_threads(self) -> None:
        """In-process mode: executors as threads, every cross-executor channel an in-process one."""
        executors = {}
        for name in self.executors:
            control = _ThreadControl(name, self._thread_reply)
            executors[name] = Executor(
                self.plan,
                name,
                self.backends,
                waker=control.waker,
                on_loaded=lambda loaded, name=name: self.on_message(name, loaded),
            )
            self.threads[name] = (None, control)
        wakers = {name: ex.waker for name, ex in executors.items()} | {FRONTEND: self.waker}
        for channel in self.plan.channels:
            if channel.src_executor == channel.dst_executor:
                continue
            producer, consumer = local_channel(channel.slots, channel.slot_bytes, channel.name)
            outbound = Outbound(channel, producer, peer=wakers[channel.dst_executor])
            inbound = Inbound(channel, consumer, peer=wakers[channel.src_executor])
            (
                self.outbound
                if channel.src_executor == FRONTEND
                else executors[channel.src_executor].outbound
            )[channel.name] = outbound
            (
                self.inbound
                if channel.dst_executor == FRONTEND
                else executors[channel.dst_executor].inbound
            )[channel.name] = inbound
        for name, executor in executors.items():
            control = self.threads[name][1]
            thread = threading.Thread(
                target=serve, args=(executor, control), name=f"omniflow-{name}", daemon=True
            )
            self.threads[name] = (thread, control)
            thread.start()

    # --- serving ----------------------------------------------------------------------------------
    def submit(self, request: _Request) -> None:
        self.requests[request.id] = request
        request.open_outputs = {c.dst for c in self.output_channels}
        params = {s.name: stage_params(s, request.admitted) for s in self.plan.stages}
        # Before the input goes out: an executor finds the Start queued when the input reaches it.
        for name in self.executors:
            start = protocol.Start(request.id, {s: params[s] for s in self.stages_of[name]})
            self.send_start(name, start)
        for channel in self.input_channels:
            self.outbound[channel.name].send(
                request.id, 0, request.admitted.inputs[channel.src], True
            )

    def cancel(self, request_id: str, error: OmniflowError) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.broadcast(protocol.Cancel(request_id))
        for outbound in self.outbound.values():
            outbound.drop({request_id})
        request.deliver(error)

    def on_message(self, executor: str, message: protocol.Message) -> None:
        if isinstance(message, protocol.Loaded):
            self.on_loaded(message)
        elif isinstance(message, protocol.Failed):
            self.cancel(
                message.request_id,
                RequestFailed(f"stage '{message.stage}' failed: {message.error}"),
            )
        elif isinstance(message, protocol.Inspection) and self.inspections is not None:
            found, reply = self.inspections
            found[executor] = message
            if len(found) == len(self.executors):
                self.inspections = None
                reply.put({**found, FRONTEND: self.inspect_frontend()})

    def inspect_frontend(self) -> protocol.Inspection:
        queued = sum(len(o.outbox) for o in self.outbound.values())
        return protocol.Inspection(FRONTEND, {FRONTEND: list(self.requests)}, 0, queued)

    def pump(self) -> bool:
        moved = False
        for name, inbound in list(self.inbound.items()):
            channel = inbound.channel
            try:
                for rid, _index, value, end, release in inbound.receive():
                    moved = True
                    owned = value.clone() if hasattr(value, "clone") else value
                    release()
                    self.deliver(rid, channel, owned, end)
            except ChannelError:
                self.inbound.pop(name).close()  # its executor died: check_executors re-links
        for name, outbound in list(self.outbound.items()):
            try:
                outbound.flush()
            except ChannelError:
                self.outbound.pop(name).close()
        return moved

    def deliver(self, request_id: str, channel: ChannelPlan, value, end: bool) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        index = request.indexes.get(channel.dst, 0)
        if value is not None or end:
            request.deliver(Chunk(request_id, channel.dst, value, index, end))
            request.indexes[channel.dst] = index + 1
        if end:
            request.open_outputs.discard(channel.dst)
            if not request.open_outputs:
                del self.requests[request_id]
                request.deliver(None)

    def check_executors(self) -> None:
        if self.mode == "process":
            dead = {n for n, p in self.processes.items() if p.poll() is not None}
        else:
            dead = {n for n, (t, _) in self.threads.items() if t is not None and not t.is_alive()}
        if not dead:
            return
        for name in dead:
            code = self.processes[name].returncode if name in self.processes else "thread ended"
            error = RequestFailed(
                f"executor '{name}' (stages {', '.join(self.stages_of[name])}) died "
                f"(exit code {code}); the request was lost" + _last_words(self.log_tail(name, 6))
            )
            for request_id in list(self.requests):
                self.cancel(request_id, error)
        if self.mode == "process":
            cleanup_stale_segments()  # the rings the dead executor had created
            self.link(dead)

    def wait_for_work(self, timeout: float) -> None:
        fds = [(self.waker.fd, select.POLLIN)]
        if self.mode == "process":
            if self.router.getsockopt(zmq.EVENTS) & ZMQ_POLLIN:
                return
            fds.append((self.router_fd, select.POLLIN))
        fds += link_fds(self.inbound.values(), self.outbound.values())
        if self.waker.fd in wait(fds, timeout):
            self.waker.drain()

    def run_commands(self) -> None:
        while self.commands:
            command, arg = self.commands.popleft()
            if command == "submit":
                self.submit(arg)
            elif command == "cancel":
                self.cancel(arg, RequestCancelled(f"request {arg} was cancelled"))
            elif command == "inspect":
                self.inspections = ({}, arg)
                self.broadcast(protocol.Inspect())
            elif command == "close":
                self.closed = True

    def serve(self) -> None:
        try:
            while not self.closed:
                self.run_commands()
                for name, message in self.receive():
                    self.on_message(name, message)
                moved = self.pump()
                if time.monotonic() >= self.next_check:  # not every turn: a syscall per executor
                    self.check_executors()
                    self.next_check = time.monotonic() + TICK_S
                if not moved and not self.commands:
                    self.wait_for_work(TICK_S)
        except Exception as err:  # no request may hang on a dead engine
            for request_id in list(self.requests):
                self.cancel(
                    request_id, EngineError(f"the engine failed: {type(err).__name__}: {err}")
                )
            raise
        finally:
            self.closed = True
            self.shutdown()

    def shutdown(self) -> None:
        for request_id in list(self.requests):
            self.cancel(request_id, EngineError("the engine was closed"))
        self.broadcast(protocol.Shutdown())
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread, control in self.threads.values():
            if thread is not None:
                thread.join(timeout=10)
            control.close()
        for link in [*self.inbound.values(), *self.outbound.values(), *self.start_queues.values()]:
            link.close()
        if self.mode == "process":
            self.router.close()
            self.context.term()
        self.waker.close()


class Outputs(dict):
    """A request's outputs by name, whole; `seed` is the seed that replays it."""

    seed: int


class Engine:
    """A running plan. Use as a context manager; `generate`, `stream`, `cancel`, `close`.

    Before any executor starts, the plan is checked against this machine (`preflight`:
    devices, models, speakers) unless the caller did so and passes its `voices`;
    `on_loaded` hears of each stage whose model has loaded.
    """

    def __init__(
        self,
        plan: Plan,
        mode: str = "process",
        backends: str = "auto",
        voices: tuple[Voice, ...] | None = None,
        on_loaded: Callable[[protocol.Loaded], None] = lambda loaded: None,
    ):
        if mode not in ("process", "inprocess"):
            raise EngineError(f"unknown mode '{mode}'; use 'process' or 'inprocess'")
        self.plan = plan
        if voices is None:
            voices = () if backends == "standin" else preflight(plan)
        self.voices = voices
        self._core = _Core(plan, mode, backends, on_loaded)
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
            self._core.closed = True
            self._core.waker.poke()
            self._thread.join()
            raise
        if failure:
            raise failure[0]

    # --- requests ------------------------------------------------------------------------------------
    def _submit(self, inputs: dict, params: dict | None, request_id: str | None, deliver) -> str:
        if self._core.closed:
            raise EngineError("the engine is closed")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        request = _Request(request_id, self.admit(inputs, params), deliver)
        self._command("submit", request)
        return request_id

    def admit(self, inputs: dict, params: dict | None = None) -> Admitted:
        """The request checked against the plan (RequestError if it does not fit); its
        `params` hold every parameter, the seed included, so passing them back replays it."""
        return admit(self.plan, inputs, params, self.voices)

    def _command(self, command: str, arg) -> None:
        self._core.commands.append((command, arg))
        self._core.waker.poke()

    def stream_sync(
        self, inputs: dict, params: dict | None = None, request_id: str | None = None
    ) -> Iterator[Chunk]:
        """Output chunks as they are produced, from this thread."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        self._submit(inputs, params, request_id, items.put)
        while (item := items.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def stream(
        self, inputs: dict, params: dict | None = None, request_id: str | None = None
    ) -> AsyncIterator[Chunk]:
        """Output chunks as they are produced; cancelling the consumer cancels the request."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        rid = self._submit(
            inputs,
            params,
            request_id,
            lambda item: loop.call_soon_threadsafe(items.put_nowait, item),
        )
        finished = False
        try:
            while (item := await items.get()) is not None:
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
            finished = True
        finally:
            if not finished:
                self.cancel(rid)

    def generate(
        self, inputs: dict, params: dict | None = None, request_id: str | None = None
    ) -> Outputs:
        """Run one request to the end; every output, whole, and its seed."""
        params = self.admit(inputs, params).params
        parts: dict[str, list] = {}
        types = {
            c.dst: c.type
            for c in self.plan.channels
            if c.dst in {o.name for o in self.plan.outputs}
        }
        for chunk in self.stream_sync(inputs, params, request_id):
            if chunk.value is not None:
                parts.setdefault(chunk.output, []).append(chunk.value)
        outputs = Outputs((name, concat(types[name], values)) for name, values in parts.items())
        outputs.seed = params[SEED_PARAM]
        return outputs

    def cancel(self, request_id: str) -> None:
        self._command("cancel", request_id)

    def inspect(self, timeout: float = 10.0) -> dict[str, protocol.Inspection]:
        """Every executor's live state (and the frontend's): for tests, debugging, metrics."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._command("inspect", reply)
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(
                f"executors did not answer an inspection within {timeout} s"
            ) from None

    # --- lifetime --------------------------------------------------------------------------------------
    @property
    def executor_pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._core.processes.items()}

    def close(self) -> None:
        if self._thread.is_alive():
            self._command("close", None)
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _last_words(log: str) -> str:
    return f"; its log ends:\n{log}" if log.strip() else ""


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
