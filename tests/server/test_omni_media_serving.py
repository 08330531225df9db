"""Omni input over HTTP: the official `openai` client sends Qwen2.5-Omni chats with media
parts (`image_url`, `input_audio`, `video_url`) to `omniflow run graphs/omni_chat.omni
--tiny`, its stages in executor processes; the text is the unsplit thinker's own `generate`
on the same processed inputs (tests/families/test_omni_media.py's reference), and the usage
counts the prompt and its media placeholders as the processor makes them. Corrupt parts are
a 400 naming the field, before any stage runs."""

from __future__ import annotations

import base64

import openai
import pytest
import torch
from transformers import AutoConfig

from omniflow.checkpoints.tiny import build_tiny
from omniflow.families.qwen2_5_omni import towers
from omniflow.hf_logging import quiet
from omniflow.media import audio_bytes, decode_audio, mp4_bytes
from tests.families import media_inputs as media
from tests.families.test_omni_media import MAX_TOKENS, processed, reference
from tests.server.conftest import GRAPHS, ServerProcess

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(
        [str(GRAPHS / "omni_chat.omni"), "--tiny", "--param", f"max_tokens={MAX_TOKENS}",
         "--param", "max_audio_tokens=4"]
    )  # fmt: skip
    yield server
    code, err = server.stop()
    assert code == 0, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _ask(client, content, **extra):
    reply = client.chat.completions.create(
        model="omni_chat",
        messages=[{"role": "user", "content": content}],
        modalities=["text"],
        seed=1,
        extra_body=extra or None,
    )
    return reply.choices[0].message.content


def _text(ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny("qwen2.5-omni")).decode(
        ids, skip_special_tokens=True
    )


def _image_and_audio():
    """A message with an image part and an audio part: its content as a client sends it,
    and the chat and media the processor takes for it."""
    image = media.image(3, 56, 84)
    wav = audio_bytes(media.audio(1.2, 330.0), 16000, "wav")
    heard = decode_audio(wav)[0]  # what the server hears: the clip as 16-bit PCM
    content = [
        {"type": "image_url", "image_url": {"url": media.data_uri("image/png", media.png(image))}},
        {"type": "text", "text": "and"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "What is in there?"},
    ]  # fmt: skip
    chat = media.user({"type": "image"}, {"type": "text", "text": "and"}, {"type": "audio"})
    return content, chat, {"image": image, "input_audio": heard}


def test_image_and_audio_parts_in_one_message(client):
    content, chat, items = _image_and_audio()
    want = reference(build_tiny("qwen2.5-omni"), chat, items)
    assert _ask(client, content) == _text(want)


def test_the_usage_counts_the_media_placeholders_the_processor_puts_in_the_prompt(client):
    content, chat, items = _image_and_audio()
    usage = client.chat.completions.create(
        model="omni_chat",
        messages=[{"role": "user", "content": content}],
        modalities=["text"],
        seed=1,
    ).usage
    path = build_tiny("qwen2.5-omni")
    ids, _ = processed(path, chat, items)
    with quiet():
        config = AutoConfig.from_pretrained(path).thinker_config
    placeholders = {
        kind: int((ids == getattr(config, f"{kind}_token_id")).sum())
        for kind in ("audio", "image", "video")
    }
    assert placeholders["audio"] and placeholders["image"] and not placeholders["video"]
    assert usage.prompt_tokens == ids.shape[1]
    details = usage.prompt_tokens_details
    got = {kind: getattr(details, f"{kind}_tokens") for kind in placeholders}
    assert got == placeholders


def test_a_video_file_is_sampled_as_the_processor_does(client):
    frames = media.frames(12)
    data = mp4_bytes(frames, fps=4)  # 3 s: the processor's 2 fps keep 6 frames
    sampled = towers.sample_frames(
        torch.frombuffer(bytearray(data), dtype=torch.uint8),
        towers.video_settings(build_tiny("qwen2.5-omni")),
        2,
    )
    assert len(sampled) == 6
    content = [
        {"type": "video_url", "video_url": {"url": media.data_uri("video/mp4", data)}},
        {"type": "text", "text": "What is in there?"},
    ]
    chat = [{"role": "user", "content": [{"type": "video"}, content[1]]}]
    want = reference(build_tiny("qwen2.5-omni"), chat, {"video": sampled})
    assert _ask(client, content) == _text(want)


def test_a_text_only_chat_still_answers(client):
    assert _ask(client, "Tell me a short story.")


