"""Qwen3-TTS-12Hz on its tiny checkpoints (tiny:qwen3-tts-customvoice, -voicedesign, -base):
the talker stage (transformers `ar` backend) and the code2wav stage (vocoder backend)
against Qwen's own `qwen_tts` package.

The oracle is golden/qwen_tts_reference.safetensors: what `qwen-tts` 0.1.1 (the official
package, on the transformers 4.57.3 it pins, torch 2.13 CPU) generates on these
checkpoints, greedily, through its own `Qwen3TTSModel` API (`generate_custom_voice`,
`generate_voice_design`, `create_voice_clone_prompt` + `generate_voice_clone`) and decodes
with its speech tokenizer; tests/families/qwen_tts_reference.py writes it. The package
cannot be installed beside omniflow (it pins transformers 4.57.3), so it runs in a venv of
its own: with QWEN_TTS_PYTHON naming that venv's python, `test_golden_is_what_qwen_tts_makes`
regenerates the file and compares (skipped otherwise).

Measured on 2 CPU cores: codes identical in all five cases; audio within 1.4e-6 of the
reference decoder's (tolerance 1e-4); the x-vector within 4.8e-7; the reference audio's
codes (Mimi encoder) identical; streamed decode vs whole decode ~1e-6 (tolerance 1e-4).
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from omniflow.backends.transformers_ar import (
    Sequence,
    TransformersAR,
    sample_sub_step,
    sub_sampling,
)
from omniflow.backends.vision import RequestEncoderBackend, encoder_backend
from omniflow.backends.vocoders import Vocoder
from omniflow.catalog.resolve import model_path
from omniflow.cli import main
from omniflow.compiler import compile_file, compile_source
from omniflow.families.qwen3_tts import voices
from omniflow.families.qwen3_tts.config import Qwen3TTSError
from omniflow.families.qwen3_tts.costs import MIMI_ENCODER_PARAMS
from omniflow.families.qwen3_tts.prompt import TTSRequest
from omniflow.families.qwen3_tts.reference import reference_generate
from omniflow.families.qwen3_tts.voices import PROMPT_PREFIX, VoiceEncoder
from omniflow.runtime.edges import StreamWriter
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.loop import StageRunner
from omniflow.runtime.port_values import Ahead
from omniflow.runtime.preflight import preflight
from omniflow.runtime.requests import RequestError, admit
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_transformers_ar import wait_for_device
from tests.gpu_wiring import stage_spec

torch.set_num_threads(1)

ROOT = Path(__file__).parents[2]
GRAPH = ROOT / "graphs" / "qwen3_tts.omni"
GOLDEN = Path(__file__).parent / "golden" / "qwen_tts_reference.safetensors"
AUDIO_TOLERANCE = 1e-4
FRAMES = 8  # the reference's max_new_tokens 9: generate predicts the frames of its first 8 codes
MODELS = {
    "CustomVoice": "tiny:qwen3-tts-customvoice",
    "VoiceDesign": "tiny:qwen3-tts-voicedesign",
    "Base": "tiny:qwen3-tts-base",
}
# name: (task, text, language, speaker, instructions, ref_text, x_vector_only, non_streaming)
CASES = {
    "cv_en": (
        "CustomVoice",
        "Good morning, how are you?",
        "English",
        "Vivian",
        "",
        "",
        False,
        True,
    ),
    # a dialect speaker (Auto -> Sichuan dialect), an instruction, streamed text
    "cv_dialect": (
        "CustomVoice",
        "Hello there.",
        "Auto",
        "eric",
        "Speak slowly.",
        "",
        False,
        False,
    ),
    "vd": ("VoiceDesign", "Good morning.", "Chinese", None, "A warm, low voice.", "", False, True),
    "clone_xvec": ("Base", "Good morning.", "English", None, "", "", True, False),
    # ICL: the reference audio's codes and transcript in the prompt, text longer than them
    "clone_icl": (
        "Base",
        "Good morning, how are you today?",
        "Auto",
        None,
        "",
        "Hello there.",
        False,
        False,
    ),
}
PROGRAM = """
pipeline q3 {{
  model "{model}"
  param max_tokens = 64
  param temperature = 0.0
  param language = "Auto"
  param x_vector_only_mode = false
  param non_streaming_mode = false
  param task_type = ""
  stage talker = ar(component="talker", max_batch=4, max_tokens=$max_tokens,
                    temperature=$temperature, language=$language, task_type=$task_type,
                    x_vector_only_mode=$x_vector_only_mode, non_streaming_mode=$non_streaming_mode)
  stage code2wav = vocoder(component="code2wav", max_batch=4)
  stage voice_encoder = encoder(component="voice_encoder", backend="transformers")
  input text: text -> talker
  input voice: text = "" -> talker.voice
  input instructions: text = "" -> talker.instructions
  input ref_audio: text = "" -> voice_encoder.ref_audio
  voice_encoder.voice -> talker.ref_audio
  input ref_text: text = "" -> talker.ref_text
  talker.codes -> code2wav [stream, chunk=auto]
  code2wav.audio -> output audio [stream, rate=24000]
}}
"""


def reference_samples() -> np.ndarray:
    """The voice clones' reference audio: 1.5 s of a 24 kHz chirp with noise."""
    t = np.arange(36000) / 24000
    noise = np.random.default_rng(0).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * (180 + 120 * t) * t) + 0.05 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(GOLDEN)


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory, golden) -> str:
    path = tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(path, golden["ref_audio"].numpy(), 24000, subtype="FLOAT")
    return str(path)


@pytest.fixture(scope="module")
def plans():
    return {
        task: compile_source(PROGRAM.format(model=m), "q3.omni", devices="cpu")
        for task, m in MODELS.items()
    }


@pytest.fixture(scope="module")
def talkers(plans):
    return {task: TransformersAR(stage_spec(plan, "talker"), "cpu") for task, plan in plans.items()}


@pytest.fixture(scope="module")
def code2wav(plans):
    return Vocoder(stage_spec(plans["CustomVoice"], "code2wav"), "cpu")


