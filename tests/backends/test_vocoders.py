"""The vocoder backend on the tiny checkpoints' real decoders (DAC, Qwen2.5-Omni token2wav)
and on tiny random Mimi and EnCodec codecs: streamed decoding with left context and
lookahead gives the whole-utterance decode, batched forwards give what requests give one
by one, bad requests fail alone, and the runtime's TTS audio is `reference_tts`'s.

Tolerances, and the errors measured on 2 CPU cores (max |streamed - whole|, waveforms of
std ~0.3 clamped to +-1):
- DAC, 9 frames of lookahead and 25 of context (its reach is 9 each way): 1.4e-5. The
  arithmetic is the same; windows of other lengths take other conv kernels' summation
  orders through ~30 layers of unit-scale activations. Tolerance 1e-4 (Mimi too).
- token2wav, two DiT blocks (24 codes) of context and lookahead: 6.8e-5 against
  `Qwen2_5OmniForConditionalGeneration.generate`'s waveform (its own DiT pass order alone
  gives 9e-6). The DiT is not local (each of its 36 passes looks one block each way), so
  this is truncation, not rounding. Tolerance 5e-4. One block of lookahead (Qwen's own
  streaming setting) is measured too: 9.3e-3.
- batched vs one by one: up to 1.5e-5 (DAC), the same rounding; padding that leaked into
  kept samples would show as errors of 0.1 to 1 (see the decode without lookahead).
  Tolerance 1e-4.
"""

import asyncio
import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch

from omniflow import families
from omniflow.backends.receptive_field import Field
from omniflow.backends.vocoders import Vocoder, VocoderError, field_reach
from omniflow.catalog import load_component_config
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_file, compile_source
from omniflow.families.codec_tts.checkpoints import reference_tts
from omniflow.families.qwen2_5_omni.checkpoints import reference_omni_generate
from omniflow.families.qwen2_5_omni.token2wav import bigvgan_field
from omniflow.plan import StagePlan
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.stage import Call, InputStream, PortSpec, StageSpec
from tests.gpu_wiring import stage_spec
from tests.runtime.test_readback import land_late

torch.set_num_threads(1)

GRAPHS = Path(__file__).parents[2] / "graphs"
DAC_TOLERANCE = 1e-4
TOKEN2WAV_TOLERANCE = 5e-4
BATCH_TOLERANCE = 1e-4
# The compiler's ramp for these edges (graphs/tts.omni, graphs/omni_chat.omni).
RAMP = [2, 4, 8, 16, 32, 64]
TTS_TEXTS = ["Good morning, how are you today?", "Hi."]
TTS_PROGRAM = """
pipeline tts_codes {
  model "tiny:tts"
  stage codec_lm = python(fn=tests.backends.test_vocoders.codes_from_text, inputs="text:text",
                          outputs="codes:codes")
  stage decoder  = vocoder(component="code2wav", max_batch=8)
  input text: text -> codec_lm
  codec_lm.codes -> decoder [stream, chunk=auto, context=25]
  decoder.audio -> output audio [stream, rate=24000]
}
"""


@functools.cache
def tts_reference(text: str):
    return reference_tts(build_tiny("tts"), text, max_new_tokens=60)


def codes_from_text(call):
    """Stands where the codec LM stage goes: emits, one frame a step, the codes that
    `reference_tts` generated for a text, passed in as the request's text (space-separated
    numbers), so that the executor running it needs no model."""
    text = yield from call.read_all("text")
    for code in text.split():
        call.emit("codes", torch.tensor([[int(code)]]))
        yield


def codec_spec(model: str, samples_per_frame: int) -> StageSpec:
    """A vocoder stage of the codec at `model`, its family code as lowering finds it, on a
    streamed edge of the compiler's ramp (so its windows lie on that grid)."""
    architectures = load_component_config(model, "code2wav").architectures
    plan = StagePlan(
        "decoder",
        "vocoder",
        "x",
        ["cpu"],
        {},
        model,
        "code2wav",
        0,
        0,
        settings={"decode": "auto", "precision": "auto", "order": "slack"},
        family=families.stage_code(architectures, "vocoder"),
    )
    audio = PortSpec("audio", "float32", (samples_per_frame,))
    return StageSpec(plan, {"codes": "codes"}, {"audio": audio}, {"codes": 25}, {"codes": RAMP})


