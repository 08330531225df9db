"""Executors: the processes (or, in-process, threads) that run a plan's stages.

`StageRunner` is one stage's continuous-batching scheduler: every loop turn it steps up to
`max_batch` of the requests that are ready, so a request waiting for its next chunk never
holds up the others. `Executor` runs the stages of one plan executor: it drains its inbound
channels into the runners, steps them in topological order, passes outputs to fused stages
by reference and to other executors through their rings, and obeys the engine's control
messages. Run as `python -m omniflow.runtime.executor` it reads its config as JSON on stdin.

The loop turns while a stage may have a request ready and otherwise sleeps until a ring,
the control socket or the waker has something for it. A request that goes well costs an
executor a wake-up per chunk that finds it asleep and no control message: its `Start` waits
on the start queue until its first chunk arrives (protocol.py), and the engine sees its end
on the output rings.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from omniflow.errors import ChannelError, OmniflowError
from omniflow.plan import ChannelPlan, Plan
from omniflow.runtime import protocol
from omniflow.runtime.backends import load_backend
from omniflow.runtime.edges import StreamWriter, apply_maps, load_adapter
from omniflow.runtime.links import Inbound, Outbound, Waker, link_fds, wait
from omniflow.runtime.requests import describe
from omniflow.runtime.shm_ring import ShmConsumer, ShmProducer
from omniflow.runtime.stage import Backend, Call, InputStream, StageSpec

# How long a finished or cancelled request's late chunks are recognised and dropped.
TOMBSTONE_S = 120.0
IDLE_WAIT_S = 0.05


@dataclass
class Event:
    """What a runner step produced for the loop to route: an output, an end, or a failure."""

    request_id: str
    stage: str
    port: str | None = None
    value: object = None
    finished: bool = False
    error: str | None = None


class StageRunner:
    def __init__(self, spec: StageSpec, backend: Backend, max_batch: int):
        self.spec = spec
        self.name = spec.plan.name
        self.backend = backend
        self.max_batch = max_batch
        self.calls: dict[str, Call] = {}
        self.tombstones: dict[str, float] = {}
        # Whether a step could find a call ready: something reached the stage since its last
        # step (a chunk, a Start, a dropped call's freed room), or that step left calls behind.
        # False lets the loop sleep without asking the backend about every call again.
        self.maybe_ready = False

    def _call(self, request_id: str) -> Call | None:
        if request_id in self.tombstones:
            return None
        call = self.calls.get(request_id)
        if call is None:
            streams = {port: InputStream(typ) for port, typ in self.spec.inputs.items()}
            call = self.calls[request_id] = Call(request_id, None, streams)
        return call

    def start(self, request_id: str, params: dict) -> None:
        call = self._call(request_id)
        if call is not None:
            call.params = params
            self.maybe_ready = True

    def feed(self, request_id: str, port: str, value, end: bool, release=None) -> bool:
        """Queue a chunk on the request's input; True if the request still lacks its Start."""
        call = self._call(request_id)
        if call is None:
            if release is not None:
                release()
            return False
        call.inputs[port].push(value, end, release)
        self.maybe_ready = True
        return call.params is None

    def step(self) -> list[Event]:
        """Step up to `max_batch` ready requests; what they produced."""
        ready = [c for c in self.calls.values() if c.params is not None and self.backend.ready(c)]
        self.maybe_ready = False
        if not ready:
            return []
        batch = ready[: self.max_batch]
        try:
            self.backend.step(batch)
        except Exception as err:  # a batched forward cannot say whose input broke it
            # The requests hear the error; the log keeps where it came from.
            print(f"stage '{self.name}': a step of {len(batch)} requests failed:", file=sys.stderr)
            traceback.print_exc()
            for call in batch:
                call.fail(err)
        events = []
        for call in batch:
            for stream in call.inputs.values():
                stream.release_spent()
            events += [
                Event(call.request_id, self.name, port, value) for port, value in call.emitted
            ]
            call.emitted.clear()
            if call.error is not None:
                events.append(Event(call.request_id, self.name, error=describe(call.error)))
                self.drop(call.request_id)
            elif call.finished:
                events.append(Event(call.request_id, self.name, finished=True))
                self.drop(call.request_id)
        # Requests further back in line go first next time: `calls` keeps arrival order.
        for call in batch:
            if call.request_id in self.calls:
                self.calls[call.request_id] = self.calls.pop(call.request_id)
        self.maybe_ready = bool(self.calls)
        return events

    def drop(self, request_id: str) -> None:
        self.tombstones[request_id] = time.monotonic()
        call = self.calls.pop(request_id, None)
        if call is not None:
            for stream in call.inputs.values():
                stream.release_spent(everything=True)
            self.backend.drop(call)
            self.maybe_ready = bool(self.calls)

    def drop_all(self) -> None:
        for request_id in list(self.calls):
            self.drop(request_id)

    def purge(self, now: float) -> None:
        self.tombstones = {r: t for r, t in self.tombstones.items() if now - t < TOMBSTONE_S}


