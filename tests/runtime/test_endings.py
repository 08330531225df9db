"""A stage says why it ended a request's outputs and what the request cost it (`Ending`),
and that reaches the caller with the end of each output, across executor processes: "length"
at the token limit, "stop" at a stop token, with the prompt's tokens and every token made.
A stage that says nothing (here a python stage; a vocoder after a talker) passes on what
its input's producer said, so that the count reaches the output it feeds."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import omniflow
from omniflow.catalog.resolve import model_path
from omniflow.compiler import compile_source
from omniflow.hf_logging import quiet

SOURCE = """
pipeline chat {
  model "tiny:qwen2"
  param max_tokens = 6
  param stop = []
  stage lm = ar(max_batch=2, max_len=256, max_tokens=$max_tokens, temperature=0.0, stop=$stop)
  stage twice = python(fn=tests.runtime.stages.double, inputs="in:tokens", outputs="out:tokens")
  input prompt: chat -> lm
  lm.text -> output text [stream]
  lm.tokens -> output ids [stream]
  lm.tokens -> twice.in [stream]
  twice.out -> output doubled [stream]
}
"""
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
LM_OUTPUTS = ("text", "ids")


@pytest.fixture(scope="module")
def engine():
    with omniflow.launch(compile_source(SOURCE, "chat.omni", "cpu")) as engine:
        yield engine


def endings(engine, params):
    """Each output's Ending, and the token ids, of one request."""
    ended, ids = {}, []
    for chunk in engine.stream_sync({"prompt": CHAT}, params):
        if chunk.output == "ids" and chunk.value is not None:
            ids += chunk.value.reshape(-1).tolist()
        if chunk.end:
            ended[chunk.output] = chunk.ending
    return ended, ids


def test_the_token_limit_ends_with_length_and_the_counts(engine):
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_path("tiny:qwen2"))
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ended, ids = endings(engine, {"max_tokens": 5})
    assert len(ids) == 5
    for ending in (ended[o] for o in LM_OUTPUTS):  # the same on every output of the stage
        assert (ending.reason, ending.tokens) == ("length", 5)
        assert ending.prompt_tokens == len(tokenizer(text).input_ids)


def test_a_stop_token_ends_with_stop_after_the_tokens_made(engine):
    _, ids = endings(engine, {"max_tokens": 6})
    first_new = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    ended, stopped = endings(engine, {"max_tokens": 6, "stop": [ids[first_new]]})
    assert stopped == ids[: first_new + 1]  # the stop token is made, and counted
    assert {(ended[o].reason, ended[o].tokens) for o in LM_OUTPUTS} == {("stop", first_new + 1)}


def test_a_stage_that_says_nothing_passes_on_what_its_input_said(engine):
    ended, ids = endings(engine, {"max_tokens": 4})
    assert len(ids) == 4
    assert ended["doubled"] == ended["ids"]  # the lm's, through the python stage's process
    assert (ended["doubled"].reason, ended["doubled"].tokens) == ("length", 4)
