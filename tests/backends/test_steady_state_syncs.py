"""The serving hot paths make no host sync in a steady-state step (issue 38): on one GPU every
stage of a plan is stepped by one thread, so one stage's sync stalls them all.

Each test runs a stage's steps on CUDA under torch's sync debug mode "error"
(`omniflow/runtime/sync_debug.py`: any `.item()`, `.tolist()`, `.cpu()`, blocking copy,
`nonzero`, mask index... of a CUDA tensor raises), requests batched, joining and leaving:
- Qwen3-TTS's talker on its captured frame step (decode="graphs"), greedy and sampled, and
  its code2wav on its captured windows, two streams beside each other;
- Qwen3-Omni's thinker and talker, both captured (MoE layers; the talker's frame step), the
  talker fed by the thinker's rows, and its code2wav on its captured windows;
- Qwen2.5-Omni's token2wav on its captured windows, three streams;
- Qwen-Image's denoiser (tiny:text-to-image) on its fused blocks, requests at different
  steps sharing forwards, with and without padded prompt rows, the steps in which they start
  too (a text-to-image request's prompt lengths come to the host without waiting, its
  latents are drawn on the host and its scheduler set there, both sent without waiting);
  and its edit pipeline's (tiny:image-edit), whose requests' input images are sent up and
  encoded by the VAE without waiting too.

Left out, per request: an `ar` stage's step in which a request starts (some request of the
step had not started before it). That step builds the request's prompt (tokenised, looked
up, a voice clone's reference codes brought to the host for the decoder to send ahead),
prefills it and joins it to its slot: once per request, and docs/architecture.md lists
a prompt's encoding among the syncs left. Those steps run under "warn" instead, so the GPU
log names what they sync. (Wan2.2's denoiser is not checked: UniPC's step, diffusers' own,
copies its coefficients up from pageable memory every step.) A vocoder leaves nothing out:
its first step of a stream opens it (host state) and sends the codes like every later one
(`readback.upload`).

On the CPU (the GPU tests' set-up, docs/testing.md) the same steps run on the static paths
(the captured steps' buffers, eagerly), where the modes change nothing: the counts say
which steps the GPU checks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from omniflow.backends.registry import load_backend
from omniflow.backends.transformers_ar import _STATE as AR_STATE
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_file, compile_source
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.stage import Call
from omniflow.runtime.sync_debug import ENV, StepSyncs
from tests.backends.test_diffusion import Stages, output, request
from tests.backends.test_stateful_vocoder import Driver, code2wav, request_codes
from tests.backends.test_token2wav_graphs import requests as token2wav_requests
from tests.backends.test_token2wav_graphs import vocoder as token2wav
from tests.backends.test_vocoders import run as run_vocoder
from tests.families.test_qwen3_tts import (  # noqa: F401 (fixtures)
    frame_requests,
    golden,
    plans,
    ref_wav,
    serve_frames,
    talker_backend,
)
from tests.gpu_wiring import cpu_decode, stage_spec
from tests.kernels.test_moe_static_decode import PIPELINE

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]
GRAPHS = Path(__file__).parents[2] / "graphs"


@functools.cache
def tiny_plan(graph: str):
    return compile_file(GRAPHS / graph, devices="cpu", tiny=True)


def on_device(device: str) -> str:
    """The decode mode serving takes on `device`'s GPU: "graphs"; on the CPU "static"."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "graphs" if device.startswith("cuda") else "static"


class SteadySyncs:
    """`backend`'s steps from now on: one in which some request starts (`key`: what the
    backend keeps in a started request's state; an `ar` stage's by default) under sync
    debug `starts` ("warn" by default), every other under "error"; counted."""

    def __init__(self, backend, key: str = AR_STATE, starts: str = "warn"):
        self.step, self.key, self.starts = backend.step, key, starts
        self.checked = self.starting = 0
        backend.step = self

    def __call__(self, calls: list[Call]) -> None:
        steady = all(self.key in call.state for call in calls)
        self.checked += steady
        self.starting += not steady
        with StepSyncs("error" if steady else self.starts):
            self.step(calls)