class Executor:
    """The stages of one plan executor, their channels, and the loop that drives them."""

    def __init__(
        self,
        plan: Plan,
        name: str,
        backends: str = "auto",
        waker: Waker | None = None,
        on_loaded: Callable[[protocol.Loaded], None] = lambda loaded: None,
    ):
        self.plan = plan
        self.name = name
        self.waker = waker or Waker()
        stages = [s for s in plan.stages if s.executor == name]
        self.runners: dict[str, StageRunner] = {}
        for stage in stages:
            spec = StageSpec.from_channels(stage, plan.channels)
            device = stage.devices[0] if stage.devices else "cpu"
            max_batch = stage.settings["max_batch"]
            began = time.monotonic()
            self.runners[stage.name] = StageRunner(
                spec, load_backend(spec, device, backends), max_batch
            )
            on_loaded(protocol.Loaded(stage.name, time.monotonic() - began))
        self.inbound: dict[str, Inbound] = {}
        self.outbound: dict[str, Outbound] = {}
        self.writers: dict[tuple[str, str], list[StreamWriter]] = defaultdict(list)
        for channel in plan.channels:
            if channel.src in self.runners:
                self.writers[channel.src, channel.src_port].append(
                    StreamWriter(channel, self._sender(channel), load_adapter(channel, plan))
                )

    # --- channels -----------------------------------------------------------------------
    def in_channels(self) -> list[ChannelPlan]:
        """Channels from another executor (or the frontend) into this one."""
        return [
            c for c in self.plan.channels if c.dst in self.runners and c.src_executor != self.name
        ]

    def out_channels(self) -> list[ChannelPlan]:
        return [
            c for c in self.plan.channels if c.src in self.runners and c.dst_executor != self.name
        ]

    def _sender(self, channel: ChannelPlan):
        if channel.dst in self.runners:
            runner = self.runners[channel.dst]
            return lambda rid, index, value, end: runner.feed(
                rid, channel.dst_port, apply_maps(channel, value, "dst"), end
            )
        return lambda rid, index, value, end: self.outbound[channel.name].send(
            rid, index, value, end
        )

    def create_inbound(self, channels: list[ChannelPlan]) -> dict[str, str]:
        """Create a shared-memory ring for each channel (this executor consumes it); their names."""
        names = {}
        for channel in channels:
            old = self.inbound.pop(channel.name, None)
            if old is not None:
                old.close()
            ring = ShmConsumer.create(channel.slots, channel.slot_bytes)
            self.inbound[channel.name] = Inbound(channel, ring)
            names[channel.name] = ring.name
        return names

    def attach_outbound(self, rings: dict[str, str]) -> None:
        by_name = {c.name: c for c in self.plan.channels}
        for channel_name, ring_name in rings.items():
            old = self.outbound.pop(channel_name, None)
            if old is not None:
                old.close()
            self.outbound[channel_name] = Outbound(
                by_name[channel_name], ShmProducer.attach(ring_name)
            )

    # --- one turn of the loop -----------------------------------------------------------------
    def pump(self) -> bool:
        """One turn: receive every chunk that has arrived, put the chunks that waited for credits,
        then step every stage once, in topological order (a fused stage sees its upstream's output
        in the same turn; outputs to other executors go out as they are produced). True if
        another turn could do more: a stage may have a request ready."""
        self.receive()
        for name, outbound in list(self.outbound.items()):
            try:
                outbound.flush()
            except ChannelError:
                self.outbound.pop(name).close()
        for runner in self.runners.values():
            if not self.congested(runner):
                for event in runner.step():
                    self.route(event)
        # A congested stage waits for credits, which wake the loop.
        return any(r.maybe_ready and not self.congested(r) for r in self.runners.values())

    def receive(self) -> None:
        """Feed every chunk waiting in the inbound rings to its stage."""
        unstarted = set()  # requests whose first chunk came before their Start was read
        for name, inbound in list(self.inbound.items()):
            channel = inbound.channel
            runner = self.runners[channel.dst]
            try:
                for rid, _index, value, end, release in inbound.receive():
                    value = apply_maps(channel, value, "dst")
                    if runner.feed(rid, channel.dst_port, value, end, release):
                        unstarted.add(rid)
            except ChannelError:
                self.inbound.pop(name).close()  # its producer is gone; the engine re-links us
        if unstarted:
            self.take_queued_starts(unstarted)

    def congested(self, runner: StageRunner) -> bool:
        """Backpressure: a stage waits while a ring it feeds has no credit for what it sent."""
        return any(o.outbox for o in self.outbound.values() if o.channel.src == runner.name)

    def inspect(self) -> protocol.Inspection:
        held = sum(
            len(s.releases) + len(s.spent)
            for r in self.runners.values()
            for c in r.calls.values()
            for s in c.inputs.values()
        )
        return protocol.Inspection(
            self.name,
            {name: list(r.calls) for name, r in self.runners.items()},
            held,
            sum(len(o.outbox) for o in self.outbound.values()),
        )

    def route(self, event: Event) -> None:
        if event.port is not None:
            for writer in self.writers.get((event.stage, event.port), ()):
                writer.write(event.request_id, event.value)
        elif event.finished:
            for (stage, _port), writers in self.writers.items():
                if stage == event.stage:
                    for writer in writers:
                        writer.end(event.request_id)
        else:
            self.cancel(event.request_id)
            self.report(protocol.Failed(event.request_id, event.stage, event.error))

    def report(self, message: protocol.Message) -> None:
        """Overridden by the loop (`serve`) to send to the engine."""

    def queued_starts(self) -> Iterator[protocol.Start]:
        """Overridden by the loop (`serve`): the Starts waiting on this executor's start queue,
        oldest first, read as they are asked for."""
        return iter(())

    def take_queued_starts(self, until: set[str] | None = None) -> None:
        """Start the requests queued so far, or only until those in `until` have started."""
        for message in self.queued_starts():
            self.start(message)
            if until is not None:
                until.discard(message.request_id)
                if not until:
                    return

    def start(self, message: protocol.Start) -> None:
        for stage, params in message.params.items():
            if stage in self.runners:
                self.runners[stage].start(message.request_id, params)

    def cancel(self, request_id: str) -> None:
        for runner in self.runners.values():
            runner.drop(request_id)
        for writers in self.writers.values():
            for writer in writers:
                writer.drop(request_id)
        for outbound in self.outbound.values():
            outbound.drop({request_id})

    def reset(self, peer: str) -> dict[str, str]:
        """After `peer` died: drop every request; re-create the rings it fed us."""
        for runner in self.runners.values():
            runner.drop_all()
        for writers in self.writers.values():
            for writer in writers:
                writer.pending.clear()
        for outbound in self.outbound.values():
            outbound.drop()
        for channel_name in [n for n, o in self.outbound.items() if o.channel.dst_executor == peer]:
            self.outbound.pop(channel_name).close()
        return self.create_inbound([c for c in self.in_channels() if c.src_executor == peer])

    def poll_fds(self) -> list[tuple[int, int]]:
        own = [(self.waker.fd, select.POLLIN)]
        return own + link_fds(self.inbound.values(), self.outbound.values())

    def close(self) -> None:
        for link in [*self.inbound.values(), *self.outbound.values()]:
            link.close()
        for runner in self.runners.values():
            runner.drop_all()
            runner.backend.close()


