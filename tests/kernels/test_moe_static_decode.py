"""The static decode step over routed MoE layers, on tiny:qwen3-omni's thinker (every layer a
sparse MoE block; its `hidden` items carry the accept layer's state, a `TappedDecoder`):
op by op (`fused_moe.fused_moe(capturable=True)`: gathered expert products, no host
readback) and on the fused kernels under Triton's interpreter (`fused_moe.fused_moe_triton`
in place of the gate/up and down products), it decodes the dynamic path's greedy tokens
and items, batched at different steps with a row leaving early; and a seeded sampled request draws the same
tokens on both static paths, run after run. The talker (MoE layers with a shared expert)
with its `frame_spec`: the static step, its code predictor's 15 steps and their draws
inside, gives the dynamic path's frames greedily (its eager `frames` never called), and a
seed's frames on both static paths, run after run."""

import pytest
import torch

from omniflow.backends import static_decode
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.compiler import compile_source
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_transformers_ar import run
from tests.gpu_wiring import cpu_decode, stage_spec
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


# Tokens of each of PROMPTS: few, as each costs an interpreted step on the fused path.
LENGTHS = [6, 3, 6]


def thinker(decode: str, fused: bool = False, device: str = "cpu") -> TransformersAR:
    """tiny:qwen3-omni's thinker stage on `decode`'s path (on the CPU, the static one on the
    fused layers where `fused`; on CUDA they are its default)."""
    torch.set_num_threads(1)
    plan = compile_source(THINKER.format(decode=decode), devices="cpu")
    spec = stage_spec(plan, "lm")
    backend = TransformersAR(spec, device)
    return backend if device != "cpu" else with_fused(backend, fused)


def greedy(decode: str, fused: bool = False, device: str = "cpu") -> dict:
    """PROMPTS batched (joining at steps 0, 1, 1; the second ends early): tokens and items."""
    backend = thinker(decode, fused, device)
    assert backend.static is None or backend.static.fused == (fused or device != "cpu")
    outputs = run(backend, calls_for(LENGTHS), joins=[0, 1, 1])
    return {"tokens": [o.tokens for o in outputs], "hidden": [o.hidden for o in outputs]}


def sampled_calls(seed: int) -> list[Call]:
    calls = []
    for i, prompt in enumerate(PROMPTS[:2]):
        stream = InputStream("chat")
        stream.push([SYSTEM, {"role": "user", "content": prompt}], end=True)
        params = {"max_tokens": 5, "temperature": 1.5, "top_k": 50, "seed": seed + i}
        calls.append(Call(f"s{i}", params, {"prompt": stream}))
    return calls


def sampled(fused: bool, seed: int, decode: str = "static", device: str = "cpu") -> list:
    """Two sampled requests with seeds `seed`, `seed + 1` on the static path (or `decode`'s)."""
    outputs = run(thinker(decode, fused, device), sampled_calls(seed), joins=[0, 1])
    return [o.tokens for o in outputs]


def fused_thinker() -> dict:
    """All, on the fused layers: one interpreted process (each costs seconds)."""
    return {"greedy": greedy("static", True), "sampled": sampled(True, 7)}


@pytest.fixture(scope="module", autouse=True)
def _jobs_ahead(interpret_ahead, request):
    """The file's three interpreted jobs (`fused`'s and `fused_frames`'), started together
    as it begins: they run side by side (kernels/conftest.py) while the other paths run
    here."""
    thinker = [(fused_thinker,)]
    talker = [(fused_greedy_talker,), (fused_sampled_talker,)]
    interpret_ahead(
        request,
        {
            test_the_fused_step_decodes_the_dynamic_paths_tokens_and_items: thinker,
            test_a_seed_draws_the_same_tokens_on_both_static_paths_run_after_run: thinker,
            test_the_fused_talker_step_completes_the_same_frames: talker,
            test_a_seed_gives_the_talker_the_same_frames_on_both_static_paths: talker,
        },
    )


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
    assert [len(t) for t in eager["tokens"]] == LENGTHS
    assert got["tokens"] == eager["tokens"]
    assert_same_items(got["hidden"], eager["hidden"])
    assert eager["hidden"][0][0].shape[1:] == (3, 64)  # accept layer, embedding, role


def test_the_fused_step_decodes_the_dynamic_paths_tokens_and_items(fused, eager):
    assert fused["greedy"]["tokens"] == eager["tokens"]
    assert_same_items(fused["greedy"]["hidden"], eager["hidden"])


def test_a_seed_draws_the_same_tokens_on_both_static_paths_run_after_run(fused):
    want = sampled(False, 7)
    assert fused["sampled"] == want == sampled(False, 7)
    assert [len(t) for t in want] == [5, 5]
    assert sampled(False, 8) != want  # the draws follow the seed


# --- the talker: its frames completed inside the static step ---------------------------------

PIPELINE = """
pipeline q3_ar {{
  model "tiny:qwen3-omni"
  param speaker = "Ethan"
  param seed = 0
  stage thinker = ar(component="thinker", max_batch=2, max_tokens=8, temperature=0.0)
  stage talker  = ar(component="talker", max_batch=2, max_tokens={frames},
                    temperature={temperature}, seed=$seed, speaker=$speaker, decode="{decode}")
  input prompt: chat -> thinker
  thinker.hidden -> talker [stream, chunk=1, adapter=qwen3_omni.thinker_to_talker]
  thinker.tokens -> output tokens [stream]
  talker.codes -> output codes [stream]
}}
"""


