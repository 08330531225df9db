"""The static decode step on the fused kernels (merged q/k/v and gate/up products, add +
RMSNorm, (q/k norms and) rotary + cache write, SiLU x up), interpreted on the CPU: tiny:qwen2,
the tiny Qwen2.5-Omni thinker and a random Qwen3 LM decode the tokens the op-by-op static
step decodes (and so HF's `generate`: tests/backends/test_transformers_ar.py), with requests
batched at different lengths and one leaving early, and tiny:qwen2 the same with the step's
attention reading each row's length on the device (`decode_attention`); the tiny Qwen3-TTS
talker, its frames completed inside the step (the code predictor fused too), the op-by-op
step's codes."""

import pytest
import torch

from omniflow.backends.static_decode import StaticDecoder
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_source
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_transformers_ar import forward_shapes, qwen3_lm, run
from tests.families import test_qwen3_tts as tts
from tests.gpu_wiring import stage_spec

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
# A short system turn in place of the templates' default one: every interpreted kernel costs
# in proportion to the prompt's rows (Qwen2.5-Omni's default system prompt is 25 tokens more).
SYSTEM = {"role": "system", "content": "Be brief."}


def static_backend(
    model: str, fused: bool, component=None, bucketed: bool = True
) -> TransformersAR:
    """The model's `lm` stage on the static path (`component` in place of the model's),
    on the fused layers or op by op."""
    torch.set_num_threads(1)
    plan = compile_source(SOURCE.format(model=model, component=MODELS[model]), devices="cpu")
    spec = stage_spec(plan, "lm")
    return with_fused(TransformersAR(spec, "cpu", component), fused, bucketed)


def with_fused(backend: TransformersAR, fused: bool, bucketed: bool = True) -> TransformersAR:
    """`backend` with its static decoder rebuilt on the fused layers where `fused` (without
    `bucketed`, attending through `decode_attention` over the whole cache)."""
    static = backend.static
    if fused:
        backend.static = StaticDecoder(
            backend.component, slots=static.slots, columns=static.columns, device="cpu",
            capture=False, extra=static.has_extra, fused=True, frames=backend.component.frame_spec,
            bucketed=bucketed,
        )  # fmt: skip
    return backend


def calls_for(max_tokens: list[int]) -> list[Call]:
    calls = []
    for i, (prompt, most) in enumerate(zip(PROMPTS, max_tokens, strict=True)):
        stream = InputStream("chat")
        stream.push([SYSTEM, {"role": "user", "content": prompt}], end=True)
        calls.append(Call(f"r{i}", {"max_tokens": most, "temperature": 0.0}, {"prompt": stream}))
    return calls


def decode(model: str, fused: bool, bucketed: bool = True) -> list[list[int]]:
    """Greedy tokens of PROMPTS batched (joining at steps 0, 1, 1) on the static path."""
    backend = static_backend(model, fused, bucketed=bucketed)
    outputs = run(backend, calls_for([10, 4, 10]), joins=[0, 1, 1])
    assert backend.static is None or backend.static.fused == fused
    if fused:
        static = backend.static
        assert static.reads_lengths != bucketed
        assert bucketed or static.length_buckets == [static.columns]
    return [out.tokens for out in outputs]


def prefilled(model: str, fused: bool) -> dict:
    """PROMPTS prefilled together (the second ends at its first token): the decoder forwards
    the prefill ran, the keys and values it left in each row's slot, and the rows' tokens
    after decoding on from there."""
    backend = static_backend(model, fused)
    calls = calls_for([6, 1, 6])
    with forward_shapes(backend.component.decoder) as forwards:
        backend.step(calls)
    static = backend.static
    slots = [(s.call.request_id, s.slot, s.length) for s in backend.rows]
    caches = [
        (static.keys[:, i, :, :n].clone(), static.values[:, i, :, :n].clone()) for _, i, n in slots
    ]
    backend.drop(calls[1])  # as the runner drops a finished request
    outputs = run(backend, [calls[0], calls[2]])
    return {
        "forwards": forwards,
        "slots": slots,
        "caches": caches,
        "tokens": [o.tokens for o in outputs],
    }


