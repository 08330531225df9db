"""The one loop that runs any program -- an executor's or the frontend's.

`StageRunner` is one stage's continuous-batching scheduler: every turn it steps up to
`max_batch` of the requests that are ready, so a request waiting for its next chunk never
holds up the others. `ProgramLoop` runs a `Program`: it drains its inbound channels into
its stages (or, for channels into pipeline outputs, hands the chunks to its `sink`), steps
the stages in topological order, passes outputs along local channels by reference and to
other programs through their rings. The frontend's program has no stages: the engine
`inject`s a request's inputs into it, and its sink delivers outputs to the request.

On a GPU the program's stages each run on a CUDA stream of their own (streams.py): the
loop enters a stage's stream for everything it does for that stage -- reading the rings
into it, its step, routing what the step produced, putting what waited for credits -- and
a chunk passed to another stage of the program is ordered on the GPU by an event, never by
a host copy or a host sync. Off GPUs the streams are program order and change nothing.

Whoever drives the loop (the executor's `serve`, the engine's I/O thread) calls `pump`
until it says nothing is left to do, then sleeps on `poll_fds`. A request's parameters
arrive as a `Start`, read from the start queue only when the request's first chunk
reaches the loop (control.py), so a request that goes well wakes a loop once per chunk.
"""

from __future__ import annotations

import gc
import select
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omniflow.errors import ChannelError, PayloadTooLarge
from omniflow.plan import ChannelPlan, Program
from omniflow.runtime import control, events
from omniflow.runtime.doorbells import Ending
from omniflow.runtime.edges import StreamWriter, arriving, leaving, transformed
from omniflow.runtime.events import RecordedEvents, Recorder
from omniflow.runtime.gpu_timeline import KernelTimeline, on_cuda
from omniflow.runtime.link import Inbound, Links
from omniflow.runtime.loading import load_order, load_stages
from omniflow.runtime.port_values import Ahead, nbytes, steps
from omniflow.runtime.requests import Admitted, describe
from omniflow.runtime.slack import HoldBudget
from omniflow.runtime.stage import Backend, Call, InputStream, StageSpec
from omniflow.runtime.streams import (
    PROGRAM_ORDER,
    CudaStageStream,
    StageStream,
    settle_loads,
    stage_streams,
)
from omniflow.runtime.sync_debug import StepSyncs
from omniflow.runtime.tallies import Tallies
from omniflow.runtime.wakeup import Waker

# How long a finished or cancelled request's late chunks are recognised and dropped.
TOMBSTONE_S = 120.0
# Passes `receive` makes over the inbound rings while the last one took a chunk. A request's
# inputs come on several rings a moment apart, and in a burst the later requests' first
# ports fill while a pass reads the other rings: 16 Qwen3-TTS requests admitted over 0.9 ms,
# one pass took 6 requests' text but all 16's last port, so the talker started 6 and the
# other 10 a 9 ms step later (docs/benchmarks-log.md, "Batched prefill from graphs").
# Bounded, so that a flood of chunks cannot keep the stages from stepping.
RECEIVE_PASSES = 4

# sink(request_id, output, value or None, end, the producer's Ending or None): a chunk of a
# pipeline output, owned by the sink (copied out of its ring).
Sink = Callable[[str, str, object, bool, Ending | None], None]


@dataclass
class Event:
    """What a runner step produced for the loop to route: an output, an end, or a failure."""

    request_id: str
    stage: str
    port: str | None = None
    value: object = None
    end: bool = False
    ending: Ending | None = None
    error: str | None = None


