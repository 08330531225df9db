"""The static decode step on the fused kernels (merged q/k/v and gate/up products, add +
RMSNorm, rotary + cache write, SiLU x up), interpreted on the CPU: tiny:qwen2 and the tiny
Qwen2.5-Omni thinker decode the tokens the op-by-op static step decodes (and so HF's
`generate`: tests/backends/test_transformers_ar.py), with requests batched at different
lengths and one leaving early."""

import torch

from omniflow.backends.static_decode import StaticDecoder
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_source
from omniflow.runtime.stage import Call, InputStream, StageSpec
from tests.backends.test_transformers_ar import run

SOURCE = """
pipeline chat {{
  model "{model}"
  stage lm = ar({component}max_batch=4, max_tokens=10, temperature=0.0, decode="static")
  input prompt: chat -> lm
  lm.tokens -> output tokens [stream]
  lm.hidden -> output hidden [stream]
}}
"""
MODELS = {"tiny:qwen2": "", "tiny:qwen2.5-omni": 'component="thinker", '}
PROMPTS = ["Tell me a short story.", "hi", "red hello short short cat small hello world"]


def decode(model: str, fused: bool) -> list[list[int]]:
    """Greedy tokens of PROMPTS batched (joining at steps 0, 1, 1) on the static path."""
    torch.set_num_threads(1)
    plan = compile_source(SOURCE.format(model=model, component=MODELS[model]), devices="cpu")
    backend = TransformersAR(StageSpec.from_channels(plan.stage("lm"), plan.channels), "cpu")
    static = backend.static
    if fused:
        backend.static = StaticDecoder(
            backend.component, slots=static.slots, columns=static.columns, device="cpu",
            capture=False, extra=static.has_extra, fused=True,
        )  # fmt: skip
    calls = []
    for i, prompt in enumerate(PROMPTS):
        stream = InputStream("chat")
        stream.push([{"role": "user", "content": prompt}], end=True)
        max_tokens = 4 if i == 1 else 10
        params = {"max_tokens": max_tokens, "temperature": 0.0}
        calls.append(Call(f"r{i}", params, {"prompt": stream}))
    outputs = run(backend, calls, joins=[0, 1, 1])
    assert backend.static is None or backend.static.fused == fused
    return [out.tokens for out in outputs]


def test_the_fused_step_decodes_the_op_by_op_steps_tokens(interpret):
    for model in MODELS:
        want = decode(model, fused=False)
        assert [len(t) for t in want] == [10, 4, 10]
        assert interpret(decode, model, True) == want
