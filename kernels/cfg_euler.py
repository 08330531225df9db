"""One denoising update in one pass: classifier-free guidance fused with the flow-matching
Euler step, `x + dt * guide(cond, uncond)` with `dt = sigma_next - sigma`. A Triton kernel on
CUDA, and the torch reference (`reference`) it is tested against.

Unfused, a guided Euler step is about ten elementwise and reduction kernels over the latents
(differences, scalings, two norms, the ratio, the upcast, the update, the downcast), each a
full read and write. Fused, the conditional and unconditional predictions and the latents are
read once and the new latents written once, in float32.

Guidance, per sample (`scale` per sample, so requests with different settings batch):

- `rescale="none"`: `uncond + scale * (cond - uncond)`.
- `rescale="norm"`: that, times `norm(cond) / norm(guided)` along the last dimension: the
  "true CFG" of diffusers' `QwenImagePipeline.__call__`. Each row of the last dimension is
  one program's tile, so the norms never leave registers.
- `rescale="std"`: diffusers' `rescale_noise_cfg`: `phi * guided * std(cond) / std(guided)
  + (1 - phi) * guided`, standard deviations over each sample. A sample spans many
  programs, so this takes two launches: per-chunk sums and centred sums of squares, then the
  update, which combines its sample's chunks (Chan et al.'s parallel variance) first.

With `uncond=None` the step is unguided: `x + dt * cond`.

`reference` performs diffusers' own operations in their order and input dtype — the
pipeline's guidance, then `FlowMatchEulerDiscreteScheduler.step` (upcast the sample, add
`dt * model_output` computed in the model's dtype, cast back) — so on float32 and bfloat16
inputs it gives diffusers' bits (the tests compare with `torch.equal`); that is what runs
off CUDA. The kernel keeps float32 throughout, so on bf16 it differs from diffusers by the
bf16 rounding of diffusers' intermediates (about one bf16 step of the result).
"""

from __future__ import annotations

import torch

from omniflow.errors import OmniflowError
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import jit, tl, triton

RESCALES = ("none", "norm", "std")
# Elements per program. A row of the last dimension must fit one tile (MAX_ROW) unless the
# step is "std"-rescaled; longer rows take the torch path.
TILE = 4096
MAX_ROW = 16384


class GuidanceError(OmniflowError):
    """Guidance inputs of mismatched shapes, or an unknown rescale."""


