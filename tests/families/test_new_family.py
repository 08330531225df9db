"""A model family added from outside omniflow (tests/families/plain_chat: its descriptor,
its run-time half, its tiny checkpoint, its published config) compiles, runs in executor
processes and serves over HTTP, without a line of omniflow changed: registered in this
process with `register`, and in a server process through OMNIFLOW_FAMILIES.

Its component prompts the LM with a transcript, not the tokenizer's chat template, so the
text it answers is the family's code at work: it must equal `generate` on that transcript.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import omniflow
from omniflow import families
from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.compiler import compile_graph, load_graph
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from tests.families import plain_chat
from tests.families.plain_chat.runtime import transcript

GRAPH = Path(plain_chat.__file__).parent / "chat.omni"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 8


@pytest.fixture
def registered():
    families.register(plain_chat.FAMILY)
    yield
    families.unregister(plain_chat.FAMILY.name)


def reference_text(model_dir: str) -> str:
    """`generate` on the family's transcript of CHAT, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(transcript(CHAT), return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_without_the_family_its_model_is_unknown():
    with pytest.raises(OmniflowError, match="unknown model 'example/plain-chat-lm'"):
        compile_graph(load_graph(GRAPH), "cpu")


def test_the_family_compiles_its_hub_id_and_lowers_its_code(registered):
    plan = compile_graph(load_graph(GRAPH), "1xH200")
    (stage,) = plan.stages
    assert stage.family.name == "plain_chat"
    assert stage.family.code == {"transformers": "tests.families.plain_chat.runtime:load"}
    # The published config sized it: 0.6B parameters in bf16.
    assert 1.0e9 < stage.weight_bytes < 1.4e9


def test_the_family_runs_in_executor_processes(registered):
    graph = use_tiny_models(load_graph(GRAPH))
    assert graph.model == "tiny:plain-chat"
    with omniflow.launch(compile_graph(graph, "cpu")) as engine:
        outputs = engine.generate({"prompt": CHAT})
    assert outputs["text"] == reference_text(model_path("tiny:plain-chat"))


def test_the_family_serves_over_http():
    from openai import OpenAI

    from tests.server.conftest import ServerProcess

    env = {families.PLUGINS_ENV: "tests.families.plain_chat"}
    server = ServerProcess([str(GRAPH), "--tiny"], env=env)
    try:
        client = OpenAI(base_url=server.url, api_key="unused")
        reply = client.chat.completions.create(
            model="plain_chat", messages=CHAT, max_tokens=MAX_TOKENS
        )
    finally:
        code, _ = server.stop()
    assert code == 0
    families.register(plain_chat.FAMILY)  # the tiny checkpoint the server built, read here
    try:
        expected = reference_text(model_path("tiny:plain-chat"))
    finally:
        families.unregister(plain_chat.FAMILY.name)
    assert reply.choices[0].message.content == expected
    assert os.environ.get(families.PLUGINS_ENV) is None  # nothing leaked into this process
