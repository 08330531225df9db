"""What the server reports is what the pipeline did: finish reasons and usage as the stage
that made the text counted them (and the audio's codec tokens as the talker counted them,
beside), the OpenAI and vLLM sampling fields reaching the
pipeline's parameters or refused with a 400 naming them at their domains' edges, a prompt
too long for the compiled context refused before any stage runs, and audio deltas without
an empty transcript. Driven with the `openai` client and httpx against the shared server
(omni chat on the tiny Qwen2.5-Omni; tests/server/conftest.py)."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

from omniflow.catalog import load_component_config
from omniflow.catalog.resolve import model_path
from omniflow.hf_logging import quiet

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    with quiet():
        return AutoTokenizer.from_pretrained(model_path("tiny:qwen2.5-omni"))


def prompt_tokens(tokenizer, messages) -> int:
    """The thinker's prompt as its tokenizer counts it: the chat template's text."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text).input_ids)


def chat(client, **fields):
    return client.chat.completions.create(
        model="omni_chat", messages=MESSAGES, modalities=["text"], seed=3, **fields
    )


def test_a_reply_cut_by_its_token_limit_ends_with_length_and_exact_usage(client, tokenizer):
    for max_tokens in (4, 8, 16):
        reply = chat(client, max_tokens=max_tokens)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == max_tokens
        assert reply.usage.prompt_tokens == prompt_tokens(tokenizer, MESSAGES)
        assert reply.usage.total_tokens == max_tokens + reply.usage.prompt_tokens


def test_a_stop_string_ends_the_reply_in_the_stage_with_stop(client, tokenizer):
    full = chat(client, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    reply = chat(client, max_tokens=16, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[: full.index(stop)]
    # The thinker stopped itself (the pipeline has a `stop` parameter): its count, under 16.
    assert 1 <= reply.usage.completion_tokens < 16
    assert reply.usage.prompt_tokens == prompt_tokens(tokenizer, MESSAGES)


def test_the_streamed_usage_chunk_is_the_replys_usage(client):
    whole = chat(client, max_tokens=6)
    stream = chat(client, max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content
    )
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.model_dump() == whole.usage.model_dump()


def spoken(client, max_audio_tokens: int, **fields):
    """A reply in text and audio (16-bit PCM) whose talker makes at most `max_audio_tokens`."""
    return client.chat.completions.create(
        model="omni_chat",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"},
        seed=3,  # a seed whose talker ends itself after 4 codes
        max_tokens=6,
        extra_body={"max_audio_tokens": max_audio_tokens},
        **fields,
    )


def test_the_audio_usage_is_the_codec_tokens_the_talker_made(client):
    # Every code the talker made became `per_code` samples of the reply's audio, so the
    # audio says how many codes there were.
    per_code = load_component_config("tiny:qwen2.5-omni", "token2wav").samples_per_frame

    def codes(reply) -> int:
        samples = len(base64.b64decode(reply.choices[0].message.audio.data)) // 2
        assert samples % per_code == 0
        return samples // per_code

    cut, free = spoken(client, 4), spoken(client, 60)
    assert codes(cut) == codes(free) == 4  # the seed draws the same codes either way
    # The talker's own count: at its limit, its codes; ending itself, its end token too,
    # as the thinker's count has the text's end token.
    assert cut.usage.completion_tokens_details.audio_tokens == 4
    assert free.usage.completion_tokens_details.audio_tokens == 5
    for reply in (cut, free):  # beside the text's tokens, which the peer's clients read
        assert reply.usage.completion_tokens == 6
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_the_streamed_usage_chunk_counts_the_audio_too(client):
    whole = spoken(client, 60)
    stream = spoken(client, 60, stream=True, stream_options={"include_usage": True})
    (usage,) = [c.usage for c in stream if c.usage is not None]
    assert usage.completion_tokens_details.audio_tokens == 5
    assert usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 0.9},
        {"top_p": 1.0},
        {"extra_body": {"top_k": 40}},
        {"extra_body": {"top_k": -1}},
        {"extra_body": {"top_k": 0}},
        {"extra_body": {"repetition_penalty": 1.05}},
        {"extra_body": {"audio_top_p": 0.5, "audio_top_k": 10, "audio_repetition_penalty": 1.2}},
    ],
)
def test_sampling_fields_reach_the_pipeline(client, fields):
    reply = chat(client, max_tokens=3, temperature=0.7, **fields)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("top_p", 0, "top_p 0 (in (0, 1])"),
        ("top_p", 1.5, "top_p 1.5 (in (0, 1])"),
        ("top_k", -2, "top_k -2 (-1 or 0 or >= 1)"),
        ("repetition_penalty", 0, "repetition_penalty 0 (in [0.01, 100])"),
        ("repetition_penalty", -1.0, "repetition_penalty -1 (in [0.01, 100])"),
        ("repetition_penalty", 1e-45, "repetition_penalty 1e-45 (in [0.01, 100])"),
        ("temperature", -0.5, "temperature -0.5 (in [0, 100])"),
        ("audio_top_p", 0, "top_p 0 (in (0, 1])"),
    ],
)
def test_values_outside_a_samplers_domain_are_a_400_naming_the_field(client, field, value, rule):
    with pytest.raises(BadRequestError) as info:
        chat(client, max_tokens=3, extra_body={field: value})
    error = info.value.body
    assert error["param"] == field
    assert rule in error["message"]


def test_a_prompt_longer_than_the_compiled_context_is_a_400_before_any_stage(served, tokenizer):
    words = " ".join(f"sea{i}" for i in range(3000))
    messages = [{"role": "user", "content": words}]
    assert prompt_tokens(tokenizer, messages) > 4096  # the thinker's compiled max_len
    with httpx.Client(base_url=served.base, timeout=60) as http:
        before = http.get("/metrics").text
        response = http.post(
            "/v1/chat/completions",
            json={"model": "omni_chat", "messages": messages, "max_tokens": 2},
        )
        after = http.get("/metrics").text
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert (
        "at most 4096 tokens (max_len)" in error["message"]
        and "stage 'thinker'" in error["message"]
    )
    assert _tokens(before) == _tokens(after)  # refused at admission: no stage ran


def _tokens(metrics: str) -> float:
    """Text tokens omni chat's stages produced, from the Prometheus text."""
    name = 'omniflow_text_output_tokens_total{model="omni_chat"}'
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name)
    )


def test_streamed_audio_deltas_carry_no_empty_transcript(served):
    body = {
        "model": "omni_chat",
        "messages": MESSAGES,
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "pcm16"},
        "max_tokens": 4,
        "max_audio_tokens": 30,
        "stream": True,
    }
    audio = []
    with httpx.stream("POST", f"{served.url}/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if "audio" in delta:
                    audio.append(delta["audio"])
    assert audio and all(a.get("transcript", None) != "" for a in audio)
