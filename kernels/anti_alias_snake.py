"""BigVGAN's anti-aliased SnakeBeta activation in one pass: upsample 2x through a 12-tap
lowpass, SnakeBeta, lowpass and downsample 2x, each filter with transformers' replicate
padding (`Qwen2_5OmniAntiAliasedActivation1d` around `Qwen2_5OmniSnakeBeta`, the activation
of every AMP block and of BigVGAN's output). A Triton kernel on CUDA, and the torch
reference (`reference`) it is tested against.

Why: transformers runs each activation as about thirteen kernels over `[B, C, T]` or its 2x
upsampled copy: a replicate pad, a depthwise transposed convolution (cuDNN's grouped
direct dgrad kernel), the ratio's scaling and a slice, SnakeBeta's eight elementwise
kernels, another pad and a depthwise strided convolution. BigVGAN runs 109 of them a
forward. On an H200 at real size, one 36-code token2wav window's BigVGAN was 2420 kernel
launches and 10.4 ms of kernel time in a CUDA graph, and ten 240-code windows took 343 ms,
of which the transposed convolution was 33%, the pads 10%, the strided convolution 10% and
SnakeBeta's elementwise kernels about 25%. This kernel reads the input once and writes
the output once; the upsampled signal lives in registers (NVIDIA's BigVGAN v2 ships the
same fusion as a CUDA kernel). Measured on an H200 (`benchmark`; BigVGAN's forward as
`Token2Wav._vocode` runs it, in a CUDA graph, with torch's default TF32 convolutions): an
activation at the ten windows' shapes (27.6M samples) takes 0.23 to 0.33 ms where
transformers' ops take 1.8 to 2.7 ms, bound by its arithmetic (two SnakeBetas and 24 taps
an output), not by memory (a copy of the tensor takes 0.07 ms); one 36-code window's
BigVGAN went to 676 launches and 4.7 ms of kernel time, ten 240-code windows from 333 to
95 ms.

The arithmetic (ratio 2, `TAPS` = 12-tap filters `f` up and `g` down, `T` samples):

- UpSample1d pads `x` by `TAPS / 2 - 1` (= 5) replicated samples each side, runs a stride-2
  transposed convolution (`f` unflipped), scales by 2 and keeps `2 T` samples after
  dropping `3 TAPS / 2 - 3` (= 15). Upsampled sample `m` (0 <= m < 2 T) is therefore
  `u[m] = 2 sum_q f[2 q + n % 2] x[clamp(n // 2 - 5 - q, 0, T - 1)]`, `n = m + 15`,
  q = 0..5: the filter's odd taps make the even samples and its even taps the odd ones,
  and the transposed convolution's own zero border is never reached.
- SnakeBeta: `s = u + sin(u exp(alpha))^2 / (exp(beta) + 1e-9)`, per channel.
- DownSample1d pads `s` by 5 replicated samples on the left and 6 on the right and runs a
  stride-2 convolution: `out[t] = sum_k g[k] s[clamp(2 t + k - 5, 0, 2 T - 1)]`.

A program works on segments of `WIDTH` pairs of upsampled samples (positions `2 n` and
`2 n + 1` for consecutive `n` starting 3 before the segment's first output, each clamped
into `[0, 2 T)`, which is the downsampler's replicate padding) and gathers each output's
twelve taps from them, so every upsampled sample's SnakeBeta is computed once, not six
times; a segment overlaps the next by 8 pairs and makes `WIDTH - 8` outputs.

Numerics: float32 throughout. The reference is transformers' ops in their order; the
kernel sums the filters' taps in its own order, its `sin` is libdevice's `sinf` and its
per-channel `exp` Triton's, so it agrees with the reference to float32 rounding, not bit
for bit: against a float64 reference on an H200 both are within about 1e-7 (relative
norm), and within 1e-6 where `exp(alpha)` reaches the hundreds, which amplifies the
rounding of `u` inside the sine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels.snake_beta import NO_DIV_BY_ZERO, snake, snake_parameters
from omniflow.kernels.snake_beta import reference as snake_reference
from omniflow.kernels.timing import cuda_median_ms
from omniflow.kernels.triton_guard import jit, tl, triton

# The filters' length and the resampling ratio the kernel is written for (transformers'
# defaults, which Qwen2.5-Omni's BigVGAN uses).
TAPS = 12
RATIO = 2
# A program's tile: up to MAX_SEGMENTS segments of up to MAX_WIDTH upsampled pairs, each
# segment within one warp (its gathers are register shuffles) and making WIDTH - OVERLAP
# outputs. On an H200, 4 x 256 ran an activation twice as fast as one 1024-pair segment
# gathered through shared memory.
MAX_WIDTH = 256
MAX_SEGMENTS = 4
# Pairs of a segment that are not its outputs: the downsampler reaches 3 pairs before the
# first output and 3 after the last; 8 keeps segments' outputs 32-byte aligned.
OVERLAP = 8


class AntiAliasError(OmniflowError):
    """Activation inputs of mismatched shapes, or filters the kernel is not written for."""


@jit
def _snake_upsampled(x_row, up_ptr, m, T, frequency, inverse_magnitude, TAPS: tl.constexpr):
    """SnakeBeta of upsampled samples `m` (each in [0, 2 T)), from the input row."""
    n = m + (3 * TAPS // 2 - 3)
    odd_taps = (n % 2) == 1
    newest = n // 2 - (TAPS // 2 - 1)  # the input sample of tap pair q = 0
    total = tl.zeros(m.shape, tl.float32)
    for q in tl.static_range(TAPS // 2):
        tap = tl.where(odd_taps, tl.load(up_ptr + 2 * q + 1), tl.load(up_ptr + 2 * q))
        source = tl.minimum(tl.maximum(newest - q, 0), T - 1)
        total += tap * tl.load(x_row + source)
    return snake(2.0 * total, frequency, inverse_magnitude)


@jit
def _anti_alias_snake_kernel(
    x_ptr, alpha_ptr, beta_ptr, up_ptr, down_ptr, out_ptr, C, T, eps,
    TAPS: tl.constexpr, SEGMENTS: tl.constexpr, WIDTH: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    channel = row % C
    frequency, inverse_magnitude = snake_parameters(
        tl.load(alpha_ptr + channel), tl.load(beta_ptr + channel), eps
    )
    x_row = x_ptr + row * T

    # Pair i of a segment holds upsampled samples 2 n and 2 n + 1, n = first - reach + i,
    # where `first` is the segment's first output: the downsampler's taps reach `reach`
    # pairs before an output and as many after it.
    reach: tl.constexpr = (TAPS // 2) // 2
    segment = tl.program_id(1) * SEGMENTS + tl.arange(0, SEGMENTS)[:, None]
    i = tl.arange(0, WIDTH)[None, :]
    first = segment * (WIDTH - OVERLAP)
    n = first - reach + i
    last = 2 * T - 1
    even = tl.minimum(tl.maximum(2 * n, 0), last)
    odd = tl.minimum(tl.maximum(2 * n + 1, 0), last)
    s_even = _snake_upsampled(x_row, up_ptr, even, T, frequency, inverse_magnitude, TAPS)
    s_odd = _snake_upsampled(x_row, up_ptr, odd, T, frequency, inverse_magnitude, TAPS)

    # Output first + i, tap k reads upsampled sample 2 (first + i) + k - (TAPS / 2 - 1).
    pair_of_output = tl.broadcast_to(i, (SEGMENTS, WIDTH))
    total = tl.zeros((SEGMENTS, WIDTH), tl.float32)
    for k in tl.static_range(TAPS):
        shift = k - (TAPS // 2 - 1) + 2 * reach
        # Wraps only for the overlap, whose outputs are not stored.
        pair = (pair_of_output + shift // 2) % WIDTH
        phase = s_even if shift % 2 == 0 else s_odd
        total += tl.load(down_ptr + k) * tl.gather(phase, pair, 1)
    t = first + i
    tl.store(out_ptr + row * T + t, total, mask=(i < WIDTH - OVERLAP) & (t < T))


def _check(x, alpha, beta, up_filter, down_filter) -> None:
    if x.dim() != 3 or x.dtype != torch.float32 or x.shape[2] < 1:
        raise AntiAliasError(f"x must be float32 [B, C, T >= 1]: {x.dtype} {list(x.shape)}")
    channels = x.shape[1]
    if alpha.shape != (channels,) or beta.shape != (channels,):
        raise AntiAliasError(
            f"alpha and beta must be [C={channels}]: {list(alpha.shape)}, {list(beta.shape)}"
        )
    for name, f in (("up", up_filter), ("down", down_filter)):
        if f.dim() != 3 or f.shape[:2] != (1, 1):
            raise AntiAliasError(f"the {name} filter must be [1, 1, taps]: {list(f.shape)}")


def anti_alias_snake_triton(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    up_ratio: int = RATIO,
    down_ratio: int = RATIO,
) -> torch.Tensor:
    """The activation with the Triton kernel. `x` `[B, C, T]`; `alpha`, `beta` `[C]`, the
    SnakeBeta parameters before their `exp`; the filters `[1, 1, TAPS]` (the modules'
    `upsample.filter`, `downsample.filter`); ratios 2."""
    _check(x, alpha, beta, up_filter, down_filter)
    taps = (up_filter.shape[-1], down_filter.shape[-1])
    if taps != (TAPS, TAPS) or (up_ratio, down_ratio) != (RATIO, RATIO):
        raise AntiAliasError(
            f"the kernel takes {TAPS}-tap filters and ratio {RATIO}: got {taps[0]} and "
            f"{taps[1]} taps, ratios {up_ratio} and {down_ratio}"
        )
    batch, channels, length = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        width = min(MAX_WIDTH, triton.next_power_of_2(length + OVERLAP))
        segments = triton.cdiv(length, width - OVERLAP)
        segments = min(MAX_SEGMENTS, triton.next_power_of_2(segments))
        grid = (batch * channels, triton.cdiv(length, segments * (width - OVERLAP)))
        _anti_alias_snake_kernel[grid](
            x, alpha.float().contiguous(), beta.float().contiguous(),
            up_filter.float().contiguous(), down_filter.float().contiguous(), out,
            channels, length, NO_DIV_BY_ZERO,
            TAPS=TAPS, SEGMENTS=segments, WIDTH=width, OVERLAP=OVERLAP,
            num_warps=max(1, min(4, segments * width // 256)),
        )  # fmt: skip
    return out


def reference(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    up_ratio: int = RATIO,
    down_ratio: int = RATIO,
) -> torch.Tensor:
    """transformers' Qwen2_5OmniUpSample1d, Qwen2_5OmniSnakeBeta and Qwen2_5OmniDownSample1d
    forwards, op by op, at any ratios and filter lengths."""
    _check(x, alpha, beta, up_filter, down_filter)
    channels, taps = x.shape[1], up_filter.shape[-1]
    pad = taps // up_ratio - 1
    trim_left = pad * up_ratio + (taps - up_ratio) // 2
    trim_right = pad * up_ratio + (taps - up_ratio + 1) // 2
    hidden = F.pad(x, (pad, pad), mode="replicate")
    hidden = up_ratio * F.conv_transpose1d(
        hidden, up_filter.expand(channels, -1, -1), stride=up_ratio, groups=channels
    )
    hidden = hidden[..., trim_left:-trim_right]

    hidden = snake_reference(hidden, alpha, beta)

    down_taps = down_filter.shape[-1]
    down_pad = (down_taps // 2 - int(down_taps % 2 == 0), down_taps // 2)
    hidden = F.pad(hidden, down_pad, mode="replicate")
    return F.conv1d(
        hidden, down_filter.expand(channels, -1, -1), stride=down_ratio, groups=channels
    )


def anti_alias_snake(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    up_ratio: int = RATIO,
    down_ratio: int = RATIO,
) -> torch.Tensor:
    """The kernel on CUDA, the reference elsewhere."""
    run = anti_alias_snake_triton if x.is_cuda and triton is not None else reference
    return run(x, alpha, beta, up_filter, down_filter, up_ratio, down_ratio)


def benchmark(batch: int = 10, mel_frames: int = 480, iters: int = 20) -> dict:
    """Median milliseconds of the kernel and the reference on CUDA at each BigVGAN stage's
    shape for `batch` windows of `mel_frames` mel frames (default: ten 240-code windows):
    Qwen2.5-Omni's BigVGAN upsamples 5, 3, 2, 2, 2, 2 times from 1536 channels, halving them
    each time, so its activations run at 768 channels and 5 samples a mel frame up to 24
    channels and 240."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import kaiser_sinc_filter1d

    up = kaiser_sinc_filter1d(0.5 / RATIO, 0.6 / RATIO, TAPS).cuda()
    down = up.clone()
    times, channels, length = {}, 1536, mel_frames
    for rate in (5, 3, 2, 2, 2, 2):
        channels, length = channels // 2, length * rate
        x = torch.randn(batch, channels, length, device="cuda")
        alpha, beta = (torch.randn(channels, device="cuda") / 4 for _ in range(2))
        inputs = (x, alpha, beta, up, down)
        for name, fn in (("triton", anti_alias_snake_triton), ("torch", reference)):
            times[channels, length, name] = cuda_median_ms(
                lambda fn=fn, inputs=inputs: fn(*inputs), iters
            )
    return times


if __name__ == "__main__":
    for (channels, length, name), ms in benchmark().items():
        print(f"C={channels} T={length} {name}: {ms:.3f} ms")
