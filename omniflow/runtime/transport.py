"""How the engine reaches its executors: one interface, two transports.

`ProcessTransport` runs each executor program in a process of its own: control over zmq
(a ROUTER here, a DEALER there) plus a start queue per executor, data over shared-memory
rings that the link phase creates and attaches (link.py). `ThreadTransport` runs them as
threads of this process, control over queues, data over in-process channels: for
debugging, and for tests that want one process. `RayTransport` (ray_transport.py) is the
process transport with the executors started as Ray actors on a cluster's nodes. The engine
never asks which it has.

Linking (both): every program -- the frontend's loop, which the engine passes in, too --
gets its channel ends before the first request. After executors die, `restart` starts
their replacements and links again every channel that touched them.
"""

from __future__ import annotations

import json
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from omniflow.devices import node_of
from omniflow.errors import OmniflowError
from omniflow.plan import Plan, Program
from omniflow.runtime import control
from omniflow.runtime.executor import STARTUP_ERROR, ZMQ_POLLIN, ControlEnd, serve
from omniflow.runtime.link import link_in_process
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.shm_ring import cleanup_stale_segments
from omniflow.runtime.wakeup import Waker, wait

LINK_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 10.0  # how long executors told to Shutdown may take to leave, together
TICK_S = 0.05

# on_message(executor, message): a control message the engine handles (Failed, Loaded, ...).
OnMessage = Callable[[str, control.Message], None]


class EngineError(OmniflowError):
    """The engine cannot run the plan (an executor failed to start, or the engine is closed)."""


class _SurvivorDied(Exception):
    """An executor that was to re-link died meanwhile."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Transport(ABC):
    """The engine's side of its executors: start and link them, send them control messages,
    hear theirs, notice deaths, restart."""

    def __init__(
        self,
        plan: Plan,
        frontend: ProgramLoop,
        backends: str,
        on_message: OnMessage,
        request_stats: bool = False,
        load: str = "sequential",
    ):
        self.plan = plan
        self.frontend = frontend
        self.backends = backends
        self.on_message = on_message
        self.request_stats = request_stats
        self.load = load  # how each executor loads its stages (loading.py)
        self.names = [p.name for p in plan.executors]
        self.stages_of = {p.name: p.stage_names for p in plan.executors}
        self.closing = False

    def describe(self, name: str) -> str:
        return f"executor '{name}' (stages {', '.join(self.stages_of[name])})"

    @abstractmethod
    def start(self) -> None:
        """Start every executor and link every channel."""

    @abstractmethod
    def send(self, executor: str, message: control.Message) -> None: ...

    @abstractmethod
    def send_start(self, executor: str, message: control.Start) -> None:
        """Queue a Start where the executor looks when the request's first chunk reaches it."""

    @abstractmethod
    def receive(self) -> list[tuple[str, control.Message]]:
        """The control messages that have arrived, with their senders."""

    @abstractmethod
    def poll_fds(self) -> list[tuple[int, int]]:
        """What the engine's wait must watch for control messages."""

    def pending(self) -> bool:
        """Whether messages wait that the fds in `poll_fds` would not announce."""
        return False

    @abstractmethod
    def dead(self) -> dict[str, str]:
        """Executors that have died: name -> how (exit code, last words)."""

    @abstractmethod
    def restart(self, names: set[str]) -> None:
        """Start replacements for dead executors and link them again."""

    @property
    def pids(self) -> dict[str, int]:
        return {}

    def broadcast(self, message: control.Message) -> None:
        for name in self.names:
            self.send(name, message)

    @abstractmethod
    def close(self) -> None:
        """Stop every executor (they were told to Shutdown) and release what links them."""