# zmq's flag enums make `events & zmq.POLLIN` cost microseconds; the loop asks every turn.
ZMQ_POLLIN = int(zmq.POLLIN)


class ZmqControl:
    """The executor's end of the control plane in process mode: a DEALER to the engine's ROUTER,
    and the start queue (a Unix socket the engine handed over at spawn, never polled)."""

    def __init__(self, address: str, identity: str, start_queue_fd: int):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity.encode())
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(address)
        self.fd = self.socket.getsockopt(zmq.FD)
        self.start_queue = socket.socket(fileno=start_queue_fd)
        self.start_queue.setblocking(False)

    def fileno(self) -> int:
        return self.fd

    def pending(self) -> bool:
        return bool(self.socket.getsockopt(zmq.EVENTS) & ZMQ_POLLIN)

    def receive(self) -> list[protocol.Message]:
        messages = []
        while self.pending():
            messages.append(protocol.decode(self.socket.recv()))
        return messages

    def queued_starts(self) -> Iterator[protocol.Start]:
        while True:
            try:
                data = self.start_queue.recv(protocol.QUEUED_START_MAX_BYTES)
            except BlockingIOError:
                return
            if not data:  # the engine is gone; the kernel ends this process too
                return
            yield protocol.decode(data)

    def send(self, message: protocol.Message) -> None:
        self.socket.send(protocol.encode(message))

    def close(self) -> None:
        self.start_queue.close()
        self.socket.close()
        self.context.term()


