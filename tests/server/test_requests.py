"""What the server makes of requests, over raw HTTP (httpx): every mistake is a 4xx in
OpenAI's error schema naming the field, never a 5xx; fields reach the pipeline's
parameters or are refused, never dropped."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from omniflow.media import audio_bytes

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
WAV = base64.b64encode(audio_bytes(torch.zeros(1600), 16000, "wav")).decode()


@pytest.fixture(scope="module")
def http(served):
    with served.client() as client:
        yield client


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def error_of(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# (endpoint, JSON body, status, what the message says, the `param` it names)
MISTAKES = [
    (CHAT, {"model": "probe", "messages": HI, "foo": 1, "bar": 2}, 400,
     "unknown fields 'foo', 'bar' for pipeline 'probe'", "foo"),
    (CHAT, {"model": "omni_chat", "messages": HI, "audio": {"voice": "Ethan", "fmt": "wav"}}, 400,
     "unknown field", "audio.fmt"),
    (CHAT, {"model": "probe", "messages": []}, 400, "at least 1", "messages"),
    (CHAT, {"model": "probe"}, 400, "required field is missing", "messages"),
    (CHAT, {"model": "probe", "messages": [{"role": "robot", "content": "x"}]}, 400, "should be 'system'",
     "messages[0].role"),
    (CHAT, {"model": "probe", "messages": [{"role": "user", "content": None}]}, 400,
     "required: a string or a list of parts", "messages[0].content"),
    (CHAT, {"model": "probe", "messages": [{"role": "user"}]}, 400,
     "required: a string or a list of parts", "messages[0].content"),
    (CHAT, {"model": "probe", "messages": [*HI, {"role": "user", "content": []}]}, 400,
     "a list of parts (at least one)", "messages[1].content"),
    # A part that is wrong inside the list is named, not the string `content` might have been.
    (CHAT, {"model": "probe", "messages": [{"role": "user", "content": [{"type": "file"}]}]}, 400,
     "'file' found using 'type' does not match", "messages[0].content[0]"),
    (CHAT, {"model": "probe", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "required field is missing", "messages[0].content[0].text"),
    (CHAT, {"model": "probe", "messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"}, *HI]}, 400,
     "tool calls are not supported", "messages[0]"),
    (CHAT, {"model": "probe", "messages": [{"role": "assistant", "audio": {"id": "a1"}}, *HI]},
     400, "keeps no audio between requests", "messages[0].audio"),
    (CHAT, {"model": "probe", "messages": HI, "max_tokens": "7"}, 400, "valid integer",
     "max_tokens"),
    (CHAT, {"model": "probe", "messages": HI, "temperature": 0.5}, 400,
     "unknown field 'temperature'", "temperature"),
    (CHAT, {"model": "omni_chat", "messages": HI, "max_tokens": 100000}, 400,
     "stage 'thinker' was compiled for max_tokens=2048", "max_tokens"),
    # Past 64 bits: it stopped the engine when it was sent to the executors.
    (CHAT, {"model": "omni_chat", "messages": HI, "top_k": 10**20}, 400,
     "'top_k' must be at most 9223372036854775807 (64 bits)", "top_k"),
    (CHAT, {"model": "omni_chat", "messages": HI, "max_completion_tokens": 0}, 400,
     "must be at least 1", "max_completion_tokens"),
    (CHAT, {"model": "omni_chat", "messages": HI, "max_tokens": 3, "max_completion_tokens": 4},
     400, "both set parameter 'max_tokens'", None),
    (CHAT, {"model": "omni_chat", "messages": HI, "presence_penalty": 0.5}, 400,
     "unknown field 'presence_penalty'", "presence_penalty"),
    (CHAT, {"model": "omni_chat", "messages": HI, "top_p": 0}, 400,
     "parameter 'top_p' is out of its domain: top_p 0 (in (0, 1])", "top_p"),
    (CHAT, {"model": "omni_chat", "messages": HI, "audio": {"voice": "Bob"}}, 400,
     "unknown speaker 'Bob'; the model has Chelsie, Ethan", "audio.voice"),
    (CHAT, {"model": "omni_chat", "messages": HI, "audio": {"format": "mp3"}}, 400,
     "use one of wav, pcm16, pcm, flac", "audio.format"),
    (CHAT, {"model": "omni_chat", "messages": HI, "stream": True, "audio": {"format": "flac"}},
     400, "streamed audio is wav or pcm16", "audio.format"),
    (CHAT, {"model": "omni_chat", "messages": HI, "n": 2}, 400, "'n' must be 1", "n"),
    (CHAT, {"model": "probe", "messages": HI, "stream_options": {"include_usage": True}}, 400,
     "stream_options are for streamed replies: set stream to true", "stream_options"),
    (CHAT, {"model": "image_understanding", "messages": HI, "modalities": ["audio"]}, 400,
     "pipeline 'image_understanding' serves /v1/chat/completions; its outputs: text (text)",
     "modalities"),
    (CHAT, {"model": "tts", "messages": HI}, 400,
     "pipeline 'tts' serves /v1/audio/speech", "model"),
    (CHAT, {"model": "nope", "messages": HI}, 404, "model 'nope' is not served here; served: "
     "omni_chat, tts, text_to_image, image_understanding, probe, edit", "model"),
    (CHAT, {"messages": HI}, 404, "no 'model' given", "model"),
    (CHAT, {"model": "probe", "messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400,
     "up to 4", "stop"),
    (CHAT, {"model": "probe", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "not an image file", "messages[0].content[0].image_url"),
    (CHAT, {"model": "omni_chat", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400,
     "remote URLs are off", "messages[0].content[0].image_url"),
    (CHAT, {"model": "image_understanding", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}]}]}, 400,
     "takes no audio input", "messages"),
    (CHAT, {"model": "probe", "messages": [{"role": "user", "content": [{"type": "video_url",
        "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}, 400, "not a video file",
     "messages[0].content[0].video_url"),
    (CHAT, {"model": "probe", "messages": HI, "extra_body": {"max_tokens": 3}, "max_tokens": 4},
     400, "different values", "extra_body.max_tokens"),
    (CHAT, {"model": "probe", "messages": HI, "extra_body": {"extra_body": {"max_tokens": 3}}},
     400, "merged into the request once", "extra_body.extra_body"),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "extra_body": {"extra_body": {"x": 1}}},
     400, "merged into the request once", "extra_body.extra_body"),
    (CHAT, {"model": "probe", "messages": HI, "seed": -1}, 400, "must be at least 0", "seed"),
    (CHAT, {"model": "probe", "messages": HI, "seed": 1 << 63}, 400,
     "must be at most 9223372036854775807 (64 bits), not 9223372036854775808", "seed"),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "response_format": "ogg"}, 400,
     "use one of wav, pcm, flac, mp3, opus, aac", "response_format"),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "speed": 8.0}, 400,
     "'speed' must be in 0.25 .. 4", "speed"),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "voice": "Nobody"}, 400,
     "unknown speaker 'Nobody'", None),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "stream": True,
                          "response_format": "flac"}, 400, "streamed speech", "response_format"),
    ("/v1/audio/speech", {"model": "tts", "input": "hi", "task_type": "Base"}, 400,
     "unknown field 'task_type'", "task_type"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "size": "big"}, 400,
     "WIDTHxHEIGHT", "size"),
    # Another script's digits (which int() reads) are not a size.
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "size": "\u0663\u0662x\u0663\u0662"},
     400, "WIDTHxHEIGHT", "size"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "size": "99999x32"},
     400, "compiled for width=1024", "size"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "response_format": "url"},
     400, "answers b64_json", "response_format"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "n": 11}, 400,
     "less than or equal to 10", "n"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "guidance_scale_2": 4.0},
     400, "unknown field 'guidance_scale_2'", "guidance_scale_2"),
    ("/v1/images/generations", {"model": "text_to_image", "prompt": "x", "lora": {"name": "a"}},
     400, "unknown field 'lora'", "lora"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, status, message, param", MISTAKES, ids=[m[3][:40] for m in MISTAKES]
)
def test_a_mistake_is_a_4xx_naming_the_field(http, path, body, status, message, param):
    error = error_of(http.post(path, json=body), status)
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, not an array"),
        (b"null", "must be a JSON object, not null"),
        (b'{"model": "probe", "messages": [], "x": NaN}', "NaN is not a JSON number"),
        (b"\xff\xfe", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_malformed_bodies_are_400(http, body, message):
    reply = http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert message in error_of(reply, 400)["message"]


def test_one_model_is_retrieved_by_its_id_as_the_list_has_it(http):
    """OpenAI's `models.retrieve`: a served name is its list entry, any other a 404 naming
    `model` (not "no route"); `/v1/models/` is still the list."""
    listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    reply = http.get("/v1/models/probe")
    assert reply.status_code == 200 and reply.json() == listed["probe"]
    for odd in ("nope", "probe/x", "..%2F..", "%00", "probe%20"):
        error = error_of(http.get(f"/v1/models/{odd}"), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
    assert http.get("/v1/models/", follow_redirects=True).json()["data"] == list(listed.values())


def test_unknown_routes_and_methods_answer_in_openai_s_schema(http):
    assert "no route /v1/nothing" in error_of(http.post("/v1/nothing", json={}), 404)["message"]
    error_of(http.get(CHAT), 405)


def test_pipeline_parameters_pass_at_the_top_or_in_extra_body(http):
    reply = http.post(CHAT, json={"model": "omni_chat", "messages": HI, "speaker": "Ethan",
                                  "extra_body": {"max_audio_tokens": 30, "audio_temperature": 0.5},
                                  "modalities": ["audio"], "seed": 1})  # fmt: skip
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["data"]
    assert reply.headers["x-omniflow-seed"] == "1" and reply.json()["seed"] == 1


def test_neutral_values_of_fields_the_pipeline_lacks_are_accepted(http):
    reply = http.post(CHAT, json={"model": "probe", "messages": HI, "top_p": 1.0, "n": 1,
                                  "presence_penalty": 0, "frequency_penalty": 0.0,
                                  "logprobs": False, "user": "me", "metadata": {"a": "b"}})  # fmt: skip
    assert reply.status_code == 200, reply.text


def test_a_temperature_too_small_to_divide_by_decodes_greedily(http):
    """(1e-45 divided the logits into infinities, and the draw failed on NaN: a 500.)"""

    def text(temperature: float) -> str:
        body = {"model": "omni_chat", "messages": HI, "max_tokens": 8, "modalities": ["text"],
                "temperature": temperature}  # fmt: skip
        reply = http.post(CHAT, json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    assert text(1e-45) == text(5e-324) == text(0.0)


def test_more_images_than_the_pipeline_runs_at_once_is_a_400_not_a_wait(http):
    """n images are n requests admitted together: more than the pipeline's limit would wait
    in its queue for ever (and every request behind them, until the wait's 503)."""
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    limit = models["text_to_image"]["max_in_flight"]
    assert limit < 10  # (the tiny graph's, under OpenAI's own bound of 10)
    body = {"model": "text_to_image", "prompt": "a cat", "size": "16x16", "n": limit + 1}
    error = error_of(http.post("/v1/images/generations", json=body, timeout=10), 400)
    assert error["param"] == "n" and f"must be 1 to {limit}: pipeline" in error["message"]
    reply = http.post("/v1/images/generations", json={**body, "n": limit}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["data"]) == limit


def test_stop_strings_cut_the_text_and_end_the_request(http, served):
    def ask(stop):
        return http.post(
            CHAT,
            json={"model": "probe", "messages": [{"role": "user", "content": "one two three"}],
                  "stop": stop},
        ).json()["choices"][0]  # fmt: skip

    assert ask("two")["message"]["content"] == "one "
    assert ask(["thr", "zzz"])["message"]["content"] == "one two "
    assert ask("zzz")["message"]["content"] == "one two three "


def test_a_streamed_stop_holds_back_only_what_could_start_a_stop_string(http):
    body = {"model": "probe", "messages": [{"role": "user", "content": "aa bb cc dd"}],
            "stop": "cc", "stream": True}  # fmt: skip
    with http.stream("POST", CHAT, json=body) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines
    )
    assert text == "aa bb "


