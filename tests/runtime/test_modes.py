"""Every example pipeline gives identical outputs under the reference interpreter, in one
process, and across processes (stand-in stages); outputs stream in order and end."""

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from omniflow.compiler import compile_file, compile_source
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestError, admit

GRAPHS = Path(__file__).parents[2] / "graphs"
IMAGE_FILE = str(GRAPHS / "image_understanding.omni")
REQUESTS = {
    "omni_chat": [
        ({"prompt": "hello"}, None),
        ({"prompt": [{"role": "user", "content": "tell me more"}]}, {"max_tokens": 3}),
    ],
    "tts": [({"text": "good morning"}, None), ({"text": "hi", "voice": "Ethan"}, None)],
    "text_to_image": [
        ({"prompt": "a red cube"}, {"steps": 3}),
        ({"prompt": "a cat", "negative_prompt": "blur"}, {"steps": 2}),
    ],
    "image_edit": [
        (
            {
                "prompt": "make it blue",
                "image": torch.arange(48, dtype=torch.uint8).reshape(4, 4, 3),
            },
            {"steps": 3},
        ),
        ({"prompt": "and this", "negative_prompt": "blur", "image": IMAGE_FILE}, {"steps": 2}),
    ],
    "image_understanding": [
        (
            {
                "prompt": "what is this?",
                "image": torch.arange(48, dtype=torch.uint8).reshape(4, 4, 3),
            },
            None,
        ),
        # An image file's path travels as its bytes; stand-ins never open it, but admission
        # checks that it names a readable file.
        ({"prompt": "and this?", "image": IMAGE_FILE}, None),
    ],
}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], str):
            assert a[key] == b[key]
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module", params=sorted(REQUESTS))
def example(request):
    """An example's name, its plan for 2xH200, and its stand-in engine in a mode (started when
    first asked for, then shared by the example's tests: their requests are independent, and
    executor processes take seconds to start)."""
    plan = compile_file(GRAPHS / f"{request.param}.omni", devices="2xH200")
    engines = {}
    with contextlib.ExitStack() as stack:

        def engine(mode: str) -> Engine:
            if mode not in engines:
                engines[mode] = stack.enter_context(Engine(plan, mode, backends="standin"))
            return engines[mode]

        yield request.param, plan, engine


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_modes_match_the_interpreter(example, mode):
    name, plan, engine = example
    reference = Interpreter(plan, "standin")
    for inputs, params in REQUESTS[name]:
        want = reference.run(inputs, params)
        assert_same(engine(mode).generate(inputs, params), want)


@pytest.mark.parametrize("example", ["omni_chat"], indirect=True)
def test_stream_delivers_every_output_in_order_with_one_end_chunk(example):
    _, plan, engine = example
    chunks = list(engine("process").stream_sync({"prompt": "stream please"}, {"max_tokens": 40}))
    for output in ("text", "audio"):
        mine = [c for c in chunks if c.output == output]
        assert [c.index for c in mine] == list(range(len(mine)))
        assert [c.end for c in mine] == [False] * (len(mine) - 1) + [True]
    audio = [c.value.shape[0] for c in chunks if c.output == "audio" and c.value is not None]
    schedule = next(c.schedule for c in plan.channels if c.name == "code2wav.audio->audio.in")
    # Chunks follow the schedule (the last one may be short); text streams token by token.
    assert audio[:-1] == [schedule[min(i, len(schedule) - 1)] for i in range(len(audio) - 1)]
    assert all(c.value.count(" ") == 1 for c in chunks if c.output == "text" and c.value)


@pytest.mark.parametrize("example", ["tts"], indirect=True)
def test_async_stream_from_several_concurrent_requests(example):
    _, plan, engine = example
    reference = Interpreter(plan, "standin")
    texts = [f"sentence number {i}" for i in range(6)]

    async def one(engine, text):
        parts = [c.value async for c in engine.stream({"text": text}) if c.value is not None]
        return torch.cat(parts)

    async def main(engine):
        return await asyncio.gather(*(one(engine, t) for t in texts))

    results = asyncio.run(main(engine("process")))
    for text, audio in zip(texts, results, strict=True):
        assert torch.equal(audio, reference.run({"text": text})["audio"])


