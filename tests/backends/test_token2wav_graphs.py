"""token2wav's static windows and precisions (issue 12, part 2): windows of the edge's grid
lengths decoded through static buffers per batch bucket (replayed from CUDA graphs on a
GPU, eager on the same buffers on CPU), tail windows padded up to those lengths where
their reach allows, and the DiT in bf16.

Tolerances, and the errors measured on 2 CPU cores (tiny:qwen2.5-omni, waveforms of rms
~0.3 clamped to +-1):
- static windows vs eager: padding a window to its grid length or a batch to its bucket
  changes only the summation order of the forwards' reductions: 8.6e-6 max. Tolerance
  1e-4 (BATCH_TOLERANCE of test_vocoders.py); padding that leaked into kept samples would
  show as errors of 0.1 to 1. Where the shapes are the same it is bit-exact.
- bf16 DiT vs float32: up to 1.4e-2 max, 4.4e-3 of the signal's rms (60-code windows);
  on the real-size token2wav (`scaled_token2wav(1.0)`, a 12-code window) 1.3e-3 of the rms.
  Tolerance: 2e-2 of the signal's rms, 5e-2 max.
- a graph's replay vs the same solve run eagerly at the same shapes: the same kernels on the
  same buffers, so equal up to the kernels' own nondeterminism; tolerance 1e-5 (float32)
  and 1e-3 (bf16, one bf16 rounding of the velocity amplified through the ODE).
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omniflow.backends.cuda_graphs import Graphs
from omniflow.backends.vocoders import Vocoder, VocoderError, Window, _Stream
from omniflow.catalog.resolve import model_path
from omniflow.families.qwen2_5_omni.token2wav import DEFAULT_STEPS, Token2Wav
from tests.backends.test_vocoders import BATCH_TOLERANCE, RAMP, omni_plan, run  # noqa: F401
from tests.gpu_wiring import stage_spec

torch.set_num_threads(1)

BF16_RMS_TOLERANCE = 2e-2
BF16_MAX_TOLERANCE = 5e-2
REPLAY_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}


def vocoder(plan, device: str, **settings) -> Vocoder:
    return Vocoder(stage_spec(plan, "code2wav", **settings), device)


def forwards(backend: Vocoder, requests) -> tuple[list, list[int]]:
    """Each request's audio, and the length of every forward the decoder ran."""
    lengths, decode = [], backend.decoder.decode

    def logging_decode(windows, frames):
        lengths.append(frames)
        return decode(windows, frames)

    backend.decoder.decode = logging_decode
    try:
        return run(backend, requests), lengths
    finally:
        vars(backend.decoder).pop("decode", None)  # (run unwraps it first)


def relative_rms(audio: torch.Tensor, reference: torch.Tensor) -> float:
    return float((audio - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


def requests(first_codes: int = 50):
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, 128, (first_codes, 1), generator=g), RAMP, {"seed": 1}),
        (torch.randint(0, 128, (30, 1), generator=g), [15], {"seed": 2, "speaker": "Ethan"}),
        (torch.randint(0, 128, (9, 1), generator=g), [4], {"seed": 3, "guidance": 0.0}),
    ]


def window_batch(decoder: Token2Wav, rows: int, frames: int) -> list[Window]:
    windows = []
    for row in range(rows):
        state = decoder.open(SimpleNamespace(params={"seed": row}))
        g = torch.Generator().manual_seed(row)
        codes = torch.randint(0, 128, (frames, 1), generator=g).to(decoder.device)
        stream = _Stream(state, 0, codes, decoder.side(state, frames).to(decoder.device))
        windows.append(Window(stream, 0, frames, 0, frames))
    return windows


# --- CPU: the bookkeeping, on the same buffers a graph reads ----------------------------------


@pytest.fixture(scope="module")
def eager(omni_plan):  # noqa: F811
    return vocoder(omni_plan, "cpu")


@pytest.fixture(scope="module")
def static(omni_plan):  # noqa: F811
    return vocoder(omni_plan, "cpu", decode="static")


def test_the_defaults_on_cpu_are_float32_and_eager(eager):
    assert eager.decode_mode == "eager"
    assert (eager.decoder.precision, eager.decoder.graphs) == ("float32", None)
    # Without static windows a forward is never padded beyond its longest window.
    assert eager.decoder.window_frames(50) == 50