def test_image_parts_need_a_pipeline_with_an_image_input(http):
    url = "data:image/png;base64," + base64.b64encode(png(np.zeros((8, 8, 3), np.uint8))).decode()
    body = {"model": "probe", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}]}  # fmt: skip
    error = error_of(http.post(CHAT, json=body), 400)
    assert "pipeline 'probe' takes no image input" in error["message"]
    assert "pipelines here that do: omni_chat, image_understanding" in error["message"]


def test_bare_base64_is_an_image_and_a_local_path_is_not_read(http, tmp_path):
    """The shared server allows no media directory: a path or file:// URL is refused, an
    existing file as a missing one (tests/server/test_hostile_media.py: allowed ones)."""
    pixels = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    (tmp_path / "x.png").write_bytes(png(pixels))
    body = {"model": "image_understanding", "max_tokens": 2, "messages": [{"role": "user",
            "content": [{"type": "image_url", "image_url": base64.b64encode(png(pixels)).decode()},
                        {"type": "text", "text": "?"}]}]}  # fmt: skip
    assert http.post(CHAT, json=body).status_code == 200
    errors = []
    for url in (str(tmp_path / "x.png"), f"file://{tmp_path / 'x.png'}",
                str(tmp_path / "missing.png")):  # fmt: skip
        body["messages"][0]["content"][0]["image_url"] = url
        errors.append(error_of(http.post(CHAT, json=body), 400))
    assert all(e == errors[0] for e in errors)
    assert errors[0]["param"] == "messages[0].content[0].image_url"
    assert "--allowed-media-dir" in errors[0]["message"]