def request_of(name: str, ref_wav: str, **params):
    task, text, language, speaker, instructions, ref_text, xvec, non_streaming = CASES[name]
    inputs = {
        "prompt": text,
        "voice": speaker or "",
        "instructions": instructions,
        "ref_text": ref_text,
    }
    inputs["ref_audio"] = ref_wav if task == "Base" else ""
    base = {"language": language, "x_vector_only_mode": xvec, "non_streaming_mode": non_streaming}
    return task, inputs, {"temperature": 0.0, "max_tokens": FRAMES, **base, **params}


@functools.cache
def voice_encoder(task: str = "Base") -> VoiceEncoder:
    """The voice_encoder stage's model of a tiny checkpoint (the stage's backend's)."""
    return voices.load(model_path(MODELS[task]), "voice_encoder", "auto")


def encoded(backend: TransformersAR, inputs: dict) -> dict:
    """A request's talker inputs as the pipeline gives them: a Base checkpoint's reference
    through the voice encoder stage (which raises what would fail the request there)."""
    if backend.component.config.task != "Base":
        return inputs
    prompt = voice_encoder().encode({"ref_audio": inputs.get("ref_audio")})
    return {**inputs, "ref_audio": prompt.get("voice", "")}


def calls_of(backend: TransformersAR, requests) -> list:
    """A Call per (inputs, params, ...) request, its inputs whole; a request whose
    reference the voice encoder refuses is that error."""
    calls = []
    for i, (inputs, params, *_) in enumerate(requests):
        try:
            inputs = encoded(backend, inputs)
        except Qwen3TTSError as err:
            calls.append(err)
            continue
        streams = {port: InputStream(kind) for port, kind in backend.spec.inputs.items()}
        for port, stream in streams.items():
            stream.push(inputs.get(port) or None, True)
        calls.append(Call(f"r{i}", params, streams))
    return calls


def run_talker(backend: TransformersAR, requests: list[tuple[dict, dict]]) -> list:
    """Step the requests (inputs, params) through the talker together; each one's codes
    `[frames, 16]` (an ICL clone's reference frames, sent ahead, first), or its error."""
    made = calls_of(backend, requests)
    calls = [c for c in made if isinstance(c, Call)]
    for _ in range(1000):
        ready = [c for c in calls if not c.finished and c.error is None and backend.ready(c)]
        if not ready:
            break
        backend.step(ready)
    for call in calls:
        backend.drop(call)
    return [
        call
        if isinstance(call, Exception)
        else call.error or torch.cat([unwrapped(v) for port, v in call.emitted if port == "codes"])
        for call in made
    ]


def unwrapped(value):
    """A value emitted, or the one it sent `Ahead`."""
    return value.value if isinstance(value, Ahead) else value


def stream_decode(backend: Vocoder, requests: list[tuple[torch.Tensor, list[int]]]) -> list:
    """Stream each request's codes `[n, 16]` into the vocoder in chunks of its schedule,
    all requests at once; each one's audio, flat."""
    calls = [Call(f"r{i}", {}, {"codes": InputStream("codes")}) for i in range(len(requests))]
    sent = [0] * len(calls)
    out = [[] for _ in calls]
    for round_ in range(10_000):
        live = [i for i, c in enumerate(calls) if not c.finished and c.error is None]
        if not live:
            break
        for i in live:
            codes, schedule = requests[i]
            stream = calls[i].inputs["codes"]
            if not stream.ended:
                n = schedule[min(round_, len(schedule) - 1)]
                chunk = codes[sent[i] : sent[i] + n]
                sent[i] += n
                stream.push(chunk if len(chunk) else None, sent[i] >= len(codes))
        backend.step([calls[i] for i in live if backend.ready(calls[i])])
        for i in live:
            out[i] += [v for port, v in calls[i].emitted if port == "audio"]
            calls[i].emitted.clear()
    assert all(c.error is None for c in calls), [c.error for c in calls]
    return [torch.cat(o).reshape(-1) for o in out]


# --- the checkpoints -----------------------------------------------------------------------


def test_checkpoints_load_into_the_reference_classes_whole(golden):
    # The reference's from_pretrained found every weight it has in each tiny checkpoint,
    # and no tensor of the checkpoint was left over: the published layout.
    for name in CASES:
        assert int(golden[f"{name}.missing"]) == 0 and int(golden[f"{name}.unexpected"]) == 0


def test_checkpoint_layout_is_the_published_one():
    root = Path(model_path(MODELS["Base"]))
    config = json.loads((root / "config.json").read_text())
    speech = json.loads((root / "speech_tokenizer" / "config.json").read_text())
    assert config["model_type"] == "qwen3_tts" and config["tts_model_type"] == "base"
    assert (
        speech["model_type"] == "qwen3_tts_tokenizer_12hz"
        and speech["decode_upsample_rate"] == 1920
    )
    talker = config["talker_config"]
    # The published ids, shifted by the tiny codebook: specials, languages, the top 1024 ids.
    assert (talker["codec_pad_id"], talker["codec_bos_id"], talker["codec_eos_token_id"]) == (
        228,
        229,
        230,
    )
    assert talker["vocab_size"] == 128 + 1024 and talker["codec_language_id"]["english"] == 130
    names = set(load_file(root / "model.safetensors"))
    assert "talker.model.codec_embedding.weight" in names and "talker.codec_head.weight" in names
    assert "talker.code_predictor.small_to_mtp_projection.weight" in names
    assert any(n.startswith("speaker_encoder.blocks.") for n in names)
    speech_names = set(load_file(root / "speech_tokenizer" / "model.safetensors"))
    assert "decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum" in speech_names
    assert any(n.startswith("encoder.encoder.layers.") for n in speech_names)  # Mimi's flat names
    custom = json.loads((Path(model_path(MODELS["CustomVoice"])) / "config.json").read_text())
    assert custom["talker_config"]["spk_id"]["vivian"] == [3065 - 2048 + 128]