class StageRunner:
    def __init__(
        self,
        spec: StageSpec,
        backend: Backend,
        max_batch: int,
        stream: StageStream = PROGRAM_ORDER,
    ):
        self.spec = spec
        self.name = spec.plan.name
        self.backend = backend
        self.max_batch = max_batch
        self.stream = stream  # what the loop enters for the stage's work (streams.py)
        self.syncs = StepSyncs.from_env()  # OMNIFLOW_SYNC_DEBUG: a step's host syncs named
        self.calls: dict[str, Call] = {}
        self.tombstones: dict[str, float] = {}
        # Whether a step could find a call ready: something reached the stage since its last
        # step (a chunk, a Start, a dropped call's freed room), or that step left calls behind.
        # False lets the loop sleep without asking the backend about every call again.
        self.maybe_ready = False
        self.recorder: Recorder | None = None
        self.tallies: Tallies | None = None
        self.totals = control.StageTotals()

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
            if self.recorder is not None:
                self.recorder.add(events.START, self.name, request_id, time.monotonic_ns())

    def feed(self, request_id: str, port: str, value, end: bool, release=None, ending=None) -> bool:
        """Queue a chunk on the request's input (with the end, its producer's `ending`, if
        it said); True if the request still lacks its Start."""
        call = self._call(request_id)
        if call is None:
            if release is not None:
                release()
            return False
        call.inputs[port].push(value, end, release, ending)
        self.maybe_ready = True
        if self.tallies is not None and value is not None:
            self.tallies.fed(request_id, self.name, steps(self.spec.inputs[port], value))
        return call.params is None

    def step(self) -> list[Event]:
        """Step up to `max_batch` ready requests, and those that cost nothing beside them;
        what they produced."""
        ready = [c for c in self.calls.values() if c.params is not None and self.backend.ready(c)]
        # A backend with device work in flight is polled again next turn (its read-back
        # lands without waking the loop).
        self.maybe_ready = self.backend.in_flight()
        if not ready:
            return []
        free, working = [], []
        for call in ready:
            (free if self.backend.costs_nothing(call) else working).append(call)
        batch = free + self.backend.urgent_first(working)[: self.max_batch]
        began = time.monotonic_ns()
        try:
            with self.syncs:
                self.backend.step(batch)
        except Exception as err:  # a batched forward cannot say whose input broke it
            # The requests hear the error; the log keeps where it came from.
            print(f"stage '{self.name}': a step of {len(batch)} requests failed:", file=sys.stderr)
            traceback.print_exc()
            for call in batch:
                call.fail(err)
        if any(call.error is not None for call in batch):
            self.stream.check_context(self.name)  # a failure that broke the GPU's ends us
        took = time.monotonic_ns() - began
        self.totals.add(len(batch), took)
        if self.recorder is not None:
            self._record(batch, began, took)
        if self.tallies is not None:
            self._tally(batch, took)
        for call in batch:
            if call.counters:
                self.totals.count(call.counters)
                if self.tallies is not None:
                    self.tallies.counted(call.request_id, self.name, call.counters)
                if self.recorder is not None:
                    self.recorder.counted(self.name, call.request_id, began, call.counters)
                call.counters = {}
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
                events.append(Event(call.request_id, self.name, end=True, ending=call.ending))
                self.drop(call.request_id)
        # Requests further back in line go first next time: `calls` keeps arrival order.
        for call in batch:
            if call.request_id in self.calls:
                self.calls[call.request_id] = self.calls.pop(call.request_id)
        self.maybe_ready = bool(self.calls) or self.backend.in_flight()
        return events

    def _record(self, batch: list[Call], began: int, took: int) -> None:
        recorded = False  # the step of a batch of requests the profile leaves out is too
        for call in batch:
            out = sum(_made(self.spec, p, v) for p, v in call.emitted)
            ended = call.finished or call.error is not None
            recorded |= self.recorder.add(
                events.CALL, self.name, call.request_id, began, took, out, ended
            )
        if recorded:
            self.recorder.add(events.STEP, self.name, None, began, took, len(batch))

    def _tally(self, batch: list[Call], took: int) -> None:
        out = [_steps_out(self.spec, call) for call in batch]
        self.tallies.step(self.name, [c.request_id for c in batch], took / 1e9, out)

    def drop(self, request_id: str) -> None:
        self.tombstones[request_id] = time.monotonic()
        call = self.calls.pop(request_id, None)
        if call is not None:
            # A device ring's slot is freed after the work queued on the stage's stream.
            with self.stream.active():
                for stream in call.inputs.values():
                    stream.release_spent(everything=True)
                self.backend.drop(call)
            self.maybe_ready = bool(self.calls)

    def drop_all(self) -> None:
        for request_id in list(self.calls):
            self.drop(request_id)

    def purge(self, now: float) -> None:
        self.tombstones = {r: t for r, t in self.tombstones.items() if now - t < TOMBSTONE_S}


