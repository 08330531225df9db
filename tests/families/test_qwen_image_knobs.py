"""Qwen-Image's knobs mean what they mean to `QwenImagePipeline.__call__`: a request as the
peer's ComfyUI client sends it, mapped to the pipeline's parameters by the server
(`images.parse_generation`) and run by the stages, gives `__call__`'s latents for the same
fields. The client's default (`guidance_scale` 7.5, `true_cfg_scale` 1.0, no negative
prompt) runs no classifier-free guidance, as in diffusers; `true_cfg_scale` 4 with a
negative prompt runs true CFG; `true_cfg_scale` 4 without one runs none (diffusers warns);
`guidance_scale` changes nothing on a transformer that is not guidance-distilled. The VAE's
tiling and slicing, asked for with the client's strings, decode as diffusers' do."""

import pytest
import torch

from omniflow.compiler import compile_file
from omniflow.runtime.interpreter import Interpreter
from omniflow.server import images
from omniflow.server.metrics import Metrics
from omniflow.server.served import Served
from tests.backends.test_diffusion import GRAPH, Stages, output, pipe  # noqa: F401

torch.set_num_threads(1)

PEER_DEFAULT = {"n": 1, "num_inference_steps": 2, "guidance_scale": 7.5, "true_cfg_scale": 1.0,
                "vae_use_slicing": False, "vae_use_tiling": False, "seed": 9}  # fmt: skip
BODIES = {
    "peer default": {"prompt": "A photo of a red cat", "size": "32x32", **PEER_DEFAULT},
    "true cfg": {"prompt": "A photo of a red cat", "size": "48x32", **PEER_DEFAULT,
                 "true_cfg_scale": 4.0, "negative_prompt": "blurry", "num_inference_steps": 3},
    "cfg without a negative prompt": {"prompt": "a blue house", "size": "32x32",
                                      **PEER_DEFAULT, "true_cfg_scale": 4.0},
    "distilled guidance ignored": {"prompt": "a blue house", "size": "32x32", **PEER_DEFAULT,
                                   "true_cfg_scale": 4.0, "negative_prompt": "dark",
                                   "guidance_scale": 1.0},
}  # fmt: skip


@pytest.fixture(scope="module")
def plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


@pytest.fixture(scope="module")
def stages(plan):
    return Stages(Interpreter(plan))


def pipeline_params(plan, body: dict) -> tuple[dict, dict]:
    """The (inputs, parameters) the server makes of `body` for the pipeline."""
    served = Served("text_to_image", plan, None, 1, Metrics())
    (request,) = images.parse_generation(served, body).requests()
    return request


def reference_latents(pipe, body: dict) -> torch.Tensor:  # noqa: F811
    """`__call__` with the body's fields as its arguments, its unpacked final latents."""
    width, height = map(int, body["size"].split("x"))
    packed = pipe(
        body["prompt"],
        negative_prompt=body.get("negative_prompt"),
        true_cfg_scale=body["true_cfg_scale"],
        guidance_scale=body["guidance_scale"],
        num_inference_steps=body["num_inference_steps"],
        height=height,
        width=width,
        generator=torch.Generator().manual_seed(body["seed"]),
        output_type="latent",
    ).images
    return pipe._unpack_latents(packed, height, width, 8)[:, :, 0]


@pytest.mark.parametrize("case", BODIES)
def test_a_peer_request_computes_what_the_diffusers_pipeline_computes(case, plan, stages, pipe):  # noqa: F811
    body = BODIES[case]
    inputs, params = pipeline_params(plan, body)
    assert params["true_cfg_scale"] == body["true_cfg_scale"]
    assert params["guidance_scale"] == body["guidance_scale"]
    request = (inputs, params)
    call = stages.denoiser_calls({"r": request})["r"]
    steps = body["num_inference_steps"]
    stages.run("dit", [[call]] * steps)
    want = reference_latents(pipe, body)
    torch.testing.assert_close(output(call, "latents"), want, rtol=0, atol=1e-5)


def test_guidance_runs_only_with_a_negative_prompt_and_a_scale_above_one(plan, stages):
    rows = {}
    for case in ("peer default", "true cfg", "cfg without a negative prompt"):
        call = stages.denoiser_calls({"r": pipeline_params(plan, BODIES[case])})["r"]
        seen = []
        hook = stages.backends["dit"].transformer.register_forward_pre_hook(
            lambda module, args, kwargs, seen=seen: seen.append(len(kwargs["hidden_states"])),
            with_kwargs=True,
        )
        try:
            stages.run("dit", [[call]] * BODIES[case]["num_inference_steps"])
        finally:
            hook.remove()
        rows[case] = set(seen)
    assert rows == {"peer default": {1}, "true cfg": {2}, "cfg without a negative prompt": {1}}


@pytest.mark.parametrize("tiling", ["True", "False"])
def test_vae_tiling_and_slicing_decode_as_diffusers_does(plan, stages, pipe, tiling):  # noqa: F811
    """At 288 x 288 the tiny VAE's tiled decode (256-pixel tiles) differs from its whole
    decode; the stage's, asked with the peer's string, equals diffusers' tiled one."""
    body = {"prompt": "a red cat", "size": "288x288", **PEER_DEFAULT,
            "vae_use_tiling": tiling, "vae_use_slicing": "True"}  # fmt: skip
    inputs, params = pipeline_params(plan, body)
    assert params["vae_use_tiling"] is (tiling == "True") and params["vae_use_slicing"] is True
    latents = reference_latents(pipe, {**body, "vae_use_tiling": False})
    call = stages.call("vae", "v", {"latents": latents}, (inputs, params))
    stages.run("vae", [[call]])
    vae = pipe.vae
    with torch.no_grad():
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        z = latents[:, :, None] / inv_std + mean
        whole = vae.decode(z, return_dict=False)[0][:, :, 0]
        vae.enable_tiling()
        try:
            tiled = vae.decode(z, return_dict=False)[0][:, :, 0]
        finally:
            vae.disable_tiling()
    assert (whole - tiled).abs().max() > 1e-3  # tiling is visible at this size
    want = tiled if tiling == "True" else whole
    got = output(call, "image").permute(0, 3, 1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
