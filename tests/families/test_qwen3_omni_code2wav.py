"""Qwen3-Omni's code2wav streamed with its carried state (`omniflow.families.qwen3_omni.
code2wav`, `omniflow.backends.carried_state`): each stream's convolution tails and
sliding-window keys and values in its slot, so a window decodes only its new frames, its
audio one frame behind them (the transposed convolutions' lookahead), batched across
streams, eager or through the static windows ("static": the captured graphs' buffers,
eagerly; "graphs" on CUDA).

Two requests on graphs/qwen3_omni.omni's code2wav (tiny:qwen3-omni), fed a frame a round
by test_stateful_vocoder's driver (so their windows share forwards, padded), each give
their whole-utterance decode: transformers' `Qwen3OmniMoeCode2Wav.forward`, n x 1920 - 555
samples, then the 555 zeros the stage emits at the end of the last frame. Measured on 2
CPU cores: 2e-5 to 3e-5 max abs, whatever the windows (summation orders of other shapes);
tolerance 1e-4, test_stateful_vocoder's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omniflow.backends.vocoders import Vocoder, Window, _Stream
from omniflow.compiler import compile_file
from tests.backends.test_code2wav_graphs import check_device_work_only
from tests.backends.test_stateful_vocoder import TOLERANCE, Driver, code2wav, request_codes

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "qwen3_omni.omni"


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


def whole(vocoder: Vocoder, codes: torch.Tensor) -> torch.Tensor:
    """transformers' whole-utterance decode, and the zeros the stage ends its last frame in."""
    decoder = vocoder.decoder
    with torch.inference_mode():
        audio = decoder.model(codes.T[None].to(decoder.device)).float()
    return F.pad(audio, (0, decoder.tail)).reshape(-1).cpu()


def assert_whole(vocoder: Vocoder, audio: dict[str, torch.Tensor], codes: list[torch.Tensor]):
    for i, frames in enumerate(codes):
        want, got = whole(vocoder, frames), audio[f"r{i}"]
        assert got.shape == want.shape == (len(frames) * 1920,)
        assert float((got - want).abs().max()) < TOLERANCE


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("schedule", [[1], [2], [3], [1, 2, 4, 3, 5]], ids=str)
def test_streams_in_windows_of_any_size_give_the_whole_decode(plan, schedule, decode):
    vocoder = code2wav(plan, schedule, decode=decode)
    assert vocoder.stateful and vocoder.context == 0 and vocoder.lag == 1
    driver = Driver(vocoder, request_codes())
    audio = driver.run()
    assert_whole(vocoder, audio, request_codes())
    if decode == "static":
        decoder = vocoder.decoder
        assert decoder.window_lengths == vocoder.grid_lengths()
        assert any((decoder.batch_bucket(n), f) in decoder.graphs for n, f in driver.shapes)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_stream_that_starts_beside_others_mid_utterance_gives_its_whole_decode(plan, decode):
    vocoder = code2wav(plan, [1, 2, 4, 3, 5], decode=decode)
    codes = request_codes()
    driver = Driver(vocoder, codes, delays=(0, 2))
    audio = driver.run()
    starts = [{start for _, start, _ in forward} for forward in driver.forwards]
    assert {0, 2} in starts  # a new stream (position 0) beside one two frames in
    assert_whole(vocoder, audio, codes)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_windows_of_other_lengths_in_one_forward_give_each_stream_its_whole_decode(plan, decode):
    """The decoder's step itself: three streams, each with windows of its own sizes, all
    live streams' next windows in every forward (padded on the right to the longest, the
    batch to its bucket); a stream's last window one frame longer, its end's lag."""
    vocoder = code2wav(plan, [1, 2, 4], decode=decode)
    decoder = vocoder.decoder
    gen = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 128, (n, 16), generator=gen) for n in (23, 11, 16)]
    sizes = [[1, 3, 2], [2, 5], [4, 1, 1]]
    decoded, audio, step, mixed = [0, 0, 0], [[], [], []], 0, False
    while any(d < len(c) for d, c in zip(decoded, codes, strict=True)):
        live = [i for i, c in enumerate(codes) if decoded[i] < len(c)]
        windows, news, spans = [], [], []
        for i in live:
            n = min(sizes[i][step % len(sizes[i])], len(codes[i]) - decoded[i])
            last = decoded[i] + n == len(codes[i])
            stream = _Stream({}, 0, codes[i], slot=i)
            windows.append(Window(stream, decoded[i], decoded[i] + n, 0, 0))
            news.append(n)
            spans.append(n + last)  # the last window's audio completes its last frame
        mixed |= len(set(news)) > 1
        frames = decoder.window_frames(max(spans))
        with torch.inference_mode():
            out = decoder.step(live, [decoded[i] for i in live], windows, frames)
        for row, i in enumerate(live):
            audio[i].append(out[row, : spans[row] * 1920])
            decoded[i] += news[row]
        step += 1
    assert mixed
    for i, frames in enumerate(codes):
        got = torch.cat(audio[i])[1920:]  # the first row's first frame: before the stream
        want = whole(vocoder, frames)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < TOLERANCE


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_slot_taken_after_another_stream_ended_holds_nothing_of_it(plan, decode):
    """One slot: the second request starts after the first ended, in the same slot, and
    decodes its own whole decode (a new stream reads zeros, not what the slot held)."""
    vocoder = code2wav(plan, [2], slots=1, decode=decode)
    codes = request_codes()
    driver = Driver(vocoder, codes, delays=(0, len(codes[0]) + 4))
    audio = driver.run()
    assert driver.slots["r0"] == driver.slots["r1"]
    assert not any(len(forward) == 2 for forward in driver.forwards)
    assert_whole(vocoder, audio, codes)