@jit
def _rows_kernel(
    x_ptr,
    cond_ptr,
    uncond_ptr,
    scale_ptr,
    dt_ptr,
    out_ptr,
    R,
    D,
    rows_per_sample,
    GUIDED: tl.constexpr,
    NORM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`ROWS` whole rows of the last dimension per program: "none", "norm" and unguided."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    live = rows < R
    inside = live[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    sample = rows // rows_per_sample
    v = tl.load(cond_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if GUIDED:
        u = tl.load(uncond_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + sample, mask=live, other=0.0)
        guided = u + scale[:, None] * (v - u)
        if NORM:
            cond_norm = tl.sqrt_rn(tl.sum(v * v, 1))
            # Rows past the end are all zeros; keep their 0/0 out of the arithmetic.
            guided_norm = tl.where(live, tl.sqrt_rn(tl.sum(guided * guided, 1)), 1.0)
            guided = guided * tl.math.div_rn(cond_norm, guided_norm)[:, None]
        v = guided
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + sample, mask=live, other=0.0)
    tl.store(out_ptr + offs, (x + dt[:, None] * v).to(out_ptr.dtype.element_ty), mask=inside)


@jit
def _std_stats_kernel(cond_ptr, uncond_ptr, scale_ptr, stats_ptr, N, CHUNK: tl.constexpr):
    """Per (sample, chunk): the sums and centred sums of squares of cond and guided."""
    sample = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < N
    base = sample.to(tl.int64) * N
    v = tl.load(cond_ptr + base + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(uncond_ptr + base + offs, mask=inside, other=0.0).to(tl.float32)
    guided = u + tl.load(scale_ptr + sample) * (v - u)
    count = tl.minimum(N - chunk * CHUNK, CHUNK).to(tl.float32)
    v_sum = tl.sum(v, 0)
    g_sum = tl.sum(guided, 0)
    v_dev = tl.where(inside, v - v_sum / count, 0.0)
    g_dev = tl.where(inside, guided - g_sum / count, 0.0)
    out = stats_ptr + (sample * tl.num_programs(1) + chunk) * 4
    tl.store(out, v_sum)
    tl.store(out + 1, tl.sum(v_dev * v_dev, 0))
    tl.store(out + 2, g_sum)
    tl.store(out + 3, tl.sum(g_dev * g_dev, 0))


@jit
def _std_step_kernel(
    x_ptr,
    cond_ptr,
    uncond_ptr,
    scale_ptr,
    phi_ptr,
    dt_ptr,
    stats_ptr,
    out_ptr,
    N,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """The update of one chunk, after combining its sample's chunk statistics."""
    sample = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    which = tl.arange(0, CHUNKS)
    present = which < chunks
    stats = stats_ptr + (sample * chunks + which) * 4
    count = tl.where(present, tl.minimum(N - which * CHUNK, CHUNK).to(tl.float32), 1.0)
    v_sum = tl.load(stats, mask=present, other=0.0)
    g_sum = tl.load(stats + 2, mask=present, other=0.0)
    v_mean = tl.sum(v_sum, 0) / N
    g_mean = tl.sum(g_sum, 0) / N
    v_dev = tl.where(present, v_sum / count - v_mean, 0.0)
    g_dev = tl.where(present, g_sum / count - g_mean, 0.0)
    v_m2 = tl.sum(tl.load(stats + 1, mask=present, other=0.0) + count * v_dev * v_dev, 0)
    g_m2 = tl.sum(tl.load(stats + 3, mask=present, other=0.0) + count * g_dev * g_dev, 0)
    # Unbiased, as torch.std: the ratio of the two deviations is sqrt(v_m2 / g_m2).
    ratio = tl.sqrt_rn(tl.math.div_rn(v_m2, g_m2))
    phi = tl.load(phi_ptr + sample)
    factor = phi * ratio + (1.0 - phi)

    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < N
    base = sample.to(tl.int64) * N
    v = tl.load(cond_ptr + base + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(uncond_ptr + base + offs, mask=inside, other=0.0).to(tl.float32)
    guided = (u + tl.load(scale_ptr + sample) * (v - u)) * factor
    x = tl.load(x_ptr + base + offs, mask=inside, other=0.0).to(tl.float32)
    new = x + tl.load(dt_ptr + sample) * guided
    tl.store(out_ptr + base + offs, new.to(out_ptr.dtype.element_ty), mask=inside)


# --- the kernel's launcher, the reference, and the wrapper -------------------------------------


def _check(x, cond, uncond, rescale: str) -> None:
    if rescale not in RESCALES:
        raise GuidanceError(f"rescale must be one of {', '.join(RESCALES)}, not {rescale!r}")
    shapes = {tuple(t.shape) for t in (x, cond, uncond) if t is not None}
    if len(shapes) != 1 or x.dim() < 2:
        raise GuidanceError(
            "latents, cond and uncond must share one shape [B, ...]: got "
            + ", ".join(str(list(t.shape)) for t in (x, cond, uncond) if t is not None)
        )


def _per_sample(value, samples: int, device, dtype=torch.float32) -> torch.Tensor:
    """A number or a `[B]` (or one-element) tensor as `[B]` on `device`, without a host sync."""
    if not torch.is_tensor(value):
        return torch.full((samples,), value, dtype=dtype, device=device)
    if value.numel() not in (1, samples):
        raise GuidanceError(
            f"a per-sample value has {value.numel()} elements for {samples} samples"
        )
    return value.to(device, dtype).reshape(-1).expand(samples).contiguous()


def cfg_euler_triton(
    x: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    scale,
    dt,
    *,
    rescale: str = "none",
    guidance_rescale=0.0,
) -> torch.Tensor:
    """Run the Triton kernels (any device Triton can run on, including the CPU under
    `TRITON_INTERPRET=1`). Arguments as `cfg_euler_step`."""
    _check(x, cond, uncond, rescale)
    guided = uncond is not None
    x, cond = x.contiguous(), cond.contiguous()
    # Unguided launches never read `uncond`; any tensor fills the slot.
    uncond = uncond.contiguous() if guided else cond
    samples, device = x.shape[0], x.device
    scale_t = _per_sample(scale, samples, device)
    dt_t = _per_sample(dt, samples, device)
    out = torch.empty_like(cond)
    if not out.numel():
        return out
    if guided and rescale == "std":
        per_sample = x.numel() // samples
        chunks = triton.cdiv(per_sample, TILE)
        stats = torch.empty(samples, chunks, 4, dtype=torch.float32, device=device)
        _std_stats_kernel[(samples, chunks)](cond, uncond, scale_t, stats, per_sample, CHUNK=TILE)
        phi = _per_sample(guidance_rescale, samples, device)
        _std_step_kernel[(samples, chunks)](
            x, cond, uncond, scale_t, phi, dt_t, stats, out, per_sample,
            CHUNK=TILE, CHUNKS=triton.next_power_of_2(chunks),
        )  # fmt: skip
        return out
    width = x.shape[-1]
    if width > MAX_ROW:
        raise GuidanceError(f"rows of {width} exceed the kernel's {MAX_ROW}; use cfg_euler_step")
    rows = x.numel() // width
    block_d = triton.next_power_of_2(width)
    tile_rows = max(1, TILE // block_d)
    _rows_kernel[(triton.cdiv(rows, tile_rows),)](
        x, cond, uncond, scale_t, dt_t, out, rows, width, rows // samples,
        GUIDED=guided, NORM=rescale == "norm", ROWS=tile_rows, BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _times(coefficient: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`number * y` as torch computes it for a Python number: in float32, rounded to
    `y.dtype` (a float32 tensor would promote a bf16 `y` instead). `coefficient` is `[B]`."""
    shape = (-1,) + (1,) * (y.dim() - 1)
    return (coefficient.float().view(shape) * y.float()).to(y.dtype)


def guide(
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scale,
    *,
    rescale: str = "none",
    guidance_rescale=0.0,
) -> torch.Tensor:
    """The guided prediction alone, with diffusers' operations: the reference's first half."""
    _check(cond, cond, uncond, rescale)
    samples, device = cond.shape[0], cond.device
    guided = uncond + _times(_per_sample(scale, samples, device, torch.float64), cond - uncond)
    if rescale == "norm":
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        guided_norm = torch.norm(guided, dim=-1, keepdim=True)
        guided = guided * (cond_norm / guided_norm)
    elif rescale == "std":
        dims = list(range(1, cond.dim()))
        rescaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
        phi = _per_sample(guidance_rescale, samples, device, torch.float64)
        guided = _times(phi, rescaled) + _times(1 - phi, guided)
    return guided


def reference(
    x: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    scale,
    dt,
    *,
    rescale: str = "none",
    guidance_rescale=0.0,
) -> torch.Tensor:
    """Unfused, as diffusers: `guide`, then the scheduler's Euler step (upcast the sample,
    add `dt * prediction` computed in the prediction's dtype, cast to that dtype). `dt` is
    rounded to that dtype as the scheduler's 0-dim tensor is; `scale` and `guidance_rescale`
    are not, as the pipeline's Python numbers are not."""
    _check(x, cond, uncond, rescale)
    prediction = cond
    if uncond is not None:
        prediction = guide(cond, uncond, scale, rescale=rescale, guidance_rescale=guidance_rescale)
    # The scheduler's `dt` is a 0-dim tensor, not a number: torch rounds it to the
    # prediction's dtype before multiplying.
    dt = _per_sample(dt, x.shape[0], x.device).to(prediction.dtype)
    step = dt.view((-1,) + (1,) * (x.dim() - 1)) * prediction
    return (x.to(torch.float32) + step).to(prediction.dtype)


def cfg_euler_step(
    x: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    scale,
    dt,
    *,
    rescale: str = "none",
    guidance_rescale=0.0,
) -> torch.Tensor:
    """The latents after one guided Euler step, in the prediction's dtype.

    `x`, `cond`, `uncond`: `[B, ...]` latents and the conditional and unconditional
    predictions (`uncond=None`: unguided). `scale`, `dt` (`sigma_next - sigma`) and
    `guidance_rescale` (phi, for `rescale="std"`): numbers or per-sample `[B]` tensors.
    The Triton kernel on CUDA, `reference` elsewhere (and where a row of the last dimension
    is longer than `MAX_ROW`, which no latent layout is)."""
    fits = (uncond is not None and rescale == "std") or x.shape[-1] <= MAX_ROW
    run = cfg_euler_triton if x.is_cuda and triton is not None and fits else reference
    return run(x, cond, uncond, scale, dt, rescale=rescale, guidance_rescale=guidance_rescale)


def benchmark(samples: int = 1, patches: int = 4096, channels: int = 64, iters: int = 50) -> dict:
    """Median milliseconds of the fused step and the reference on CUDA, bf16, per rescale
    (default: one 1024x1024 Qwen-Image latent, packed)."""
    shape = (samples, patches, channels)
    x, cond, uncond = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = {}
    for rescale in RESCALES:
        for name, fn in (("triton", cfg_euler_triton), ("torch", reference)):
            times[rescale, name] = cuda_median_ms(
                lambda fn=fn, r=rescale: fn(
                    x, cond, uncond, 4.0, -0.02, rescale=r, guidance_rescale=0.7
                ),
                iters,
            )
    return times


if __name__ == "__main__":
    for samples in (1, 4):
        print(f"B={samples}", benchmark(samples))
