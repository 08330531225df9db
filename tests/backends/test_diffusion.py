"""The diffusers stage backends on the tiny Qwen-Image checkpoint: text encoder, step-wise
denoiser and VAE, run by the real runtime in every mode, give the diffusers pipeline's own
images (to within 1/255 per pixel; they have come out identical) and latents (within 1e-5);
requests at different steps share one transformer forward and give what they give alone;
each request keeps its own scheduler."""

import asyncio
import time
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

from omniflow.backends.diffusion import (
    DiffusersBackendError,
    pack_prompts,
    prompt_header,
    unpack_prompts,
)
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_file, compile_source
from omniflow.hf_logging import quiet
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import admit, stage_params
from omniflow.runtime.stage import Call, InputStream
from tests.runtime.test_readback import land_late

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "text_to_image.omni"
# Guided with prompts of different lengths, another size and step count, and unguided; the
# graph's denoiser takes the request's seed as its generator's, as the reference does.
REQUESTS = [
    (
        {"prompt": "A photo of a red cat", "negative_prompt": " "},
        {"steps": 2, "true_cfg_scale": 4.0, "height": 32, "width": 32, "seed": 0},
    ),
    (
        {"prompt": "a dog on a beach at sunset", "negative_prompt": "blurry, low quality"},
        {"steps": 3, "true_cfg_scale": 4.0, "height": 48, "width": 32, "seed": 0},
    ),
    (
        {"prompt": "a blue house"},
        {"steps": 2, "true_cfg_scale": 1.0, "height": 32, "width": 32, "seed": 0},
    ),
]
SEEDED = """
pipeline seeded {
  model "tiny:text-to-image"
  param seed = 0
  stage encoder = encoder(component="text_encoder")
  stage dit = diffusion(component="transformer", steps=2, true_cfg_scale=4.0, cfg=negative_prompt,
                        height=32, width=32, seed=$seed)
  stage vae = vae(component="vae")
  input prompt: text -> encoder
  input negative_prompt: text = " "
  encoder.hidden -> dit
  dit.latents -> vae
  vae.image -> map(denorm | to_uint8) -> output image
}
"""


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """The graph's `to_uint8` on an image already in [0, 1]."""
    return torch.floor(image.clamp(0, 1) * 255 + 0.5).to(torch.uint8)