def run(backend, requests, log=None):
    """Step `requests` [(codes [n, Q], schedule, params)] through `backend` together: each
    round every request receives its next chunk, then one step takes every ready request.
    Returns each request's audio [frames, samples] (or its error). `log` receives, for each
    step, its decoder forwards, each as the (start, end, keep_start, keep_end) of its windows.
    """
    calls = [
        Call(f"r{i}", params, {"codes": InputStream("codes")})
        for i, (_, _, params) in enumerate(requests)
    ]
    sent, out, step_log = [0] * len(calls), [[] for _ in calls], []
    decode = backend.decoder.decode

    def logging_decode(windows, frames):
        step_log.append([(w.start, w.end, w.keep_start, w.keep_end) for w in windows])
        return decode(windows, frames)

    backend.decoder.decode = logging_decode
    try:
        for round_ in range(10_000):
            live = [i for i, c in enumerate(calls) if not c.finished and c.error is None]
            if not live:
                break
            for i in live:
                codes, schedule, _ = requests[i]
                stream = calls[i].inputs["codes"]
                if not stream.ended:
                    n = schedule[min(round_, len(schedule) - 1)]
                    chunk = codes[sent[i] : sent[i] + n]
                    sent[i] += n
                    stream.push(chunk if len(chunk) else None, sent[i] >= len(codes))
            step_log.clear()
            backend.step([calls[i] for i in live if backend.ready(calls[i])])
            if log is not None:
                log.append(list(step_log))
            for i in live:
                out[i] += [value for port, value in calls[i].emitted if port == "audio"]
                calls[i].emitted.clear()
    finally:
        del backend.decoder.decode
    per_frame = backend.decoder.samples_per_frame
    return [
        call.error if call.error else (torch.cat(o) if o else torch.zeros(0, per_frame))
        for call, o in zip(calls, out, strict=True)
    ]


def windows(log) -> list:
    return sorted(w for step in log for forward in step for w in forward)


def max_error(audio: torch.Tensor, whole: torch.Tensor) -> float:
    assert audio.dtype == torch.float32 and audio.shape[0] * audio.shape[1] == whole.numel()
    return float((audio.reshape(-1) - whole.reshape(-1)).abs().max())


# --- DAC (tiny:tts code2wav) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tts_plan():
    return compile_file(GRAPHS / "tts.omni", devices="cpu", tiny=True)


@pytest.fixture(scope="module")
def dac(tts_plan):
    return Vocoder(stage_spec(tts_plan, "decoder"), "cpu")


def test_dac_reach_and_shape_come_from_the_model(dac):
    # DAC's decoder, walked: conv1 (kernel 7) reaches 3 frames each way; each block's
    # transposed conv (kernel 2s, stride s = 10, 8, 6, 4, padding ceil(s/2)) upsamples it and
    # its residual units (kernel 7, dilations 1, 3, 9) add 39 positions each way; conv2 3 more.
    # Frame 0 reaches samples -15452..17371, 1920 per frame: 9 frames either way (8.05, 9.05).
    assert (dac.decoder.samples_per_frame, dac.decoder.num_codebooks) == (1920, 1)
    assert (dac.decoder.reach.context, dac.decoder.reach.lookahead) == (9, 9)
    assert (dac.context, dac.decoder.lookahead) == (25, 9)