def test_static_windows_follow_the_edge_grid(static):
    decoder = static.decoder
    # One block kept (12 codes) with one of lookahead (the shipped graph's lookahead=12);
    # then two blocks with the one block of context there is; then four, and sixteen with two
    # of context from then on, each with its block of lookahead.
    assert static.grid_lengths() == [24, 48, 84, 228]
    # Buckets as the AR stages pad batches, up to GRAPH_BATCH (the stage's max_batch is 64).
    assert decoder.batch_buckets == [1, 2, 4, 8]
    # Windows are captured while they are launch-bound: up to 768 codes a batch.
    # A window's solve is three graphs: its begin, one RK4 step (replayed for each) and its end.
    assert sorted(decoder.graphs.keys()) == [
        (frames, batch, DEFAULT_STEPS, phase)
        for frames in (24, 48, 84, 228)
        for batch in (1, 2, 4, 8)
        if batch == 1 or batch * frames <= 768
        for phase in ("begin", "end", "step")
    ]
    assert [decoder.batch_bucket(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    assert [decoder.window_frames(n) for n in (20, 24, 25, 85, 229)] == [24, 24, 48, 228, 229]
    # Nothing is captured off CUDA: the same buffers are solved eagerly.
    assert decoder.graphs.captures == 0


def test_static_windows_decode_what_eager_decodes(eager, static):
    batch = requests()
    expected, eager_lengths = forwards(eager, batch)
    got, static_lengths = forwards(static, batch)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) < BATCH_TOLERANCE
    # The last window of the 50-code stream (38 codes, its keep ending at the stream's end)
    # is padded on the left up to a grid length: its 24 codes of context cover BigVGAN's
    # reach of 9. Only the 9-code utterance, too short to pad, runs at its own length.
    assert 38 in eager_lengths and 38 not in static_lengths
    assert set(static_lengths) <= {24, 48, 84, 228, 9}
    # One request alone at grid lengths is bit-exact: the same shapes, the same arithmetic.
    codes = batch[0][0][:24]
    (alone_static,), (alone_eager,) = (
        run(b, [(codes, [24], {"seed": 4})]) for b in (static, eager)
    )
    assert torch.equal(alone_static, alone_eager)


def test_decode_modes_and_precisions_are_checked(omni_plan):  # noqa: F811
    with pytest.raises(VocoderError, match="needs a CUDA device"):
        vocoder(omni_plan, "cpu", decode="graphs")
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), "cpu")
    with pytest.raises(VocoderError, match="not float16"):
        decoder.set_precision("float16")
    decoder.prepare([36], 1, capture=False)
    with pytest.raises(VocoderError, match="before the static windows"):
        decoder.set_precision("bfloat16")


def test_forwards_beyond_the_largest_bucket_run_in_parts_of_it():
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), "cpu")
    decoder.prepare([36], 2, capture=False)
    windows = window_batch(decoder, 3, 36)
    with torch.inference_mode():
        parts = decoder.decode(windows, 36)  # rows 0-1 at bucket 2, row 2 at bucket 1
        whole = decoder.decode_eager(windows, 36)
    assert parts.shape == whole.shape == (3, 36 * decoder.samples_per_frame)
    assert float((parts - whole).abs().max()) < BATCH_TOLERANCE


def test_a_forward_of_more_codes_than_a_graph_holds_runs_in_static_parts():
    """Windows of a static length whose batch bucket holds more than GRAPH_CODES codes (not
    captured) decode in parts of the largest batch that is, not eagerly: 5 windows of 100
    codes at buckets 4 and 1 (8 x 100 is over 768), and the audio of the eager batch."""
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), "cpu")
    decoder.prepare([100], 8, capture=False)
    assert decoder.static_batch(100) == 4 and decoder.static_batch(36) == 8
    assert (100, 8, DEFAULT_STEPS, "begin") not in decoder.graphs
    windows = window_batch(decoder, 5, 100)
    with torch.inference_mode():
        parts = decoder.decode(windows, 100)
        assert decoder.eager_windows == 0
        whole = decoder.decode_eager(windows, 100)
    assert float((parts - whole).abs().max()) < BATCH_TOLERANCE
    with torch.inference_mode():
        decoder.decode(window_batch(decoder, 2, 37), 37)  # no static window that long
    assert decoder.eager_windows == 2


class _Ops(TorchDispatchMode):
    """Records the ATen ops run within it."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# Ops a CUDA graph cannot hold: reading a value back to the host (`.item()`, `bool(t)`),
# shapes that depend on data, tensors made from host data (a host-to-device copy).
HOST_ROUND_TRIPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "repeat_interleave",
    "unique",
    "_unique2",
    "lift_fresh",
    "lift_fresh_copy",
}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_window_solve_is_device_work_only(precision):
    """What a graph captures makes no host round trip (checked op by op on the CPU; on
    CUDA each would fail the capture) where transformers' own modules make two."""
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), "cpu")
    decoder.set_precision(precision)
    windows = window_batch(decoder, 2, 36)
    with torch.inference_mode():
        inputs = decoder._inputs(windows, 36)
        with _Ops() as solve:
            decoder._solve(steps=DEFAULT_STEPS, **inputs)
        with _Ops() as modules:
            decoder.bigvgan(torch.zeros(1, decoder.mel_dim, 8))
            decoder.dit.text_embed(torch.zeros(1, 4, dtype=torch.int64))
    assert {"linear", "scaled_dot_product_attention", "conv1d"} <= solve.names
    assert not solve.names & HOST_ROUND_TRIPS
    assert modules.names & HOST_ROUND_TRIPS == {"lift_fresh", "repeat_interleave"}


