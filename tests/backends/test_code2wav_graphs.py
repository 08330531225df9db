"""code2wav's step captured as CUDA graphs (issue 37): each stream's state in its fixed
slot, every forward padded to a static window (batch bucket x window length, captured when
the stage loads) and replayed; the same buffers run eagerly on the CPU ("static").

Two requests interleaved on the ramp schedule 1, 2, 4, 8 (so windows of several lengths
share padded forwards, test_stateful_vocoder's driver) decode through the static windows
and eagerly at each forward's own shape, and each request's audio is compared with its
whole-utterance decode. The step's graphs are captured at load and none after: serving
only replays them.

Tolerances:
- float32 (the CPU, and CUDA with cuDNN's TF32 off): 1e-4 max abs, test_stateful_vocoder's
  (summation orders of other shapes through ~30 layers; measured up to 5e-5 on the CPU).
- CUDA as served: cuDNN runs float32 convolutions in TF32 by default (10-bit mantissas), so
  shapes that differ (a window against the whole utterance) round differently: the bf16
  audio tolerance of the GPU tests (test_token2wav_graphs: 2e-2 of the signal's rms, 5e-2
  max); a state carried wrongly is off by the signal's size.
"""

from __future__ import annotations

import pytest
import torch

from omniflow.backends.vocoders import Vocoder
from tests.backends.test_stateful_vocoder import (
    TOLERANCE,
    Driver,
    code2wav,
    plan,  # noqa: F401
    request_codes,
    stream_a_clone,
    whole,
)
from tests.backends.test_token2wav_graphs import (
    BF16_MAX_TOLERANCE,
    BF16_RMS_TOLERANCE,
    HOST_ROUND_TRIPS,
    _Ops,
    relative_rms,
)

torch.set_num_threads(1)

SCHEDULE = [1, 2, 4, 8]


def streamed(plan, device: str, decode: str) -> tuple[Vocoder, dict[str, torch.Tensor], int]:  # noqa: F811
    """The two requests streamed through code2wav on `device` in `decode` mode: the stage,
    each request's audio, and the graphs captured when it loaded."""
    vocoder = code2wav(plan, SCHEDULE, device, decode=decode)
    graphs = vocoder.decoder.graphs
    captured = graphs.captures if graphs is not None else 0
    return vocoder, Driver(vocoder, request_codes()).run(), captured


def static_against_eager(plan, device: str) -> tuple[Vocoder, dict, dict]:  # noqa: F811
    """Static windows (graphs on CUDA) and eager streams of the same requests, checked:
    the static windows made at load, every one captured on CUDA and none after."""
    static = "graphs" if device == "cuda" else "static"
    fast, fast_audio, captured = streamed(plan, device, static)
    _, eager_audio, _ = streamed(plan, device, "eager")
    graphs = fast.decoder.graphs
    assert fast.decode_mode == static and fast.decoder.window_lengths == SCHEDULE
    assert captured == (len(graphs.keys()) if device == "cuda" else 0)
    assert graphs.captures == captured, "serving captured a graph"
    # What its load line reports (`captured N CUDA graphs in S s`): nothing on the CPU.
    assert fast.captures == captured and (fast.capture_seconds > 0) == (device == "cuda")
    assert graphs.replays > 0 if device == "cuda" else graphs.replays == 0
    return fast, fast_audio, eager_audio


def test_static_windows_stream_the_whole_decode_on_the_cpu(plan):  # noqa: F811
    vocoder, static_audio, eager_audio = static_against_eager(plan, "cpu")
    for i, codes in enumerate(request_codes()):
        want = whole(vocoder, codes)
        for audio in (static_audio[f"r{i}"], eager_audio[f"r{i}"]):
            assert audio.shape == want.shape
            assert float((audio - want).abs().max()) < TOLERANCE


def check_device_work_only(decoder) -> None:
    """What a graph of a stateful decoder captures, a static window's forward over the slots
    at its largest bucket, makes no host round trip (checked op by op on the CPU; on CUDA
    each would fail the capture)."""
    batch, frames = decoder.batch_buckets[-1], decoder.window_lengths[-1]
    inputs = decoder.graphs.inputs((batch, frames))
    ops = _Ops()
    with torch.inference_mode(), ops:
        decoder._stream(**inputs)
    assert "index_copy_" in ops.names and "index_select" in ops.names  # the slots, by index
    assert not ops.names & HOST_ROUND_TRIPS, ops.names & HOST_ROUND_TRIPS


def test_the_step_is_device_work_only(plan):  # noqa: F811
    check_device_work_only(code2wav(plan, SCHEDULE, decode="static").decoder)


@pytest.mark.gpu
def test_replayed_steps_equal_the_eager_step_and_the_whole_decode_in_float32(plan):  # noqa: F811
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        vocoder, graphs_audio, eager_audio = static_against_eager(plan, "cuda")
        for i, codes in enumerate(request_codes()):
            want, got, eager = whole(vocoder, codes), graphs_audio[f"r{i}"], eager_audio[f"r{i}"]
            assert got.shape == want.shape == eager.shape
            assert float((got - eager).abs().max()) < TOLERANCE
            assert float((got - want).abs().max()) < TOLERANCE


@pytest.mark.gpu
def test_replayed_steps_as_served_within_tf32_tolerance_of_the_whole_decode(plan):  # noqa: F811
    vocoder, graphs_audio, _ = static_against_eager(plan, "cuda")
    for i, codes in enumerate(request_codes()):
        want, got = whole(vocoder, codes), graphs_audio[f"r{i}"]
        assert got.shape == want.shape
        assert relative_rms(got, want) < BF16_RMS_TOLERANCE
        assert float((got - want).abs().max()) < BF16_MAX_TOLERANCE


@pytest.mark.gpu
def test_a_clones_reference_frames_decode_beside_the_replayed_windows(plan):  # noqa: F811
    """A voice clone's reference frames decode in one window of their own (11 frames,
    longer than every static window: eagerly, and nothing captured while serving), then its
    frames in replayed windows: its audio within the served tolerance of the whole decode's
    after the reference's share."""
    vocoder = code2wav(plan, SCHEDULE, "cuda", decode="graphs")
    captured = vocoder.decoder.graphs.captures
    audio, want, _ = stream_a_clone(vocoder)
    assert vocoder.decoder.graphs.captures == captured, "serving captured a graph"
    assert audio.shape == want.shape
    assert relative_rms(audio, want) < BF16_RMS_TOLERANCE
    assert float((audio - want).abs().max()) < BF16_MAX_TOLERANCE
