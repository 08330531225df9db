"""The diffusers stage backends on the tiny Qwen-Image-Edit checkpoint: the text encoder
reading the instruction together with the input image, the step-wise denoiser attending to
the input image's VAE latents beside its noise, and the VAE, run by the interpreter and by
the engine in one process and across processes, give the images of diffusers' own
`QwenImageEditPipeline.__call__` (to within 1/255 per pixel) and its latents (within 1e-5);
edit requests at different steps share one transformer forward; a request whose image
cannot be used fails alone."""

import asyncio
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image

from omniflow.backends.diffusion import DiffusersBackendError, unpack_prompts
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_file
from omniflow.families.qwen_image.pipeline import load_processor
from omniflow.hf_logging import quiet
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.preflight import preflight
from omniflow.runtime.requests import RequestError, admit, stage_params
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_diffusion import assert_close_pixels, step_when_ready, to_uint8

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "image_edit.omni"


def pixels(height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (height, width, 3), generator=generator).to(torch.uint8)


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> list[tuple[dict, dict]]:
    """A wide image given as a tensor, edited with guidance; another image of its aspect
    ratio given as a PNG file, unguided, with more steps and another seed. Both input
    images are resized to 1216 x 864 pixels and both outputs are 32 x 32, so the two can
    share a transformer forward."""
    path = tmp_path_factory.mktemp("images") / "wide.png"
    Image.fromarray(pixels(80, 112, 1).numpy()).save(path)
    return [
        (
            {"image": pixels(40, 56, 0), "prompt": "Make the cat blue.", "negative_prompt": " "},
            {"steps": 2, "true_cfg_scale": 4.0, "height": 32, "width": 32, "seed": 0},
        ),
        (
            {"image": str(path), "prompt": "Turn the sky into a sunset."},
            {"steps": 3, "true_cfg_scale": 1.0, "height": 32, "width": 32, "seed": 7},
        ),
    ]


