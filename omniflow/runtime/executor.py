"""An executor: a `ProgramLoop` driven by the engine's control messages, in a process of its
own (`python -P -m omniflow.runtime.executor`, its program, control address and the
engine's sys.path as JSON on stdin) or in a thread of the engine's process (transport.py).

`serve` is the executor's life: obey control messages, pump the loop, sleep when there is
nothing to do. The control plane arrives through a `ControlEnd` -- a zmq DEALER plus the
start queue here, queues in the in-process transport.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import NamedTuple

import zmq

from omniflow.devices import local_name
from omniflow.errors import OmniflowError
from omniflow.plan import Program
from omniflow.runtime import control, events
from omniflow.runtime.budgets import memory_after_load
from omniflow.runtime.heap import freeze_startup_heap
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.shm_ring import (
    SEGMENT_PREFIX,
    SHM_DIR,
    cleanup_stale_segments,
    process_alive,
)
from omniflow.runtime.streams import GpuContextLost, cuda_here
from omniflow.runtime.wakeup import wait

IDLE_WAIT_S = 0.05
ENGINE_WATCH_S = 0.2  # how often an executor process checks that its engine is alive
ENGINE_EXIT_WAIT_S = 2.0  # how long one told to stop waits for its engine's end, to clean up
PURGE_EVERY_S = 10.0
# zmq.POLLIN as a plain int: the flag enum costs microseconds per use in the hot loop.
ZMQ_POLLIN = int(zmq.POLLIN)
# Marks the line of an executor's log that says why it could not start.
STARTUP_ERROR = "omniflow executor cannot start: "


class ControlEnd(ABC):
    """An executor's end of the control plane."""

    @abstractmethod
    def fileno(self) -> int: ...

    @abstractmethod
    def pending(self) -> bool: ...

    @abstractmethod
    def receive(self) -> list[control.Message]: ...

    @abstractmethod
    def queued_starts(self) -> Iterator[control.Start]: ...

    @abstractmethod
    def send(self, message: control.Message) -> None: ...

    def close(self) -> None:  # noqa: B027 (nothing to close by default)
        """Release what the end holds."""


class ZmqControl(ControlEnd):
    """A process's end: a DEALER to the engine's ROUTER, and the start queue (a Unix socket
    the engine handed over at spawn, read only when a request's first chunk arrives)."""

    def __init__(self, address: str, identity: str, start_queue_fd: int | None):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity.encode())
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(address)
        self.fd = self.socket.getsockopt(zmq.FD)
        # None: no start queue (an executor on another node); every Start comes over zmq.
        self.start_queue = None
        if start_queue_fd is not None:
            self.start_queue = socket.socket(fileno=start_queue_fd)
            self.start_queue.setblocking(False)

    def fileno(self) -> int:
        return self.fd

    def pending(self) -> bool:
        return bool(self.socket.getsockopt(zmq.EVENTS) & ZMQ_POLLIN)

    def receive(self) -> list[control.Message]:
        messages = []
        while self.pending():
            messages.append(control.decode(self.socket.recv()))
        return messages

    def queued_starts(self) -> Iterator[control.Start]:
        while self.start_queue is not None:
            try:
                data = self.start_queue.recv(control.QUEUED_START_MAX_BYTES)
            except BlockingIOError:
                return
            if not data:  # the engine is gone; the kernel ends this process too
                return
            yield control.decode(data)

    def send(self, message: control.Message) -> None:
        self.socket.send(control.encode(message))

    def close(self) -> None:
        if self.start_queue is not None:
            self.start_queue.close()
        self.socket.close()
        self.context.term()


