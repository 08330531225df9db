"""The vocoder backend's carried-state streaming (`Decoder.stateful`), on Qwen3-TTS's code2wav
(tiny CustomVoice checkpoint): driven through the runtime's own stage runner, frames arriving
one per round as a talker makes them, windows of 1 frame, of 3 and of a mixed schedule, two
requests interleaved and decoded in shared forwards, each request's audio is its
whole-utterance decode; each frame is decoded once. The states live in fixed slots (one per
stream the stage batches): decoded eagerly at each forward's shape, and through the static
windows (batch buckets x window lengths, the buffers CUDA graphs replay; eager on the CPU)
alike; a cancelled or finished request's slot is freed and the next stream reuses it, its
old contents unread; a stream that finds every slot taken waits for one.

Tolerance: 1e-4 (max abs, waveforms of std ~0.3 clamped to +-1). Measured on 2 CPU cores:
up to 5e-5, the rounding of other window lengths' conv and attention summation orders
through ~30 layers; the whole decode itself moves by 3.5e-5 between a batch of one and of
two. A window decoded without its stream's state is off by the signal's size (> 1e-2).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from omniflow.backends.vocoders import Vocoder
from omniflow.compiler import compile_file
from omniflow.runtime.loop import StageRunner
from omniflow.runtime.readback import IN_FLIGHT, HostCopy
from omniflow.runtime.stage import StageSpec

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "qwen3_tts.omni"
TOLERANCE = 1e-4
# Two requests of different lengths; the second starts three frames after the first.
LENGTHS, DELAYS = (23, 17), (0, 3)


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


def code2wav(plan, schedule: list[int], device="cpu", slots=None, **settings) -> Vocoder:
    """The graph's code2wav stage on `device`, its edge's chunks (so its windows)
    `schedule`, `slots` streams at once (default: the graph's max_batch), `settings`
    (decode: "eager", "static" or "graphs") over the graph's."""
    stage = plan.stage("code2wav")
    stage = dataclasses.replace(
        stage, settings={**stage.settings, **settings}, batch=slots or stage.batch
    )
    spec = StageSpec.from_channels(stage, plan.channels)
    return Vocoder(dataclasses.replace(spec, schedules={"codes": schedule}), device)


def request_codes() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n, 16), generator=gen) for n in LENGTHS]


def whole(vocoder: Vocoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        model = vocoder.decoder.model
        return model(codes.T[None].to(model.pre_conv.conv.weight.device)).reshape(-1).cpu()


class Driver:
    """The requests through a `StageRunner` (what an executor runs per stage): round by
    round, each live request gets its next frame, then the runner steps. Records every
    decoder forward as its windows' (request, start, end), and each request's slot."""

    def __init__(self, vocoder: Vocoder, codes: list[torch.Tensor], delays=DELAYS):
        self.runner = StageRunner(vocoder.spec, vocoder, 4)
        self.vocoder, self.codes, self.delays = vocoder, list(codes), list(delays)
        self.sent = [0] * len(codes)
        self.audio: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(codes))}
        self.forwards: list[list[tuple[str, int, int]]] = []
        self.slots: dict[str, int] = {}
        self.shapes: list[tuple[int, int]] = []  # each forward's (windows, frames)
        self.round = 0
        for request_id in self.audio:
            self.runner.start(request_id, {})
        step = vocoder.decoder.step

        def logged(slots, positions, windows, frames):
            names = {id(c.state.get("stream")): r for r, c in self.runner.calls.items()}
            self.forwards.append([(names[id(w.stream)], w.start, w.end) for w in windows])
            self.shapes.append((len(windows), frames))
            for w, slot in zip(windows, slots, strict=True):
                assert self.slots.setdefault(names[id(w.stream)], slot) == slot
            return step(slots, positions, windows, frames)

        vocoder.decoder.step = logged

    def add(self, codes: torch.Tensor) -> str:
        """Start one more request now; its id."""
        request_id = f"r{len(self.codes)}"
        self.codes.append(codes)
        self.delays.append(self.round)
        self.sent.append(0)
        self.audio[request_id] = []
        self.runner.start(request_id, {})
        return request_id

    def round_(self) -> None:
        for i, codes in enumerate(self.codes):
            request_id = f"r{i}"
            if self.round < self.delays[i] or self.sent[i] == len(codes):
                continue
            if request_id in self.runner.calls:
                frame = codes[self.sent[i] : self.sent[i] + 1]
                self.sent[i] += 1
                self.runner.feed(request_id, "codes", frame, self.sent[i] == len(codes))
        for event in self.runner.step():
            assert event.error is None, event.error
            if event.port == "audio":
                self.audio[event.request_id].append(event.value.reshape(-1))
        self.round += 1

    def run(self) -> dict[str, torch.Tensor]:
        # Until every stream ends, under a time limit, not a count of rounds: while a GPU
        # still runs a step's windows, rounds step nothing, and a busy GPU takes many.
        deadline = time.monotonic() + 120
        while self.runner.calls:
            assert time.monotonic() < deadline, f"streams unfinished: {list(self.runner.calls)}"
            self.round_()
        del self.vocoder.decoder.step
        return {r: torch.cat(parts) for r, parts in self.audio.items() if parts}


