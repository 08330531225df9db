"""The request shapes vllm-omni's real clients send (../shared/reference/peer_api.md), as
they send them: the `/v1/models` check first, raw JSON with a literal nested `extra_body`
and a top-level `sampling_params_list`, every diffusion field at the top level, multipart
edits whose values are all strings."""

import base64
import io

import numpy as np
import pytest
import soundfile
from PIL import Image

QWEN_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group,capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)


@pytest.fixture(scope="module")
def http(served):
    with served.client() as client:
        yield client


def check_model(http, model: str) -> None:
    """What the peer's client does before every request but /videos."""
    reply = http.get("/v1/models")
    assert reply.status_code == 200
    assert model in [entry["id"] for entry in reply.json()["data"]]


def test_understanding_with_sampling_params_list_and_nested_extra_body(http):
    check_model(http, "omni_chat")
    body = {
        "model": "omni_chat",
        "messages": [
            {"role": "system", "content": QWEN_SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Describe the weather."}]},
        ],
        "modalities": ["text", "audio"],
        "sampling_params_list": [
            {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "seed": 7},
            {"max_tokens": 40, "temperature": 0.9, "top_p": 1.0, "repetition_penalty": 1.0, "seed": 7},
            {"seed": 7},
        ],
        "extra_body": {"mm_processor_kwargs": {"use_audio_in_video": False}},
    }  # fmt: skip
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["seed"] == 7
    choices = reply.json()["choices"]
    text = audio = None
    for choice in choices:  # the peer's loop: the last choice with a key wins
        message = choice["message"]
        if "content" in message:
            text = message["content"]
        if message.get("audio"):
            audio = message["audio"]["data"]
    assert text
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio)))
    assert rate == 24000 and len(samples) > 0


def test_one_sampling_dict_applies_to_every_stage(http):
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": "hi"}],
            "sampling_params_list": [{"temperature": 0.5, "seed": 3}], "modalities": ["text"]}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"max_tokens": 5}, {"max_tokens": 40}, {"max_tokens": 100}],
         "sampling_params_list[2].max_tokens: stage code2wav takes no 'max_tokens'"),
        ([{"min_p": 0.2}], "sampling_params_list[0].min_p"),
        ([{}, {}], "has 2 entries; pipeline 'omni_chat' has 3 stages (thinker, talker, code2wav)"),
        ([{"seed": 1}, {"seed": 2}, {}], "both set parameter 'seed'"),
    ],
)  # fmt: skip
def test_sampling_params_the_pipeline_cannot_take_are_named(http, entries, message):
    body = {"model": "omni_chat", "messages": [{"role": "user", "content": "hi"}],
            "sampling_params_list": entries}  # fmt: skip
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_image_generation_with_every_diffusion_field_at_the_top(http):
    check_model(http, "text_to_image")
    body = {"model": "text_to_image", "prompt": "a red boat", "size": "32x32",
            "response_format": "b64_json", "negative_prompt": "blurry", "n": 1,
            "num_inference_steps": 2, "guidance_scale": 7.5, "true_cfg_scale": 1.0,
            "vae_use_slicing": False, "vae_use_tiling": False, "seed": 9}  # fmt: skip
    reply = http.post("/v1/images/generations", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    image = Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))).convert("RGB")
    assert image.size == (32, 32)


def test_image_edit_multipart_as_the_peer_sends_it(http):
    check_model(http, "edit")
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buffer, format="PNG")
    sampling = {"n": 1, "num_inference_steps": 50, "guidance_scale": 7.5, "true_cfg_scale": 1.0,
                "vae_use_slicing": False, "vae_use_tiling": True, "seed": 5}  # fmt: skip
    fields = {"model": "edit", "prompt": "brighter", "size": "16x16",
              **{k: str(v) for k, v in sampling.items()}, "lora": "{}"}  # fmt: skip
    files = {"image": ("image.png", buffer.getvalue(), "image/png")}
    reply = http.post("/v1/images/edits", data=fields, files=files)
    assert reply.status_code == 200, reply.text
    image = Image.open(io.BytesIO(base64.b64decode(reply.json()["data"][0]["b64_json"])))
    assert image.size == (16, 16)


def test_speech_as_the_peer_sends_it(http):
    check_model(http, "tts")
    body = {"model": "tts", "input": "Hello there.", "voice": "Vivian", "response_format": "wav",
            "speed": 1.0, "max_new_tokens": 24}  # fmt: skip
    reply = http.post("/v1/audio/speech", json=body)
    assert reply.status_code == 200, reply.text
    samples, rate = soundfile.read(io.BytesIO(reply.content))
    assert rate == 24000 and len(samples) > 0