@pytest.mark.parametrize("schedule", [RAMP, [1], [25]])
def test_dac_stream_equals_the_whole_decode(dac, schedule):
    ref = tts_reference(TTS_TEXTS[0])
    codes = ref.codes[:, None]
    log = []
    (audio,) = run(dac, [(codes, schedule, {})], log)
    assert max_error(audio, ref.waveform) < DAC_TOLERANCE
    # Windows keep the frames of the edge's planned chunks, whatever chunks arrive: audio
    # starts once the first planned chunk and its lookahead have arrived, and no later.
    first_step = next(i for i, step in enumerate(log) if step)
    arrived = sum(schedule[min(i, len(schedule) - 1)] for i in range(first_step + 1))
    needed = dac.grid_end(0) + dac.decoder.lookahead
    assert arrived >= needed
    assert sum(schedule[min(i, len(schedule) - 1)] for i in range(first_step)) < needed
    assert [keep for step in log for forward in step for *_, keep in forward][:2] == [
        dac.grid_end(0),
        dac.grid_end(dac.grid_end(0)),
    ]


def test_dac_without_lookahead_is_not_its_whole_decode(dac):
    """What the lookahead buys: DAC decoded causally is far off near every chunk's end."""
    ref = tts_reference(TTS_TEXTS[0])
    (audio,) = run(dac, [(ref.codes[:, None], RAMP, {"lookahead": 0})])
    assert max_error(audio, ref.waveform) > 0.1


def test_dac_batches_requests_of_different_lengths_in_one_forward(dac):
    g = torch.Generator().manual_seed(1)
    requests = [
        (torch.randint(0, 128, (70, 1), generator=g), RAMP, {}),
        (torch.randint(0, 128, (23, 1), generator=g), [5, 3], {}),
        (torch.randint(0, 128, (41, 1), generator=g), [1, 9, 2], {}),
    ]
    log = []
    together = run(dac, requests, log)
    alone = [run(dac, [r])[0] for r in requests]
    for a, b in zip(together, alone, strict=True):
        assert float((a - b).abs().max()) < BATCH_TOLERANCE
    # Windows of several requests and lengths share forwards (a request's own windows go to
    # forwards of their own: they decode at their own lengths, timing-independent).
    assert any(len({end - start for start, end, _, _ in forward}) > 1 for s in log for forward in s)


def test_dac_whole_short_utterances_of_other_lengths_take_their_own_forward(dac, monkeypatch):
    """A window that is a whole utterance cannot be padded on either side without changing
    its kept samples; it shares a forward only with windows of its own length. (Codes on a
    whole-output edge: one window per utterance.)"""
    monkeypatch.setattr(dac, "grid_end", None)
    g = torch.Generator().manual_seed(2)
    requests = [(torch.randint(0, 128, (n, 1), generator=g), [n], {}) for n in (6, 11, 11)]
    log = []
    together = run(dac, requests, log)
    # One forward a step: the first request's alone (the others are longer), then theirs.
    assert [[len(forward) for forward in step] for step in log] == [[1], [2]]
    for (codes, _, _), audio in zip(requests, together, strict=True):
        with torch.no_grad():
            whole = dac.decoder.model.decode(audio_codes=codes.T[None]).audio_values
        assert max_error(audio, whole) < BATCH_TOLERANCE


def ordered(tts_plan, order: str) -> Vocoder:
    spec = stage_spec(tts_plan, "decoder")
    plan = dataclasses.replace(spec.plan, settings={**spec.plan.settings, "order": order})
    return Vocoder(dataclasses.replace(spec, plan=plan), "cpu")


@pytest.mark.parametrize("order", ["slack", "arrival"])
def test_the_request_about_to_run_dry_goes_first(tts_plan, order, monkeypatch):
    """r0 has been sent 60 frames (4.8 s) of audio when r1 arrives, waiting for its first
    packet. By slack r1's window leads the next step, alone: r0's is longer, so it cannot
    join. By arrival r0's leads, and r1's shorter window is padded into the same forward."""
    vocoder = ordered(tts_plan, order)
    monkeypatch.setattr(vocoder, "grid_end", None)  # every ready frame in one window
    g = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, 128, (n, 1), generator=g) for n in (98, 20)]
    r0, r1 = (Call(f"r{i}", {}, {"codes": InputStream("codes")}) for i in range(2))
    r0.inputs["codes"].push(codes[0][:69], False)
    vocoder.step([r0])  # keeps frames 0-60 (9 of lookahead wait)
    (audio,) = [value for port, value in r0.emitted if port == "audio"]
    assert len(audio) == 60
    r0.emitted.clear()
    r1.inputs["codes"].push(codes[1], False)
    r0.inputs["codes"].push(codes[0][69:], False)
    vocoder.step([r0, r1])
    sent = [call.request_id for call in (r0, r1) if call.emitted]
    assert sent == (["r1"] if order == "slack" else ["r0", "r1"])
    assert vocoder.ready(r0) == (order == "slack")  # its window is left for the next step