def assert_close_pixels(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.uint8 and got.shape == want.shape
    assert (got.int() - want.int()).abs().max() <= 1


@pytest.fixture(scope="module")
def pipe():
    with quiet():
        pipe = DiffusionPipeline.from_pretrained(build_tiny("text-to-image"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_call(pipe, inputs: dict, params: dict, output_type: str, seed: int = 0):
    """The pipeline's own `__call__` for one request: its `.images` in `output_type`."""
    with quiet():
        return pipe(
            inputs["prompt"],
            negative_prompt=inputs.get("negative_prompt", " "),
            true_cfg_scale=params["true_cfg_scale"],
            num_inference_steps=params["steps"],
            height=params["height"],
            width=params["width"],
            generator=torch.Generator().manual_seed(seed),
            output_type=output_type,
        ).images


def reference(pipe, inputs: dict, params: dict, seed: int = 0) -> torch.Tensor:
    """The pipeline's own `__call__` for one request, as uint8 pixels [1, H, W, 3]."""
    return to_uint8(torch.from_numpy(pipeline_call(pipe, inputs, params, "np", seed)))


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


@pytest.fixture(scope="module")
def interpreter(plan):
    return Interpreter(plan)


@pytest.fixture(scope="module")
def references(pipe):
    return [reference(pipe, inputs, params) for inputs, params in REQUESTS]


async def run_concurrently(engine: Engine) -> list[torch.Tensor]:
    """Every request at once, so that the stages can batch them."""

    async def one(inputs, params):
        return [c.value async for c in engine.stream(inputs, params) if c.value is not None]

    outputs = await asyncio.gather(*(one(i, p) for i, p in REQUESTS))
    return [torch.cat(chunks) for chunks in outputs]


@pytest.mark.parametrize("runner", ["interpreter", "inprocess", "process"])
def test_images_match_the_diffusers_pipeline(runner, plan, interpreter, references):
    if runner == "interpreter":
        images = [interpreter.run(inputs, params)["image"] for inputs, params in REQUESTS]
    else:
        with Engine(plan, runner) as engine:
            images = asyncio.run(run_concurrently(engine))
    for got, want in zip(images, references, strict=True):
        assert_close_pixels(got, want)


def test_seed_parameter_picks_the_pipeline_generator_seed(pipe):
    seeded = Interpreter(compile_source(SEEDED, devices="cpu"))
    inputs = {"prompt": "A photo of a red cat", "negative_prompt": "dark"}
    settings = {"steps": 2, "true_cfg_scale": 4.0, "height": 32, "width": 32}
    images = {seed: seeded.run(inputs, {"seed": seed})["image"] for seed in (0, 7)}
    for seed, image in images.items():
        assert_close_pixels(image, reference(pipe, inputs, settings, seed))
    assert not torch.equal(images[0], images[7])


# --- the backends driven directly, step by step ---------------------------------------------


def request(prompt: str, steps: int, guidance: float = 4.0, height: int = 32) -> tuple:
    return (
        {"prompt": prompt, "negative_prompt": "grey"},
        {"steps": steps, "true_cfg_scale": guidance, "height": height, "width": 32, "seed": 0},
    )


def output(call: Call, port: str) -> torch.Tensor:
    (value,) = [v for p, v in call.emitted if p == port]
    return value


def step_when_ready(backend, batch: list[Call]) -> None:
    """`backend`'s step of `batch` once each call is ready, as a stage's loop steps it (a
    request's first step waits for what its backend copies to the host: a GPU's lands a
    moment later)."""
    waited = time.monotonic() + 10
    while not all(backend.ready(c) for c in batch):
        assert backend.in_flight() and time.monotonic() < waited, "a call will never be ready"
    backend.step(batch)


class Stages:
    """The interpreter's loaded backends, driven call by call as a stage runner drives them."""

    def __init__(self, interpreter: Interpreter):
        self.plan = interpreter.plan
        self.backends = interpreter.backends

    def call(self, stage: str, name: str, values: dict, request: tuple) -> Call:
        """A Call of `stage` for `request` whose input streams hold `values` and have ended."""
        inputs, params = request
        streams = {}
        for channel in (c for c in self.plan.channels if c.dst == stage):
            streams[channel.dst_port] = InputStream(channel.type)
            streams[channel.dst_port].push(values[channel.dst_port], end=True)
        resolved = stage_params(self.plan.stage(stage), admit(self.plan, inputs, params))
        return Call(name, resolved, streams)

    def run(self, stage: str, schedule: list[list[Call]]) -> None:
        """One step per batch of `schedule`; every call must have finished by the end."""
        for batch in schedule:
            step_when_ready(self.backends[stage], batch)
        assert all(c.finished and c.error is None for batch in schedule for c in batch)

    def denoiser_calls(self, requests: dict) -> dict[str, Call]:
        """Denoiser calls of `requests` (name -> request), their prompts (and an edit's
        images) encoded in one batch."""
        images = {n: {k: v for k, v in r[0].items() if k == "image"} for n, r in requests.items()}
        encoded = {
            name: self.call("encoder", name, {"prompt": r[0]["prompt"], **images[name]}, r)
            for name, r in requests.items()
        }
        self.run("encoder", [list(encoded.values())])
        hidden = {name: output(call, "hidden") for name, call in encoded.items()}
        return {
            name: self.call("dit", name, {"cond": hidden[name], **images[name]}, r)
            for name, r in requests.items()
        }

    def alone(self, requests: dict) -> dict[str, Call]:
        """Each request's denoiser call run to its end as the only request in the stage."""
        calls = {}
        for name, r in requests.items():
            calls[name] = self.denoiser_calls({name: r})[name]
            self.run("dit", [[calls[name]]] * r[1]["steps"])
        return calls

    def decode(self, calls: dict[str, Call], requests: dict) -> dict[str, torch.Tensor]:
        """The VAE's images of finished denoiser calls, decoded in one batch, as uint8."""
        vae = {
            name: self.call("vae", name, {"latents": output(c, "latents")}, requests[name])
            for name, c in calls.items()
        }
        self.run("vae", [list(vae.values())])
        return {name: to_uint8((output(c, "image") + 1) * 0.5) for name, c in vae.items()}

    def assert_same_as_alone(self, calls: dict[str, Call], requests: dict) -> None:
        """Latents and images of `calls`, denoised and decoded together, are what each
        request gives alone."""
        solo = self.alone(requests)
        images = self.decode(calls, requests)
        for name, call in calls.items():
            want = output(solo[name], "latents")
            torch.testing.assert_close(output(call, "latents"), want, rtol=0, atol=1e-5)
            assert_close_pixels(images[name], self.decode({name: solo[name]}, requests)[name])


@pytest.fixture(scope="module")
def stages(interpreter):
    return Stages(interpreter)


def test_latents_match_the_pipeline_latents(stages, pipe):
    requests = {str(i): r for i, r in enumerate(REQUESTS)}
    for name, call in stages.alone(requests).items():
        inputs, params = requests[name]
        packed = pipeline_call(pipe, inputs, params, "latent")
        want = pipe._unpack_latents(packed, params["height"], params["width"], 8)[:, :, 0]
        torch.testing.assert_close(output(call, "latents"), want, rtol=0, atol=1e-5)


def test_requests_at_different_steps_share_one_forward(stages):
    requests = {"a": request("a red cat", 3), "b": request("a green field under a sky", 3, 1.0)}
    calls = stages.denoiser_calls(requests)
    timesteps = []
    hook = stages.backends["dit"].transformer.register_forward_hook(
        lambda module, args, kwargs, out: timesteps.append(kwargs["timestep"].clone()),
        with_kwargs=True,
    )
    a, b = calls["a"], calls["b"]
    try:
        stages.run("dit", [[a], [a, b], [a, b], [b]])  # b starts one step behind a
    finally:
        hook.remove()
    # One forward per step: a's conditional and unconditional rows, then b's unguided row,
    # each row at its own request's timestep.
    assert [len(t) for t in timesteps] == [2, 3, 3, 1]
    assert all(t[0] == t[1] != t[2] for t in timesteps[1:3])
    stages.assert_same_as_alone(calls, requests)


def test_each_request_keeps_its_own_scheduler(stages):
    requests = {"short": request("a red cat", 2), "long": request("a tall lighthouse", 5)}
    calls = stages.denoiser_calls(requests)
    short, long = calls["short"], calls["long"]
    stages.run("dit", [[long], [short, long], [long], [short, long], [long]])
    stages.assert_same_as_alone(calls, requests)


def test_a_request_starts_once_its_conditionings_header_is_on_the_host(stages, monkeypatch):
    """Its prompt lengths are copied to the host without waiting (a GPU's copy lands a
    moment later: held back three polls here); meanwhile the request is not ready and the
    backend in flight, and then it denoises what it denoises alone."""
    requests = {"late": request("a red cat", 2)}
    held_back = land_late(monkeypatch)
    (call,) = stages.denoiser_calls(requests).values()
    dit = stages.backends["dit"]
    assert not dit.ready(call) and dit.in_flight()
    stages.run("dit", [[call], [call]])
    assert held_back and not dit.in_flight()
    monkeypatch.undo()
    torch.testing.assert_close(
        output(call, "latents"), output(stages.alone(requests)["late"], "latents"), rtol=0, atol=0
    )


def test_conditioning_of_another_layout_fails_its_request_in_a_step(stages):
    call = stages.call("dit", "odd", {"cond": torch.ones(1, 1, 8)}, request("a red cat", 2))
    dit = stages.backends["dit"]
    assert dit.ready(call) and not dit.in_flight()
    dit.step([call])
    assert "not the diffusers text encoder's" in str(call.error)


def test_a_bad_request_fails_alone(stages):
    requests = {"bad": request("a red cat", 2, height=40), "good": request("a red dog", 2)}
    calls = stages.denoiser_calls(requests)
    dit = stages.backends["dit"]
    step_when_ready(dit, list(calls.values()))
    assert isinstance(calls["bad"].error, DiffusersBackendError)
    assert "height must be a positive multiple of 16" in str(calls["bad"].error)
    step_when_ready(dit, [calls["good"]])
    assert calls["good"].finished and calls["good"].error is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_layout_round_trips_lengths_exactly(dtype):
    rows = [torch.randn(n, 8).to(dtype) for n in (1023, 300)]
    packed = pack_prompts(rows)
    assert packed.shape == (2, 1024, 8) and packed.dtype == dtype
    for got, want in zip(unpack_prompts(packed, prompt_header(packed).value), rows, strict=True):
        assert torch.equal(got, want)


def test_foreign_conditioning_is_refused():
    with pytest.raises(DiffusersBackendError, match="not the diffusers text encoder"):
        prompt_header(torch.ones(1, 1, 8))
    hidden = torch.ones(1, 5, 8)
    with pytest.raises(DiffusersBackendError, match="not the diffusers text encoder"):
        unpack_prompts(hidden, prompt_header(hidden).value)