def test_graphs_copy_inputs_into_leading_rows_and_count_nothing_without_capture():
    graphs = Graphs("cpu", capture=False)
    inputs = {"x": torch.zeros(4, 3)}
    graphs.add("k", lambda x: x * 2, inputs)
    out = graphs.run("k", {"x": torch.ones(2, 3)})
    assert out.tolist() == [[2.0] * 3] * 2 + [[0.0] * 3] * 2
    assert (graphs.captures, graphs.replays) == (0, 0)
    with pytest.raises(ValueError, match="already registered"):
        graphs.add("k", lambda x: x, inputs)
    with pytest.raises(ValueError, match="CUDA device"):
        Graphs("cpu", capture=True)


def test_bf16_dit_is_within_its_tolerance_of_float32(omni_plan, eager):  # noqa: F811
    bf16 = vocoder(omni_plan, "cpu", precision="bfloat16")
    assert bf16.decoder.dit.proj_out.weight.dtype == torch.bfloat16
    # its rotary frequencies float32, as transformers keeps them in a bf16 model
    assert bf16.decoder.dit.rotary_embed.inv_freq.dtype == torch.float32
    batch = requests()[:2]
    for a, b in zip(run(bf16, batch), run(eager, batch), strict=True):
        assert 0 < relative_rms(a, b) < BF16_RMS_TOLERANCE
        assert float((a - b).abs().max()) < BF16_MAX_TOLERANCE


# --- static windows against the eager solve: replayed from graphs on a GPU ----------------------

STATIC_WINDOWS = [(1, 60), (4, 36), (4, 60), (1, 36)]  # (rows, frames) of each decode


def static_against_eager(device: str, precision: str) -> Token2Wav:
    """Token2wav on `device` with static windows of 36 and 60 codes for batches up to 4
    (captured as graphs on CUDA): each of STATIC_WINDOWS decoded through them is the same
    solve run eagerly, within REPLAY_TOLERANCE. Returns the decoder."""
    decoder = Token2Wav(str(model_path("tiny:qwen2.5-omni")), device)
    decoder.set_precision(precision)
    decoder.prepare([36, 60], 4, capture=device != "cpu")
    assert len(decoder.graphs.keys()) == 3 * 6  # buckets 1, 2, 4; begin, step, end
    for rows, frames in STATIC_WINDOWS:
        windows = window_batch(decoder, rows, frames)
        with torch.inference_mode():
            static = decoder.decode(windows, frames)
            solved = decoder.decode_eager(windows, frames)
        error = float((static - solved).abs().max())
        print(f"{precision} rows {rows} frames {frames}: static vs eager {error:.1e}")
        assert error <= REPLAY_TOLERANCE[precision]
    return decoder


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_static_windows_equal_the_eager_solve_on_the_cpu(precision):
    decoder = static_against_eager("cpu", precision)
    assert (decoder.graphs.captures, decoder.graphs.replays) == (0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_graph_replay_equals_the_eager_solve_and_never_recaptures(precision):
    decoder = static_against_eager("cuda", precision)
    # A decode replays its begin, its step DEFAULT_STEPS - 1 times, and its end.
    replays = len(STATIC_WINDOWS) * (DEFAULT_STEPS + 1)
    assert (decoder.graphs.captures, decoder.graphs.replays) == (3 * 6, replays)


# The stage on CUDA is built as the CPU fixtures build theirs (`vocoder(omni_plan, ...)`).
@pytest.mark.gpu
def test_cuda_stage_defaults_to_bf16_graphs_within_tolerance_of_float32(omni_plan):  # noqa: F811
    fast = vocoder(omni_plan, "cuda")
    assert (fast.decode_mode, fast.decoder.precision) == ("graphs", "bfloat16")
    captured = fast.decoder.graphs.captures
    assert captured == 3 * 14  # 24, 48 and 84 codes at batches 1, 2, 4, 8; 228 at 1 and 2
    exact = vocoder(omni_plan, "cuda", decode="eager", precision="float32")
    batch = requests()
    for a, b in zip(run(fast, batch), run(exact, batch), strict=True):
        rms, peak = relative_rms(a, b), float((a - b).abs().max())
        print(f"bf16 graphs vs float32 eager: rms {rms:.1e}, max {peak:.1e}")
        assert rms < BF16_RMS_TOLERANCE and peak < BF16_MAX_TOLERANCE
    # Windows replayed; none captured after load.
    assert fast.decoder.graphs.captures == captured and fast.decoder.graphs.replays > 0