def serve(executor: Executor, control) -> None:
    """The executor loop: obey control messages, pump channels and stages, sleep when idle."""
    executor.report = control.send
    executor.queued_starts = control.queued_starts
    running = True
    last_purge = time.monotonic()
    check_control = True
    while running:
        for message in control.receive() if check_control else ():
            if isinstance(message, protocol.Start):  # one that did not fit the start queue
                executor.start(message)
            elif isinstance(message, protocol.Cancel):
                # The engine queued the request's Start before it sent the Cancel: take it
                # now, or it would start the request after the Cancel dropped it.
                executor.take_queued_starts()
                executor.cancel(message.request_id)
            elif isinstance(message, protocol.Connect):
                executor.attach_outbound(message.rings)
                control.send(protocol.Linked(executor.name))
            elif isinstance(message, protocol.Reset):
                control.send(protocol.Hello(executor.name, executor.reset(message.peer)))
            elif isinstance(message, protocol.Inspect):
                control.send(executor.inspect())
            elif isinstance(message, protocol.Shutdown):
                running = False
        if not running:
            break
        more_to_do = executor.pump()
        now = time.monotonic()
        if now - last_purge > 10:
            for runner in executor.runners.values():
                runner.purge(now)
            last_purge = now
        if more_to_do or control.pending():
            check_control = True
            continue
        ready = wait([(control.fileno(), select.POLLIN), *executor.poll_fds()], IDLE_WAIT_S)
        # Nothing was pending before the wait, so a message since would have made its fd ready;
        # the turn after a wake-up by data skips asking (one that arrives meanwhile is seen by
        # the next turn or the check before the next wait).
        check_control = control.fileno() in ready
        if executor.waker.fd in ready:
            # Drained after the wait, before the turn that handles what the pokes announced: a
            # poke during that turn leaves the next wait nothing to sleep through.
            executor.waker.drain()
    executor.close()


def _die_with_parent() -> None:
    """Have the kernel send SIGTERM if the engine dies, and turn SIGTERM into a clean exit
    (rings closed, segments unlinked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if os.getppid() == 1:  # the engine died before prctl took effect
        sys.exit(0)


# Marks the line of an executor's log that says why it could not start.
STARTUP_ERROR = "omniflow executor cannot start: "


def main() -> None:
    _die_with_parent()
    config = json.loads(sys.stdin.read())
    control = ZmqControl(config["control"], config["executor"], config["start_queue_fd"])
    try:
        executor = Executor(
            Plan.from_json(config["plan"]),
            config["executor"],
            config["backends"],
            on_loaded=control.send,
        )
        control.send(protocol.Hello(executor.name, executor.create_inbound(executor.in_channels())))
    except OmniflowError as err:  # a model or stage it cannot load: the engine reports this line
        print(f"{STARTUP_ERROR}{err}", flush=True)
        sys.exit(3)
    except Exception:
        traceback.print_exc()
        sys.exit(3)
    try:
        serve(executor, control)
    finally:
        control.close()


if __name__ == "__main__":
    main()
