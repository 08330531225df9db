"""Qwen2.5-Omni split into a thinker stage and a talker stage (the transformers `ar`
backend, joined by the `qwen_omni` adapters) gives exactly what the unsplit model's own
`generate` gives on tiny:qwen2.5-omni with greedy decoding: the same text tokens and text,
and the same codec ids, under the reference interpreter and the engine in both modes,
one request at a time and several at once.

The plan here is the thinker and talker of graphs/omni_chat.omni with text, tokens and
codes as outputs (the codes through `qwen_omni.talker_to_code2wav`, as token2wav gets
them); the code2wav stage belongs to the vocoder backend's tests. The same holds on the
static-cache decode path (`decode="static"`: the step CUDA graphs capture, run eagerly);
on a GPU, graph replay gives that path's codes."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omniflow.backends.static_decode import COLUMN_QUANTUM
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni.checkpoints import omni_prompt_ids, reference_omni_generate
from omniflow.families.qwen2_5_omni.thinker_talker import (
    _CONDITIONING,
    talker_to_code2wav,
    thinker_to_talker,
)
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestFailed
from omniflow.runtime.stage import Call, InputStream
from tests.gpu_wiring import stage_spec, stages_on_cpu

torch.set_num_threads(1)

TALKER_MAX_TOKENS = 48
SOURCE = f"""
pipeline omni_ar {{
  model "tiny:qwen2.5-omni"
  param max_tokens = 24
  param speaker = "Chelsie"
  stage thinker = ar(component="thinker", max_batch=4, max_tokens=$max_tokens, temperature=0.0)
  # Greedy; the repetition penalty is the talker's default (1.05), as in generate().
  stage talker  = ar(component="talker", max_batch=4, max_tokens={TALKER_MAX_TOKENS}, temperature=0.0,
                    speaker=$speaker)
  input prompt: chat -> thinker
  thinker.hidden -> talker [stream, chunk=1, adapter=qwen_omni.thinker_to_talker]
  thinker.text -> output text [stream]
  thinker.tokens -> output tokens [stream]
  talker.tokens -> output codec_tokens [stream]
  talker.codes -> output codes [stream, adapter=qwen_omni.talker_to_code2wav]
}}
"""
# (prompt, thinker max_tokens, speaker): the talker ends with its pad id, ends with its
# eos id, and runs to its max_tokens past the end of a short reply; another speaker.
CASES = [
    ("what the red red world how the", 24, "Chelsie"),
    ("why", 24, "Chelsie"),
    ("Tell me a short story.", 6, "Chelsie"),
    ("Hi", 5, "Ethan"),
]


@pytest.fixture(scope="module")
def references():
    path = build_tiny("qwen2.5-omni")
    return [
        reference_omni_generate(
            path,
            prompt,
            max_new_tokens=max_tokens,
            speaker=speaker,
            talker_max_new_tokens=TALKER_MAX_TOKENS,
            token2wav_num_steps=1,
        )
        for prompt, max_tokens, speaker in CASES
    ]


@pytest.fixture(scope="module")
def plan():
    return compile_source(SOURCE, devices="cpu")


def decoding(decode: str, devices: str = "cpu"):
    """The plan with both stages on the `decode` path."""
    source = SOURCE.replace("= ar(", f'= ar(decode="{decode}", ')
    assert source.count(f'decode="{decode}"') == 2
    return compile_source(source, devices=devices)


@pytest.fixture(scope="module")
def static_plan():
    return decoding("static")


def run_case(run, case) -> dict:
    prompt, max_tokens, speaker = case
    return run({"prompt": prompt}, {"max_tokens": max_tokens, "speaker": speaker})


def assert_matches(out: dict, ref) -> None:
    assert out["tokens"].reshape(-1).tolist() == ref.text_ids.tolist()
    assert out["text"] == ref.text
    assert out["codes"].shape == (len(ref.codec_ids), 1)
    assert out["codes"].reshape(-1).tolist() == ref.codec_ids.tolist()
    # The talker's own ids: the codes, then its end-of-speech id if it stopped early.
    raw = out["codec_tokens"].reshape(-1).tolist()
    assert raw[: len(ref.codec_ids)] == ref.codec_ids.tolist()
    assert len(raw) == min(len(ref.codec_ids) + 1, TALKER_MAX_TOKENS)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_interpreter_matches_generate(plan, static_plan, references, decode):
    interpreter = Interpreter(plan if decode == "eager" else static_plan)
    outs = [run_case(interpreter.run, case) for case in CASES]
    for out, ref in zip(outs, references, strict=True):
        assert_matches(out, ref)
    # The cases cover each way the talker ends: its pad id, its eos id, max_tokens.
    assert [int(out["codec_tokens"][-1]) for out in outs[:2]] == [128, 130]
    assert len(references[2].codec_ids) == TALKER_MAX_TOKENS


@pytest.mark.parametrize("mode", ["inprocess", "process", "inprocess-static"])
def test_engine_matches_generate(plan, static_plan, references, mode):
    mode, _, decode = mode.partition("-")
    with Engine(static_plan if decode else plan, mode) as engine:
        for case, ref in zip(CASES, references, strict=True):
            assert_matches(run_case(engine.generate, case), ref)
        # All at once: the stages batch them, rows joining and leaving at different steps.
        with ThreadPoolExecutor(len(CASES)) as pool:
            outs = list(pool.map(lambda case: run_case(engine.generate, case), CASES))
        for out, ref in zip(outs, references, strict=True):
            assert_matches(out, ref)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_talker_rows_waiting_for_the_thinker_idle_in_the_batch(
    plan, static_plan, references, decode
):
    """The stages driven directly, the edge's adapter applied as the runtime applies it:
    each talker request gets its thinker rows at its own pace, so in most steps some rows
    wait (masked dummy columns in the others' forward; on the static path, rows computed
    and not advanced) and still give generate's codes."""
    plan = plan if decode == "eager" else static_plan
    thinker, talker = (
        TransformersAR(stage_spec(plan, name), "cpu") for name in ("thinker", "talker")
    )
    edge = thinker_to_talker(plan.stage("thinker"))
    conditioning = []
    for prompt, max_tokens, _ in CASES:
        call = Call(
            "t", {"max_tokens": max_tokens, "temperature": 0.0}, {"prompt": InputStream("chat")}
        )
        call.inputs["prompt"].push([{"role": "user", "content": prompt}], end=True)
        while not call.finished:
            thinker.step([call])
        thinker.drop(call)
        conditioning.append(edge(torch.cat([v for port, v in call.emitted if port == "hidden"])))
    calls = []
    for i, (_, _, speaker) in enumerate(CASES):
        params = {"max_tokens": TALKER_MAX_TOKENS, "temperature": 0.0, "speaker": speaker}
        calls.append(Call(f"c{i}", params, {"embeds": InputStream("hidden")}))
    sent = [int((rows[:, 1, 0] == 0).sum()) for rows in conditioning]
    for call, rows, prompt in zip(calls, conditioning, sent, strict=True):
        call.inputs["embeds"].push(rows[:prompt], end=False)  # the prompt rows come at once
    codes = [[] for _ in calls]
    idle = 0
    for step in range(1000):
        for i, (call, rows) in enumerate(zip(calls, conditioning, strict=True)):
            if step % (i + 2) == 0 and sent[i] < len(rows):  # call i gets a row every i+2 steps
                sent[i] += 1
                call.inputs["embeds"].push(rows[sent[i] - 1 : sent[i]], end=sent[i] == len(rows))
        ready = [c for c in calls if not c.finished and talker.ready(c)]
        idle += len({id(s.call) for s in talker.rows} - {id(c) for c in ready})
        talker.step(ready)
        for i, call in enumerate(calls):
            codes[i] += [int(v) for port, v in call.emitted if port == "codes"]
            call.emitted.clear()
        if all(c.finished for c in calls):
            break
    for call in calls:
        talker.drop(call)
    assert talker.rows == [] and talker.cache is None
    assert idle > 20  # row-steps spent waiting in the batch
    for got, ref in zip(codes, references, strict=True):
        assert got[: len(ref.codec_ids)] == ref.codec_ids.tolist()
        assert len(got) == min(len(ref.codec_ids) + 1, TALKER_MAX_TOKENS)


