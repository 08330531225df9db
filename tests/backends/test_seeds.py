"""One request seed replays a whole sampling pipeline: omni chat on tiny:qwen2.5-omni with
the thinker and the talker both sampling gives byte-identical text and audio for the same
seed under the interpreter, in one process and across processes; another seed differs."""

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.ir.values import StageSeed
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import stage_seed

torch.set_num_threads(1)

SOURCE = """
pipeline sampled_omni {
  model "tiny:qwen2.5-omni"
  param max_tokens = 6
  stage thinker  = ar(component="thinker", max_batch=2, max_tokens=$max_tokens, temperature=1.0)
  stage talker   = ar(component="talker", max_batch=2, max_tokens=24, temperature=0.9)
  stage code2wav = vocoder(component="token2wav", max_batch=2)
  input prompt: chat -> thinker
  thinker.hidden -> talker   [stream, chunk=1, adapter=qwen_omni.thinker_to_talker]
  talker.codes   -> code2wav [stream, chunk=auto, context=25, adapter=qwen_omni.talker_to_code2wav]
  code2wav.audio -> output audio [stream, rate=24000]
  talker.tokens  -> output codec [stream]
  thinker.text   -> output text [stream]
}
"""
PROMPT = {"prompt": "Tell me a short story."}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if isinstance(a[k], str) else torch.equal(a[k], b[k]) for k in a
    )


@pytest.fixture(scope="module")
def plan():
    return compile_source(SOURCE, "sampled_omni.omni")


@pytest.fixture(scope="module")
def reference(plan):
    interpreter = Interpreter(plan)
    return {seed: interpreter.run(PROMPT, {"seed": seed}) for seed in (11, 12)}


def test_every_sampling_stage_gets_its_own_stream_of_the_request_seed(plan):
    assert [s.params["seed"] for s in plan.stages] == [StageSeed(s.name) for s in plan.stages]
    seeds = {stage_seed(11, s.name) for s in plan.stages}
    assert len(seeds) == 3 and stage_seed(11, "talker") != stage_seed(12, "talker")


def test_another_seed_samples_otherwise(reference):
    assert all(r["audio"].numel() and r["text"] for r in reference.values())
    assert reference[11]["text"] != reference[12]["text"]
    assert not torch.equal(reference[11]["codec"], reference[12]["codec"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_a_seed_replays_the_request_in_every_mode(plan, reference, mode):
    with Engine(plan, mode) as engine:
        for seed, want in reference.items():
            outputs = engine.generate(PROMPT, {"seed": seed})
            assert outputs.seed == seed and same(dict(outputs), want)
        unseeded = engine.generate(PROMPT)
        assert same(dict(engine.generate(PROMPT, {"seed": unseeded.seed})), dict(unseeded))