def speak(
    decode: str, *, fused=False, frames=39, temperature=0.0, seeds=(0,), device="cpu"
) -> list:
    """The talker's codes `[n, 16]` for each of `seeds` on "Hello! How are you today?",
    the thinker eager on the CPU, the talker on `device` on `decode`'s path (on the CPU the
    static one on the fused layers, its code predictor's too, where `fused`; on CUDA they
    are its default); on the static path the component's eager `frames` fails if called."""
    torch.set_num_threads(1)
    # The interpreter loads its stages on the CPU; on CUDA its talker is replaced.
    source = PIPELINE.format(frames=frames, temperature=temperature, decode=cpu_decode(decode))
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    if device == "cpu":
        talker = with_fused(interpreter.backends["talker"], fused)
    else:
        interpreter.backends["talker"].close()
        talker = TransformersAR(stage_spec(interpreter.plan, "talker", decode=decode), device)
        interpreter.backends["talker"] = talker
        fused = talker.static is not None
    if talker.static is not None:
        assert talker.static.fused == talker.static.frames.cache.fused == fused
        talker.component.frames = _never_called
    chat = [{"role": "user", "content": "Hello! How are you today?"}]
    return [
        interpreter.run({"prompt": chat}, {"speaker": "Chelsie", "seed": seed})["codes"]
        for seed in seeds
    ]


def _never_called(*args):
    raise AssertionError("the static path ran the component's eager frames")


SAMPLED = {"frames": 2, "temperature": 0.9}


def fused_greedy_talker() -> list:
    """The talker on the fused layers, interpreted: a few frames (each is 16 interpreted
    decodes), greedy."""
    return speak("static", fused=True, frames=2)


def fused_sampled_talker() -> list:
    """The same, sampled: one interpreted process each (the interpreter's time limit)."""
    return speak("static", fused=True, seeds=(3, 4), **SAMPLED)


@pytest.fixture(scope="module")
def fused_frames(interpret) -> dict:
    return {"greedy": interpret(fused_greedy_talker), "sampled": interpret(fused_sampled_talker)}


def test_the_talkers_static_step_completes_the_dynamic_paths_frames():
    """Greedy: the same codes frame for frame, to the end of speech (the talker's MoE layers
    and its code predictor's 15 steps inside the step)."""
    (want,) = speak("eager")
    (got,) = speak("static")
    assert want.shape[1:] == (16,) and len(want) > 4
    assert torch.equal(got, want)


def test_the_fused_talker_step_completes_the_same_frames(fused_frames):
    (want,) = speak("eager", frames=2)
    (got,) = fused_frames["greedy"]
    assert len(want) == 2 and torch.equal(got, want)


def test_a_seed_gives_the_talker_the_same_frames_on_both_static_paths(fused_frames):
    """Sampled (codebook 0 and the code predictor's draws): a seed's frames on the op-by-op
    static step, again, and on the fused one; another seed's differ. (The dynamic path on
    the CPU draws from each request's generator, as `generate` does: other draws.)"""
    same, again, other = speak("static", seeds=(3, 3, 4), **SAMPLED)
    assert len(same) == 2 and torch.equal(same, again) and not torch.equal(same, other)
    for got, want in zip(fused_frames["sampled"], (same, other), strict=True):
        assert torch.equal(got, want)


# --- on the GPU: the captured steps ---------------------------------------------------------


@pytest.mark.gpu
def test_on_the_gpu_the_captured_thinker_decodes_the_static_and_dynamic_paths_tokens():
    """The thinker's captured steps (fused MoE kernels inside the graphs) give the same step
    run eagerly exactly, greedy and sampled, with nothing captured after load; the dynamic
    path's greedy tokens too (float32 on the GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    graphed = thinker("auto", device="cuda:0")
    assert graphed.decode == "graphs" and graphed.static.fused
    captured = graphed.static.captures
    got = run(graphed, calls_for(LENGTHS), joins=[0, 1, 1])
    assert graphed.static.captures == captured
    tokens = [o.tokens for o in got]
    assert tokens == greedy("static", device="cuda:0")["tokens"]
    assert tokens == greedy("eager", device="cuda:0")["tokens"]
    draws = sampled(True, 7, "graphs", "cuda:0")
    assert draws == sampled(True, 7, "static", "cuda:0") and [len(t) for t in draws] == [5, 5]


@pytest.mark.gpu
def test_on_the_gpu_the_captured_talker_frame_is_the_static_and_dynamic_paths():
    """The talker's captured frame step (its MoE step, the code predictor's 15 steps and
    their draws in one graph) gives the eagerly run static step's frames, greedy and
    sampled, and the dynamic path's on the GPU (the same (seed, frame, sub-step) draws)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for how in ({"frames": 39}, {**SAMPLED, "frames": 8, "seeds": (3, 4)}):
        got = speak("graphs", device="cuda:0", **how)
        for decode in ("static", "eager"):
            want = speak(decode, device="cuda:0", **how)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), decode
