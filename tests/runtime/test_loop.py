"""The executor loop's contract, turn by turn: `pump()` says whether another turn could do
more, so the loop sleeps only when nothing is left; a request's Start is taken from the start
queue when its first chunk arrives; a stage that lacks credits waits without spinning; a
first packet on the device holds back the steps that can wait."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omniflow.backends import static_decode
from omniflow.compiler import compile_file, compile_source
from omniflow.runtime import control, loop, slack
from omniflow.runtime.doorbells import ChunkMeta
from omniflow.runtime.engine import Engine
from omniflow.runtime.events import CALL, RecordedEvents
from omniflow.runtime.link import Inbound, Outbound
from omniflow.runtime.loop import ProgramLoop
from omniflow.runtime.readback import HostCopy
from omniflow.runtime.shm_ring import local_channel
from tests.profiler.helpers import identity_chain
from tests.runtime.test_readback import land_late

GRAPHS = Path(__file__).parents[2] / "graphs"
CHAIN = identity_chain("chain", 1, 8, 8)
PARAMS = {"b": {"fn": "omniflow.runtime.builtin_stages.identity", "max_batch": 1}}


class Harness:
    """The program of executor `b` of the chain, alone, its rings in-process: we feed its
    input and read its output, and hold its start queue."""

    def __init__(self, out_slots: int = 4):
        plan = compile_source(CHAIN, "chain.omni")
        program = plan.program("b")
        self.executor = ProgramLoop(program)
        (into,), (out,) = program.inbound, program.outbound
        self.input, consumer = local_channel(into.slots, into.slot_bytes)
        producer, self.output = local_channel(out_slots, out.slot_bytes)
        self.executor.links.set_inbound(Inbound(into, consumer))
        self.executor.links.set_outbound(Outbound(out, producer))
        self.start_queue: list[control.Start] = []
        self.starts_read = 0
        self.executor.queued_starts = self._queued_starts

    def _queued_starts(self):
        while self.start_queue:
            self.starts_read += 1
            yield self.start_queue.pop(0)

    def send(self, request_id: str, value: int) -> None:
        self.input.put(torch.tensor([[value]]), ChunkMeta(request_id, 0, end=True))

    def turns(self, limit: int = 20) -> int:
        """Pump until the executor says nothing is left to do; how many turns that took."""
        for turn in range(1, limit + 1):
            if not self.executor.pump():
                return turn
        raise AssertionError(f"the executor still had work after {limit} turns")

    def received(self) -> list[tuple[str, list, bool]]:
        got = []
        while (item := self.output.try_get()) is not None:
            got.append((item.meta.request_id, item.tensors[0].flatten().tolist(), item.meta.end))
            item.release()
        return got


def test_a_request_starts_from_the_queue_when_its_chunk_arrives_and_then_the_loop_may_sleep():
    h = Harness()
    h.start_queue.append(control.Start("r1", PARAMS))
    assert not h.executor.pump()  # nothing arrived: the queue is not even read
    assert h.starts_read == 0
    h.send("r1", 7)
    h.turns()
    assert h.starts_read == 1
    assert h.received() == [("r1", [7], True)]
    assert not h.executor.runners["b"].calls
    assert not h.executor.pump()


def test_reading_the_queue_stops_at_the_start_the_chunk_needs():
    h = Harness()
    h.start_queue += [control.Start(r, PARAMS) for r in ("r1", "r2", "r3")]
    h.send("r2", 5)
    h.turns()
    # r1 and r2 were read (in queue order), r3 waits for its own chunk.
    assert h.starts_read == 2
    assert [s.request_id for s in h.start_queue] == ["r3"]
    assert h.received() == [("r2", [5], True)]
    h.send("r1", 4)
    h.send("r3", 6)
    h.turns()
    assert sorted(h.received()) == [("r1", [4], True), ("r3", [6], True)]


def test_a_chunk_whose_start_is_not_queued_waits_for_it_without_spinning():
    h = Harness()
    h.send("r1", 3)
    assert not h.executor.pump()  # nothing can run: the loop may sleep
    assert h.received() == []
    h.executor.start(control.Start("r1", PARAMS))  # as when it comes over zmq
    h.turns()
    assert h.received() == [("r1", [3], True)]


def test_a_chunk_landing_after_its_ring_was_read_is_taken_by_the_same_receive():
    """A pass reads the rings one after another, and a chunk can land in a ring the pass
    has read (as a burst's requests do while it reads their other ports): `receive` passes
    again while a pass took something, so the request is fed in this turn, not the next."""
    h = Harness()
    h.start_queue += [control.Start(r, PARAMS) for r in ("r1", "r2")]
    (inbound,) = h.executor.links.inbound.values()
    read, late = inbound.receive, ["r2"]

    def receive_then_one_lands():
        yield from read()
        if late:  # the ring is empty now: r2's chunk arrives just after
            h.send(late.pop(), 9)

    inbound.receive = receive_then_one_lands
    h.send("r1", 8)
    h.executor.receive()
    assert not late and sorted(h.executor.runners["b"].calls) == ["r1", "r2"]
    h.turns()
    assert sorted(h.received()) == [("r1", [8], True), ("r2", [9], True)]


def test_a_stage_without_credit_lets_the_loop_sleep_and_resumes_when_credit_returns():
    h = Harness(out_slots=1)
    for i in range(3):
        h.start_queue.append(control.Start(f"r{i}", PARAMS))
        h.send(f"r{i}", i)
        h.turns()
    # r0 fills the output ring, r1 waits in the outbox, and the stage stops there: r2 waits.
    state = h.executor.inspect()
    assert state.queued_chunks == 1 and state.calls == {"b": ["r2"]}
    assert not h.executor.pump()
    got = []
    while len(got) < 3:
        got += h.received()  # frees the slot: a credit
        h.turns()
    assert got == [(f"r{i}", [i], True) for i in range(3)]


@pytest.mark.parametrize("queued", [True, False], ids=["start-queue", "zmq"])
def test_a_start_too_big_for_the_queue_goes_over_zmq(queued, monkeypatch):
    if not queued:
        monkeypatch.setattr(control, "QUEUED_START_MAX_BYTES", 0)
    plan = compile_source(CHAIN, "chain.omni")
    with Engine(plan, "process") as engine:
        for i in range(5):
            assert engine.generate({"x": [[i]]})["y"].flatten().tolist() == [i]
        state = engine.inspect()
    assert all(not any(i.calls.values()) for i in state.values())


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_inspection_counts_steps_and_bytes_per_stage_and_channel(mode):
    plan = compile_source(CHAIN, "chain.omni")
    with Engine(plan, mode) as engine:
        for i in range(3):
            engine.generate({"x": [[i], [i]]})
        state = engine.inspect()
    stages = {name: t for x in state.values() for name, t in x.stages.items()}
    channels = {name: t for x in state.values() for name, t in x.channels.items()}
    assert set(stages) == {"a", "b", "c"}
    assert all(t.calls >= 3 and t.steps >= 1 and t.step_ns > 0 for t in stages.values())
    assert set(channels) == {c.name for c in plan.channels if c.kind != "local"}
    # Two int64 tokens per request entered and left; nothing waits for credits now.
    assert channels["x.out->a.in"].bytes == channels["c.out->y.in"].bytes == 3 * 2 * 8
    assert all(t.queued == 0 and t.chunks >= 3 for t in channels.values())


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_request_stats_reach_the_caller_before_its_last_chunk(mode):
    plan = compile_source(CHAIN, "chain.omni")
    tables = []
    with Engine(plan, mode, on_stats=tables.append) as engine:
        for i in range(2):
            engine.generate({"x": [[i], [i], [i]]}, request_id=f"r{i}")
            assert [t.request_id for t in tables] == [f"r{k}" for k in range(i + 1)]
    stats = tables[-1]
    assert set(stats.stages) == {"a", "b", "c"}
    assert all(s["num_tokens_in"] == s["num_tokens_out"] == 3 for s in stats.stages.values())
    assert set(stats.edges) == {c.name for c in plan.channels}
    # Every channel between programs has its sending and its receiving side.
    for name in (c.name for c in plan.channels if c.kind != "local"):
        row = stats.edges[name]
        assert row["size_kbytes"] == 3 * 8 / 1024 and row["tx_time_ms"] > 0
        assert row["in_flight_time_ms"] >= 0 and "rx_decode_time_ms" in row


@pytest.mark.parametrize(
    "budget, order, held",
    [(True, "arrival", True), (False, "slack", True), (False, "arrival", False)],
    ids=["first-packets-first", "own-makers-wait", "no-hold"],
)
def test_while_a_first_packet_is_on_the_device_the_talker_launches_no_next_frame(
    budget, order, held, monkeypatch, tmp_path
):
    """Qwen3-TTS (tiny) in one program, its talker on the static path, the device's latency
    injected (a step's tokens and a window's audio land three polls late): the loop holds the
    talker's next frame until code2wav's first audio is out, so the frame after the first
    comes after it: within the hold's budget (raised for the CPU's slow steps); and with the
    budget spent, where code2wav orders by slack, as the request's own makers wait for its
    first window (`makers_wait_for`). With neither (`no-hold`) the talker runs ahead and its
    second frame lands first."""
    graph = tmp_path / "qwen3_tts.omni"
    source = (GRAPHS / "qwen3_tts.omni").read_text()
    source = source.replace('(component="talker",', '(component="talker", decode="static",')
    source = source.replace('(component="code2wav",', f'(component="code2wav", order="{order}",')
    # A frame a chunk: off GPUs a per-token stream is what puts two stages in one program.
    graph.write_text(
        source.replace(
            "talker.codes -> code2wav [stream, chunk=auto]",
            "talker.codes -> code2wav [stream, chunk=1]",
        )
    )
    plan = compile_file(graph, devices="cpu", tiny=True)
    (program,) = [p for p in plan.executors if len(p.stages) > 1]
    assert {s.name for s in program.stages} == {"talker", "code2wav"}
    # A frame's 80 ms, as the compiler marks the edge on a GPU (a CPU plan keeps its runs
    # bit for bit: unpaced).
    for channel in [*plan.channels, *program.local]:
        if channel.dst == "code2wav":
            channel.plays_s = 0.08
    spell = 60.0 if budget else 0.0
    monkeypatch.setattr(slack, "HOLD_SPELL_S", spell)
    monkeypatch.setattr(loop, "HoldBudget", lambda: slack.HoldBudget(left=spell))
    land_late(monkeypatch, static_decode.Launched)
    land_late(monkeypatch, HostCopy)
    with Engine(plan, "inprocess") as engine:
        engine.start_profile(1 << 16)
        engine.generate({"text": "Hello there."}, {"max_tokens": 6, "seed": 1}, request_id="r")
        profiles = engine.stop_profile()
    emitted = {"talker": [], "code2wav": []}  # when each stage's steps emitted something
    for profile in profiles:
        recorded = RecordedEvents(profile.names, profile.requests, profile.rows)
        for t, _dur, kind, what, _request, n, _m in recorded.events():
            if kind == CALL and n > 0 and recorded.names[what] in emitted:
                emitted[recorded.names[what]].append(t)
    talker, code2wav = sorted(emitted["talker"]), sorted(emitted["code2wav"])
    assert len(talker) >= 2 and code2wav
    assert (talker[1] > code2wav[0]) == held
