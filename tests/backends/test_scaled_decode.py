"""On a GPU, the AR stages of Qwen2.5-Omni at real size (random bf16 weights made in memory,
`omniflow.families.qwen2_5_omni.checkpoints.scaled_stage`): replaying the decode step's captured CUDA
graphs gives exactly the greedy tokens of the same static step run eagerly, over 64 steps
with requests joining at different steps, and serving captures nothing after load.

On the CPU, the same set-up: the plans and the real-size components built on the meta
device (no weights) construct the backends the GPU test does, with its buckets; and the
GPU test's requests (token-id prompts) decode on the tiny models alike on both paths."""

import pytest
import torch

from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni.checkpoints import scaled_stage
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_transformers_ar import run
from tests.gpu_wiring import stage_spec

SOURCES = {
    "thinker": """
pipeline scaled {{
  model "tiny:qwen2.5-omni"
  stage thinker = ar(component="thinker", max_batch=8, max_len=128, max_tokens=64,
                     decode="{decode}")
  input prompt: tokens -> thinker
  thinker.tokens -> output tokens [stream]
  thinker.hidden -> output hidden [stream]
}}
""",
    "talker": """
pipeline scaled {{
  model "tiny:qwen2"
  stage talker = ar(max_batch=8, max_len=128, max_tokens=64, decode="{decode}")
  input prompt: tokens -> talker
  talker.tokens -> output tokens [stream]
}}
""",
}
PROMPTS = [100, 37, 64]  # prompt lengths; request i joins at step JOINS[i]
JOINS = [0, 1, 3]


def backend(stage: str, component, decode: str, device: str = "cuda:0") -> TransformersAR:
    """The stage of its plan compiled for one H200 (on the CPU: for the CPU), on `device`
    with `component` (None: the plan's tiny model, loaded)."""
    devices = "cpu" if device == "cpu" else "1xH200"
    plan = compile_source(SOURCES[stage].format(decode=decode), devices=devices)
    spec = stage_spec(plan, stage)
    return TransformersAR(spec, device, component=component)


def prompt_vocab(stage: str, component) -> int:
    """The ids the test's random prompts are drawn from: the thinker's text vocabulary, the
    talker's codes."""
    return len(component.tokenizer) if stage == "thinker" else 8192


def greedy(backend: TransformersAR, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    calls = []
    for i, length in enumerate(PROMPTS):
        stream = InputStream("tokens")
        stream.push(torch.randint(0, vocab, (length,), generator=generator), end=True)
        calls.append(Call(f"r{i}", {"max_tokens": 64, "temperature": 0.0}, {"prompt": stream}))
    outputs = run(backend, calls, joins=JOINS)
    assert all(call.error is None for call in calls)
    return [out.tokens for out in outputs]


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_the_real_size_stages_build_what_the_gpu_test_captures(stage):
    """The GPU test's plan and real-size component, on the meta device (no weights, no
    CUDA): the backend constructs, its static cache sized for the GPU test's 4 x 2 graphs."""
    component = scaled_stage(stage, 1.0, "meta")
    static = backend(stage, component, "static", "meta").static
    assert static.batch_buckets == [1, 2, 4, 8] and static.length_buckets == [128, 256]
    assert prompt_vocab(stage, component) <= component.head.out_features


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_the_gpu_tests_requests_decode_alike_on_the_cpus_paths(stage):
    """The GPU test's requests, token-id prompts joining at different steps, on the tiny
    models: the static step run eagerly decodes the dynamic cache's tokens."""
    eager = backend(stage, None, "eager", "cpu")
    vocab = min(eager.component.head.out_features, 8192)
    assert greedy(backend(stage, None, "static", "cpu"), vocab) == greedy(eager, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_real_size_graph_replay_gives_the_eager_static_steps_greedy_tokens(stage):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    component = scaled_stage(stage, 1.0, "cuda")
    vocab = prompt_vocab(stage, component)
    graphed = backend(stage, component, "graphs")
    captured = graphed.static.captures
    # batch 1, 2, 4, 8 x the whole cache (the fused step attends by each row's length; else
    # 128, 256 columns), each batch's finish, prompts' prefills at batches 1 to 8 x widths
    # 16 to 256 (none for the thinker, whose prompts carry multimodal positions)
    static = graphed.static
    widths = [] if stage == "thinker" or not static.fused else [16, 32, 64, 128, 256]
    assert static.prefill_widths == widths
    assert static.length_buckets == ([256] if static.fused else [128, 256])
    assert captured == len(static.graphs) + len(static.finish_graphs) + len(static.prefill_graphs)
    assert captured == 4 * (len(static.length_buckets) + 1) + len(static.prefill_buckets)
    assert len(static.prefill_buckets) == 4 * len(widths)  # (none over 4096 positions)
    want = greedy(backend(stage, component, "static"), vocab)
    got = greedy(graphed, vocab)
    assert [len(t) for t in got] == [64] * len(PROMPTS)
    assert got == want
    assert graphed.static.captures == captured and graphed.static.replays >= 64