def test_while_a_first_packet_is_on_the_device_a_stream_ahead_of_its_listener_waits(
    tts_plan, monkeypatch
):
    """r0 has been sent 60 frames of audio. While some stage of the program has a first
    packet on the device (`first_packets_first`, the loop's), r0's next window waits and r0
    is not ready; r1's first window decodes, and while its audio is on its way (landing
    three polls late, injected) it is this stage's first packet in flight. Once that has
    landed and the flag is down, r0 goes on."""
    vocoder = ordered(tts_plan, "slack")
    monkeypatch.setattr(vocoder, "grid_end", None)  # every ready frame in one window
    g = torch.Generator().manual_seed(3)
    codes = [torch.randint(0, 128, (n, 1), generator=g) for n in (98, 20)]
    r0, r1 = (Call(f"r{i}", {}, {"codes": InputStream("codes")}) for i in range(2))
    r0.inputs["codes"].push(codes[0][:69], False)
    vocoder.step([r0])
    r0.emitted.clear()
    r0.inputs["codes"].push(codes[0][69:], False)
    vocoder.first_packets_first = True
    assert not vocoder.ready(r0)
    land_late(monkeypatch)
    r1.inputs["codes"].push(codes[1], False)
    vocoder.step([r0, r1])
    assert vocoder.first_packet_in_flight() and not r0.emitted
    for _ in range(5):
        if r1.emitted:
            break
        vocoder.step([r1])
    assert r1.emitted and not vocoder.first_packet_in_flight()
    assert not vocoder.ready(r0)
    vocoder.first_packets_first = False
    assert vocoder.ready(r0)
    vocoder.step([r0])
    for _ in range(5):
        if r0.emitted:
            break
        vocoder.step([r0])
    assert r0.emitted


@pytest.mark.parametrize("order", ["slack", "arrival"])
def test_a_requests_makers_wait_for_its_first_window_and_a_later_one_its_listener_needs(
    tts_plan, order, monkeypatch
):
    """While r0's first window is on the device (its audio landing three polls late,
    injected), the stage says r0's makers wait for it (`makers_wait_for`: the loop hands it
    to every stage, whose rows for r0 launch nothing); once it is out, not. A later window
    holds them while its listener would be played out before it could play through and
    their pace spares the pause: a long window after the first, not a short one behind it.
    By arrival order, never."""
    vocoder = ordered(tts_plan, order)
    monkeypatch.setattr(vocoder, "grid_end", None)  # every ready frame in one window
    land_late(monkeypatch)
    codes = torch.randint(0, 128, (200, 1), generator=torch.Generator().manual_seed(4))
    r0 = Call("r0", {}, {"codes": InputStream("codes")})
    pushed = 0

    def window(frames: int) -> set[str]:
        """r0's next window of `frames` kept frames on the device: who waits for it."""
        nonlocal pushed
        r0.inputs["codes"].push(codes[pushed : pushed + frames], False)
        pushed += frames
        r0.emitted.clear()
        vocoder.step([r0])
        waiting = vocoder.makers_wait_for()
        for _ in range(5):
            if r0.emitted:
                break
            vocoder.step([r0])
        assert r0.emitted and not vocoder.makers_wait_for()
        return waiting

    slack = order == "slack"
    lookahead = vocoder.lookahead
    assert window(lookahead + 4) == ({"r0"} if slack else set())  # the first: 4 frames
    assert window(60) == ({"r0"} if slack else set())  # 60 frames: its listener has 4
    assert window(1) == set()  # 1 frame: its listener has 64