# --- /v1/images/edits: multipart, every value a string --------------------------------------
def edit(http, fields: dict, image: bytes | None = b"png", **files):
    payload = {}
    if image is not None:
        pixels = np.full((16, 16, 3), 10, np.uint8)
        payload["image"] = ("image.png", png(pixels) if image == b"png" else image, "image/png")
    payload.update(files)
    return http.post("/v1/images/edits", data=fields, files=payload)


def test_edit_string_values_parse_as_the_fields_types(http):
    fields = {"model": "edit", "prompt": "invert", "size": "16x16", "n": "2",
              "num_inference_steps": "50", "guidance_scale": "7.5", "true_cfg_scale": "4",
              "vae_use_tiling": "True", "vae_use_slicing": "False", "seed": "42",
              "lora": "{}", "response_format": "b64_json"}  # fmt: skip
    reply = edit(http, fields)
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert len(data) == 2 and reply.json()["seed"] == 42
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))))
    assert (image == 245).all()


@pytest.mark.parametrize(
    "fields, files, message, param",
    [
        ({"prompt": "x", "num_inference_steps": "fifty"}, {}, "must be an integer", "num_inference_steps"),
        ({"prompt": "x", "guidance_scale": "nan"}, {}, "must be a number", "guidance_scale"),
        ({"prompt": "x", "vae_use_tiling": "maybe"}, {}, "a boolean (True or False)", "vae_use_tiling"),
        ({"prompt": "x", "lora": "{bad"}, {}, "a JSON dict", "lora"),
        ({"prompt": "x", "colour": "red"}, {}, "unknown field 'colour'", "colour"),
        ({"prompt": "x", "n": "0"}, {}, "'n' must be 1 to 8: pipeline 'edit' runs 8 requests at once", "n"),
        ({}, {}, "'prompt' is missing", "prompt"),
        ({"prompt": "x"}, {"mask": ("mask.png", b"x", "image/png")}, "takes no image named 'mask'", "mask"),
    ],
)  # fmt: skip
def test_edit_mistakes_name_the_field(http, fields, files, message, param):
    error = error_of(edit(http, {"model": "edit", **fields}, **files), 400)
    assert message in error["message"] and error["param"] == param