def test_rebuilding_gives_identical_bytes(tmp_path):
    """Portable seeded weights (one speech tokenizer shared by the three checkpoints, as
    the published ones share theirs): a rebuild writes the same files, byte for byte."""
    from omniflow.checkpoints.tiny import MANIFEST, build_tiny

    def files(directory: Path) -> dict:
        return json.loads((directory / MANIFEST).read_text())["files"]

    built = {task: files(Path(model_path(model))) for task, model in MODELS.items()}
    for task, model in MODELS.items():
        name = model.removeprefix("tiny:")
        assert files(build_tiny(name, tmp_path / name)) == built[task]
        assert sum(entry["bytes"] for entry in built[task].values()) < 5_000_000
    tokenizer = {task: f["speech_tokenizer/model.safetensors"] for task, f in built.items()}
    assert len({entry["sha256"] for entry in tokenizer.values()}) == 1


def test_the_real_size_builds_have_the_catalogs_parameter_counts():
    """At depth 1 the scaled builders' modules (on the meta device) have the parameters the
    catalog counts for the published checkpoints (the code predictor once: in the LM
    formula, from its code_predictor_config), as do the tiny checkpoints' files."""
    from omniflow import families
    from omniflow.catalog import load_component_config
    from omniflow.catalog.costs import count_parameters
    from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
    from omniflow.families.qwen3_tts import REAL_MODELS
    from omniflow.families.qwen3_tts.checkpoints import parameter_count, scaled_config
    from omniflow.families.qwen3_tts.config import TTSConfig
    from omniflow.families.qwen3_tts.modeling import Talker, build_speaker_encoder
    from omniflow.families.qwen3_tts.speech_tokenizer import SpeechDecoder

    tokenizer = build_tokenizer("qwen")
    for task in ("customvoice", "base"):
        config, speech = scaled_config(task, 1.0, tokenizer)
        parsed = TTSConfig.of(config)
        with torch.device("meta"):
            talker = parameter_count(Talker(parsed))
            speaker = parameter_count(build_speaker_encoder(parsed)) if task == "base" else 0
            decoder = parameter_count(SpeechDecoder(speech["decoder_config"]))
        real = REAL_MODELS[task]
        assert talker == count_parameters(load_component_config(real, "talker")), task
        assert decoder == count_parameters(load_component_config(real, "code2wav")) == 114_323_137
        # The voice encoder stage: the speaker encoder beside the speech tokenizer's encoder.
        voice = count_parameters(load_component_config(real, "voice_encoder"))
        assert voice == (speaker + MIMI_ENCODER_PARAMS if speaker else 0), task
    assert talker == 1_916_676_352 and speaker == 12_001_088  # the Base talker, its encoder
    builders = {m: path for f in families.families() for m, path in f.scaled.items()}
    assert builders[REAL_MODELS["voicedesign"]].endswith("checkpoints:build_scaled_voicedesign")
    for task, model in MODELS.items():
        files = load_file(Path(model_path(model)) / "model.safetensors")
        counted = sum(v.numel() for k, v in files.items() if not k.startswith("speaker_encoder."))
        assert counted == count_parameters(load_component_config(model, "talker")), task


# --- the talker ---------------------------------------------------------------------------


def test_talker_codes_are_the_reference_codes(talkers, golden, ref_wav):
    """Greedy codes of all three tasks equal `qwen_tts`'s `generate`: the prompts (named
    speaker, dialect, instruction, voice description, x-vector, ICL with reference codes,
    streamed and whole text), codebook 0 and the code predictor's 15."""
    by_task: dict[str, list] = {}
    for name in CASES:
        task, inputs, params = request_of(name, ref_wav)
        by_task.setdefault(task, []).append((name, inputs, params))
    for task, cases in by_task.items():
        results = run_talker(talkers[task], [(i, p) for _, i, p in cases])  # batched
        for (name, _, _), codes in zip(cases, results, strict=True):
            assert isinstance(codes, torch.Tensor), codes
            if f"{name}.ref_code" in golden:  # ICL: the reference's frames go first, marked
                marked = golden[f"{name}.ref_code"] + 128  # the codebook size; the last twice
                marked[-1] += 128
                assert torch.equal(codes[: len(marked)], marked), name
                ref = marked
                codes = codes[len(ref) :]
            assert codes.dtype == torch.int64 and codes.shape == (FRAMES, 16), name
            assert torch.equal(codes, golden[f"{name}.codes"]), name


def test_unsplit_run_is_the_reference(golden):
    """omniflow's unsplit run (families/qwen3_tts/reference.py, what CI can check without
    the package) gives the reference's codes and audio."""
    task, text, language, speaker, instructions, _, _, non_streaming = CASES["cv_dialect"]
    request = TTSRequest(text, task, language, speaker, instructions, non_streaming=non_streaming)
    ref = reference_generate(model_path(MODELS[task]), request, FRAMES)
    assert torch.equal(ref.codes, golden["cv_dialect.codes"])
    assert float((ref.waveform - golden["cv_dialect.audio"]).abs().max()) < AUDIO_TOLERANCE