def decode_each(fused: bool, bucketed: bool = True) -> list[list[list[int]]]:
    """`decode` for every model, then for the Qwen3 LM."""
    backend = static_backend("tiny:qwen2", fused, qwen3_lm(), bucketed)
    qwen3 = [out.tokens for out in run(backend, calls_for([10, 4, 10]), joins=[0, 1, 1])]
    return [*(decode(model, fused, bucketed) for model in MODELS), qwen3]


def tts_frames(fused: bool) -> list[torch.Tensor]:
    """Two greedy requests of the tiny Qwen3-TTS talker on the static path, joining at
    different steps: their codes."""
    torch.set_num_threads(1)
    plan = compile_source(tts.PROGRAM.format(model=tts.MODELS["CustomVoice"]), devices="cpu")
    backend = with_fused(tts.talker_backend(plan, "static"), fused)
    assert backend.static.fused == backend.static.frames.cache.fused == fused
    requests = [
        (*tts.request_of("cv_en", "", max_tokens=5)[1:], 0, None),
        (*tts.request_of("cv_dialect", "", max_tokens=3)[1:], 2, None),
    ]
    return tts.serve_frames(backend, requests)


def prefilled_each(fused: bool) -> list[dict]:
    return [prefilled(model, fused) for model in MODELS]


# Each test interprets its own job (a process of its own): one job for the whole file took
# ~40 s of the interpreter's limit (then 120 s) on an idle 2-core machine, too near it when loaded.
# They start together as the file begins, and run side by side (kernels/conftest.py).


@pytest.fixture(scope="module", autouse=True)
def _jobs_ahead(interpret_ahead, request):
    interpret_ahead(
        request,
        {
            test_the_fused_step_decodes_the_op_by_op_steps_tokens: [(decode_each, True)],
            test_the_step_reading_each_rows_length_decodes_the_op_by_op_steps_tokens: [
                (decode, "tiny:qwen2", True, False)
            ],
            test_the_fused_step_completes_the_op_by_op_steps_frames: [(tts_frames, True)],
            test_the_fused_prefill_writes_the_slots_the_model_forward_fills: [
                (prefilled_each, True)
            ],
        },
    )


def test_the_fused_step_decodes_the_op_by_op_steps_tokens(interpret):
    want = decode_each(fused=False)
    assert [[len(t) for t in tokens] for tokens in want[: len(MODELS)]] == [[10, 4, 10]] * len(
        MODELS
    )
    assert interpret(decode_each, True) == want


def test_the_step_reading_each_rows_length_decodes_the_op_by_op_steps_tokens(interpret):
    """The fused step attending through `decode_attention` (each row over its own columns,
    read on the device) over the whole cache: one length bucket, the same tokens (tiny:qwen2
    alone: each interpreted attention costs in proportion to the cache's columns)."""
    assert interpret(decode, "tiny:qwen2", True, False) == decode("tiny:qwen2", fused=False)


def test_the_fused_step_completes_the_op_by_op_steps_frames(interpret):
    want = tts_frames(fused=False)
    assert [len(codes) for codes in want] == [5, 3]
    for got, codes in zip(interpret(tts_frames, True), want, strict=True):
        assert torch.equal(got, codes)


def test_the_fused_prefill_writes_the_slots_the_model_forward_fills(interpret):
    """On the fused layers a batch of prompts is prefilled straight into its slots, without
    the model's forward: the same keys and values (within float32 rounding) and the same
    tokens on from there as the model's forward and the copy into the slots; a request
    that ends at its first token gives its slot to the last row."""
    fused = interpret(prefilled_each, True)
    for want, got in zip(prefilled_each(False), fused, strict=True):
        assert [rows for rows, _ in want["forwards"]] == [3] and got["forwards"] == []
        assert (
            got["slots"]
            == want["slots"]
            == [("r0", 0, want["slots"][0][2]), ("r2", 1, want["slots"][1][2])]
        )
        for mine, theirs in zip(got["caches"], want["caches"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert got["tokens"] == want["tokens"]