# --- Qwen3-TTS --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_tts_talkers_frame_steps_make_no_host_sync(plans, ref_wav, device):  # noqa: F811
    """Four requests (one sampled, seeded) joining at steps 0..3, one ending early and one
    dropped mid-way: every step after the four starts runs under "error"."""
    talker = talker_backend(plans["CustomVoice"], on_device(device), device)
    assert talker.decode == on_device(device) and talker.static.frames is not None
    syncs = SteadySyncs(talker)
    requests = frame_requests(ref_wav)
    frames = serve_frames(talker, requests)
    assert syncs.starting == len({join for _, _, join, _ in requests})
    # A frame a step: the longest request's frames, less those of the steps others started in.
    assert syncs.checked >= max(len(f) for f in frames) - syncs.starting > 4


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_tts_code2wav_windows_make_no_host_sync(monkeypatch, plans, device):  # noqa: F811
    """Two streams, the second starting three frames in, a frame a round on the schedule
    1, 2, 4, 8, through the executor's StageRunner with OMNIFLOW_SYNC_DEBUG=error: every
    step checked, the first of each stream too."""
    decode = on_device(device)
    monkeypatch.setenv(ENV, "error")
    vocoder = code2wav(plans["CustomVoice"], [1, 2, 4, 8], device, decode=decode)
    assert_streams_whole(vocoder, decode)


def assert_streams_whole(vocoder, decode: str) -> None:
    """`request_codes` streamed through `vocoder` (a `Driver`, which fails on any error a
    step raised): each stream's audio comes out whole, the windows captured where asked."""
    assert vocoder.decode_mode == decode
    codes = request_codes()
    audio = Driver(vocoder, codes).run()
    for i, frames in enumerate(codes):
        assert audio[f"r{i}"].shape == (len(frames) * vocoder.decoder.samples_per_frame,)
    graphs = vocoder.decoder.graphs
    assert (graphs.replays > 0) == (decode == "graphs")


# --- Qwen3-Omni -------------------------------------------------------------------------------


def omni_ar_stages(device: str) -> tuple[Interpreter, SteadySyncs, SteadySyncs]:
    """tiny:qwen3-omni's thinker and talker (test_moe_static_decode's pipeline, 8 frames
    sampled) on `device` in an interpreter, both on the decode serving takes there, each
    step watched."""
    torch.set_num_threads(1)
    decode = on_device(device)
    # The interpreter loads its stages on the CPU: theirs replaced below.
    source = PIPELINE.format(frames=8, temperature=0.9, decode=cpu_decode(decode))
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    watched = []
    for name in ("thinker", "talker"):
        interpreter.backends[name].close()
        backend = TransformersAR(stage_spec(interpreter.plan, name, decode=decode), device)
        assert backend.decode == decode
        interpreter.backends[name] = backend
        watched.append(SteadySyncs(backend))
    return interpreter, *watched


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_omni_thinker_and_talker_steps_make_no_host_sync(device):
    """Three requests (two seeds of one prompt, another prompt), one after another: each
    stage's steps after its start under "error" (the talker's receive steps before its
    prefill too: the thinker's rows, their roles read back without waiting)."""
    interpreter, thinker, talker = omni_ar_stages(device)
    prompts = ["Hello! How are you today?", "Hello! How are you today?", "Say something."]
    frames = 0
    for seed, prompt in enumerate(prompts):
        chat = [{"role": "user", "content": prompt}]
        out = interpreter.run({"prompt": chat}, {"speaker": "Chelsie", "seed": seed})
        assert out["codes"].shape[1:] == (16,) and len(out["codes"]) > 1
        frames += len(out["codes"])
    assert thinker.starting == len(prompts) and thinker.checked >= 2 * len(prompts)
    # Its first frame comes from the step it starts in, each of the others from a step.
    assert talker.checked >= frames - len(prompts)


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_omni_code2wav_windows_make_no_host_sync(monkeypatch, device):
    decode = on_device(device)
    monkeypatch.setenv(ENV, "error")
    plan = tiny_plan("qwen3_omni.omni")
    assert_streams_whole(code2wav(plan, [1, 2, 4, 8], device, decode=decode), decode)