IDENTITY = 'python(fn=omniflow.runtime.builtin_stages.identity, inputs="in:{}", outputs="out:{}")'
MAPS = f"""pipeline maps {{
  stage a = {IDENTITY.format("audio", "audio")}
  stage b = {IDENTITY.format("audio", "image")}
  stage c = {IDENTITY.format("image", "image")}
  input x: audio -> map(gain(0.5) | clamp(-1, 1)) -> a
  a.out -> map(gain(2.0)) -> b.in [stream, chunk=1]
  b.out -> map(denorm | to_uint8) -> c.in [stream, chunk=8]
  c.out -> map(gain(0.5)) -> output y [stream]
}}"""


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_map_chains_run_once_in_every_position(mode):
    plan = compile_source(MAPS, "maps.omni")
    runs_in = {c.name: (c.kind, c.pointwise.runs_in) for c in plan.channels}
    assert runs_in == {
        "x.out->a.in": ("shm", "frontend"),  # the frontend, on the input side
        "a.out->b.in": ("local", "a+b"),  # a fused edge
        "b.out->c.in": ("shm", "a+b"),  # an executor, on its way out
        "c.out->y.in": ("shm", "frontend"),  # the frontend, on the output side
    }
    x = torch.tensor([[0.5], [-0.25], [1.0], [0.1]])
    # x/2 clamped, doubled, [-1, 1] -> [0, 255], halved.
    want = torch.floor((x.clamp(-1, 1) + 1) * 0.5 * 255 + 0.5) * 0.5
    assert torch.equal(Interpreter(plan).run({"x": x})["y"], want)
    with Engine(plan, mode) as engine:
        assert torch.equal(engine.generate({"x": x})["y"], want)


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_an_empty_text_input_is_a_value(mode):
    plan = compile_source(
        """pipeline echo {
          stage up = python(fn=tests.runtime.stages.fail_on_boom, inputs="in:text", outputs="out:text")
          input prompt: text -> up
          up.out -> output out
        }""",
        "echo.omni",
    )
    with Engine(plan, mode) as engine:
        assert engine.generate({"prompt": ""}) == {"out": ""}
        assert engine.generate({"prompt": "still here"})["out"] == "STILL HERE"


SCOPED = """pipeline scoped {
  stage up = python(fn=tests.runtime.stages.fail_on_boom, inputs="in:text", outputs="out:text")
  stage join = python(fn=tests.runtime.stages.join, inputs="a:text, b:text", outputs="out:text")
  input word: text -> up
  input rest: text -> join.b
  up.out -> join.a
  up.out -> output loud
  join.out -> output sentence
}"""


def test_a_scoped_request_takes_the_inputs_its_stages_parameters_name():
    """A guidance companion (`cfg=negative_prompt`) is read by a stage's parameter, not an
    edge: a request scoped to the image still takes it, its default where not given."""
    plan = compile_file(str(GRAPHS / "text_to_image.omni"), devices="cpu", tiny=True)
    scoped = admit(plan, {"prompt": "a cat"}, outputs=frozenset({"image"}))
    assert scoped.inputs == {"prompt": "a cat", "negative_prompt": ""}


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_a_request_for_some_outputs_runs_only_their_stages(mode):
    """`admit(..., outputs=)`: the request runs the stages those outputs depend on, takes
    only the inputs they read (`rest`, required, is not asked for), and ends when they do;
    the other stages never start it, though a stage it runs feeds them, and serve the next
    request as before."""
    plan = compile_source(SCOPED, "scoped.omni")
    stats = []
    with Engine(plan, mode, on_stats=stats.append) as engine:
        with pytest.raises(RequestError, match="unknown output"):
            engine.admit({"word": "hi"}, outputs=frozenset({"nope"}))
        scoped = engine.admit({"word": "hi"}, outputs=frozenset({"loud"}))
        assert scoped.scope == {"up"} and "rest" in scoped.absent
        assert engine.generate(scoped) == {"loud": "HI"}
        steps = {
            stage: totals.steps
            for found in engine.inspect().values()
            for stage, totals in found.stages.items()
        }
        assert steps == {"up": 1, "join": 0}
        assert engine.generate({"word": "a", "rest": "b"}) == {"loud": "A", "sentence": "A b"}
        assert len(stats) == 2  # each request's tables came, the scoped one's too