def test_a_thinker_prompt_at_max_len_fits_the_talkers_cache():
    """A thinker prompt at its max_len, with the talker's whole max_tokens, fits the
    talker's static cache, which holds the speaker's and first reply's rows the talker's
    prompt adds (the family's `added_positions`) beside max_len + max_tokens."""
    from transformers import AutoTokenizer

    prompt = "Tell me a short story."
    tokenizer = AutoTokenizer.from_pretrained(build_tiny("qwen2.5-omni"))
    length = omni_prompt_ids(tokenizer, prompt).shape[1]
    talker_tokens = COLUMN_QUANTUM - length  # max_len + max_tokens: one quantum exactly
    source = SOURCE.replace("max_batch=4,", f"max_batch=4, max_len={length},")
    source = source.replace(f"max_tokens={TALKER_MAX_TOKENS}", f"max_tokens={talker_tokens}")
    interpreter = Interpreter(compile_source(source.replace("= ar(", '= ar(decode="static", ')))
    assert interpreter.backends["talker"].static.columns >= length + 2 + talker_tokens
    out = interpreter.run({"prompt": prompt}, {"max_tokens": 2})
    assert len(out["codes"]) > 0


def test_adapters_work_row_by_row(plan):
    items = torch.randn(5, 3, 8)
    items[:, 2] = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])[:, None]
    rows = thinker_to_talker(plan.stage("thinker"))
    whole = rows(items)
    assert torch.equal(whole[:, 0], items[:, 0] + items[:, 1])
    assert torch.equal(whole[:, 1], items[:, 2])
    assert torch.equal(torch.cat([rows(items[:2]), rows(items[2:])]), whole)

    frames = talker_to_code2wav(plan.stage("talker"))
    ids = torch.tensor([[5], [127], [128], [3], [130]])  # tiny codes are 0..127
    assert frames(ids).reshape(-1).tolist() == [5, 127, 3]
    assert torch.equal(torch.cat([frames(ids[:3]), frames(ids[3:])]), frames(ids))


