"""Step caching in the step-wise denoiser (omniflow/backends/step_cache.py), on tiny
Qwen-Image: off (threshold 0) it is bit-identical to no cache, on it skips the blocks after
the first for the steps it reuses and counts them; a request's decisions are its own in a
shared batch; the counters reach the stage's totals and the request's stats."""

import asyncio

import pytest
import torch

from omniflow.compiler import compile_source
from omniflow.profiler.analysis import parse_trace, stage_stats, timelines
from omniflow.profiler.report import report_data
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from tests.backends.test_diffusion import GRAPH, Stages, output, step_when_ready

torch.set_num_threads(1)

STEPS = 8


def request(threshold: float, prompt: str = "A photo of a red cat", **more) -> tuple:
    return (
        {"prompt": prompt, "negative_prompt": "blurry"},
        {"steps": STEPS, "true_cfg_scale": 4.0, "height": 32, "width": 32, "seed": 0,
         "cache_threshold": threshold, **more},
    )  # fmt: skip


@pytest.fixture(scope="module")
def plan():
    """The example graph, its step cache's warm-up and run length pipeline parameters too."""
    text = GRAPH.read_text(encoding="utf-8")
    text = text.replace(
        "cache_threshold=$cache_threshold)",
        "cache_threshold=$cache_threshold, cache_warmup=$cache_warmup,\n"
        "                            cache_max_reuse=$cache_max_reuse)",
    ).replace("  param cache_threshold = 0.0\n", "  param cache_threshold = 0.0\n"
              "  param cache_warmup = 2\n  param cache_max_reuse = 0\n")  # fmt: skip
    assert "$cache_warmup" in text and "param cache_warmup" in text
    return compile_source(text.replace("Qwen/Qwen-Image", "tiny:text-to-image"), devices="cpu")


@pytest.fixture(scope="module")
def stages(plan):
    return Stages(Interpreter(plan))


def denoise(stages, requests: dict, schedule=None) -> dict:
    """Each request's (latents, counters, second-block forwards), run together."""
    calls = stages.denoiser_calls(requests)
    dit = stages.backends["dit"]
    second = []
    # Inside the second block (its image MLP): the wrapped block itself is always called.
    hook = dit.transformer.transformer_blocks[1].img_mlp.register_forward_pre_hook(
        lambda module, args: second.append(len(args[0]))
    )
    counters = {name: {} for name in calls}
    try:
        for batch in schedule or [list(calls)] * STEPS:
            step_when_ready(dit, [calls[name] for name in batch])
            for name in batch:
                for key, value in calls[name].counters.items():
                    counters[name][key] = counters[name].get(key, 0) + value
                calls[name].counters = {}
    finally:
        hook.remove()
    return {name: (output(c, "latents"), counters[name], second) for name, c in calls.items()}


def test_threshold_zero_is_bit_identical_to_no_cache(stages):
    plain = denoise(stages, {"r": request(0.0)})["r"]
    assert plain[1] == {"steps_computed": STEPS}
    # Caching on but never allowed to reuse (warmup past the end): the split forward path,
    # every block on every row, still the same bits.
    split = denoise(stages, {"r": request(5.0, cache_warmup=STEPS)})["r"]
    assert torch.equal(split[0], plain[0]) and split[1] == {"steps_computed": STEPS}


def test_a_threshold_reuses_steps_and_skips_their_blocks(stages):
    plain = denoise(stages, {"r": request(0.0)})["r"]
    latents, counters, second = denoise(stages, {"r": request(1.0)})["r"]
    reused = counters.get("steps_reused", 0)
    assert reused > 0 and counters["steps_computed"] + reused == STEPS
    # The second block ran at the computed steps only (two rows: the CFG pair).
    assert second == [2] * counters["steps_computed"]
    assert not torch.equal(latents, plain[0])
    assert (latents - plain[0]).abs().max() < 5.0  # an approximation, not noise


def test_warmup_and_the_last_step_are_computed(stages):
    _, counters, _ = denoise(stages, {"r": request(10.0, cache_warmup=3)})["r"]
    assert counters == {"steps_computed": 4, "steps_reused": STEPS - 4}  # 3 warm-up, the last
    _, capped, _ = denoise(stages, {"r": request(10.0, cache_warmup=1, cache_max_reuse=1)})["r"]
    assert capped["steps_reused"] == 3  # every other step after the first, never the last


def test_each_request_decides_for_itself_in_a_shared_batch(stages):
    requests = {"cached": request(1.0), "plain": request(0.0, "a dog on a beach at sunset")}
    together = denoise(stages, requests)
    for name, r in requests.items():
        alone = denoise(stages, {name: r})[name]
        torch.testing.assert_close(together[name][0], alone[0], rtol=0, atol=1e-5)
        assert together[name][1] == alone[1]
    # The second block ran on the plain request's pair alone at the steps the other reused.
    reused = together["cached"][1]["steps_reused"]
    assert sorted(together["plain"][2]) == sorted([2] * reused + [4] * (STEPS - reused))


def test_counters_reach_the_totals_the_request_stats_and_the_profile(plan):
    stats = []
    with Engine(plan, "inprocess", on_stats=stats.append) as engine:
        engine.start_profile()

        async def run():
            inputs, params = request(1.0)
            return [c async for c in engine.stream(inputs, params)]

        asyncio.run(run())
        totals = {n: t for i in engine.inspect().values() for n, t in i.stages.items()}
        trace = chrome_trace(engine.stop_profile(), plan)
    profile = parse_trace(trace)
    (dit,) = [row for row in stage_stats(profile) if row["stage"] == "dit"]
    assert dit["counters"] == totals["dit"].counters
    counters = totals["dit"].counters
    assert counters["steps_computed"] + counters["steps_reused"] == STEPS
    assert counters["steps_reused"] > 0
    (request_stats,) = [s for s in stats if "dit" in s.stages]
    assert request_stats.stages["dit"]["steps_reused"] == counters["steps_reused"]
    # The profile's per-request record, and the report's page data built from it.
    (timeline,) = [r for r in timelines(profile) if "dit" in r.counters]
    assert timeline.counters["dit"] == counters
    (page_request,) = [r for r in report_data(trace)["requests"] if r["counted"]]
    assert page_request["counted"] == {"dit": counters}