def test_code_predictor_batches_as_one_at_a_time(talkers, ref_wav):
    """Three requests decoding together (the code predictor's 15 sub-steps run for all rows
    at once) give each one's codes alone, sampled (seeded) as well as greedy."""
    requests = [
        request_of("cv_en", ref_wav, temperature=0.9, seed=1)[1:],
        request_of("cv_dialect", ref_wav, seed=7, temperature=0.9, top_k=20)[1:],
        request_of("cv_en", ref_wav, max_tokens=5)[1:],
    ]
    together = run_talker(talkers["CustomVoice"], requests)
    alone = [run_talker(talkers["CustomVoice"], [r])[0] for r in requests]
    for a, b in zip(together, alone, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(together[0][: len(together[2])], together[2])  # sampling drew


def test_the_code_predictors_device_draws_do_not_depend_on_the_batch():
    """The CUDA path of a sub-step's draws (the fused sampler, here its torch reference):
    greedy rows take the argmax, sampled rows draw from their own (seed, frame, sub-step)
    stream, whatever else is in the batch."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 128, generator=gen)
    seqs = [
        Sequence(None, None, generator, None, None, seed=seed, generated=frame)
        for generator, seed, frame in (
            (None, 1, 0),
            (torch.Generator(), 2, 5),
            (torch.Generator(), 3, 5),
        )
    ]
    how = sub_sampling(0.9, 50, 1.0)
    together = sample_sub_step(logits, seqs, how, 4, on_device=True)
    assert together[0] == logits[0].argmax()
    for i in (1, 2):
        alone = sample_sub_step(logits[i : i + 1], seqs[i : i + 1], how, 4, on_device=True)
        assert alone[0] == together[i]
    other_step = sample_sub_step(logits, seqs, how, 5, on_device=True)
    draws = [sample_sub_step(logits, seqs, how, g, on_device=True)[1] for g in range(1, 16)]
    assert len(set(map(int, draws))) > 1 and other_step.shape == together.shape
    assert torch.equal(sample_sub_step(logits, seqs, None, 4, on_device=True), logits.argmax(-1))


# --- the static decode path: frames completed inside the step ------------------------------


def talker_backend(plan, decode: str, device: str = "cpu") -> TransformersAR:
    return TransformersAR(stage_spec(plan, "talker", decode=decode), device)


def frame_requests(ref_wav: str, task: str = "CustomVoice") -> list[tuple]:
    """(inputs, params, join step, dropped before step) of requests decoding together:
    greedy ones joining at steps 0, 2 and 3, one ending at its max_tokens while the others
    run, one dropped mid-way, and one sampled with a seed; for Base, voice clones (one with
    its reference codes sent ahead of its first frame)."""
    if task == "Base":
        return [
            (*request_of("clone_icl", ref_wav)[1:], 0, None),
            (*request_of("clone_xvec", ref_wav, max_tokens=5)[1:], 1, None),
            (*request_of("clone_icl", ref_wav, temperature=0.9, seed=4)[1:], 2, None),
        ]
    return [
        (*request_of("cv_en", ref_wav, max_tokens=12)[1:], 0, None),
        (*request_of("cv_dialect", ref_wav, max_tokens=5)[1:], 2, None),
        (*request_of("cv_en", ref_wav, max_tokens=10)[1:], 3, 7),
        (*request_of("cv_dialect", ref_wav, max_tokens=9, temperature=0.9, seed=5)[1:], 1, None),
    ]


def serve_frames(backend: TransformersAR, requests: list[tuple]) -> list[torch.Tensor]:
    """Step `frame_requests` through the talker, each offered from its join step until it
    ends (or is dropped); each one's codes `[frames, 16]`. No row is left behind."""
    calls = calls_of(backend, requests)
    live: list[Call] = []
    for step in itertools.count():
        for call, (_, _, join, drop) in zip(calls, requests, strict=True):
            if join == step:
                live.append(call)
            if drop == step and call in live:
                backend.drop(call)
                live.remove(call)
        if not live and step > max(r[2] for r in requests):
            break
        assert step < 200, "the requests never ended"
        wait_for_device(backend)
        ready = [c for c in live if backend.ready(c)]
        backend.step(ready)
        for call in ready:
            assert call.error is None, call.error
            if call.finished:
                backend.drop(call)
                live.remove(call)
    assert backend.rows == []
    return [torch.cat([unwrapped(v) for port, v in c.emitted if port == "codes"]) for c in calls]


def assert_same_frames(got: list, want: list, requests: list[tuple], rows=None) -> None:
    """Equal codes for `rows` (default all); a dropped request's as far as both went (the
    static path's step in flight when it is dropped emits nothing)."""
    for i in range(len(requests)) if rows is None else rows:
        if requests[i][3] is None:
            assert torch.equal(got[i], want[i]), i
        else:
            n = min(len(got[i]), len(want[i]))
            assert n >= 3 and torch.equal(got[i][:n], want[i][:n]), i


def never_called(*args):
    raise AssertionError("the static path ran the component's eager frames")


def test_the_static_step_completes_the_eager_paths_frames(plans, talkers, ref_wav, monkeypatch):
    """decode="static" (the steps CUDA graphs capture, here run eagerly: the code predictor's
    sub-steps and their sampling inside them) gives the eager path's codes, greedily, the
    first frame after each prefill included, which the static path's first step completes
    (the component's eager `frames` made to fail): requests joining at different steps,
    one ending while the others run, one dropped, a sampled one beside them; and voice
    clones, one sending its reference codes ahead of its first frame. (Sampled draws differ
    off CUDA, where the eager path draws from each request's generator, as `generate`
    does.)"""
    for task in ("CustomVoice", "Base"):
        static = talker_backend(plans[task], "static")
        assert static.static is not None and static.static.frames is not None
        monkeypatch.setattr(static.component, "frames", never_called)
        requests = frame_requests(ref_wav, task)
        want = serve_frames(talkers[task], requests)
        got = serve_frames(static, requests)
        greedy = [i for i, r in enumerate(requests) if r[1]["temperature"] == 0]
        assert_same_frames(got, want, requests, greedy)
        assert all(len(w) > 1 for w in want)
        assert static.static.first_steps == len({r[2] for r in requests})  # one a prefill
    assert talker_backend(plans["CustomVoice"], "auto").decode == "eager"  # the CPU default


def test_the_frame_is_captured_once_per_batch_bucket_not_per_length(plans):
    """The talker's graphs (`capture_plan`, read on the CPU): the frame's completion, G
    positions of the code predictor and G samplings, is in one finish graph per batch
    bucket, while the talker's own step is captured per (batch, length) bucket, so the
    positions captured at load fall by (steps x G) against a whole frame step per bucket."""
    static = talker_backend(plans["CustomVoice"], "static").static
    groups = static.frames.groups
    plan = static.capture_plan()
    steps = sum(c.kind == "step" for c in plan)
    finishes = [c.key for c in plan if c.kind == "finish"]
    assert steps == len(static.batch_buckets) * len(static.length_buckets) > len(finishes)
    assert finishes == [(b,) for b in reversed(static.batch_buckets)]
    work = static.capture_work()
    assert work.whole_step_captured - work.captured == steps * groups
    assert work.captured == sum(c.kind != "finish" for c in plan) + len(finishes) * groups
    assert work.whole_step_warmed - work.warmed > steps * groups
    print(work.line())


def test_requests_starting_together_share_one_prefill_and_first_step(plans, talkers, ref_wav):
    """Requests that start in the same step are prefilled together and their first frames
    completed in one first step (the static path), each giving its codes of the eager
    path; a request that starts later takes a first step of its own beside the running
    rows."""
    requests = [
        (*request_of("cv_en", ref_wav, max_tokens=4)[1:], 0, None),
        (*request_of("cv_dialect", ref_wav, max_tokens=6)[1:], 0, None),
        (*request_of("cv_en", ref_wav, max_tokens=3)[1:], 0, None),
        (*request_of("cv_dialect", ref_wav, max_tokens=3)[1:], 2, None),
    ]
    static = talker_backend(plans["CustomVoice"], "static")
    got = serve_frames(static, requests)
    assert static.static.first_steps == 2
    assert_same_frames(got, serve_frames(talkers["CustomVoice"], requests), requests)


@pytest.mark.gpu
def test_captured_frames_are_the_eager_static_steps_and_the_dynamic_paths(plans, ref_wav):
    """On CUDA the talker takes the captured static step by default (the talker's step
    graph, then the frame's finish graph), and replaying it gives exactly the codes of the
    same step run eagerly, greedy and sampled (seeded), with nothing captured after load
    and every step replayed, the first step after each prefill (its first frames) and each
    prefill included, and one step graph per batch bucket (its attention reads each row's
    length on the device); the dynamic path on the GPU (the same (seed, frame, sub-step) draws) gives
    the same codes too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plan = plans["CustomVoice"]
    graphed = talker_backend(plan, "auto", "cuda:0")
    static = graphed.static
    assert graphed.decode == "graphs" and static.frames is not None
    assert set(static.finish_graphs) == set(static.batch_buckets)
    assert static.reads_lengths and static.length_buckets == [static.columns]
    assert static.warm_ups == static.capture_work().warm_ups == static.captures
    captured = static.captures
    requests = frame_requests(ref_wav)
    got = serve_frames(graphed, requests)
    assert static.captures == captured and static.first_steps == len({r[2] for r in requests})
    # A step replays the talker's step and the frame's finish, a first step the finish.
    assert static.replays == 2 * static.launches + static.first_steps
    assert static.prefill_replays == static.first_steps  # each prefill replayed
    assert_same_frames(
        got, serve_frames(talker_backend(plan, "static", "cuda:0"), requests), requests
    )
    assert_same_frames(
        got, serve_frames(talker_backend(plan, "eager", "cuda:0"), requests), requests
    )


def test_requests_that_do_not_fit_the_checkpoint_fail_alone(talkers, ref_wav):
    cv = request_of("cv_en", ref_wav)[1:]
    bad = {
        "CustomVoice": [
            ({**cv[0], "voice": "Nobody"}, cv[1], "unknown voice 'Nobody'"),
            (cv[0], {**cv[1], "language": "Klingon"}, "unknown language 'Klingon'"),
            (cv[0], {**cv[1], "task_type": "Base"}, "does only CustomVoice"),
            ({**cv[0], "ref_audio": ref_wav}, cv[1], "does not clone voices"),
        ],
        "VoiceDesign": [({**cv[0], "voice": "Vivian"}, cv[1], "no named voices")],
        "Base": [
            (cv[0] | {"voice": ""}, cv[1], "needs ref_audio"),
            (
                {**cv[0], "voice": "", "ref_audio": ref_wav},
                {**cv[1], "x_vector_only_mode": False},
                "needs ref_text",
            ),
            ({**cv[0], "voice": "", "ref_audio": "not base64!"}, cv[1], "ref_audio is neither"),
        ],
    }
    for task, cases in bad.items():
        results = run_talker(
            talkers[task],
            [(i, p) for i, p, _ in cases]
            + [
                request_of(
                    "vd" if task == "VoiceDesign" else "clone_xvec" if task == "Base" else "cv_en",
                    ref_wav,
                )[1:]
            ],
        )
        for (_, _, message), result in zip(cases, results, strict=False):
            assert isinstance(result, Exception) and message in str(result), (message, result)
        assert isinstance(results[-1], torch.Tensor)  # the good request beside them ran


def test_reference_audio_forms_agree(talkers, ref_wav):
    """A WAV path, its base64, a data: URI and 24 kHz samples give the voice encoder stage
    the same voice prompt, hence the same clone."""
    data = Path(ref_wav).read_bytes()
    forms = [
        ref_wav,
        base64.b64encode(data).decode(),
        "data:audio/wav;base64," + base64.b64encode(data).decode(),
        torch.from_numpy(sf.read(ref_wav, dtype="float32")[0]),
    ]
    prompts = [voice_encoder().encode({"ref_audio": f})["voice"] for f in forms]
    assert all(p == prompts[0] for p in prompts)
    _, inputs, params = request_of("clone_xvec", ref_wav, max_tokens=3)
    results = run_talker(talkers["Base"], [({**inputs, "ref_audio": f}, params) for f in forms])
    assert all(torch.equal(r, results[0]) for r in results)


def test_the_voice_encoder_stage_makes_the_prompt_the_talker_clones_from(plans, ref_wav):
    """The voice_encoder stage (an encoder stage: `voices.VoiceEncoder`) encodes the
    reference once into a voice prompt, x-vector and codes; a prompt passes it as it is (an
    uploaded voice, encoded before), no reference sends nothing, and a checkpoint that
    clones no voices refuses a reference. The talker loads no encoder."""
    backend = encoder_backend(stage_spec(plans["Base"], "voice_encoder"), "cpu")
    assert isinstance(backend, RequestEncoderBackend)
    encoder = backend.encoder
    prompt = encoder.encode({"ref_audio": ref_wav})["voice"]
    assert prompt.startswith(PROMPT_PREFIX)
    assert len(prompt) < 8000  # x-vector and 19 frames of codes
    x_vector, codes = voices.decode_prompt(prompt)
    assert x_vector.shape == (64,) and codes.shape == (19, 16)  # the tiny talker's width
    assert encoder.encode({"ref_audio": prompt}) == {"voice": prompt}
    assert encoder.encode({"ref_audio": None}) == {} == encoder.encode({"ref_audio": ""})
    with pytest.raises(Qwen3TTSError, match="clones no voices"):
        voice_encoder("CustomVoice").encode({"ref_audio": ref_wav})
    with pytest.raises(Qwen3TTSError, match="unencoded"):
        run_talker_unencoded(plans, ref_wav)


def test_requests_with_no_reference_pass_the_voice_encoder_beside_its_batch(plans, ref_wav):
    """A request with no reference costs the voice_encoder stage nothing, so its runner
    steps every such request at once beside its max_batch of references to encode: every
    CustomVoice request of a burst reaches the talker in the same turn (at max_batch 8,
    sixteen took two turns, and the talker prefilled them in two groups)."""
    backend = encoder_backend(stage_spec(plans["Base"], "voice_encoder"), "cpu")
    runner = StageRunner(backend.spec, backend, max_batch=1)
    for i, ref in enumerate(["", "", ref_wav, "", ref_wav, ""]):
        runner.start(f"r{i}", {})
        runner.feed(f"r{i}", "ref_audio", ref, True)

    def ended(events) -> list[str]:
        return sorted(e.request_id for e in events if e.end)

    first = runner.step()
    assert ended(first) == ["r0", "r1", "r2", "r3", "r5"]  # the 4 without, 1 reference
    assert [e.request_id for e in first if e.port == "voice"] == ["r2"]
    assert ended(runner.step()) == ["r4"]


def run_talker_unencoded(plans, ref_wav) -> None:
    """A Base talker given raw audio (no voice encoder stage before it) fails."""
    backend = TransformersAR(stage_spec(plans["Base"], "talker"), "cpu")
    assert not hasattr(backend.component, "encoders")
    _, inputs, params = request_of("clone_xvec", ref_wav)
    call = Call("raw", params, {p: InputStream(k) for p, k in backend.spec.inputs.items()})
    for port, stream in call.inputs.items():
        stream.push(inputs.get(port) or None, True)
    backend.component.request(call)


def test_admission_refuses_what_the_checkpoint_does_not_do(plans, ref_wav):
    """The family's admission checks (`Family.admission`) refuse at admission, naming the
    request's field, what the talker stage would fail: no stage runs for them."""
    cv_inputs = {"text": "Hi.", "voice": "Vivian"}
    prompt = {
        "ref_audio": voice_encoder().encode({"ref_audio": torch.from_numpy(reference_samples())})[
            "voice"
        ],
        "ref_text": "Hello there.",
    }
    bad = {
        "CustomVoice": [
            ({**cv_inputs, "voice": "Nobody"}, {}, "voice", "unknown speaker 'Nobody'"),
            (cv_inputs, {"language": "Klingon"}, "language", "unknown language 'Klingon'"),
            (cv_inputs, {"task_type": "Base"}, "task_type", "does only CustomVoice"),
            ({**cv_inputs, "ref_audio": ref_wav}, {}, "ref_audio", "does not clone voices"),
        ],
        "VoiceDesign": [(cv_inputs, {}, "voice", "no named voices")],
        "Base": [
            ({"text": "Hi."}, {}, "ref_audio", "needs ref_audio"),
            ({"text": "Hi.", "ref_audio": ref_wav}, {}, "ref_text", "needs ref_text"),
            ({"text": "Hi.", "ref_audio": "not base64!"}, {}, "ref_audio", "ref_audio is neither"),
            (
                {"text": "Hi.", "ref_audio": PROMPT_PREFIX + "AAAA"},
                {},
                "ref_audio",
                "not a readable voice prompt",
            ),
            (
                {**prompt, "text": "Hi.", "instructions": "Whisper."},
                {},
                "instructions",
                "takes no instructions",
            ),
        ],
    }
    good = {
        "CustomVoice": ({**cv_inputs, "voice": "vivian"}, {"language": "english"}),
        "VoiceDesign": ({"text": "Hi.", "instructions": "A low voice."}, {}),
        "Base": ({**prompt, "text": "Hi."}, {}),
    }
    for task, cases in bad.items():
        plan = plans[task]
        checks = preflight(plan)
        for inputs, params, field, message in cases:
            with pytest.raises(RequestError, match=message) as info:
                admit(plan, inputs, params, checks)
            assert info.value.field == field, (task, message)
        admitted = admit(plan, *good[task], checks)
        if task == "CustomVoice":  # any letter case; the model's own spelling goes on
            assert admitted.inputs["voice"] == "Vivian"
    # x_vector_only_mode needs no transcript.
    admit(plans["Base"], {"text": "Hi.", "ref_audio": ref_wav}, {"x_vector_only_mode": True},
          preflight(plans["Base"]))  # fmt: skip


# --- code2wav --------------------------------------------------------------------------------


def test_audio_is_the_reference_decoders(code2wav, golden):
    """The streamed code2wav stage on the reference's codes gives the reference speech
    tokenizer's waveform (`Qwen3TTSTokenizerV2Model.decode`)."""
    schedule = [1, 2, 4, 8]
    for name in CASES:
        (audio,) = stream_decode(code2wav, [(golden[f"{name}.codes"], schedule)])
        assert audio.shape == golden[f"{name}.audio"].shape
        assert float((audio - golden[f"{name}.audio"]).abs().max()) < AUDIO_TOLERANCE


def test_voice_clone_audio_is_the_references(plans, golden, ref_wav):
    """Both voice clones through the talker and code2wav stages give the waveform
    `generate_voice_clone` returns; for ICL that is the decode of the reference's codes and
    the new ones together with the reference's share cut, so the new audio's first frames
    hear the reference as context (decoding the new codes alone is far off)."""
    interpreter = Interpreter(plans["Base"])
    for name in ("clone_xvec", "clone_icl"):
        _, inputs, params = request_of(name, ref_wav)
        inputs["text"] = inputs.pop("prompt")
        audio = interpreter.run(inputs, params)["audio"].reshape(-1)
        wav = golden[f"{name}.wav"]
        assert audio.shape == wav.shape, name
        assert float((audio - wav).abs().max()) < AUDIO_TOLERANCE, name
    alone = golden["clone_icl.audio"]
    assert float((alone - golden["clone_icl.wav"]).abs().max()) > 1e-2


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_clones_first_frame_is_heard_as_soon_as_it_is_made(plans, talkers, ref_wav, decode):
    """An ICL clone sends its reference's frames ahead of its first frame (`ahead_codes`):
    the codes edge's writer sends them at once, off the edge's chunk schedule, so the first
    frame is the schedule's first chunk, alone; and code2wav, whose windows' grid starts
    after the context, plays that frame as soon as it has it. (Sent as frames of the
    stream, the reference's frames used up the schedule's first chunks, here 19 of them the
    1, 2, 4 and 8, and the first frame waited in a chunk of 16; a 5 s reference's 62, up to
    32, and a chunk of 64: seconds of talker steps before any audio.) With static windows
    the reference's is padded to one (eager where longer than all), the first frame's is one."""
    _, inputs, params = request_of("clone_icl", ref_wav)
    (call,) = calls_of(talkers["Base"], [(inputs, params)])
    while not call.finished:
        assert call.error is None, call.error
        talkers["Base"].step([call])
    talkers["Base"].drop(call)
    values = [v for port, v in call.emitted if port == "codes"]
    assert isinstance(values[0], Ahead) and not any(isinstance(v, Ahead) for v in values[1:])
    context = len(values[0].value)
    assert context == 19

    plan = plans["Base"]
    (edge,) = [c for c in plan.channels if c.name == CODES_EDGE]
    chunks = []
    writer = StreamWriter(edge, lambda rid, i, value, end, ending: chunks.append(value))
    for value in values:
        writer.write(call.request_id, value)
    writer.end(call.request_id)
    longest = max(edge.schedule)
    ahead = -(-context // longest)  # the reference's frames, in slots of the longest chunk
    sizes = [len(c) for c in chunks if c is not None]
    assert sum(sizes[:ahead]) == context and max(sizes[:ahead]) <= longest
    assert sizes[ahead] == edge.schedule[0] == 1  # the first frame: the first chunk, alone

    vocoder = Vocoder(stage_spec(plan, "code2wav", decode=decode), "cpu")

    def first_audio(*pushes: list) -> torch.Tensor:
        """The audio code2wav plays, pushed each list of chunks in turn and stepped (twice at
        most: a window of the reference's frames, then the first frame's)."""
        listen = Call("clone", {}, {"codes": InputStream("codes")})
        for push in (*pushes, []):
            for chunk in push:
                listen.inputs["codes"].push(chunk, False)
            vocoder.step([listen])
            assert listen.error is None, listen.error
            stream = listen.state["stream"]
            if push is pushes[0]:  # the first window: the reference's frames alone, silent
                assert stream.decoded == context and not listen.emitted
        assert stream.decoded == context + 1  # then the first frame, in a window of its own
        audio = torch.cat([v for port, v in listen.emitted if port == "audio"]).reshape(-1)
        vocoder.drop(listen)
        return audio

    # The reference's frames and the first frame at once, or the reference's alone (as it
    # comes: it is sent as the talker starts) and the first frame later: the same windows,
    # the first frame's audio, the same bits.
    together = first_audio(chunks[: ahead + 1])
    apart = first_audio(chunks[:ahead], chunks[ahead : ahead + 1])
    assert together.numel() == 1920 and torch.equal(together, apart)


def test_a_clones_reference_frames_are_not_counted_as_the_talkers_output(plans, ref_wav):
    """The talker's `num_tokens_out` (the per-stage stats a request reports) counts what it
    made, not the reference's frames it sent ahead of them."""
    _, inputs, params = request_of("clone_icl", ref_wav)
    inputs["text"] = inputs.pop("prompt")
    tables = []
    with Engine(plans["Base"], "inprocess", on_stats=tables.append) as engine:
        out = engine.generate(inputs, params)
    frames = out["audio"].numel() // 1920
    assert 0 < frames < 19  # the reference's 19 frames sent ahead would outnumber its own
    assert tables[-1].stages["talker"]["num_tokens_out"] in (frames, frames + 1)  # + its end


def test_streamed_decode_is_the_whole_decode(code2wav):
    """The decoder is causal (it looks no frame ahead, and back 22 frames on the tiny one)
    and carries each stream's state, so it re-decodes no context; streamed in any chunks,
    several requests in one forward, it gives the whole-utterance decode
    (tests/backends/test_stateful_vocoder.py: windows of 1, 3 and mixed, and cancels)."""
    assert code2wav.decoder.reach.lookahead == 0 and code2wav.decoder.reach.context == 22
    assert code2wav.stateful and code2wav.context == 0
    assert code2wav.decoder.samples_per_frame == 1920
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 128, (n, 16), generator=gen) for n in (60, 37, 5)]
    schedules = [[1, 2, 4, 8, 16, 32], [5], [2]]
    streamed = stream_decode(code2wav, list(zip(codes, schedules, strict=True)))
    model = code2wav.decoder.model
    with torch.inference_mode():
        for c, audio in zip(codes, streamed, strict=True):
            whole = model(c.T[None]).reshape(-1)
            assert audio.shape == whole.shape
            assert float((audio - whole).abs().max()) < AUDIO_TOLERANCE