def test_bad_codes_fail_their_request_alone(dac):
    good = torch.randint(0, 128, (12, 1))
    requests = [
        (good, [4], {}),
        (good + 704, [4], {}),  # token ids with the codec offset still on
        (torch.zeros(4, 3, dtype=torch.int64), [4], {}),  # three codebooks for a one-codebook codec
        (torch.zeros(4, 1), [4], {}),  # floats
        (good, [4], {"lookahead": -1}),
    ]
    ok, offset, codebooks, floats, lookahead = run(dac, requests)
    assert ok.shape == (12, 1920)
    assert isinstance(offset, VocoderError) and "codec offset" in str(offset)
    assert isinstance(codebooks, VocoderError) and "codebooks" in str(codebooks)
    assert isinstance(floats, VocoderError) and "integers" in str(floats)
    assert isinstance(lookahead, VocoderError) and "whole number of frames" in str(lookahead)


def test_an_empty_stream_finishes_without_audio(dac):
    (audio,) = run(dac, [(torch.zeros(0, 1, dtype=torch.int64), [1], {})])
    assert audio.shape == (0, 1920)


def test_plan_and_model_must_agree(tts_plan):
    spec = stage_spec(tts_plan, "decoder")
    wrong = dataclasses.replace(spec, outputs={"audio": PortSpec("audio", "float32", (480,))})
    with pytest.raises(VocoderError, match="1920 samples per frame"):
        Vocoder(wrong, "cpu")
    talker = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, component="talker"))
    with pytest.raises(VocoderError, match="qwen3, not a codec"):
        Vocoder(talker, "cpu")


# --- token2wav (tiny:qwen2.5-omni) -----------------------------------------------------------


@pytest.fixture(scope="module")
def omni_plan():
    return compile_file(GRAPHS / "omni_chat.omni", devices="cpu", tiny=True)


@pytest.fixture(scope="module")
def token2wav(omni_plan):
    """The shipped stage: Qwen's own streaming setting, one DiT block of lookahead."""
    return Vocoder(stage_spec(omni_plan, "code2wav"), "cpu")


@pytest.fixture(scope="module")
def exact_token2wav(tmp_path_factory):
    """The stage at `lookahead=24`: two blocks, its stream the whole-utterance decode."""
    path = tmp_path_factory.mktemp("exact") / "omni_chat.omni"
    path.write_text((GRAPHS / "omni_chat.omni").read_text().replace("lookahead=12", "lookahead=24"))
    plan = compile_file(path, devices="cpu", tiny=True)
    return Vocoder(stage_spec(plan, "code2wav"), "cpu")


@pytest.fixture(scope="module")
def omni_reference():
    """Codes and waveform of Qwen2.5-Omni's own generate (talker codes, token2wav with the
    global RNG seeded with 0)."""
    return reference_omni_generate(
        build_tiny("qwen2.5-omni"),
        "Tell me a short story.",
        max_new_tokens=4,
        talker_max_new_tokens=80,
    )


def test_token2wav_windows_follow_the_dit_blocks(token2wav):
    decoder = token2wav.decoder
    # 24-mel-frame DiT blocks are 12 codes; two blocks of context (of the edge's 25) and of
    # lookahead. BigVGAN, walked: conv_pre (kernel 7) reaches 3 mel frames each way; each of
    # its six transposed convs (kernel 11, 7, 4, 4, 4, 4 at stride 5, 3, 2, 2, 2, 2) is followed
    # by an AMP block of three residual branches, each two anti-aliased activations (5
    # positions each way: 12-tap filters at 2x) and two kernel-3 convs (dilation 1, 3 or 5,
    # then 1), 42 positions each way in all; then one more activation and conv_post (kernel
    # 7). Mel frame 0 reaches samples -4237..4476, 240 per mel frame: 18 mel frames either
    # way (17.7, 18.7), 9 codes of 2 mel frames.
    assert (decoder.samples_per_frame, decoder.unit) == (480, 12)
    assert (token2wav.context, decoder.lookahead) == (24, 24)
    assert (decoder.reach.context, decoder.reach.lookahead) == (9, 9)