# --- Qwen2.5-Omni -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_qwen2_5_omni_token2wav_windows_make_no_host_sync(device):
    """Three streams on their own schedules (a ramp, chunks of 15 and of 4; one unguided),
    every step of them under "error", its first of a stream too (which opens it: its
    speaker's conditioning was made at load, its noise is drawn on the host and sent)."""
    decode = on_device(device)
    vocoder = token2wav(tiny_plan("omni_chat.omni"), device, decode=decode)
    assert vocoder.decode_mode == decode
    batch = token2wav_requests()
    with StepSyncs("error"):
        audio = run_vocoder(vocoder, batch)
    for got, (codes, _, _) in zip(audio, batch, strict=True):
        assert isinstance(got, torch.Tensor) and len(got) == len(codes)
    graphs = vocoder.decoder.graphs
    assert (graphs.replays > 0) == (decode == "graphs")


# --- diffusion --------------------------------------------------------------------------------


def denoiser_stages(graph: str, device: str) -> tuple[Stages, SteadySyncs]:
    """A tiny diffusion graph's encoder and denoiser loaded on `device`, and the denoiser's
    steps checked from now on, the steps in which a request starts too."""
    on_device(device)
    interpreter = Interpreter(tiny_plan(graph))
    for name in ("encoder", "dit"):
        interpreter.backends[name].close()
        interpreter.backends[name] = load_backend(interpreter.specs[name], device)
    return Stages(interpreter), SteadySyncs(interpreter.backends["dit"], "denoising", "error")


@pytest.mark.parametrize("device", DEVICES)
def test_qwen_image_denoising_steps_make_no_host_sync(device):
    """Two guided requests of different prompt lengths (padded rows: a mask) and an
    unguided one, starting a step apart, then sharing forwards with and without padding:
    every step under "error", the steps in which they start too."""
    stages, dit = denoiser_stages("text_to_image.omni", device)
    requests = {
        "a": request("a red cat", 4),
        "b": request("a green field under a wide blue sky", 4),
        "c": request("a red dog", 3, guidance=1.0),
    }
    calls = stages.denoiser_calls(requests)
    a, b, c = calls.values()
    stages.run("dit", [[a], [a, b], [a, b], [a, b, c], [b, c], [c]])
    assert dit.starting == 3 and dit.checked == 3
    for call in calls.values():
        assert output(call, "latents").device.type == torch.device(device).type


@pytest.mark.parametrize("device", DEVICES)
def test_qwen_image_edit_denoising_steps_make_no_host_sync(device):
    """Two edits, one guided, starting a step apart: every step under "error", the steps in
    which they start (the input image sent up and VAE-encoded) too."""
    stages, dit = denoiser_stages("image_edit.omni", device)
    image = torch.randint(0, 256, (40, 56, 3), generator=torch.Generator().manual_seed(0))

    def edit(prompt: str, steps: int, guidance: float = 4.0) -> tuple:
        inputs, params = request(prompt, steps, guidance)
        return {**inputs, "image": image.to(torch.uint8)}, params

    requests = {"a": edit("Make the cat blue.", 3), "b": edit("Make it night.", 2, 1.0)}
    calls = stages.denoiser_calls(requests)
    a, b = calls.values()
    stages.run("dit", [[a], [a, b], [a, b]])
    assert dit.starting == 2 and dit.checked == 1
    for call in calls.values():
        assert output(call, "latents").device.type == torch.device(device).type
