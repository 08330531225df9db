"""Plans over two GPUs of one host, run for real (skipped on a machine with fewer): omni
chat's two-GPU plan decodes what its one-GPU plan does, and an executor killed on the
second GPU fails its requests fast, is restarted, and leaves no shared or device memory.
On the CPU, their plans compile and their stages load (and run, where they are stand-ins).

Not yet run: no two-GPU machine was at hand when they were written (docs/deploy.md)."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from omniflow.compiler import compile_file, compile_source
from omniflow.runtime.engine import Engine, RequestFailed
from omniflow.runtime.interpreter import Interpreter
from tests.backends.test_token2wav_graphs import BF16_RMS_TOLERANCE, relative_rms
from tests.gpu_wiring import stages_on_cpu
from tests.runtime.test_device_ring import MiB, free_bytes, settled_free_bytes
from tests.runtime.test_failures import no_leaks  # noqa: F401 (a fixture)

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

GRAPHS = Path(__file__).parents[2] / "graphs"
# Greedy text and codes, one seed: both plans must decode the same reply.
PARAMS = {"max_tokens": 16, "max_audio_tokens": 120, "audio_temperature": 0.0, "seed": 0}
CHAIN = """pipeline chain {
  stage src = python(fn=tests.runtime.stages.counter, inputs="n:text", outputs="out:tokens") @ cuda:0
  stage dst = python(fn=tests.runtime.stages.double, inputs="in:tokens", outputs="out:tokens") @ cuda:1
  input n: text -> src
  src.out -> dst [stream, chunk=8]
  dst.out -> output out [stream]
}"""


def omni_chat_plan(devices: str):
    """graphs/omni_chat.omni on tiny models for `devices`: on two GPUs, the talker's codes
    cross to code2wav on the other one. (Which GPU takes which stage follows the models'
    sizes: the tiny ones put code2wav on cuda:0, the real ones on cuda:1.)"""
    plan = compile_file(GRAPHS / "omni_chat.omni", devices=devices, tiny=True)
    crossing = plan.stage("talker").devices != plan.stage("code2wav").devices
    assert crossing == (devices == "2xH200")
    return plan


def chain_plan():
    """CHAIN across two GPUs: dst's ring in cuda:1's memory, filled by peer copies."""
    plan = compile_source(CHAIN, "chain.omni", devices="2xH200")
    edge = next(c for c in plan.channels if c.name == "src.out->dst.in")
    assert (edge.kind, edge.device) == ("p2p", "cuda:1")
    return plan


def test_the_gpu_tests_plans_load_and_run_on_the_cpu():
    """Both omni chat plans compile and the two-GPU one's stages load here; the chain runs
    here (under the interpreter) to the output the GPU test expects of it."""
    omni_chat_plan("1xH200")
    with stages_on_cpu(omni_chat_plan("2xH200")) as stages:
        assert {name: type(backend).__name__ for name, backend in stages.items()} == {
            "hearing": "MediaEncoder",
            "vision": "MediaEncoder",
            "thinker": "TransformersAR",
            "talker": "TransformersAR",
            "code2wav": "Vocoder",
        }
    out = Interpreter(chain_plan()).run({"n": "20"})["out"]
    assert out.flatten().tolist() == [2 * i for i in range(20)]


@pytest.mark.gpu
@two_gpus
def test_omni_chat_on_two_gpus_decodes_what_one_gpu_does():
    replies = {}
    for devices in ("1xH200", "2xH200"):
        plan = omni_chat_plan(devices)
        with Engine(plan, "process") as engine:
            replies[devices] = engine.generate({"prompt": "Say something, please."}, PARAMS)
    one, two = replies["1xH200"], replies["2xH200"]
    assert one["text"] == two["text"]
    assert one["audio"].shape == two["audio"].shape and one["audio"].numel() > 0
    rms = relative_rms(two["audio"].float(), one["audio"].float())
    assert rms < BF16_RMS_TOLERANCE, rms


@pytest.mark.gpu
@two_gpus
def test_an_executor_killed_on_the_second_gpu_fails_its_requests_fast_and_recovers(
    no_leaks,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.01")
    plan = chain_plan()
    baseline = free_bytes(1)
    with Engine(plan, "process") as engine:
        stream = engine.stream_sync({"n": "400"})
        next(stream)  # the request is streaming through dst
        killed = engine.executor_pids["dst"]
        os.kill(killed, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RequestFailed, match=r"executor 'dst' \(stages dst\) died"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 2.0
        monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0")
        out = engine.generate({"n": "20"})["out"]
        assert out.flatten().tolist() == [2 * i for i in range(20)]
        assert engine.executor_pids["dst"] != killed
    # Every executor is gone: the driver gives their contexts and rings back.
    assert settled_free_bytes(baseline, 64 * MiB, device=1) >= baseline - 64 * MiB