# --- the pipeline ---------------------------------------------------------------------------
CODES_EDGE = "talker.codes->code2wav.codes"


def test_same_seed_same_bytes_through_the_graph():
    """graphs/qwen3_tts.omni on the tiny CustomVoice checkpoint, sampled: a seed replays the
    same audio bytes; another seed gives other audio."""
    interpreter = Interpreter(compile_file(str(GRAPH), devices="cpu", tiny=True))
    inputs = {"text": "Good morning.", "voice": "Ryan"}

    def audio(seed: int) -> bytes:
        out = interpreter.run(inputs, {"max_tokens": 6, "seed": seed, "language": "English"})
        assert out["audio"].dtype == torch.int16 and out["audio"].numel() == 6 * 1920
        return out["audio"].numpy().tobytes()

    first = audio(11)
    assert audio(11) == first and audio(12) != first


def test_a_paced_codes_edge_through_the_engine_sends_each_frame_while_its_listener_is_dry():
    """The graph through the engine, seeded, its codes edge paced as a GPU plan's is
    (`plays_s`; a CPU plan has none): a frame that plays for a nanosecond leaves the
    listener dry from the first packet on, so the talker's writer sends every frame as it is
    made and code2wav decodes each alone, a window of one frame a step; a frame that plays
    for 1000 s keeps the listener far ahead, and the chunks keep the schedule's grid (1, 2,
    4, ...), as unpaced. The audio is the same up to the carried state's rounding."""
    frames = 12
    params = {"max_tokens": frames, "seed": 11, "language": "English"}

    def run(plays_s: float | None) -> tuple[np.ndarray, int]:
        plan = compile_file(str(GRAPH), devices="cpu", tiny=True)
        ends = [c for p in plan.programs for c in (*p.inbound, *p.outbound, *p.local)]
        for channel in [*plan.channels, *ends]:
            if channel.name == CODES_EDGE:
                channel.plays_s = plays_s
        with Engine(plan, "inprocess") as engine:
            out = engine.generate({"text": "Good morning.", "voice": "Ryan"}, params)
            steps = sum(
                i.stages["code2wav"].steps
                for i in engine.inspect().values()
                if "code2wav" in i.stages
            )
        return out["audio"].numpy().astype(np.int32), steps

    (plain, plain_steps), (ahead, ahead_steps), (dry, dry_steps) = map(run, (None, 1e3, 1e-9))
    spoken = len(plain)  # frames of 1920 samples: this seed speaks 8 of its 12
    assert spoken >= 4
    assert ahead_steps == plain_steps < spoken  # windows of 1, 2, 4, ... frames
    assert dry_steps >= spoken  # one frame a window
    assert np.array_equal(ahead, plain)
    assert dry.shape == plain.shape and np.abs(dry - plain).max() <= 8  # pcm16 LSBs