class ProcessTransport(Transport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_dir = Path(tempfile.mkdtemp(prefix="omniflow-logs-"))
        self.processes: dict[str, subprocess.Popen] = {}
        self.linked = False  # whether every executor has been linked once (later: restarts)
        self.start_queues: dict[str, socket.socket] = {}
        self.ring_names: dict[str, str] = {}
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # A restarted executor reconnects under its old name, maybe before zmq has noticed
        # that the dead one's connection closed: without handover the newcomer would be
        # refused and never heard.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.address = self.bind_control()
        self.router_fd = self.router.getsockopt(zmq.FD)

    def bind_control(self) -> str:
        """Bind the control ROUTER where the executors can reach it; its address."""
        address = f"ipc://{self.log_dir}/control"
        self.router.bind(address)
        return address

    def start(self) -> None:
        self.link(set(self.names))

    # --- control plane ------------------------------------------------------------------------
    def send(self, executor: str, message: control.Message) -> None:
        self.router.send_multipart([executor.encode(), control.encode(message)])

    def send_start(self, executor: str, message: control.Start) -> None:
        # One that does not fit the queue goes over zmq, which wakes the executor.
        data = control.encode(message)
        if len(data) <= control.QUEUED_START_MAX_BYTES:
            try:
                self.start_queues[executor].send(data)
                return
            except OSError:  # full (or the executor is gone: the engine's check sees to that)
                pass
        self.send(executor, message)

    def receive(self) -> list[tuple[str, control.Message]]:
        got = []
        while self.router.getsockopt(zmq.EVENTS) & ZMQ_POLLIN:
            identity, data = self.router.recv_multipart()
            got.append((identity.decode(), control.decode(data)))
        return got

    def poll_fds(self) -> list[tuple[int, int]]:
        return [(self.router_fd, select.POLLIN)]

    def pending(self) -> bool:
        # zmq's fd is edge-triggered: it says nothing of messages already waiting.
        return bool(self.router.getsockopt(zmq.EVENTS) & ZMQ_POLLIN)

    # --- processes ----------------------------------------------------------------------------
    def spawn(self, name: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)  # a full queue must not stall the engine: send_start falls back
        old = self.start_queues.pop(name, None)
        if old is not None:
            old.close()
        self.start_queues[name] = ours
        config = {
            "name": name,
            "program": self.plan.program(name).to_json(),
            "control": self.address,
            "backends": self.backends,
            "start_queue_fd": theirs.fileno(),
            # Removed by an executor left behind by an engine killed outright (main()).
            "log_dir": str(self.log_dir),
            # The engine's torch threads: reductions split by thread count round differently,
            # and a seed must replay a request bit for bit in every run mode.
            "torch_threads": _torch_threads(),
            "host_executors": host_executors(self.plan, name),
            "request_stats": self.request_stats,
            "load": self.load,
            # Executors import as the engine does (`take_engine_path`); they start with -P,
            # which keeps their working directory off the front of sys.path.
            "sys_path": sys.path,
            "spawned_at": time.time(),  # for its `Started`: how long its Python took
        }
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "omniflow.runtime.executor"],
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

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.processes.items()}

    def dead(self) -> dict[str, str]:
        return {
            name: f"exit code {proc.returncode}" + _last_words(self.log_tail(name, 6))
            for name, proc in self.processes.items()
            if proc.poll() is not None
        }

    def restart(self, names: set[str]) -> None:
        """Start replacements for `names` and re-link; one more executor that dies while
        that goes on (a survivor whose peer vanished under it) joins the restart."""
        while True:
            cleanup_stale_segments()  # the rings the dead executors had created
            try:
                self.link(names)
                return
            except _SurvivorDied as died:
                names = names | {died.name}

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def ended(self, name: str) -> bool:
        """Whether executor `name` was started and has ended."""
        proc = self.processes.get(name)
        return proc is not None and proc.poll() is not None

    def startup_failure(self, name: str) -> str:
        for line in reversed(self.log_tail(name).splitlines()):
            if line.startswith(STARTUP_ERROR):
                return f"{self.describe(name)} could not start: {line.removeprefix(STARTUP_ERROR)}"
        code = self.processes[name].returncode
        return (
            f"{self.describe(name)} exited with code {code} while starting:\n{self.log_tail(name)}"
        )

    # --- linking ------------------------------------------------------------------------------
    def link(self, fresh: set[str]) -> None:
        """Start the executors in `fresh` and (re)connect every channel that touches them:
        each program creates the rings it reads and says their names (`Hello`), then every
        writer attaches (`Connect`, answered by `Linked`)."""
        peers = sorted(fresh)
        if self.linked:  # a restart: the survivors drop every request and re-link
            for name in self.names:
                if name not in fresh:
                    self.send(name, control.Reset(peers))
            self.ring_names.update(self.frontend.reset(peers))
        else:
            self.ring_names.update(self.frontend.links.create_rings(self.frontend.program.inbound))
        for name in fresh:
            self.spawn(name)
        # Every executor answers Hello: the fresh on start, survivors on Reset.
        self.await_replies(set(self.names), control.Hello, fresh)
        connects = {}
        for program in [*self.plan.executors, self.frontend.program]:
            rings = {
                c.name: self.ring_names[c.name]
                for c in program.outbound
                if program.name in fresh or c.dst_executor in fresh
            }
            if program is self.frontend.program:
                self.frontend.links.attach_rings(program.outbound, rings)
            elif rings or program.name in fresh:
                connects[program.name] = rings
        for name, rings in connects.items():
            self.send(name, control.Connect(rings))
        self.await_replies(set(connects), control.Linked, fresh)
        self.linked = True

    def await_replies(self, names: set[str], kind: type, fresh: set[str]) -> None:
        deadline = time.monotonic() + LINK_TIMEOUT_S
        pending = set(names)
        while pending:
            for name, message in self.receive():
                if isinstance(message, control.Hello):
                    self.ring_names.update(message.rings)
                if isinstance(message, kind):
                    pending.discard(name)
                else:
                    self.on_message(name, message)
            for name in pending:
                if not self.ended(name):
                    continue
                if name in fresh:
                    raise EngineError(self.startup_failure(name))
                raise _SurvivorDied(name)
            if time.monotonic() > deadline:
                raise EngineError(
                    f"executors {', '.join(sorted(pending))} did not answer within "
                    f"{LINK_TIMEOUT_S:.0f} s"
                )
            if self.closing:
                raise EngineError("the engine was closed while its executors started")
            if pending and not self.pending():
                wait([(self.frontend.waker.fd, select.POLLIN), *self.poll_fds()], TICK_S)
                self.frontend.waker.drain()

    def close(self) -> None:
        """Wait for the executors (told to Shutdown) to leave, all within one
        `CLOSE_TIMEOUT_S`; kill those still busy (a stage in one long computation hears no
        Shutdown) and remove the rings they could not."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        killed = False
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed = True
        if killed:
            cleanup_stale_segments()
        self.release()

    def release(self) -> None:
        """Release what linked the executors: start queues, the control socket, the logs."""
        for queue in self.start_queues.values():
            queue.close()
        self.router.close()
        self.context.term()
        shutil.rmtree(self.log_dir, ignore_errors=True)


class ThreadControl(ControlEnd):
    """An in-process executor's end of the control plane: a queue in, a callback out, and the
    start queue (appended to without a poke)."""

    def __init__(self, name: str, to_engine: Callable[[str, control.Message], None]):
        self.name = name
        self.inbox: deque = deque()
        self.starts: deque = deque()
        self.waker = Waker()
        self.to_engine = to_engine

    def fileno(self) -> int:
        return self.waker.fd

    def pending(self) -> bool:
        return bool(self.inbox)

    def receive(self) -> list[control.Message]:
        messages = []
        while self.inbox:
            messages.append(self.inbox.popleft())
        return messages

    def queued_starts(self) -> Iterator[control.Start]:
        while self.starts:
            yield self.starts.popleft()

    def send(self, message: control.Message) -> None:
        self.to_engine(self.name, message)

    def put(self, message: control.Message) -> None:
        self.inbox.append(message)
        self.waker.poke()

    def close(self) -> None:
        self.waker.close()


class ThreadTransport(Transport):
    """Executors as threads of this process; in-process channels pass references. An
    executor thread that dies takes the engine down with it (no restart): this transport is
    for debugging."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.controls: dict[str, ThreadControl] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.replies: deque = deque()

    def _reply(self, executor: str, message: control.Message) -> None:
        self.replies.append((executor, message))
        self.frontend.waker.poke()

    def start(self) -> None:
        loops = {}
        for name in self.names:
            self.controls[name] = ThreadControl(name, self._reply)
            loops[name] = ProgramLoop(
                self.plan.program(name),
                self.backends,
                waker=self.controls[name].waker,
                on_loaded=lambda loaded, name=name: self.on_message(name, loaded),
                request_stats=self.request_stats,
                load=self.load,
            )
        loops[self.frontend.name] = self.frontend
        crossing = [c for c in self.plan.channels if c.src_executor != c.dst_executor]
        link_in_process(
            crossing,
            {name: loop.links for name, loop in loops.items()},
            {name: loop.waker for name, loop in loops.items()},
        )
        for name in self.names:
            thread = threading.Thread(
                target=serve, args=(loops[name], self.controls[name]), name=f"omniflow-{name}"
            )
            thread.daemon = True
            self.threads[name] = thread
            thread.start()

    def send(self, executor: str, message: control.Message) -> None:
        end = self.controls.get(executor)
        if end is not None:  # None: its stages never finished loading
            end.put(message)

    def send_start(self, executor: str, message: control.Start) -> None:
        self.controls[executor].starts.append(message)

    def receive(self) -> list[tuple[str, control.Message]]:
        got = []
        while self.replies:
            got.append(self.replies.popleft())
        return got

    def poll_fds(self) -> list[tuple[int, int]]:
        return []  # replies poke the frontend's waker

    def dead(self) -> dict[str, str]:
        return {name: "its thread ended" for name, t in self.threads.items() if not t.is_alive()}

    def restart(self, names: set[str]) -> None:
        raise EngineError(
            f"{', '.join(self.describe(n) for n in sorted(names))} ended; in-process executors "
            "are not restarted (run the engine with mode='process')"
        )

    def close(self) -> None:
        for thread in self.threads.values():
            thread.join(timeout=10)
        for end in self.controls.values():
            end.close()


def host_executors(plan: Plan, name: str) -> int:
    """How many of the plan's executors share executor `name`'s host (its node, on Ray)."""

    def node(program: Program) -> str:
        return node_of(program.devices[0]) if program.devices else ""

    mine = node(plan.program(name))
    return sum(node(p) == mine for p in plan.executors)


def _torch_threads() -> int | None:
    """This process's torch thread count, if it uses torch (never imports it itself)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_num_threads()


def _last_words(log: str) -> str:
    return f"; its log ends:\n{log}" if log.strip() else ""


TRANSPORTS: dict[str, type[Transport]] = {"process": ProcessTransport, "inprocess": ThreadTransport}
MODES = (*TRANSPORTS, "ray")


def transport_class(mode: str) -> type[Transport]:
    """The transport of a run mode; `ray` is imported only when asked for (Ray is optional)."""
    if mode == "ray":
        from omniflow.runtime.ray_transport import RayTransport

        return RayTransport
    return TRANSPORTS[mode]