def test_a_window_without_its_state_is_far_off(plan):
    """What the slot carries matters: the frames after the first ten, decoded from a fresh
    state, are not the whole decode's."""
    vocoder = code2wav(plan, [1])
    decoder, (codes, _) = vocoder.decoder, request_codes()
    index = torch.tensor([0])
    with torch.inference_mode():
        cold = decoder._stream(codes[10:].T[None], index, 0 * index, index + len(codes) - 10)
    # Its audio starts a frame behind: frame 9's, which a fresh state has not computed.
    got = cold.reshape(-1)[1920 : (len(codes) - 10) * 1920]
    want = whole(vocoder, codes)[1920 * 10 : 1920 * (len(codes) - 1)]
    assert float((got - want).abs().max()) > 1e-2


def test_in_bf16_its_rotary_frequencies_stay_float32(plan):
    """As transformers keeps them in a bf16 model (the checkpoint's dtype, what "auto" runs
    on CUDA): the pre-transformer's sliding-window attention reaches positions far into a
    stream, where bf16-rounded frequencies would turn its angles."""
    vocoder = code2wav(plan, [1], precision="bfloat16")
    model = vocoder.decoder.model
    assert model.pre_transformer.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    rotary = model.pre_transformer.rotary_emb
    want, _ = rotary.compute_default_rope_parameters(rotary.config)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, want)


def test_the_step_is_device_work_only(plan):
    check_device_work_only(code2wav(plan, [1, 2, 4], decode="static").decoder)


@pytest.mark.gpu
def test_captured_steps_equal_the_eager_step_and_the_whole_decode_in_float32(plan):
    """On CUDA (cuDNN's TF32 off, float32): the graphs captured at load, replayed, give the
    eager step's audio and the whole decode; none captured while serving."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        graphs = code2wav(plan, [1, 2, 4, 8], "cuda", decode="graphs", precision="float32")
        eager = code2wav(plan, [1, 2, 4, 8], "cuda", decode="eager", precision="float32")
        captured = graphs.decoder.graphs.captures
        assert captured == len(graphs.decoder.graphs.keys()) > 0
        fast, slow = Driver(graphs, request_codes()).run(), Driver(eager, request_codes()).run()
        assert graphs.decoder.graphs.captures == captured, "serving captured a graph"
        assert graphs.decoder.graphs.replays > 0
        for request_id in fast:
            assert float((fast[request_id] - slow[request_id]).abs().max()) < TOLERANCE
        assert_whole(graphs, fast, request_codes())
