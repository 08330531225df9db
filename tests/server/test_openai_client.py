"""The official `openai` package against a real server: chat (text; text and audio; streamed
with audio), speech, image generation and edit, chat with an image; the files decode."""

import base64
import io

import numpy as np
import pytest
import soundfile
from openai import OpenAI
from PIL import Image

RATE = 24000


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)


def png_data_uri(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_models_lists_every_served_pipeline(client):
    ids = {m.id for m in client.models.list()}
    assert ids == {"omni_chat", "tts", "text_to_image", "image_understanding", "probe", "edit"}


def test_chat_text(client):
    reply = client.chat.completions.create(
        model="probe", messages=[{"role": "user", "content": "hello there world"}]
    )
    assert reply.choices[0].message.content == "hello there world "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3


def test_chat_text_only_from_omni_chat(client):
    reply = client.chat.completions.create(
        model="omni_chat",
        messages=[{"role": "user", "content": "Hi"}],
        modalities=["text"],
        max_tokens=4,
    )
    message = reply.choices[0].message
    assert message.content and message.audio is None


def test_chat_text_and_audio_decodes_at_the_pipelines_rate(client):
    reply = client.chat.completions.create(
        model="omni_chat",
        messages=[
            {"role": "system", "content": "You are Qwen."},
            {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
        ],
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        max_completion_tokens=5,
        seed=11,
        extra_body={"max_audio_tokens": 60},
    )
    message = reply.choices[0].message
    assert message.content
    assert message.audio.transcript == message.content and message.audio.expires_at > 0
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert rate == RATE and len(samples) > 0


def test_the_same_seed_replays_a_chat(client):
    def ask():
        return (
            client.chat.completions.create(
                model="omni_chat",
                messages=[{"role": "user", "content": "Hi"}],
                temperature=0.7,
                seed=5,
                extra_body={"max_audio_tokens": 30},
            )
            .choices[0]
            .message
        )

    first, second = ask(), ask()
    assert (first.content, first.audio.data) == (second.content, second.audio.data)


def test_streamed_chat_sends_audio_before_the_end(client):
    stream = client.chat.completions.create(
        model="omni_chat",
        messages=[{"role": "user", "content": "Hi"}],
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"},
        max_tokens=6,
        seed=4,  # a seed whose reply has several audio chunks (the tiny talker stops at random)
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_audio_tokens": 240},
    )
    events, pcm, text = [], b"", ""
    for chunk in stream:
        if not chunk.choices:
            events.append("usage")
            continue
        delta = chunk.choices[0].delta
        audio = delta.model_dump().get("audio")
        if audio and audio.get("data"):
            events.append("audio")
            pcm += base64.b64decode(audio["data"])
        elif delta.content:
            events.append("text")
            text += delta.content
        if chunk.choices[0].finish_reason:
            events.append("finish")
    assert text and pcm and len(pcm) % 2 == 0
    # several audio deltas, the first well before the stream ends; usage comes last
    assert events.count("audio") >= 2
    assert events.index("audio") < events.index("finish") and events[-1] == "usage"


def test_speech_whole_and_streamed(client):
    reply = client.audio.speech.create(
        model="tts", voice="Vivian", input="Good morning.", response_format="wav"
    )
    samples, rate = soundfile.read(io.BytesIO(reply.content))
    assert rate == RATE and len(samples) > 0
    with client.audio.speech.with_streaming_response.create(
        model="tts", voice="Vivian", input="Good morning.", response_format="pcm"
    ) as streamed:
        pieces = list(streamed.iter_bytes())
    assert sum(map(len, pieces)) > 0 and sum(map(len, pieces)) % 2 == 0


def test_image_generation_pngs_decode(client):
    reply = client.images.generate(
        model="text_to_image",
        prompt="a red boat",
        size="32x32",
        n=2,
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 3},
    )
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in reply.data]
    assert [i.size for i in images] == [(32, 32), (32, 32)]
    assert images[0].tobytes() != images[1].tobytes()  # seeds 3 and 4


def test_image_edit_pngs_decode(client, tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    path = tmp_path / "in.png"
    Image.fromarray(pixels).save(path)
    with path.open("rb") as image:
        reply = client.images.edit(model="edit", image=image, prompt="invert it")
    edited = np.asarray(Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))))
    assert edited.shape == (24, 40, 3) and (edited == 255 - pixels).all()


def test_chat_with_an_image_on_the_image_understanding_pipeline(client):
    pixels = np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    reply = client.chat.completions.create(
        model="image_understanding",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_uri(pixels)}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        max_tokens=3,
    )
    assert reply.choices[0].message.content
