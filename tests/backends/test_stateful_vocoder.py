"""The vocoder backend's carried-state streaming (`Decoder.stateful`), on Qwen3-TTS's code2wav
(tiny CustomVoice checkpoint): driven through the runtime's own stage runner, frames arriving
one per round as a talker makes them, windows of 1 frame, of 3 and of a mixed schedule, two
requests interleaved and decoded in shared forwards, each request's audio is its
whole-utterance decode; each frame is decoded once; a cancelled request's state is freed.

Tolerance: 1e-4 (max abs, waveforms of std ~0.3 clamped to +-1). Measured on 2 CPU cores:
up to 5e-5, the rounding of other window lengths' conv and attention summation orders
through ~30 layers; the whole decode itself moves by 3.5e-5 between a batch of one and of
two. A window decoded without its stream's state is off by the signal's size (> 1e-2).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path

import pytest
import torch

from omniflow.backends.vocoders import Vocoder
from omniflow.compiler import compile_file
from omniflow.runtime.loop import StageRunner
from omniflow.runtime.stage import StageSpec

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "qwen3_tts.omni"
TOLERANCE = 1e-4
# Two requests of different lengths; the second starts three frames after the first.
LENGTHS, DELAYS = (23, 17), (0, 3)


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


def code2wav(plan, schedule: list[int]) -> Vocoder:
    """The graph's code2wav stage, its edge's chunks (so its windows) `schedule`."""
    spec = StageSpec.from_channels(plan.stage("code2wav"), plan.channels)
    return Vocoder(dataclasses.replace(spec, schedules={"codes": schedule}), "cpu")


def request_codes() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n, 16), generator=gen) for n in LENGTHS]


def whole(vocoder: Vocoder, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return vocoder.decoder.model(codes.T[None]).reshape(-1)


class Driver:
    """The requests through a `StageRunner` (what an executor runs per stage): round by
    round, each live request gets its next frame, then the runner steps. Records every
    decoder forward as its windows' (request, start, end)."""

    def __init__(self, vocoder: Vocoder, codes: list[torch.Tensor], delays=DELAYS):
        self.runner = StageRunner(vocoder.spec, vocoder, 4)
        self.vocoder, self.codes, self.delays = vocoder, codes, delays
        self.sent = [0] * len(codes)
        self.audio: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(codes))}
        self.forwards: list[list[tuple[str, int, int]]] = []
        self.round = 0
        for request_id in self.audio:
            self.runner.start(request_id, {})
        step = vocoder.decoder.step

        def logged(states, windows, frames):
            names = {id(c.state.get("stream")): r for r, c in self.runner.calls.items()}
            self.forwards.append([(names[id(w.stream)], w.start, w.end) for w in windows])
            return step(states, windows, frames)

        vocoder.decoder.step = logged

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
        while self.runner.calls and self.round < 1000:
            self.round_()
        del self.vocoder.decoder.step
        return {r: torch.cat(parts) for r, parts in self.audio.items() if parts}


def kept_windows(forwards, request_id: str) -> list[int]:
    return [end - start for forward in forwards for r, start, end in forward if r == request_id]


@pytest.mark.parametrize("schedule", [[1], [3], [1, 2, 4, 3, 5]], ids=["1", "3", "mixed"])
def test_carried_state_streams_the_whole_decode(plan, schedule):
    vocoder = code2wav(plan, schedule)
    assert vocoder.stateful and vocoder.context == 0
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


def test_a_window_without_its_state_is_far_off(plan):
    """What the carried state holds matters: the frames after the first ten, decoded from a
    fresh state, are not the whole decode's."""
    vocoder = code2wav(plan, [1])
    (codes, _) = request_codes()
    model = vocoder.decoder.model
    with torch.inference_mode():
        cold, _ = model.stream(codes[10:].T[None], [model.fresh()], [len(codes) - 10])
    assert float((cold.reshape(-1) - whole(vocoder, codes)[1920 * 10 :]).abs().max()) > 1e-2


def test_a_cancelled_request_frees_its_state_and_the_other_goes_on(plan):
    vocoder = code2wav(plan, [1])
    codes = request_codes()
    driver = Driver(vocoder, codes)
    for _ in range(6):
        driver.round_()
    victim = driver.runner.calls["r0"].state["stream"]
    carried = weakref.ref(victim.carried)
    assert victim.decoded == 6
    del victim
    driver.runner.drop("r0")  # what an executor does when a request is cancelled
    gc.collect()
    assert carried() is None, "the cancelled request's state is still held"
    survivor = driver.runner.calls["r1"].state["stream"]
    kept = weakref.ref(survivor.carried)
    del survivor
    audio = driver.run()
    assert not driver.runner.calls
    gc.collect()
    assert kept() is None, "a finished request's state is still held"
    got, want = audio["r1"], whole(vocoder, codes[1])
    assert got.shape == want.shape and float((got - want).abs().max()) < TOLERANCE