def test_edit_needs_an_image_a_decodable_one_and_multipart(http):
    assert (
        "image to edit is missing"
        in error_of(edit(http, {"model": "edit", "prompt": "x"}, None), 400)["message"]
    )
    assert (
        "not an image file"
        in error_of(edit(http, {"model": "edit", "prompt": "x"}, b"junk"), 400)["message"]
    )
    reply = http.post("/v1/images/edits", json={"model": "edit", "prompt": "x"})
    assert "multipart/form-data" in error_of(reply, 400)["message"]
    assert "serves /v1/images/generations" in error_of(
        edit(http, {"model": "text_to_image", "prompt": "x"}), 400
    )["message"]  # fmt: skip


def test_health_and_openapi(http):
    assert http.get("/health").json()["status"] == "ok"
    schema = http.get("/openapi.json").json()
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_a_photo_past_the_plans_buffer_is_scaled_down_to_fit(http):
    """A photo larger than the plan's image buffer (omni chat's 1024 x 1024 RGB: a phone's
    12 MP photo is past it) is seen scaled down to fit, its aspect kept, not refused; the
    usage counts the image tokens of what the model saw: as many as the same picture sent
    at that size, within a merged patch's row of rounding. Two photos share the buffer."""

    def ask(*sides: tuple[int, int]) -> dict:
        parts = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
                png(np.full((h, w, 3), 90, dtype=np.uint8))).decode()}}
            for w, h in sides
        ] + [{"type": "text", "text": "what?"}]  # fmt: skip
        body = {"model": "omni_chat", "max_tokens": 2, "modalities": ["text"],
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip
        reply = http.post(CHAT, json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]

    big, fitted = ask((2400, 1600))["image_tokens"], ask((1254, 836))["image_tokens"]
    assert abs(big - fitted) <= 45, (big, fitted)  # 1254 x 836: 2400 x 1600 scaled to 1 MP
    assert ask((2400, 1600), (1600, 2400))["image_tokens"] > 0


def test_a_null_text_field_is_its_default(http):
    """`negative_prompt: null` is the input's default, as null is for every other field
    (it was a 400 "must be a string"): the same image as without it."""
    body = {"model": "text_to_image", "prompt": "a cat", "size": "16x16", "seed": 3,
            "response_format": "b64_json"}  # fmt: skip
    plain = http.post("/v1/images/generations", json=body)
    null = http.post("/v1/images/generations", json={**body, "negative_prompt": None})
    assert plain.status_code == null.status_code == 200, null.text
    assert null.json()["data"] == plain.json()["data"]
