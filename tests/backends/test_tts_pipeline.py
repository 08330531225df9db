"""graphs/tts.omni end to end on tiny:tts with its real backends: the transformers `ar`
backend runs the talker as a codec LM (prompt from text + voice, the generation config's
suppress mask, greedy, `codec_token_offset` subtracted, end-of-speech not emitted) and the
vocoder stage decodes its streamed codes with DAC. The audio must be `reference_tts`'s
waveform (the unsplit talker `generate()` + one whole `DacModel.decode`), up to the DAC
streaming tolerance of tests/backends/test_vocoders.py (1.4e-5 measured, 1e-4 allowed) and
pcm16 rounding (half a step, 1.5e-5).
"""

import functools
from pathlib import Path

import pytest
import torch

from omniflow.catalog.resolve import model_path
from omniflow.compiler import compile_file, compile_source
from omniflow.families.codec_tts.checkpoints import reference_tts
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestFailed

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "tts.omni"
TOLERANCE = 1e-4
MAX_TOKENS = 40
CASES = [("hello there", "Vivian"), ("Good morning, how are you today?", "Ryan")]
CODES_PROGRAM = """
pipeline tts_codes {
  model "tiny:tts"
  stage codec_lm = ar(component="talker", max_batch=4, max_tokens=40)
  input text: text -> codec_lm
  input voice: text = "Vivian" -> codec_lm.voice
  codec_lm.codes -> output codes
}
"""


@functools.cache
def reference(text: str, voice: str):
    return reference_tts(model_path("tiny:tts"), text, voice=voice, max_new_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def plan():
    return compile_file(str(GRAPH), devices="cpu", tiny=True)


def pcm_error(audio: torch.Tensor, waveform: torch.Tensor) -> float:
    assert audio.dtype == torch.int16 and audio.numel() == waveform.numel()
    got = audio.reshape(-1).float() / 32767
    return float((got - waveform.clamp(-1, 1)).abs().max())


def test_cases_cover_both_ends():
    # One case ends at end-of-speech (not emitted as a code), the other at max_tokens.
    assert [len(reference(text, voice).codes) for text, voice in CASES] == [24, MAX_TOKENS]


def test_codec_lm_emits_the_reference_codes():
    interpreter = Interpreter(compile_source(CODES_PROGRAM, "tts_codes.omni", devices="cpu"))
    for text, voice in CASES:
        codes = interpreter.run({"text": text, "voice": voice})["codes"]
        assert codes.dtype == torch.int64 and codes.shape[1:] == (1,)
        assert torch.equal(codes.reshape(-1), reference(text, voice).codes)


def test_interpreter_audio_is_the_reference_waveform(plan):
    interpreter = Interpreter(plan)
    for text, voice in CASES:
        params = {"max_tokens": MAX_TOKENS}
        inputs = {"text": text} if voice == "Vivian" else {"text": text, "voice": voice}
        audio = interpreter.run(inputs, params)["audio"]
        assert pcm_error(audio, reference(text, voice).waveform) < TOLERANCE


def test_engine_audio_is_the_reference_waveform(plan):
    with Engine(plan, "process") as engine:
        for text, voice in CASES:
            out = engine.generate({"text": text, "voice": voice}, {"max_tokens": MAX_TOKENS})
            assert pcm_error(out["audio"], reference(text, voice).waveform) < TOLERANCE


def test_unknown_voice_fails_the_request(plan):
    with pytest.raises(RequestFailed, match="ARBackendError: unknown voice 'Nobody'"):
        Interpreter(plan).run({"text": "hello there", "voice": "Nobody"})