def serve(loop: ProgramLoop, end: ControlEnd) -> None:
    """Obey control messages, pump the loop, sleep when idle; until Shutdown."""
    loop.report = end.send
    loop.queued_starts = end.queued_starts
    running = True
    last_purge = time.monotonic()
    check_control = True
    while running:
        for message in end.receive() if check_control else ():
            running = _obey(loop, end, message)
            if not running:
                break
        if not running:
            break
        more_to_do = loop.pump()
        now = time.monotonic()
        if now - last_purge > PURGE_EVERY_S:
            loop.purge(now)
            last_purge = now
        if more_to_do or end.pending():
            check_control = True
            continue
        slept = time.monotonic_ns()
        ready = wait([(end.fileno(), select.POLLIN), *loop.poll_fds()], IDLE_WAIT_S)
        if loop.recorder is not None:
            loop.recorder.add(events.WAIT, None, None, slept, time.monotonic_ns() - slept)
        # Nothing was pending before the wait, so a message since would have made its fd ready;
        # the turn after a wake-up by data skips asking (one that arrives meanwhile is seen by
        # the next turn or the check before the next wait).
        check_control = end.fileno() in ready
        if loop.waker.fd in ready:
            # Drained after the wait, before the turn that handles what the pokes announced: a
            # poke during that turn leaves the next wait nothing to sleep through.
            loop.waker.drain()
    loop.close()


def _obey(loop: ProgramLoop, end: ControlEnd, message: control.Message) -> bool:
    """Carry out one control message; False on Shutdown."""
    if isinstance(message, control.Start):  # one that did not fit the start queue
        loop.start(message)
    elif isinstance(message, control.Cancel):
        # The engine queued the request's Start before it sent the Cancel: take it now, or
        # it would start the request after the Cancel dropped it.
        loop.take_queued_starts()
        loop.cancel(message.request_id)
    elif isinstance(message, control.Connect):
        loop.links.attach_rings(loop.program.outbound, message.rings)
        end.send(control.Linked(loop.name))
    elif isinstance(message, control.Reset):
        end.send(control.Hello(loop.name, loop.reset(message.peers)))
    elif isinstance(message, control.Inspect):
        end.send(loop.inspect())
    elif isinstance(message, control.Profile):
        # Answered either way: the engine waits until every executor records (or has
        # handed over what it recorded; nothing, if it was restarted meanwhile).
        recorded = loop.profile(message)
        answer = vars(recorded) if recorded is not None else {}
        end.send(control.Profiled(loop.name, **answer))
    elif isinstance(message, control.Shutdown):
        return False
    return True


def _die_with_parent() -> None:
    """Have the kernel send SIGTERM when the engine's thread that started this process
    ends, and turn SIGTERM into a clean exit (rings closed, segments unlinked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A terminal's Ctrl-C reaches the whole process group: the engine decides what it means
    # (cancel, shut down) and tells its executors; one killed by it would be a lost request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() == 1:  # the engine died before prctl took effect
        sys.exit(0)


def _watch_engine(engine: int, log_dir: str | None) -> None:
    """Exit at once when the engine process `engine` ends, removing what it would have:
    this process's rings, the engine's, and its log folder `log_dir`. The kernel's SIGTERM
    (the engine's thread that started this process ended) says so when Python gets to run
    its handler, which a stage in one long computation may keep it from for minutes; so a
    thread also watches for this process's re-parenting (it runs meanwhile: torch releases
    the GIL in its kernels)."""

    def leave(*_) -> None:
        for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}-*"):
            path.unlink(missing_ok=True)
        deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
        while process_alive(engine) and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine's threads end before its process does
        if not process_alive(engine):
            cleanup_stale_segments()
            if log_dir is not None:
                shutil.rmtree(log_dir, ignore_errors=True)
        os._exit(0)

    def watch() -> None:
        while os.getppid() == engine:
            time.sleep(ENGINE_WATCH_S)
        leave()

    signal.signal(signal.SIGTERM, leave)
    threading.Thread(target=watch, name="omniflow-engine-watch", daemon=True).start()


class TorchThreads(NamedTuple):
    """An executor's torch threads while its stages load, and while it serves (None: torch's
    own count)."""

    load: int | None
    serve: int | None


def torch_threads(program: Program, engine: int | None, host_executors: int) -> TorchThreads:
    """This executor's torch threads: the engine's (`engine`; None: torch's own), so that a
    seed replays a request bit for bit in every run mode, but one while serving for an
    executor whose stages all run on CUDA. Such an executor's host work is small and bursty
    (a step's features, its kernel launches, an output edge's map of a chunk), and a parallel
    region waits at its barrier for every thread it woke: with threads that other processes'
    CPU work (the server's, other executors') keeps off the cores, each burst waits whole
    scheduler slices. Five executors at a 16-CPU host's count made an H200's audio tower step
    77 ms against 21 ms at one thread; one executor at that count made Qwen3-TTS's output map
    (clamp, pcm16: 0.2 ms of a chunk) take 20-80 ms at 64 streams on an H100
    (docs/benchmarks-log.md, "What bound it: torch threads" and "One torch thread a GPU
    executor"). Its stages load at its share of the host's CPUs (no more than the engine's
    count): a checkpoint's copies and casts on the host are large parallel work, with nothing
    of the executor serving yet, and the host's other executors loading beside it."""
    if not program.devices or not all(local_name(d).startswith("cuda") for d in program.devices):
        return TorchThreads(engine, engine)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cpus or 1) // max(1, host_executors))
    return TorchThreads(min(engine, share) if engine else share, 1)


