"""The vLLM `ar` backend on tiny:qwen2-wide-heads, checked against vLLM's own `LLM` on the same model:
greedy tokens and text equal `LLM.chat`/`LLM.generate`, under the reference interpreter, the
in-process engine and executor processes; each runtime step streams one engine step; several
concurrent requests each get their own output; max_tokens, seeds, stop strings and stop ids
are honoured; ports vLLM cannot produce fail at construction.

vLLM lives in its own environment (scripts/vllm-env.sh); elsewhere this module skips.
"""

import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

# vLLM pins its own transformers, and a tiny checkpoint's manifest names the libraries that
# built it: sharing the main environment's cache would rebuild it back and forth.
os.environ.setdefault("OMNIFLOW_CACHE", os.path.join(sys.prefix, "omniflow-cache"))

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from omniflow.backends.vllm_ar import VllmAR, VllmBackendError  # noqa: E402
from omniflow.catalog.resolve import model_path  # noqa: E402
from omniflow.compiler import compile_source  # noqa: E402
from omniflow.runtime.engine import Engine  # noqa: E402
from omniflow.runtime.interpreter import Interpreter  # noqa: E402
from omniflow.runtime.stage import Call, StageSpec  # noqa: E402
from tests.backends.ar_requests import (  # noqa: E402
    PROMPTS,
    check_bad_parameters_fail_only_their_request,
    join_and_cancel,
    request,
)

CHAT = """
pipeline chat {
  model "tiny:qwen2-wide-heads"
  param max_tokens = 12
  stage lm = ar(backend="vllm", max_batch=4, max_tokens=$max_tokens, temperature=0.0)
  input prompt: chat -> lm
  lm.text -> output text [stream]
  lm.tokens -> output tokens [stream]
}
"""
TEXT = CHAT.replace("prompt: chat", "prompt: text")
HIDDEN = CHAT.replace("lm.tokens -> output tokens", "lm.hidden -> output hidden")
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_tokens": 16}


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def completion(output) -> tuple[list[int], str]:
    return list(output.outputs[0].token_ids), output.outputs[0].text


@pytest.fixture(scope="module")
def plan():
    return compile_source(CHAT, devices="cpu")


@pytest.fixture(scope="module")
def ref(plan):
    """vLLM's own outputs, from an `LLM` with the settings the backend gives its engine."""
    stage = plan.stage("lm")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as the backend's
        llm = LLM(
            model=model_path(stage.model),
            max_model_len=4096,
            max_num_seqs=stage.batch,
            kv_cache_memory_bytes=stage.kv_cache_bytes,
            enforce_eager=True,
        )
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    out = {
        "chat": [completion(o) for o in llm.chat([chat(p) for p in PROMPTS], greedy)],
        "text": [completion(o) for o in llm.generate(PROMPTS, greedy)],
    }
    full_text = out["chat"][0][1]
    out["stop_string"] = full_text[4:7]
    out["stop_id"] = out["chat"][0][0][5]
    for key, params in (
        ("stopped_by_string", {"stop": [out["stop_string"]]}),
        ("stopped_by_id", {"stop_token_ids": [out["stop_id"]]}),
        ("seed7", {**SAMPLED, "seed": 7}),
    ):
        params = {"temperature": 0.0, "max_tokens": 12} | params
        out[key] = completion(llm.chat(chat(PROMPTS[0]), SamplingParams(**params))[0])
    # Shut down before any backend starts: vLLM's engines share the process's torch.distributed
    # state, and shutting one down tears it down.
    llm.llm_engine.engine_core.shutdown()
    del llm
    return out


@pytest.fixture(scope="module")
def interpreter(plan, ref):
    interpreter = Interpreter(plan)
    yield interpreter
    for backend in interpreter.backends.values():
        backend.close()


@pytest.fixture(scope="module")
def backend(interpreter):
    return interpreter.backends["lm"]


def run(backend, calls: list[Call], joins=None, cancel=None) -> list[dict]:
    """Step the backend until every call is done, call i offered from step joins[i] on and
    dropped before step cancel[i]; per call, its tokens and the text pieces of every step."""
    joins = joins or [0] * len(calls)
    cancel = cancel or {}
    outs = [{"tokens": [], "pieces": [], "steps": []} for _ in calls]
    live: list[Call] = []
    for step in itertools.count():
        join_and_cancel(backend, calls, live, step, joins, cancel)
        if not live and step > max(joins):
            break
        ready = [c for c in live if backend.ready(c)]
        backend.step(ready)
        for call in ready:
            out = outs[calls.index(call)]
            assert call.error is None, call.error
            emitted = dict(call.emitted)
            call.emitted.clear()
            tokens = emitted.get("tokens")
            out["steps"].append(None if tokens is None else tuple(tokens.shape))
            if tokens is not None:
                assert tokens.dtype == torch.int64
                out["tokens"] += tokens.reshape(-1).tolist()
            if "text" in emitted:
                out["pieces"].append(emitted["text"])
            if call.finished:
                backend.drop(call)
                live.remove(call)
    assert backend.running == {}
    assert not backend.engine.has_unfinished_requests()
    return outs