@pytest.fixture(scope="module")
def pipe():
    """The pipeline as diffusers loads it, but for the processor: diffusers' loading of
    Qwen2VLProcessor needs torchvision, so it is given the one the backends load."""
    path = build_tiny("image-edit")
    with quiet():
        pipe = QwenImageEditPipeline.from_pretrained(
            path, processor=load_processor(path / "processor")
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_call(pipe, inputs: dict, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's own `__call__` for one request: its image as uint8 pixels
    [1, H, W, 3], and its final latents [1, C, H/8, W/8], read at its last step."""
    image = inputs["image"]
    if isinstance(image, str):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    else:
        image = Image.fromarray(image.numpy())
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    height, width = params["height"], params["width"]
    with quiet():
        images = pipe(
            image,
            inputs["prompt"],
            negative_prompt=inputs.get("negative_prompt", " "),
            true_cfg_scale=params["true_cfg_scale"],
            num_inference_steps=params["steps"],
            height=height,
            width=width,
            generator=torch.Generator().manual_seed(params["seed"]),
            output_type="np",
            callback_on_step_end=keep_latents,
        ).images
    latents = pipe._unpack_latents(last["latents"], height, width, pipe.vae_scale_factor)
    return to_uint8(torch.from_numpy(images)), latents[:, :, 0]


@pytest.fixture(scope="module")
def references(pipe, requests):
    return [pipeline_call(pipe, inputs, params) for inputs, params in requests]


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


@pytest.fixture(scope="module")
def interpreter(plan):
    return Interpreter(plan)


async def run_concurrently(engine: Engine, requests) -> list[torch.Tensor]:
    """Every request at once, so that the stages can batch them."""

    async def one(inputs, params):
        return [c.value async for c in engine.stream(inputs, params) if c.value is not None]

    outputs = await asyncio.gather(*(one(i, p) for i, p in requests))
    return [torch.cat(chunks) for chunks in outputs]


@pytest.mark.parametrize("runner", ["interpreter", "inprocess", "process"])
def test_images_match_the_diffusers_pipeline(
    runner, plan, interpreter, requests, references, monkeypatch
):
    # Each request costs a 1216 x 864 VAE encode (about 2 s here), so across processes only
    # the second one runs: its image travels as a file's path; in one process both run at
    # once and share the stages' batches.
    cases = list(zip(requests, references, strict=True))
    if runner == "process":
        cases = cases[1:]
    if runner == "interpreter":
        images = [interpreter.run(inputs, params)["edited"] for (inputs, params), _ in cases]
    else:
        # One torch thread per executor process, as in this one: three executors' spinning
        # worker threads on two cores made the run three times slower.
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        with Engine(plan, runner) as engine:
            images = asyncio.run(run_concurrently(engine, [request for request, _ in cases]))
    for got, (_, (want, _)) in zip(images, cases, strict=True):
        assert_close_pixels(got, want)


# --- the backends driven directly, step by step ---------------------------------------------


def output(call: Call, port: str) -> torch.Tensor:
    (value,) = [v for p, v in call.emitted if p == port]
    return value


def stage_call(plan, stage: str, name: str, values: dict, request: tuple) -> Call:
    """A Call of `stage` for `request` whose input streams hold `values` and have ended."""
    inputs, params = request
    streams = {}
    for channel in (c for c in plan.channels if c.dst == stage):
        streams[channel.dst_port] = InputStream(channel.type)
        streams[channel.dst_port].push(values[channel.dst_port], end=True)
    resolved = stage_params(plan.stage(stage), admit(plan, inputs, params))
    return Call(name, resolved, streams)


def test_an_input_image_past_the_processors_aspect_ratio_is_refused_at_admission(plan, requests):
    """What the encoder stage would fail (Qwen2.5-VL's processor takes up to 200:1) is a
    RequestError naming the image before any stage runs; 200:1 passes."""
    inputs, params = requests[0]
    checks = preflight(plan)
    for height, width in ((4, 4000), (300, 1)):
        with pytest.raises(RequestError, match="up to 200:1") as info:
            admit(plan, {**inputs, "image": pixels(height, width, 2)}, params, checks)
        assert info.value.field == "image"
    admit(plan, {**inputs, "image": pixels(1, 200, 2)}, params, checks)


def test_edits_at_different_steps_share_one_forward_and_bad_images_fail_alone(
    plan, interpreter, requests, references
):
    backends = interpreter.backends
    (a_inputs, _), (b_inputs, _) = requests
    # Sides 300 times apart: the pipeline's processor refuses it.
    narrow = ({**a_inputs, "image": pixels(1, 300, 2)}, requests[0][1])
    encoded = [
        stage_call(plan, "encoder", name, {"prompt": r[0]["prompt"], "image": r[0]["image"]}, r)
        for name, r in zip("abn", [*requests, narrow], strict=True)
    ]
    backends["encoder"].step(encoded)
    a_hidden, b_hidden = (output(c, "hidden") for c in encoded[:2])
    assert [c.error is None and c.finished for c in encoded] == [True, True, False]
    assert isinstance(encoded[2].error, DiffusersBackendError)
    assert "factor of at most 200" in str(encoded[2].error)
    # Past the 64 dropped template tokens, each row is <|vision_start|>, the image's 1333
    # tokens (31 x 43 merged patches of 1204 x 868 pixels), <|vision_end|>, the prompt (5
    # tokens; the negative " " is 1) and the template's 5 closing tokens.
    rows = [row.shape[0] for row in unpack_prompts(a_hidden, a_hidden[:, 0, :2])]
    assert rows == [1 + 1333 + 1 + 5 + 5, 1 + 1333 + 1 + 1 + 5]

    a = stage_call(plan, "dit", "a", {"cond": a_hidden, "image": a_inputs["image"]}, requests[0])
    b = stage_call(plan, "dit", "b", {"cond": b_hidden, "image": b_inputs["image"]}, requests[1])
    # Admission would refuse a path that is no readable file; this one reaches the stage.
    unreadable = stage_call(
        plan, "dit", "bad", {"cond": a_hidden, "image": str(GRAPH)}, requests[0]
    )
    forwards = []
    hook = backends["dit"].transformer.register_forward_hook(
        lambda module, args, kwargs, out: forwards.append(
            (kwargs["hidden_states"].shape, kwargs["timestep"].clone())
        ),
        with_kwargs=True,
    )
    try:
        for batch in ([a, unreadable], [a, b], [b], [b]):  # b starts one step behind a
            step_when_ready(backends["dit"], batch)
    finally:
        hook.remove()
    assert isinstance(unreadable.error, DiffusersBackendError)
    assert "cannot read image file" in str(unreadable.error)
    # One forward per step: a's conditional and unconditional rows, then b's unguided row,
    # each row at its own request's timestep; every row is the 2 x 2 patches of the 32 x 32
    # output's noise, then the 76 x 54 patches of the input image's latents.
    assert [shape for shape, _ in forwards] == [(2, 4 + 4104, 16), (3, 4108, 16)] + [
        (1, 4108, 16)
    ] * 2
    timesteps = forwards[1][1]
    assert timesteps[0] == timesteps[1] != timesteps[2]
    for call, (_, want) in zip((a, b), references, strict=True):
        assert call.finished and call.error is None
        torch.testing.assert_close(output(call, "latents"), want, rtol=0, atol=1e-5)