def kept_windows(forwards, request_id: str) -> list[int]:
    return [end - start for forward in forwards for r, start, end in forward if r == request_id]


CONTEXT = 11  # a voice clone's reference frames, ahead of its stream's


def clone_codes() -> tuple[torch.Tensor, torch.Tensor]:
    """A voice clone's frames, CONTEXT of its reference's then 20 new ones: as they are,
    and as its talker sends them (the reference's marked: every code offset by the codebook
    size, the last frame's by twice that)."""
    codes = torch.randint(0, 128, (CONTEXT + 20, 16), generator=torch.Generator().manual_seed(1))
    marked = codes.clone()
    marked[:CONTEXT] += 128
    marked[CONTEXT - 1] += 128
    return codes, marked


def stream_a_clone(vocoder: Vocoder) -> tuple[torch.Tensor, torch.Tensor, Driver]:
    """A clone streamed frame by frame beside another request: its audio, what its whole
    decode gives after its reference's share, and the driver (its forwards)."""
    codes, marked = clone_codes()
    driver = Driver(vocoder, [request_codes()[0], marked])
    audio = driver.run()["r1"]
    return audio, whole(vocoder, codes)[CONTEXT * 1920 :], driver


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_clones_reference_frames_are_decoded_in_one_window_once_all_came(plan, decode):
    # Its reference frames come one by one, as a slow edge would bring them: they are
    # decoded once the last (marked last) is in, in one window, whatever their arrival
    # (the same bits), and emit nothing; the grid of its windows starts after them.
    vocoder = code2wav(plan, [1, 2, 4], decode=decode)
    audio, want, driver = stream_a_clone(vocoder)
    assert audio.shape == want.shape
    assert float((audio - want).abs().max()) < TOLERANCE
    windows = [
        (start, end) for forward in driver.forwards for r, start, end in forward if r == "r1"
    ]
    assert windows[:4] == [(0, CONTEXT), (11, 12), (12, 14), (14, 18)]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("schedule", [[1], [3], [1, 2, 4, 3, 5]], ids=["1", "3", "mixed"])
def test_carried_state_streams_the_whole_decode(plan, schedule, decode):
    vocoder = code2wav(plan, schedule, decode=decode)
    assert vocoder.stateful and vocoder.context == 0 and vocoder.decode_mode == decode
    codes = request_codes()
    driver = Driver(vocoder, codes)
    audio = driver.run()
    for i, c in enumerate(codes):
        got, want = audio[f"r{i}"], whole(vocoder, c)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < TOLERANCE
        # Each frame decoded once, in windows on the schedule's grid.
        windows = kept_windows(driver.forwards, f"r{i}")
        assert sum(windows) == len(c)
        grid = [*schedule, *[schedule[-1]] * len(c)]
        assert windows[:-1] == grid[: len(windows) - 1] and windows[-1] <= grid[len(windows) - 1]
    shared = [f for f in driver.forwards if len(f) == 2]
    assert shared, "the two requests never shared a forward"
    if schedule == [1, 2, 4, 3, 5]:  # windows of different lengths, padded on the right
        assert any(f[0][2] - f[0][1] != f[1][2] - f[1][1] for f in shared)
    decoder = vocoder.decoder
    if decode == "static":  # every forward ran on a static window's buffers
        lengths = {"1": [1], "3": [1, 2, 3], "mixed": [1, 2, 4, 5]}
        assert (
            decoder.window_lengths == lengths[str(schedule[0]) if len(schedule) == 1 else "mixed"]
        )
        assert all((decoder.batch_bucket(n), f) in decoder.graphs for n, f in driver.shapes)
        if len(schedule) > 1:  # a lone window of 3 padded to 4, its state taken at frame 3
            assert any(
                n == 1 and f > w[0][2] - w[0][1]
                for w, (n, f) in zip(driver.forwards, driver.shapes, strict=True)
            )


