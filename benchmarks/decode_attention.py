"""Claim: a decode step's attention that reads each row's length on the device
(`omniflow.kernels.decode_attention`) is as fast as the static step's SDPA over its length
bucket, so the step can drop its length buckets (one CUDA graph per batch bucket, not per
batch x length).

For the Qwen3-TTS talker's and the Qwen2.5-Omni thinker's attention shapes (from their
published configs), at batch 1, 16 and 64 and rows filled to 100, 500, 2,000 and 4,000 of a
4,096-column cache: the static step's attention as it runs today (SDPA over bucket T, the next
power of two past the longest row, with the step's mask, which a step makes once for all its
layers and so is made once here, outside the timed layers) against the kernel over the whole
cache, each captured in a CUDA graph over a few layers (each layer its own cache, so
the keys stream from HBM). Prints microseconds a layer and the ratio. Needs a CUDA GPU.

    python benchmarks/decode_attention.py [--batches 1 16 64] [--filled 100 500 2000 4000]
"""

from __future__ import annotations

import argparse
import math

import torch
from skinny_matmul import graph_us

from omniflow.catalog.components import builtin_files
from omniflow.kernels import decode_attention

COLUMNS = 4096
LAYERS = 4  # caches a graph cycles through: 4 x 2 x 64 x 8 x 4096 x 128 x 2 B = 4.3 GB at batch 64


def shapes() -> dict[str, tuple[int, int, int]]:
    """name -> (kv heads, query heads per kv head, head dim)."""
    tts = builtin_files("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice")["config.json"]["talker_config"]
    omni = builtin_files("Qwen/Qwen2.5-Omni-7B")["config.json"]["thinker_config"]["text_config"]
    out = {}
    for name, config in (("qwen3-tts talker", tts), ("qwen2.5-omni thinker", omni)):
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        dim = config.get("head_dim") or config["hidden_size"] // heads
        out[name] = (kv, heads // kv, dim)
    return out


def bucket(longest: int) -> int:
    """The static step's length bucket: a power of two from 128 past the longest row."""
    return min(COLUMNS, max(128, 2 ** math.ceil(math.log2(longest + 1))))


def ways(batch: int, filled: int, kv: int, group: int, dim: int):
    """(the bucketed SDPA, the kernel): callables of a layer index."""
    on = {"device": "cuda", "dtype": torch.bfloat16}
    caches = [
        (torch.randn(batch, kv, COLUMNS, dim, **on), torch.randn(batch, kv, COLUMNS, dim, **on))
        for _ in range(LAYERS)
    ]
    q = torch.randn(batch, kv, group, dim, **on)
    lengths = torch.full((batch,), filled, device="cuda")
    length, scale = bucket(filled), dim**-0.5
    visible = torch.arange(length, device="cuda")[None] <= lengths[:, None]
    mask = torch.where(visible, 0.0, -math.inf).to(q.dtype)[:, None, None]

    def bucketed(i: int) -> torch.Tensor:
        keys, values = caches[i]
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys[:, :, :length], values[:, :, :length], attn_mask=mask, scale=scale
        )

    def kernel(i: int) -> torch.Tensor:
        keys, values = caches[i]
        return decode_attention.decode_attention_triton(q, keys, values, lengths, scale)

    return bucketed, kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--filled", type=int, nargs="+", default=[100, 500, 2000, 4000])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: the kernel's speed only means something on one")
        return
    print(f"{torch.cuda.get_device_name()}: {COLUMNS}-column cache, {LAYERS} layers a graph")
    print(f"{'shape':<22} {'batch':>5} {'filled':>6} {'T':>5} {'SDPA us':>8} {'kernel us':>9} "
          f"{'ratio':>5}")  # fmt: skip
    for name, (kv, group, dim) in shapes().items():
        for batch in args.batches:
            for filled in args.filled:
                bucketed, kernel = ways(batch, filled, kv, group, dim)
                with torch.no_grad():
                    want, got = bucketed(0), kernel(0)
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
                    base, ours = graph_us(bucketed, LAYERS), graph_us(kernel, LAYERS)
                print(f"{name:<22} {batch:>5} {filled:>6} {bucket(filled):>5} {base:>8.1f} "
                      f"{ours:>9.1f} {base / ours:>5.2f}")  # fmt: skip
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
