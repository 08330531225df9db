"""Omni input over HTTP on Qwen3-Omni: the official `openai` client sends a chat with an
image part and an audio part to `omniflow run graphs/qwen3_omni.omni --tiny`; the text is
the unsplit model's own `generate` on the same processed inputs
(tests/families/test_qwen3_omni_media.py's reference), and the talker speaks it."""

from __future__ import annotations

import base64

import openai
import pytest
import torch

from omniflow.checkpoints.tiny import build_tiny
from omniflow.media import audio_bytes, decode_audio
from tests.families import media_inputs as media
from tests.families.test_qwen3_omni_media import MAX_TOKENS, reference_text
from tests.server.conftest import GRAPHS, ServerProcess

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server():
    # Its executors threads of one process (they start in seconds; executor processes are
    # tested with omni chat's media, test_omni_media_serving.py).
    server = ServerProcess(
        [str(GRAPHS / "qwen3_omni.omni"), "--tiny", "--mode", "inprocess",
         "--param", f"max_tokens={MAX_TOKENS}", "--param", "max_audio_tokens=4"]
    )  # fmt: skip
    yield server
    code, err = server.stop()
    assert code == 0, err


def test_image_and_audio_parts_in_one_message(server):
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    path = build_tiny("qwen3-omni")
    image = media.image(3, 64, 96)
    wav = audio_bytes(media.audio(1.2, 330.0), 16000, "wav")
    heard = decode_audio(wav)[0]  # what the server hears: the clip as 16-bit PCM
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="qwen3_omni",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": media.data_uri("image/png", media.png(image))},
                    },
                    {"type": "text", "text": "and"},
                    {
                        "type": "input_audio",
                        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
                    },
                    {"type": "text", "text": "What is in there?"},
                ],
            }
        ],  # fmt: skip
        seed=1,
    )
    chat = media.user({"type": "image"}, {"type": "text", "text": "and"}, {"type": "audio"})
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()
    want = reference_text(path, model, chat, {"image": image, "input_audio": heard})
    message = reply.choices[0].message
    assert message.content == AutoTokenizer.from_pretrained(path).decode(
        want, skip_special_tokens=True
    )
    assert message.audio is not None and base64.b64decode(message.audio.data)  # it speaks