def land_late(driver: Driver, rounds: int) -> None:
    """Each forward's audio lands on the host `rounds` rounds after it was decoded (as on a
    busy GPU), not at once as off CUDA."""
    copy = driver.vocoder.host_copies.copy

    @dataclasses.dataclass
    class Held(HostCopy):
        due: int = 0

        def landed(self) -> bool:
            return driver.round >= self.due

    driver.vocoder.host_copies.copy = lambda audio: Held(
        copy(audio).value, due=driver.round + rounds
    )


def test_audio_still_on_its_way_to_the_host_is_polled_for_not_waited_for(plan):
    """A forward's audio is read back without waiting for the device: held back here for
    three rounds (as a busy GPU would), the stage decodes the next forward meanwhile (at
    most IN_FLIGHT on their way), then decodes nothing more and emits nothing until the
    oldest lands, while the runner keeps polling it; every request's audio still comes out
    whole and in order."""
    vocoder = code2wav(plan, [1, 2, 4])
    codes = request_codes()
    driver = Driver(vocoder, codes)
    land_late(driver, 3)
    full, polled = 0, 0
    while driver.runner.calls and driver.round < 1000:
        before = len(driver.forwards)
        driver.round_()
        if len(vocoder.reading) == IN_FLIGHT:
            full += 1
            # Full: no forward until the oldest lands, and the loop is told to come back.
            assert driver.runner.maybe_ready
            polled += len(driver.forwards) == before
    del vocoder.decoder.step
    assert full and polled
    for i, c in enumerate(codes):
        got, want = torch.cat(driver.audio[f"r{i}"]), whole(vocoder, c)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < TOLERANCE
        assert sum(kept_windows(driver.forwards, f"r{i}")) == len(c)  # each frame once
    assert not vocoder.reading and not vocoder.in_flight()
    # Requests cancelled while their audio is on its way keep no loop polling.
    driver = Driver(vocoder, codes)
    while not vocoder.reading:
        driver.round_()
    for request_id in list(driver.runner.calls):
        driver.runner.drop(request_id)
    assert driver.runner.step() == [] and not driver.runner.maybe_ready
    assert vocoder.reading and not vocoder.in_flight()
    del vocoder.decoder.step


def test_a_paced_stream_whose_listener_runs_dry_decodes_what_it_has(plan):
    """On a paced edge (a GPU plan's; slack.py) a stream whose listener has run dry does
    not wait for the rest of its grid window: frames arriving every 50 ms, slower than the
    80 ms each plays only after the first window, leave the listener dry, and each window
    holds what has arrived, shorter than the grid's 8; the audio is still the whole
    decode. (A slower machine only makes the listener drier.)"""
    vocoder = code2wav(plan, [1, 8])
    vocoder.spec = dataclasses.replace(vocoder.spec, paced={"codes": 0.08})
    codes = request_codes()[:1]
    driver = Driver(vocoder, codes, delays=[0])
    while driver.runner.calls and driver.round < 1000:
        driver.round_()
        time.sleep(0.05)
    del vocoder.decoder.step
    windows = kept_windows(driver.forwards, "r0")
    assert windows[0] == 1 and sum(windows) == len(codes[0])
    assert any(w < 8 for w in windows[1:-1])  # cut short of the grid, not just at the end
    got, want = torch.cat(driver.audio["r0"]), whole(vocoder, codes[0])
    assert got.shape == want.shape and float((got - want).abs().max()) < TOLERANCE