@pytest.mark.parametrize(
    "part,field",
    [
        ({"type": "image_url", "image_url": {"url": media.data_uri("image/png", b"not a png")}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}},
         "input_audio"),
        ({"type": "video_url", "video_url": {"url": media.data_uri("video/mp4", b"not a video")}}, "video_url"),
    ],
)  # fmt: skip
def test_a_corrupt_part_is_a_400_naming_it(client, part, field):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, [part, {"type": "text", "text": "hi"}])
    assert info.value.body["param"] == f"messages[0].content[0].{field}"


@pytest.mark.parametrize(
    "options",
    [{"mm_processor_kwargs": {"use_audio_in_video": True}},
     {"mm_processor_kwargs": {"use_audio_in_video": "yes"}},
     {"use_audio_in_video": True}],  # (the top level: `_ask` puts these in extra_body)
)  # fmt: skip
def test_use_audio_in_video_needs_the_videos_audio_track(client, options):
    """Wherever it is set and however a true value is spelled, the video's audio goes in:
    this one has none."""
    data = mp4_bytes(media.frames(4), fps=2)  # no audio stream
    content = [{"type": "video_url", "video_url": {"url": media.data_uri("video/mp4", data)}}]
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, content, **options)
    assert info.value.body["param"] == "messages[0].content[0].video_url"
    assert "audio track" in info.value.body["message"]


def test_use_audio_in_video_reads_as_the_pipelines_parameter_does(client):
    """ "no" is false, as the pipeline's parameter reads it (it once turned the video's
    audio on), and a value that is no boolean is a 400 naming it."""
    data = mp4_bytes(media.frames(4), fps=2)
    content = [{"type": "video_url", "video_url": {"url": media.data_uri("video/mp4", data)}}]
    assert isinstance(_ask(client, content, mm_processor_kwargs={"use_audio_in_video": "no"}), str)
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, content, mm_processor_kwargs={"use_audio_in_video": 5})
    assert info.value.body["param"] == "mm_processor_kwargs.use_audio_in_video"


def test_an_unknown_processor_option_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, "hi", mm_processor_kwargs={"fps": 3})
    assert info.value.body["param"] == "mm_processor_kwargs.fps"


def test_media_past_the_plans_lengths_are_a_400_before_any_stage_runs(client):
    """Media are counted at admission from their sizes (`Family.media_tokens`): a video of
    more embeddings than the vision stage was compiled for (max_len 4096), two videos within
    it alone but past it together, and a video and a clip within their towers' lengths but
    past the thinker's 4096 prompt tokens together, are a 400 `context_length_exceeded`
    naming the input that brings the most by its part (`messages` where it has several;
    they failed in their stage as a 500)."""

    def video(frames: int) -> dict:  # 448 x 448 px at 2 fps: 256 embeddings a pair of frames
        data = mp4_bytes(torch.zeros(frames, 448, 448, 3, dtype=torch.uint8), fps=2)
        return {"type": "video_url", "video_url": {"url": media.data_uri("video/mp4", data)}}

    wav = audio_bytes(media.audio(20.0, 330.0), 16000, "wav")  # 500 embeddings
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}  # fmt: skip
    ask = {"type": "text", "text": "What is in there?"}
    first = "messages[0].content[0].video_url"
    refused = [
        ([video(36), ask], first, "'video' is media of 4609 embedding rows; stage 'vision'"),
        ([video(20), video(20), ask], "messages", "of 5122 embedding rows; stage 'vision'"),
        ([video(30), clip, ask], first, "'video' brings 3840 tokens to a prompt of at least 4"),
    ]  # (18 x 256 + a header row; 2 x (10 x 256 + 1); 15 x 256 beside 500 and the text)
    for content, param, says in refused:
        with pytest.raises(openai.BadRequestError) as info:
            _ask(client, content)
        body = info.value.body
        assert body["code"] == "context_length_exceeded" and body["param"] == param, body
        assert says in body["message"], body["message"]
    assert _ask(client, [video(30), ask])  # alone, within both


def test_input_audio_takes_base64_or_a_data_uri(client):
    """OpenAI's `input_audio.data` is base64; a data: URI (as some clients send) is heard the
    same; neither is a 400 that says it is not base64 "nor a data: URI"."""
    wav = base64.b64encode(audio_bytes(media.audio(1.0, 330.0), 16000, "wav")).decode()
    for data in (wav, f"data:audio/wav;base64,{wav}"):
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        assert isinstance(_ask(client, [part, {"type": "text", "text": "hi"}]), str)
    part = {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, [part, {"type": "text", "text": "hi"}])
    assert info.value.body["message"].endswith("not valid base64"), info.value.body