def test_omniflow_run_writes_a_wav(tmp_path, capsys):
    code = main(
        ["run", str(GRAPH), "--once", "--tiny", "--mode", "inprocess",
         "--input", "text=Hello there.", "--input", "voice=Vivian",
         "--param", "max_tokens=5", "--out", str(tmp_path)]
    )  # fmt: skip
    capsys.readouterr()
    assert code == 0
    samples, rate = sf.read(tmp_path / "audio.wav", dtype="int16")
    # Sampled: the random talker may end its speech before its 5 frames.
    assert rate == 24000 and len(samples) % 1920 == 0 and 0 < len(samples) <= 5 * 1920


def test_the_graph_compiles_for_the_real_checkpoint():
    plan = compile_file(str(GRAPH), devices="1xH200")
    edge = next(c for c in plan.channels if c.src == "talker")
    assert edge.type == "codes"
    assert {s.name for s in plan.stages} >= {"talker", "code2wav"}


# --- the reference itself -----------------------------------------------------------------


def reference_cases(ref_wav: str) -> list[dict]:
    return [
        {
            "name": name,
            "model_dir": model_path(MODELS[task]),
            "task": task,
            "text": text,
            "language": language,
            "speaker": speaker,
            "instructions": instructions,
            "ref_audio": ref_wav,
            "ref_text": ref_text,
            "x_vector_only_mode": xvec,
            "non_streaming_mode": non_streaming,
            "max_new_tokens": FRAMES + 1,
        }
        for name, (
            task,
            text,
            language,
            speaker,
            instructions,
            ref_text,
            xvec,
            non_streaming,
        ) in CASES.items()
    ]