def test_a_streams_makers_wait_for_its_first_window_alone(plan):
    """Ordered by slack on a paced edge, a stream's makers wait for its first window on the
    device (`makers_wait_for`, slack.py), not for a later one, even one longer than what its
    listener has left: the edge keeps a carried-state stream fed (a chunk goes out short
    where the listener would run dry), and the pause would hold up the other streams'
    frames."""
    frame_s = 0.08
    vocoder = code2wav(plan, [1, 8], order="slack")
    vocoder.spec = dataclasses.replace(vocoder.spec, paced={"codes": frame_s})
    driver = Driver(vocoder, request_codes()[:1], delays=[0])
    land_late(driver, 2)
    firsts, laters = 0, 0
    while driver.runner.calls and driver.round < 1000:
        driver.round_()
        now = time.monotonic()
        for decoded in vocoder.reading:
            for window in decoded.windows:
                if window.stream.first_sent is None:
                    firsts += 1
                    assert vocoder.makers_wait_for() == {"r0"}
                else:
                    audio_s = (window.keep_end - window.keep_start) * frame_s
                    laters += window.stream.runs_out(frame_s) - now < audio_s
                    assert vocoder.makers_wait_for() == set()
        time.sleep(0.05)  # a frame every 50 ms: 8-frame windows once the stream is ahead
    del vocoder.decoder.step
    assert firsts and laters


def test_a_window_without_its_state_is_far_off(plan):
    """What the carried state holds matters: the frames after the first ten, decoded from a
    fresh state, are not the whole decode's."""
    vocoder = code2wav(plan, [1])
    (codes, _) = request_codes()
    model, states = vocoder.decoder.model, vocoder.decoder.states
    index = torch.tensor([0])
    with torch.inference_mode():
        cold = model.stream(codes[10:].T[None], states, index, 0 * index, index + len(codes) - 10)
    assert float((cold.reshape(-1) - whole(vocoder, codes)[1920 * 10 :]).abs().max()) > 1e-2


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_cancelled_request_frees_its_slot_for_the_next(plan, decode):
    """A request cancelled mid-stream gives its slot back; a request that starts after it
    takes that slot (its old state unread: it decodes to its own whole decode), and the one
    still running goes on. When all have ended every slot is free."""
    vocoder = code2wav(plan, [1], decode=decode)
    free = sorted(vocoder.free_slots)
    codes = request_codes()
    driver = Driver(vocoder, codes)
    for _ in range(6):
        driver.round_()
    victim = driver.runner.calls["r0"].state["stream"]
    slot = victim.slot
    assert victim.decoded == 6 and slot == driver.slots["r0"] and slot not in vocoder.free_slots
    driver.runner.drop("r0")  # what an executor does when a request is cancelled
    assert slot in vocoder.free_slots and victim.slot is None
    late = driver.add(codes[0][:9])
    audio = driver.run()
    assert not driver.runner.calls
    assert driver.slots[late] == driver.slots["r0"], "the freed slot was not reused"
    assert sorted(vocoder.free_slots) == free
    for request_id, c in (("r1", codes[1]), (late, codes[0][:9])):
        got, want = audio[request_id], whole(vocoder, c)
        assert got.shape == want.shape and float((got - want).abs().max()) < TOLERANCE


def test_a_stream_waits_for_a_free_slot(plan):
    """With one slot, the second request's windows wait until the first has ended; both
    decode to their whole decodes."""
    vocoder = code2wav(plan, [2], slots=1, decode="static")
    codes = request_codes()
    driver = Driver(vocoder, codes)
    audio = driver.run()
    assert driver.slots == {"r0": 0, "r1": 0}
    assert all(len(forward) == 1 for forward in driver.forwards)
    first_of_r1 = next(i for i, f in enumerate(driver.forwards) if f[0][0] == "r1")
    assert all(f[0][0] == "r1" for f in driver.forwards[first_of_r1:])
    for i, c in enumerate(codes):
        got, want = audio[f"r{i}"], whole(vocoder, c)
        assert got.shape == want.shape and float((got - want).abs().max()) < TOLERANCE