def _steps_out(spec: StageSpec, call: Call) -> int:
    """The steps a call emitted this step: the most on any one port (a thinker's text and
    hidden states are the same tokens)."""
    per_port: dict[str, int] = defaultdict(int)
    for port, value in call.emitted:
        per_port[port] += _made(spec, port, value)
    return max(per_port.values(), default=0)


def _made(spec: StageSpec, port: str, value) -> int:
    """The steps of a stage's own stream in a value it emitted on `port`: none in what it
    sent `Ahead` of it (a voice clone's reference frames, which it did not make)."""
    return 0 if isinstance(value, Ahead) else steps(spec.outputs[port].type, value)


class ProgramLoop:
    """Runs one program: its stages, its channel ends (`links`), and the writers that chunk
    each stage output (or, in the frontend, each input) onto its channels."""

    def __init__(
        self,
        program: Program,
        backends: str = "auto",
        waker: Waker | None = None,
        on_loaded: Callable[[control.Loaded], None] = lambda loaded: None,
        sink: Sink | None = None,
        request_stats: bool = False,
        load: str = "sequential",
    ):
        self.program = program
        self.name = program.name
        self.waker = waker or Waker()
        self.sink = sink
        self.recorder: Recorder | None = None
        self.timeline: KernelTimeline | None = None  # with a GPU profile (gpu_timeline.py)
        self.channel_totals = {c.name: control.ChannelTotals() for c in program.outbound}
        self.handoffs = {c.name: control.HandoffTotals() for c in program.inbound}
        self.links = Links()
        self.hold = HoldBudget()  # how long first packets may hold the running streams
        streams = stage_streams(program)
        order = load_order(program, streams, load)
        loaded = load_stages(program, backends, streams, order, on_loaded)
        self.runners: dict[str, StageRunner] = {
            stage.name: StageRunner(
                loaded[stage.name].spec,
                loaded[stage.name].backend,
                stage.settings["max_batch"],
                streams[stage.name],
            )
            for stage in program.stages
        }
        # Where stages loaded at once on a GPU, each one's allocator pool holds its memory.
        self.load_pools = [d.pool for d in loaded.values() if d.pool is not None]
        settle_loads(streams)
        self.tallies = (
            Tallies(list(self.runners), lambda stats: self.report(stats)) if request_stats else None
        )
        for runner in self.runners.values():
            runner.tallies = self.tallies
        self.arrive = {c.name: arriving(c) for c in [*program.inbound, *program.local]}
        stages = {s.name: s for s in program.stages}
        self.writers: dict[tuple[str, str], list[StreamWriter]] = defaultdict(list)
        for channel in [*program.outbound, *program.local]:
            self.writers[channel.src, channel.src_port].append(
                StreamWriter(
                    channel,
                    self._sender(channel),
                    leaving(channel, stages.get(channel.src)),
                    merges=channel in program.local,
                )
            )

    def _stream(self, stage: str) -> StageStream:
        """The stream a stage's work runs on (an input's or output's: program order)."""
        runner = self.runners.get(stage)
        return PROGRAM_ORDER if runner is None else runner.stream

    # --- overridden by whoever drives the loop ----------------------------------------------
    def report(self, message: control.Message) -> None:
        """Tell the engine (a stage failed a request)."""

    def queued_starts(self) -> Iterator[control.Start]:
        """The Starts waiting on this program's start queue, oldest first, read as they are
        asked for."""
        return iter(())

    # --- channels -----------------------------------------------------------------------------
    def _sender(self, channel: ChannelPlan):
        if channel not in self.program.local:
            return lambda rid, index, value, end, ending: self._send_out(
                channel, rid, index, value, end, ending
            )
        arrive = self.arrive[channel.name]
        if channel.dst in self.runners:
            runner = self.runners[channel.dst]
            producer = self._stream(channel.src)

            def hand_off(rid: str, index: int, value, end: bool, ending) -> None:
                producer.hand_off(value, runner.stream)
                runner.feed(rid, channel.dst_port, arrive(value), end, ending=ending)

            return hand_off
        return lambda rid, index, value, end, ending: self.sink(
            rid, channel.dst, arrive(value), end, ending
        )

    def _send_out(
        self, channel: ChannelPlan, rid: str, index: int, value, end: bool, ending
    ) -> None:
        outbound = self.links.outbound.get(channel.name)
        if outbound is None:  # its consumer died; the request fails with it
            return
        began = time.monotonic_ns()
        try:
            outbound.send(rid, index, value, end, ending)
        except PayloadTooLarge as err:
            self.fail(rid, channel.src if channel.src in self.runners else self.name, str(err))
            return
        except ChannelError:  # its consumer died: the engine fails its requests and re-links us
            self.links.outbound.pop(channel.name).close()
            return
        took, size = time.monotonic_ns() - began, nbytes(value)
        totals = self.channel_totals[channel.name]
        totals.chunks += 1
        totals.bytes += size
        totals.put_ns += took
        if self.recorder is not None:
            self.recorder.add(events.SEND, channel.name, rid, began, took, size, index)
        if self.tallies is not None:
            self.tallies.sent(rid, channel.name, size, took / 1e9)

    # --- one turn -----------------------------------------------------------------------------
    def pump(self) -> bool:
        """One turn: receive every chunk that has arrived, put the chunks that waited for
        credits, then step every stage once, in topological order (a stage downstream of a
        local channel sees its upstream's output in the same turn), the streams that can
        wait held back while a first packet is on the device, and a request's own makers
        while its window they wait for is (slack.py). True if another turn could do more: a
        stage may have a request ready."""
        self.receive()
        for name, outbound in list(self.links.outbound.items()):
            try:
                with self._stream(outbound.channel.src).active():  # a device ring's copy
                    outbound.flush()
            except ChannelError:
                self.links.outbound.pop(name).close()
        # A first packet on the device anywhere here goes before the streams that can wait.
        wanted = any(r.backend.first_packet_in_flight() for r in self.runners.values())
        first = self.hold.hold(wanted, time.monotonic())
        # A request's own makers wait while a stage has work of its on the device that its
        # listener needs first (outside the hold budget: only that request waits).
        held = frozenset().union(*(r.backend.makers_wait_for() for r in self.runners.values()))
        for runner in self.runners.values():
            runner.backend.first_packets_first = first
            runner.backend.held_requests = held
        for runner in self.runners.values():
            if not self.congested(runner):
                with runner.stream.active():
                    for event in runner.step():
                        self.route(event)
        # A congested stage waits for credits, which wake the loop.
        return any(r.maybe_ready and not self.congested(r) for r in self.runners.values())

    def receive(self) -> None:
        """Feed every chunk waiting in the inbound rings to its stage (or the sink): pass
        over them again while a pass took something (at most RECEIVE_PASSES), for the
        chunks that landed in a ring after this pass had read it."""
        unstarted = set()  # requests whose first chunk came before their Start was read
        for _ in range(RECEIVE_PASSES):
            chunks = 0
            for name, inbound in list(self.links.inbound.items()):
                stage = inbound.channel.dst
                try:
                    with self._stream(stage).active():  # a device ring's wait for its copy
                        chunks += self._receive_from(inbound, self.runners.get(stage), unstarted)
                except ChannelError:
                    self.links.inbound.pop(name).close()  # its producer is gone: re-linked
            if not chunks:
                break
        if unstarted:
            self.take_queued_starts(unstarted)

    def _receive_from(
        self, inbound: Inbound, runner: StageRunner | None, unstarted: set[str]
    ) -> int:
        """Feed the chunks waiting in one inbound ring to its stage (`runner`; None: the
        sink), noting in `unstarted` the requests whose Start has not been read yet; how
        many there were."""
        name = inbound.channel.name
        arrive, handoffs = self.arrive[name], self.handoffs[name]
        chunks = 0
        for meta, value, release in inbound.receive():
            chunks += 1
            rid, end, taken = meta.request_id, meta.end, time.monotonic_ns()
            handoffs.add(taken - meta.sent)
            if self.recorder is not None:
                self.recorder.add(events.RECV, name, rid, taken, 0, nbytes(value), meta.chunk)
            value = transformed(self.recorder, arrive, value, name, rid, meta.chunk, events.MAPS)
            if self.tallies is not None:
                arrived = time.monotonic_ns()
                self.tallies.received(rid, name, (arrived - taken) / 1e9, (taken - meta.sent) / 1e9)
            if runner is None:
                owned = value.clone() if hasattr(value, "clone") else value
                release()
                self.sink(rid, inbound.channel.dst, owned, end, meta.ending)
            elif runner.feed(rid, inbound.channel.dst_port, value, end, release, meta.ending):
                unstarted.add(rid)
        return chunks

    def congested(self, runner: StageRunner) -> bool:
        """Backpressure: a stage waits while a ring it feeds has no credit for what it sent."""
        return any(o.outbox for o in self.links.outbound.values() if o.channel.src == runner.name)

    def route(self, event: Event) -> None:
        if event.port is not None:
            for writer in self.writers.get((event.stage, event.port), ()):
                writer.write(event.request_id, event.value)
        elif event.end:
            for (stage, _port), writers in self.writers.items():
                if stage == event.stage:
                    for writer in writers:
                        writer.end(event.request_id, event.ending)
            if self.tallies is not None:  # after its last chunks went out
                self.tallies.ended(event.request_id, event.stage)
        else:
            self.fail(event.request_id, event.stage, event.error)

    def fail(self, request_id: str, stage: str, error: str) -> None:
        self.cancel(request_id)
        self.report(control.Failed(request_id, stage, error))

    # --- requests -----------------------------------------------------------------------------
    def inject(self, request_id: str, request: Admitted) -> None:
        """A request's inputs, whole, onto the channels that leave them (the frontend): as
        admission encoded them, where they go out as they are."""
        for (source, _port), writers in self.writers.items():
            if source in request.absent:  # an optional input left out: its edges end empty
                for writer in writers:
                    writer.end(request_id)
            elif source in request.inputs:
                for writer in writers:
                    channel = writer.channel
                    as_is = channel.adapter is None and not channel.maps
                    if as_is and channel not in self.program.local:  # one chunk, as encoded
                        writer.send(request_id, 0, request.wire[source], True, None)
                    else:
                        writer.write(request_id, request.inputs[source])
                        writer.end(request_id)

    def take_queued_starts(self, until: set[str] | None = None) -> None:
        """Start the requests queued so far, or only until those in `until` have started."""
        for message in self.queued_starts():
            self.start(message)
            if until is not None:
                until.discard(message.request_id)
                if not until:
                    return

    def start(self, message: control.Start) -> None:
        for name, runner in self.runners.items():
            params = message.params.get(name)
            if params is not None:
                runner.start(message.request_id, params)
            else:  # outside the request's scope: what reaches the stage for it is dropped
                runner.drop(message.request_id)
                if self.tallies is not None:
                    self.tallies.ended(message.request_id, name)

    def cancel(self, request_id: str) -> None:
        if self.tallies is not None:
            self.tallies.drop(request_id)
        for runner in self.runners.values():
            runner.drop(request_id)
        for writers in self.writers.values():
            for writer in writers:
                writer.drop(request_id)
        for outbound in self.links.outbound.values():
            outbound.drop({request_id})

    def reset(self, peers: list[str]) -> dict[str, str]:
        """After `peers` died: drop every request; new rings for the channels they wrote to
        this program (their replacements attach to them)."""
        for runner in self.runners.values():
            runner.drop_all()
        for writers in self.writers.values():
            for writer in writers:
                writer.drop()
        for outbound in self.links.outbound.values():
            outbound.drop()
        return self.links.relink(self.program.inbound, peers)

    def purge(self, now: float) -> None:
        for runner in self.runners.values():
            runner.purge(now)

    # --- profiling ----------------------------------------------------------------------------
    def profile(self, ask: control.Profile) -> RecordedEvents | None:
        """Start recording (a fresh buffer of `ask.capacity` events; with `ask.gpu`, the
        kernel timeline too if this program's stages run on CUDA), or stop and return what
        was recorded. With `ask.stages`, only those stages and the channels into and out of
        them are recorded (a program with none of them records nothing); with
        `ask.requests`, only the requests whose ids start with one of them."""
        if ask.on:
            stages = ask.stages
            wanted = set(self.runners if stages is None else stages)
            channels = self.program.inbound + self.program.outbound
            names = [s for s in self.runners if s in wanted] + [
                c.name for c in channels if stages is None or {c.src, c.dst} & wanted
            ]
            self.recorder = Recorder(names, ask.capacity, tuple(ask.requests)) if names else None
            if ask.gpu and names and on_cuda(self.program) and self.timeline is None:
                self.timeline = KernelTimeline("cuda")
                self.timeline.start(
                    {
                        name: runner.stream.stream
                        for name, runner in self.runners.items()
                        if isinstance(runner.stream, CudaStageStream)
                    }
                )
        recorded = None if ask.on or self.recorder is None else self.recorder.dump()
        if not ask.on:
            self.recorder = None
            if self.timeline is not None:
                timeline, self.timeline = self.timeline, None
                kernels = timeline.stop()
                if recorded is not None:
                    recorded.kernels = kernels
                    recorded.streams = sorted(timeline.streams.items())
        for runner in self.runners.values():
            runner.recorder = self.recorder
        for writers in self.writers.values():
            for writer in writers:
                writer.recorder = self.recorder
        return recorded

    def inspect(self) -> control.Inspection:
        inbound = {(c.dst, c.dst_port): c.name for c in self.program.inbound}
        by_channel = dict.fromkeys(inbound.values(), 0)
        held = 0
        for name, runner in self.runners.items():
            for call in runner.calls.values():
                for port, stream in call.inputs.items():
                    slots = len(stream.releases) + len(stream.spent)
                    held += slots
                    if (name, port) in inbound:
                        by_channel[inbound[name, port]] += slots
        for name, totals in self.channel_totals.items():
            outbound = self.links.outbound.get(name)
            totals.queued = len(outbound.outbox) if outbound is not None else 0
        progress = {}
        for name, runner in self.runners.items():
            known = {}
            for request_id, call in runner.calls.items():
                done = runner.backend.progress(call) if call.params is not None else None
                if done is not None:
                    known[request_id] = list(done)
            if known:
                progress[name] = known
        return control.Inspection(
            self.name,
            {name: list(r.calls) for name, r in self.runners.items()},
            held,
            sum(len(o.outbox) for o in self.links.outbound.values()),
            {name: r.totals for name, r in self.runners.items()},
            self.channel_totals,
            by_channel,
            self.handoffs,
            progress,
            gc.get_freeze_count(),
        )

    def poll_fds(self) -> list[tuple[int, int]]:
        return [(self.waker.fd, select.POLLIN), *self.links.poll_fds()]

    def close(self) -> None:
        self.links.close()
        for runner in self.runners.values():
            runner.drop_all()
            runner.backend.close()
        self.load_pools.clear()
