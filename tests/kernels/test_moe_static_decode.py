"""The static decode step over routed MoE layers, on tiny:qwen3-omni's thinker (every layer a
sparse MoE block; its `hidden` items carry the accept layer's state, a `TappedDecoder`):
op by op (`fused_moe.capturable_moe`: gathered expert products, no host readback) and on
the fused kernels under Triton's interpreter (`fused_moe.fused_moe_triton` in place of the
gate/up and down products), it decodes the dynamic path's greedy tokens and items, batched
at different steps with a row leaving early; and a seeded sampled request draws the same
tokens on both static paths, run after run."""

import pytest
import torch

from omniflow.backends import static_decode
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_source
from omniflow.runtime.stage import Call, InputStream, StageSpec
from tests.backends.test_transformers_ar import run
from tests.kernels.test_fused_decode import PROMPTS, SYSTEM, calls_for, with_fused

THINKER = """
pipeline chat {{
  model "tiny:qwen3-omni"
  stage lm = ar(component="thinker", max_batch=4, max_tokens=10, temperature=0.0,
                decode="{decode}")
  input prompt: chat -> lm
  lm.tokens -> output tokens [stream]
  lm.hidden -> output hidden [stream]
}}
"""


def thinker(decode: str, fused: bool = False) -> TransformersAR:
    """tiny:qwen3-omni's thinker stage on `decode`'s path (the static one on the fused
    layers where `fused`)."""
    torch.set_num_threads(1)
    plan = compile_source(THINKER.format(decode=decode), devices="cpu")
    spec = StageSpec.from_channels(plan.stage("lm"), plan.channels)
    return with_fused(TransformersAR(spec, "cpu"), fused)


def greedy(decode: str, fused: bool = False) -> dict:
    """PROMPTS batched (joining at steps 0, 1, 1; the second ends early): tokens and items."""
    backend = thinker(decode, fused)
    assert backend.static is None or backend.static.fused == fused
    outputs = run(backend, calls_for([10, 4, 10]), joins=[0, 1, 1])
    return {"tokens": [o.tokens for o in outputs], "hidden": [o.hidden for o in outputs]}


def sampled_calls(seed: int) -> list[Call]:
    calls = []
    for i, prompt in enumerate(PROMPTS[:2]):
        stream = InputStream("chat")
        stream.push([SYSTEM, {"role": "user", "content": prompt}], end=True)
        params = {"max_tokens": 8, "temperature": 1.5, "top_k": 50, "seed": seed + i}
        calls.append(Call(f"s{i}", params, {"prompt": stream}))
    return calls


def sampled(fused: bool, seed: int) -> list[list[int]]:
    """Two sampled requests with seeds `seed`, `seed + 1` on the static path."""
    outputs = run(thinker("static", fused), sampled_calls(seed), joins=[0, 1])
    return [o.tokens for o in outputs]


def fused_thinker() -> dict:
    """All, on the fused layers: one interpreted process (each costs seconds)."""
    return {"greedy": greedy("static", True), "sampled": sampled(True, 7)}


@pytest.fixture(scope="module")
def fused(interpret) -> dict:
    return interpret(fused_thinker)


@pytest.fixture(scope="module")
def eager() -> dict:
    return greedy("eager")


def assert_same_items(got: list, want: list) -> None:
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_thinkers_moe_layers_run_on_the_static_path():
    decoder = thinker("eager").component.decoder
    assert static_decode.unsupported(decoder) is None and static_decode.fusable(decoder)


def test_the_op_by_op_static_step_decodes_the_dynamic_paths_tokens_and_items(eager):
    got = greedy("static")
    assert [len(t) for t in eager["tokens"]] == [10, 4, 10]
    assert got["tokens"] == eager["tokens"]
    assert_same_items(got["hidden"], eager["hidden"])
    assert eager["hidden"][0][0].shape[1:] == (3, 64)  # accept layer, embedding, role


def test_the_fused_step_decodes_the_dynamic_paths_tokens_and_items(fused, eager):
    assert fused["greedy"]["tokens"] == eager["tokens"]
    assert_same_items(fused["greedy"]["hidden"], eager["hidden"])


def test_a_seed_draws_the_same_tokens_on_both_static_paths_run_after_run(fused):
    want = sampled(False, 7)
    assert fused["sampled"] == want == sampled(False, 7)
    assert [len(t) for t in want] == [8, 8]
    assert sampled(False, 8) != want  # the draws follow the seed