def make_golden(python: str, out: Path, workdir: Path) -> dict[str, torch.Tensor]:
    """Run the reference package (in the venv of `python`) on the cases; its outputs, with
    the reference audio they cloned."""
    samples = reference_samples()
    wav = workdir / "ref.wav"
    sf.write(wav, samples, 24000, subtype="FLOAT")
    cases = workdir / "cases.json"
    cases.write_text(json.dumps(reference_cases(str(wav))))
    script = Path(__file__).parent / "qwen_tts_reference.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [python, str(script), str(cases), str(out)], check=True, env=env, capture_output=True
    )
    made = load_file(out)
    made["ref_audio"] = torch.from_numpy(samples)
    return made


@pytest.mark.skipif(
    not os.environ.get("QWEN_TTS_PYTHON"), reason="QWEN_TTS_PYTHON (a python with qwen-tts) not set"
)
def test_golden_is_what_qwen_tts_makes(tmp_path, golden):
    made = make_golden(os.environ["QWEN_TTS_PYTHON"], tmp_path / "ref.safetensors", tmp_path)
    assert set(made) == set(golden)
    for key, value in made.items():
        if value.is_floating_point():
            assert float((value - golden[key]).abs().max()) < 1e-5, key
        else:
            assert torch.equal(value, golden[key]), key