def test_token2wav_stream_matches_the_models_generate(exact_token2wav, token2wav, omni_reference):
    codes = omni_reference.codec_ids[:, None]
    assert len(codes) >= 48  # several DiT blocks
    log = []
    (streamed,) = run(exact_token2wav, [(codes, RAMP, {"seed": 0})], log)
    error = max_error(streamed, omni_reference.waveform)
    assert error < TOKEN2WAV_TOLERANCE
    # Windows keep one DiT block (12 codes), then two, four... at a time, back to back.
    kept = [(keep_start, keep_end) for _, _, keep_start, keep_end in windows(log)]
    sizes, grid = [end - start for start, end in kept], [12, 24, 48] + [192] * len(kept)
    assert sizes[:-1] == grid[: len(sizes) - 1] and sizes[-1] <= grid[len(sizes) - 1]
    assert len(sizes) >= 3
    assert all(a[1] == b[0] for a, b in zip(kept, kept[1:], strict=False))
    assert kept[-1][1] == len(codes)
    # The grid makes the waveform independent of how the codes were chunked: other chunks
    # decode the very same windows (batched otherwise, so equal up to rounding).
    other_log = []
    (other,) = run(exact_token2wav, [(codes, [7, 1, 30], {"seed": 0})], other_log)
    assert windows(other_log) == windows(log)
    assert float((other - streamed).abs().max()) < BATCH_TOLERANCE
    # One block of lookahead (Qwen's streaming setting, the shipped graph's) costs a hundred
    # times the error.
    (short,) = run(token2wav, [(codes, RAMP, {"seed": 0})])
    short_error = max_error(short, omni_reference.waveform)
    assert 10 * error < short_error < 0.05
    print(
        f"token2wav streamed vs whole: {error:.2e}; with one block of lookahead {short_error:.2e}"
    )


def test_a_stages_lookahead_is_its_requests_default(omni_plan, token2wav, exact_token2wav):
    """`lookahead=12` on the stage (the shipped graph's): the compiler hands the vocoder its
    first window after 24 codes, the static windows are made for it, and a request that
    names none streams what one naming 12 does on a stage of another lookahead."""
    codes_edge = next(c for c in omni_plan.channels if c.dst == "code2wav")
    assert codes_edge.schedule == [24, 24, 48, 192]
    assert (token2wav.grid_lengths()[0], exact_token2wav.grid_lengths()[0]) == (24, 36)
    codes = torch.randint(0, 128, (40, 1), generator=torch.Generator().manual_seed(5))
    log = []
    (default,) = run(token2wav, [(codes, [24, 8, 8], {"seed": 0})], log)
    (asked,) = run(exact_token2wav, [(codes, [24, 8, 8], {"seed": 0, "lookahead": 12})])
    assert float((default - asked).abs().max()) < BATCH_TOLERANCE
    # The first window decodes once the 24 codes of the first chunk are in.
    assert [(w[2], w[3]) for forward in log[0] for w in forward] == [(0, 12)]


def test_token2wav_batches_requests_and_keeps_their_own_noise_and_speaker(token2wav):
    g = torch.Generator().manual_seed(3)
    requests = [
        (torch.randint(0, 128, (50, 1), generator=g), RAMP, {"seed": 1}),
        (torch.randint(0, 128, (30, 1), generator=g), [15], {"seed": 2, "speaker": "Ethan"}),
        (torch.randint(0, 128, (9, 1), generator=g), [4], {"seed": 1, "guidance": 0.0}),
    ]
    log = []
    together = run(token2wav, requests, log)
    alone = [run(token2wav, [r])[0] for r in requests]
    for a, b in zip(together, alone, strict=True):
        assert float((a - b).abs().max()) < BATCH_TOLERANCE
    # Requests whose windows are ready in the same step share its forward.
    shared = []
    run(token2wav, [(r[0][:36], [36], {"seed": i}) for i, r in enumerate(requests[:2])], shared)
    # Each request's two windows (12 + 24 codes), one a step: two forwards of both.
    assert [[len(forward) for forward in step] for step in shared if step] == [[2], [2]]
    # The same codes with another seed or speaker sound different.
    codes = requests[0][0][:12]
    base, seed, speaker = run(
        token2wav,
        [
            (codes, [12], {"seed": 1}),
            (codes, [12], {"seed": 2}),
            (codes, [12], {"seed": 1, "speaker": "Ethan"}),
        ],
    )
    assert not torch.allclose(base, seed) and not torch.allclose(base, speaker)