def test_greedy_matches_vllm_chat_under_the_interpreter(interpreter, ref):
    for prompt, (tokens, text) in zip(PROMPTS, ref["chat"], strict=True):
        out = interpreter.run({"prompt": chat(prompt)})
        assert out["tokens"].reshape(-1).tolist() == tokens
        assert out["text"] == text


def test_text_prompts_match_vllm_generate(ref):
    interpreter = Interpreter(compile_source(TEXT, devices="cpu"))
    try:
        for prompt, (tokens, text) in zip(PROMPTS, ref["text"], strict=True):
            out = interpreter.run({"prompt": prompt}, {"max_tokens": 12})
            assert out["tokens"].reshape(-1).tolist() == tokens
            assert out["text"] == text
    finally:
        interpreter.backends["lm"].close()


def test_each_step_streams_one_engine_step_of_every_request(backend, ref):
    # Requests join at different steps, and request 1 is cancelled before step 4 (its vLLM
    # request is aborted); every step of a running request emits exactly its next token.
    calls = [request(p) for p in PROMPTS]
    outs = run(backend, calls, joins=[0, 1, 1, 3], cancel={1: 4})
    for i in (0, 2, 3):
        tokens, text = ref["chat"][i]
        assert outs[i]["tokens"] == tokens
        assert outs[i]["steps"] == [(1, 1)] * len(tokens)
        assert "".join(outs[i]["pieces"]) == text
        assert len(outs[i]["pieces"]) > 1  # the text streamed, not in one piece at the end
    assert outs[1]["tokens"] == ref["chat"][1][0][:3]  # steps 1 to 3


def test_max_tokens_seed_and_stops_are_honoured(backend, ref):
    assert run(backend, [request(PROMPTS[0], max_tokens=3)])[0]["tokens"] == ref["chat"][0][0][:3]

    seeded = run(backend, [request(PROMPTS[0], seed=7, **SAMPLED)])[0]
    assert (seeded["tokens"], "".join(seeded["pieces"])) == ref["seed7"]
    # The same seed beside other sampled requests draws the same; another seed does not.
    together = run(
        backend,
        [request(PROMPTS[0], seed=7, **SAMPLED), request(PROMPTS[1], seed=3, **SAMPLED)],
        joins=[1, 0],
    )
    assert together[0]["tokens"] == seeded["tokens"]
    assert run(backend, [request(PROMPTS[0], seed=8, **SAMPLED)])[0]["tokens"] != seeded["tokens"]
    assert seeded["tokens"] != ref["chat"][0][0][: len(seeded["tokens"])]  # it did sample

    by_string = run(backend, [request(PROMPTS[0], stop=[ref["stop_string"]])])[0]
    assert (by_string["tokens"], "".join(by_string["pieces"])) == ref["stopped_by_string"]
    by_id = run(backend, [request(PROMPTS[0], stop=[ref["stop_id"]])])[0]
    assert by_id["tokens"] == ref["stopped_by_id"][0]
    assert by_id["tokens"][-1] == ref["stop_id"]


def test_bad_parameters_fail_only_their_request(backend, ref):
    check_bad_parameters_fail_only_their_request(backend, VllmBackendError)
    assert backend.running == {}


def concurrent(engine, n: int) -> list[dict]:
    """The first n prompts submitted at once, each with its own max_tokens."""
    with ThreadPoolExecutor(n) as pool:
        jobs = [
            pool.submit(engine.generate, {"prompt": chat(p)}, {"max_tokens": 12 - i})
            for i, p in enumerate(PROMPTS[:n])
        ]
        return [job.result() for job in jobs]


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_concurrent_requests_through_the_engine(plan, ref, mode):
    with Engine(plan, mode) as engine:
        outs = concurrent(engine, 4 if mode == "inprocess" else 2)
    for i, out in enumerate(outs):
        tokens, text = ref["chat"][i]
        assert out["tokens"].reshape(-1).tolist() == tokens[: 12 - i]
        if len(tokens) <= 12 - i:  # it ended by itself: all of its text
            assert out["text"] == text


def test_ports_vllm_cannot_produce_fail_at_construction():
    plan = compile_source(HIDDEN, devices="cpu")
    spec = StageSpec.from_channels(plan.stage("lm"), plan.channels)
    with pytest.raises(VllmBackendError, match='hidden.*backend="transformers"'):
        VllmAR(spec, "cpu")