if (
    __name__ == "__main__"
):  # python tests/families/test_qwen3_tts.py PYTHON: rewrite the golden file
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        made = make_golden(sys.argv[1], Path(work) / "ref.safetensors", Path(work))
    GOLDEN.parent.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(made.items())}, str(GOLDEN))
    print(GOLDEN)


def test_the_talker_in_bf16_is_the_checkpoints_weights_with_float32_rotary_frequencies():
    """As Qwen's package has them (transformers' `from_pretrained` keeps them float32 in a
    bf16 model): the talker's and its code predictor's, computed from the config."""
    from omniflow.families.qwen3_tts.talker import load

    talker = load(model_path(MODELS["CustomVoice"]), "talker", "cpu", torch.bfloat16).model
    rotaries = [m for m in talker.modules() if hasattr(m, "inv_freq")]
    assert len(rotaries) == 2  # the talker's, the code predictor's
    for rotary in rotaries:
        want, _ = rotary.compute_default_rope_parameters(rotary.config)
        assert rotary.inv_freq.dtype == torch.float32
        assert torch.equal(rotary.inv_freq, want)
    # made in bf16 and loaded: the checkpoint's tensors as bf16
    tensors = load_file(Path(model_path(MODELS["CustomVoice"])) / "model.safetensors")
    assert torch.equal(talker.codec_head.weight, tensors["talker.codec_head.weight"].bfloat16())