def test_the_talker_takes_prompt_rows_only_before_reply_rows(plan):
    """A chunk's roles say where the prompt ends: prompt rows first, then reply rows, and no
    prompt row once a reply row has come; otherwise the request fails with that reason."""
    talker = TransformersAR(stage_spec(plan, "talker"), "cpu")
    width = talker.component.width

    def rows(*roles: float) -> torch.Tensor:
        chunk = torch.randn(len(roles), 2, width)
        chunk[:, 1] = torch.tensor(roles)[:, None]
        return chunk

    def received(*chunks: torch.Tensor) -> Call:
        call = Call("r", {}, {"embeds": InputStream("hidden")})
        for chunk in chunks:
            call.inputs["embeds"].push(chunk, end=False)
            talker.component.receive([call])
        return call

    ok = received(rows(0.0, 0.0, 1.0), rows(1.0))
    cond = ok.state[_CONDITIONING]
    assert ok.error is None and [len(p) for p in cond.prompt] == [2] and len(cond.replies) == 2
    for bad in [(rows(1.0, 0.0),), (rows(0.0, 1.0), rows(0.0))]:
        call = received(*bad)
        assert "prompt rows arrived after its reply rows" in str(call.error)
    # A step takes every request's chunk at once; a bad one fails only its request.
    good, bad = (Call(r, {}, {"embeds": InputStream("hidden")}) for r in ("good", "bad"))
    good.inputs["embeds"].push(rows(0.0, 1.0, 1.0), end=False)
    bad.inputs["embeds"].push(rows(1.0, 0.0, 1.0), end=False)
    talker.component.receive([bad, good])
    assert good.error is None and len(good.state[_CONDITIONING].replies) == 2
    assert "prompt rows arrived after its reply rows" in str(bad.error)


def test_talker_needs_the_adapter_and_a_known_speaker(plan):
    unadapted = compile_source(
        SOURCE.replace(", adapter=qwen_omni.thinker_to_talker", ""), devices="cpu"
    )
    with pytest.raises(RequestFailed, match="adapter qwen_omni.thinker_to_talker"):
        Interpreter(unadapted).run({"prompt": "hi"}, {"max_tokens": 3})
    with pytest.raises(
        RequestFailed, match="unknown speaker 'Nobody'; this model has Chelsie, Ethan"
    ):
        Interpreter(plan).run({"prompt": "hi"}, {"max_tokens": 3, "speaker": "Nobody"})


def test_the_gpu_tests_plan_loads_on_the_cpu():
    """The GPU test's plan, both stages on cuda:0 capturing graphs, loads here (its graphs'
    static buffers run eagerly)."""
    plan = decoding("graphs", "1xH200")
    assert {s.name: (s.devices, s.settings["decode"]) for s in plan.stages} == {
        "thinker": (["cuda:0"], "graphs"),
        "talker": (["cuda:0"], "graphs"),
    }
    with stages_on_cpu(plan) as stages:
        assert all(s.decode == "static" and s.static is not None for s in stages.values())


@pytest.mark.gpu
def test_on_the_gpu_graph_replay_gives_the_static_steps_codes():
    """Thinker and talker on cuda:0: replaying their captured graphs gives the text and codec
    ids of the same static steps run eagerly, one request at a time and all at once."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runs = {}
    for decode in ("static", "graphs"):
        with Engine(decoding(decode, "1xH200"), "inprocess") as engine:
            alone = [run_case(engine.generate, case) for case in CASES]
            with ThreadPoolExecutor(len(CASES)) as pool:
                together = list(pool.map(lambda case: run_case(engine.generate, case), CASES))
        runs[decode] = [
            (out["tokens"].reshape(-1).tolist(), out["codec_tokens"].reshape(-1).tolist())
            for out in alone + together
        ]
    assert runs["graphs"] == runs["static"]