def take_engine_path(engine_path: list[str]) -> None:
    """Import as the engine does (a python stage's module, an adapter): its sys.path first,
    then this process's own entries behind it. A Ray worker puts its working directory
    first, where a folder named as an installed package would shadow that package (this
    repository's kernels/ shadows PyPI's `kernels`, which transformers imports)."""
    sys.path[:] = [*engine_path, *(p for p in sys.path if p not in engine_path)]


def start_loop(config: dict, end: ControlEnd, began: float | None = None) -> ProgramLoop:
    """An executor's loop for the program in `config` (what the engine's transport sends):
    what its start took said (`Started`: `began`, when its main began, against the engine's
    `spawned_at`), its stages loaded, what they hold of its GPUs said (`Memory`), and the
    rings it reads created and announced (`Hello`)."""
    take_engine_path(config["sys_path"])
    program = Program.from_json(config["program"])
    threads = torch_threads(program, config.get("torch_threads"), config.get("host_executors", 1))
    set_torch_threads(threads.load)
    spawned = config.get("spawned_at")
    python = None if spawned is None or began is None else began - spawned
    end.send(control.Started(program.name, python, cuda_contexts(program)))
    loop = ProgramLoop(
        program,
        config["backends"],
        on_loaded=end.send,
        request_stats=config.get("request_stats", False),
        load=config.get("load", "sequential"),
    )
    for report in memory_after_load(program):
        end.send(report)
    set_torch_threads(threads.serve)
    freeze_startup_heap()
    end.send(control.Hello(loop.name, loop.links.create_rings(program.inbound)))
    return loop


def set_torch_threads(count: int | None) -> None:
    if count:
        import torch

        torch.set_num_threads(count)


def cuda_contexts(program: Program) -> float:
    """Create the CUDA context of each of `program`'s GPUs here now (the first CUDA call
    would), and say how long that took (0 where it has none here)."""
    gpus = [local_name(d) for d in program.devices if cuda_here(d)]
    if not gpus:
        return 0.0
    import torch

    began = time.perf_counter()
    for gpu in dict.fromkeys(gpus):
        torch.cuda.synchronize(gpu)
    return time.perf_counter() - began


def dump_stacks_on_usr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to the executor's log: an executor that
    stalls (a launch that never returns, a lock) can be looked at without a debugger."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def main() -> None:
    began = time.time()
    engine = os.getppid()
    _die_with_parent()
    dump_stacks_on_usr1()
    config = json.loads(sys.stdin.read())
    _watch_engine(engine, config.get("log_dir"))
    end = ZmqControl(config["control"], config["name"], config["start_queue_fd"])
    try:
        loop = start_loop(config, end, began)
    except OmniflowError as err:  # a model or stage it cannot load: the engine reports this line
        print(f"{STARTUP_ERROR}{err}", flush=True)
        sys.exit(3)
    except Exception:
        traceback.print_exc()
        sys.exit(3)
    try:
        serve(loop, end)
    except GpuContextLost as err:
        # Its last words, for the engine's error; then out at once: tearing down would call
        # into the broken context. The engine restarts it, and the janitor removes its rings.
        print(f"omniflow executor ends: {err}", flush=True)
        os._exit(4)
    finally:
        end.close()
    # All it owns is released (its rings in loop.close, its control socket just now): out
    # without the interpreter's teardown of torch and the models' modules, which every close
    # and restart waited for (~3 s an executor of the tiny omni chat, on 2 cores).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
