"""The fused guidance + Euler step: its torch reference gives diffusers' bits (Qwen-Image's
true CFG and `rescale_noise_cfg`, then `FlowMatchEulerDiscreteScheduler.step`), and its
Triton kernels (interpreted on the CPU, compiled on a GPU) agree with the reference."""

import pytest
import torch

from omniflow.kernels import cfg_euler
from omniflow.kernels.cfg_euler import GuidanceError

# (samples, patches, channels): a channel count below one tile; one that is not a power of
# two; and samples longer than one 4096-element chunk, so "std" combines two chunks.
SHAPES = [(3, 37, 64), (5, 7, 100), (2, 100, 64)]


def tensors(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


def settings(samples: int) -> dict:
    """Per-sample guidance scales and step sizes, and one phi for every sample."""
    return {
        "scale": torch.linspace(1.5, 7.0, samples),
        "dt": -torch.linspace(0.02, 0.3, samples),
        "guidance_rescale": 0.7,
    }


def cases() -> list[dict]:
    found = []
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            x, cond, uncond = tensors(shape, dtype, seed=i)
            for rescale in cfg_euler.RESCALES:
                found.append({"x": x, "cond": cond, "uncond": uncond, "rescale": rescale})
            found.append({"x": x, "cond": cond, "uncond": None, "rescale": "none"})
    return found


def run_kernel(found: list[dict]) -> list[torch.Tensor]:
    """Runs under TRITON_INTERPRET=1: the kernel's new latents per case."""
    return [
        cfg_euler.cfg_euler_triton(
            c["x"], c["cond"], c["uncond"], **settings(c["x"].shape[0]), rescale=c["rescale"]
        )
        for c in found
    ]


def assert_agree(got: torch.Tensor, case: dict) -> None:
    """The kernel computes the reference's math in float32 and rounds once at the end. So it
    matches the reference on float32 inputs to rounding, and on bf16 inputs the reference run
    in float32 then rounded to bf16, within one bf16 step (the reference in bf16 rounds after
    every op, as diffusers does, and drifts further)."""
    upcast = {k: v.float() if torch.is_tensor(v) else v for k, v in case.items()}
    want = cfg_euler.reference(
        upcast["x"],
        upcast["cond"],
        upcast["uncond"],
        **settings(case["x"].shape[0]),
        rescale=case["rescale"],
    ).to(case["cond"].dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = 1e-5 if want.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-5)


@pytest.fixture(scope="module")
def kernel(interpret):
    found = cases()
    return list(zip(found, interpret(run_kernel, found), strict=True))


def test_kernel_agrees_with_the_reference(kernel):
    for case, got in kernel:
        assert_agree(got, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_qwen_image_guidance_then_the_scheduler_step(dtype):
    from diffusers import FlowMatchEulerDiscreteScheduler

    x, cond, uncond = tensors((1, 37, 64), dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    scheduler.set_begin_index(0)
    scheduler.step(cond, scheduler.timesteps[0], x)  # now at index 1
    # QwenImagePipeline.__call__'s true CFG, verbatim.
    comb_pred = uncond + 4.0 * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    noise_pred = comb_pred * (cond_norm / noise_norm)
    want = scheduler.step(noise_pred, scheduler.timesteps[1], x, return_dict=False)[0]

    dt = scheduler.sigmas[2:3] - scheduler.sigmas[1:2]
    got = cfg_euler.reference(x, cond, uncond, 4.0, dt, rescale="norm")
    assert torch.equal(got, want)
    assert torch.equal(cfg_euler.cfg_euler_step(x, cond, uncond, 4.0, dt, rescale="norm"), want)
    unguided = scheduler.step(cond, scheduler.timesteps[2], x, return_dict=False)[0]
    dt = scheduler.sigmas[3:4] - scheduler.sigmas[2:3]
    assert torch.equal(cfg_euler.reference(x, cond, None, 1.0, dt), unguided)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_std_rescale_is_diffusers_rescale_noise_cfg(dtype):
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    _, cond, uncond = tensors((3, 4, 8, 8), dtype)
    guided = uncond + 7.5 * (cond - uncond)
    want = rescale_noise_cfg(guided, cond, guidance_rescale=0.7)
    got = cfg_euler.guide(cond, uncond, 7.5, rescale="std", guidance_rescale=0.7)
    assert torch.equal(got, want)
    assert torch.equal(cfg_euler.guide(cond, uncond, 7.5), guided)


def test_bad_inputs_are_refused():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(GuidanceError, match="rescale must be one of none, norm, std"):
        cfg_euler.cfg_euler_step(x, x, x, 2.0, -0.1, rescale="l2")
    with pytest.raises(GuidanceError, match="must share one shape"):
        cfg_euler.cfg_euler_step(x, x, torch.zeros(2, 3, 5), 2.0, -0.1)
    with pytest.raises(GuidanceError, match="3 elements for 2 samples"):
        cfg_euler.cfg_euler_step(x, x, x, torch.ones(3), -0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [*SHAPES, (2, 4096, 64)])
def test_kernel_matches_reference_on_gpu(shape, dtype):
    x, cond, uncond = (t.cuda() for t in tensors(shape, dtype))
    for guide_with in (uncond, None):
        for rescale in cfg_euler.RESCALES:
            case = {"x": x, "cond": cond, "uncond": guide_with, "rescale": rescale}
            got = cfg_euler.cfg_euler_step(
                x, cond, guide_with, **settings(shape[0]), rescale=rescale
            )
            assert_agree(got, case)