def test_token2wav_rejects_unknown_speakers_and_step_counts(token2wav):
    codes = torch.zeros(3, 1, dtype=torch.int64)
    speaker, steps = run(
        token2wav, [(codes, [3], {"speaker": "Nobody"}), (codes, [3], {"steps": 1})]
    )
    assert isinstance(speaker, VocoderError) and "Chelsie, Ethan" in str(speaker)
    assert isinstance(steps, VocoderError) and "steps" in str(steps)


# --- Mimi and EnCodec (tiny random codecs) ----------------------------------------------------


def save_codec(directory: Path, model, samples_per_frame: int) -> str:
    """A codec with random codebooks (the classes' init leaves them zero) in tiny:tts's layout."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("embed_sum", "embed", "embed_avg")):
                buffer.copy_(torch.randn(buffer.shape, generator=g))
    model.save_pretrained(directory / "code2wav")
    index = {
        "code2wav": ["transformers", type(model).__name__],
        "samples_per_frame": samples_per_frame,
    }
    (directory / "model_index.json").write_text(json.dumps(index))
    return str(directory)


@pytest.fixture(scope="module")
def mimi(tmp_path_factory):
    from transformers import MimiConfig, MimiModel

    config = MimiConfig(
        hidden_size=32,
        num_filters=8,
        upsampling_ratios=[8, 6, 5, 4],
        codebook_size=64,
        codebook_dim=16,
        num_quantizers=2,
        upsample_groups=32,
        vector_quantization_hidden_dimension=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        sliding_window=16,
    )
    torch.manual_seed(0)
    root = save_codec(tmp_path_factory.mktemp("mimi"), MimiModel(config), 1920)
    return Vocoder(codec_spec(root, 1920), "cpu")


@pytest.fixture(scope="module")
def encodec(tmp_path_factory):
    from transformers import EncodecConfig, EncodecModel

    config = EncodecConfig(
        hidden_size=16,
        num_filters=4,
        upsampling_ratios=[8, 5, 4, 2],
        codebook_size=64,
        codebook_dim=16,
        target_bandwidths=[1.5],
        num_lstm_layers=1,
    )
    torch.manual_seed(0)
    root = save_codec(tmp_path_factory.mktemp("encodec"), EncodecModel(config), 320)
    return Vocoder(codec_spec(root, 320), "cpu")


def test_mimi_is_causal_and_streams_exactly(mimi):
    decoder = mimi.decoder
    assert (decoder.samples_per_frame, decoder.num_codebooks, decoder.lookahead) == (1920, 2, 0)
    # Causal throughout. Frame 0 reaches 3 positions past its own at the transformer's 2x
    # rate (upsampling kernel 4), the 16-position window 15 more, the SEANet's first conv
    # (kernel 7) 6 more; its transposed convs (kernel 2r, stride r = 8, 6, 5, 4) and kernel-3
    # convs take that to sample 25395, in frame 13 of 1920 samples.
    assert (decoder.reach.context, decoder.reach.lookahead) == (13, 0)
    assert decoder.reach.context <= mimi.context  # its transformer's window fits the context
    codes = torch.randint(0, 64, (60, 2), generator=torch.Generator().manual_seed(4))
    (streamed,) = run(mimi, [(codes, RAMP, {})])
    with torch.no_grad():
        whole = decoder.model.decode(codes.T[None]).audio_values
    assert max_error(streamed, whole) < DAC_TOLERANCE


def test_encodec_batches_exactly_though_its_lstm_never_forgets(encodec):
    decoder = encodec.decoder
    assert (decoder.samples_per_frame, decoder.num_codebooks, decoder.lookahead) == (320, 3, 0)
    # The LSTM carries every earlier frame: no finite context, so left padding is never used.
    # Its first conv reflects 6 frames, so inputs of fewer than 7 are never padded.
    assert (decoder.reach.context, decoder.reach.min_frames) == (math.inf, 7)
    g = torch.Generator().manual_seed(5)
    requests = [
        (torch.randint(0, 64, (40, 2), generator=g), RAMP, {}),
        (torch.randint(0, 64, (17, 2), generator=g), [3], {}),
    ]
    together = run(encodec, requests)
    alone = [run(encodec, [r])[0] for r in requests]
    for a, b in zip(together, alone, strict=True):
        assert float((a - b).abs().max()) < BATCH_TOLERANCE


# --- reach: what the architecture says against what a decode shows ---------------------------


@pytest.mark.parametrize("name", ["dac", "token2wav", "mimi", "encodec"])
def test_no_sample_outside_the_field_depends_on_the_frame(name, request):
    """Changing input frame 24 of 48 leaves every sample outside the frame's field exactly as
    it was: they are computed from equal numbers. The reach the change shows may fall short of
    the architecture's (influence at the field's edges can vanish in rounding, by how much
    depends on the machine), never exceed it."""
    decoder = request.getfixturevalue(name).decoder
    frames, frame = 48, 24
    g = torch.Generator().manual_seed(6)
    if name == "token2wav":  # the BigVGAN, mel frames in
        field, decode = bigvgan_field(decoder.bigvgan), decoder.bigvgan
        x = torch.randn(1, decoder.mel_dim, frames, generator=g) - 4.0
        y = x.clone()
        y[..., frame] += 1.0
    else:
        field, decode = decoder.field(), decoder._run
        x = torch.randint(0, decoder.codebook_size, (1, decoder.num_codebooks, frames), generator=g)
        y = x.clone()
        y[..., frame] = (y[..., frame] + 1) % decoder.codebook_size
    with torch.no_grad():
        before, after = decode(x).reshape(-1), decode(y).reshape(-1)
    assert before.numel() == frames * field.per_frame
    relative = torch.arange(before.numel()) - frame * field.per_frame
    outside = (relative < field.first) | (relative > field.last)
    assert torch.equal(before[outside], after[outside])
    changed = relative[before != after]
    seen = field_reach(Field(int(changed.min()), int(changed.max()), field.per_frame))
    reach = field_reach(field)
    assert seen.context <= reach.context and seen.lookahead <= reach.lookahead


# --- TTS in the runtime ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tts_program():
    return compile_source(TTS_PROGRAM, "tts_codes.omni", devices="cpu")


def as_text(codes: torch.Tensor) -> str:
    return " ".join(str(int(code)) for code in codes)


async def run_concurrently(engine: Engine, texts: list[str]) -> list[torch.Tensor]:
    async def one(text):
        chunks = [c.value async for c in engine.stream({"text": text}) if c.value is not None]
        return torch.cat(chunks)

    return await asyncio.gather(*(one(text) for text in texts))


@pytest.mark.parametrize("runner", ["interpreter", "inprocess", "process"])
def test_tts_audio_is_the_reference_waveform(runner, tts_program):
    references = [tts_reference(text) for text in TTS_TEXTS]
    texts = [as_text(ref.codes) for ref in references]
    if runner == "interpreter":
        interpreter = Interpreter(tts_program)
        audio = [interpreter.run({"text": text})["audio"] for text in texts]
    else:
        with Engine(tts_program, runner) as engine:
            audio = asyncio.run(run_concurrently(engine, texts))
    for got, ref in zip(audio, references, strict=True):
        assert max_error(got, ref.waveform) < DAC_TOLERANCE


def test_dac_audio_does_not_depend_on_how_the_codes_arrived(dac):
    """The same codes, chunked four ways: the windows follow the edge's planned chunks and a
    request's windows never share a forward, so the audio is the same bits every time."""
    codes = tts_reference(TTS_TEXTS[0]).codes[:, None]
    runs = [run(dac, [(codes, schedule, {})])[0] for schedule in (RAMP, [1], [7, 3], [25])]
    assert all(torch.equal(audio, runs[0]) for audio in runs[1:])
