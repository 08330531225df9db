"""Claim (issue 40): which attention kernel is fastest at the DiT shapes omniflow serves, and how
close each comes to attention's FLOP bound.

Times, at each shape below, a guided pair's attention (two rows: the conditional and the
unconditional) in bf16 on every kernel of `omniflow.backends.dit_blocks` that runs here:
torch's `scaled_dot_product_attention` as torch picks (`sdpa`), each SDPA backend forced
(`flash`, `efficient`, `cudnn`, `math`), and the flash-attn package's `flash_attn_func`
(FlashAttention-3's `flash_attn_interface` where it installs, else FlashAttention-2) —
what the diffusion stage's `attention` setting chooses between. Each row: the kernel's ms
(CUDA events, median) and its ratio to the FLOP bound, `4 B H S_q S_k Dh` (QK^T and PV) /
the bf16 matmul rate measured in the same run (8192^3). A kernel that cannot run a shape
(not installed, no kernel for it, out of memory) says why.

Shapes (`[B, S, H, Dh]`, self-attention unless noted):
- Qwen-Image 1024^2: 4096 image + `--text-tokens` prompt tokens, joint; 24 heads x 128.
- Qwen-Image 512^2: 1024 image + prompt tokens.
- Wan2.2-A14B 832x480x81: 21 latent frames x 30 x 52 patches = 32760 tokens, 40 heads x 128,
  and its cross-attention to the 512 text rows.
- Wan2.2-TI2V-5B 1280x704x121: 31 x 22 x 40 = 27280 tokens, 24 heads x 128.

The last lines name the fastest kernel at each shape and the one the stage's `auto` picks
at load (the fastest at AUTO_TOKENS tokens of the transformer's heads): where they differ,
set `attention=` on the diffusion stage.

    python benchmarks/attention.py --tiny       # CPU check: tiny shapes, float32
    python benchmarks/attention.py              # one GPU, the real shapes
"""

from __future__ import annotations

import argparse
import sys

import torch
from diffusion import timed_ms
from stage_steps import matmul_rate

from omniflow.backends.dit_blocks import AUTO_TOKENS, KERNELS, Attention, fastest, refusal
from omniflow.kernels.timing import cuda_median_ms

TEXT_TOKENS = 512  # Wan pads every prompt to 512 rows


def shapes(text_tokens: int) -> list[tuple[str, int, int, int, int]]:
    """(label, query tokens, key tokens, heads, head dim) of each benchmarked attention."""
    return [
        ("Qwen-Image 1024^2", 4096 + text_tokens, 4096 + text_tokens, 24, 128),
        ("Qwen-Image 512^2", 1024 + text_tokens, 1024 + text_tokens, 24, 128),
        ("Wan A14B 832x480x81", 32760, 32760, 40, 128),
        ("Wan A14B cross-attn", 32760, TEXT_TOKENS, 40, 128),
        ("Wan TI2V-5B 1280x704x121", 27280, 27280, 24, 128),
    ]


def tiny_shapes() -> list[tuple[str, int, int, int, int]]:
    return [("tiny self", 96, 96, 2, 16), ("tiny cross", 96, 7, 2, 16)]


def time_kernel(kernel: str, q, k, v, cuda: bool, repeats: int) -> float | str:
    """Milliseconds of `kernel` on (q, k, v), or why it cannot run them."""
    why = refusal(kernel, q, k, v)  # also its first call: a warm-up
    if why is not None:
        return why[:60]
    attend = Attention(kernel)
    if cuda:
        ms = cuda_median_ms(lambda: attend(q, k, v), iters=repeats)
        torch.cuda.empty_cache()
        return ms
    return timed_ms(lambda: attend(q, k, v), "cpu", repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny shapes, float32")
    parser.add_argument("--text-tokens", type=int, default=32, help="Qwen-Image's prompt tokens")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per kernel")
    args = parser.parse_args()
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py: no CUDA device (use --tiny for the CPU check)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rate = matmul_rate(device, 8192 if cuda else 256, dtype)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}: {str(dtype)[6:]} matmul {rate / 1e12:.3g} TFLOP/s; guided pairs (B = 2)")
    print(f"{'shape':>26} {'S_q':>6} {'S_k':>6} {'H x Dh':>8} {'kernel':>11} {'ms':>9} "
          f"{'roof ms':>8} {'vs roof':>8}")  # fmt: skip
    best = {}
    for label, s_q, s_k, heads, dim in tiny_shapes() if args.tiny else shapes(args.text_tokens):
        g = torch.Generator(device).manual_seed(0)
        q = torch.randn(2, s_q, heads, dim, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(2, s_k, heads, dim, generator=g, device=device, dtype=dtype)
                for _ in range(2))  # fmt: skip
        roof = 4 * 2 * heads * s_q * s_k * dim / rate * 1e3
        times = {}
        for kernel in KERNELS:
            got = time_kernel(kernel, q, k, v, cuda, args.repeats)
            shown = f"{got:9.3f} {roof:8.3f} {got / roof:7.2f}x" if isinstance(got, float) else got
            print(f"{label:>26} {s_q:>6} {s_k:>6} {f'{heads}x{dim}':>8} {kernel:>11} {shown}")
            if isinstance(got, float):
                times[kernel] = got
        best[label] = min(times, key=times.get)
        del q, k, v
    print()
    for label, kernel in best.items():
        print(f"fastest at {label}: {kernel}")
    if cuda:
        for heads in sorted({h for _, _, _, h, _ in shapes(args.text_tokens)}):
            picked = next(iter(fastest(heads, 128, dtype, device)))
            print(f"attention='auto' at load ({AUTO_TOKENS} tokens, {heads} heads): {picked}")


if __name__ == "__main__":
    main()
