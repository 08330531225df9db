"""Claim: a decode step's projections of a few rows stream their weights faster through the
skinny kernel (`omniflow.kernels.skinny_matmul`) than through cuBLAS and the kernels around
it.

For each projection of the real-size Qwen2.5-Omni-7B thinker and talker (shapes from the
published config; `--model qwen3-tts`: Qwen3-TTS-1.7B's talker and code predictor) at 1 and
10 rows, both ways as a decode step runs them, captured in a CUDA graph over the model's
layers (each layer its own weight, so the weights stream from HBM and not from L2; a code
predictor's 5 layers run 15 times a frame, so its weights cycle through 75):

- q/k/v: `F.linear` (with its bias where the model has one), against the kernel (the
  decode step keeps cuBLAS for it: this row says why);
- o and down: `F.linear` then the residual add + RMSNorm that follows, against the split
  kernel's partial sums added up by that norm;
- gate/up: `F.linear` then `silu_mul`, against the gated kernel.

Prints microseconds a layer, the weight's stream rate, and the ratio, next to a device copy's
rate measured in the same run. `--sweep` also times block sizes and pipeline depths and
prints the best per projection (the kernel's defaults come from such a sweep). Needs a CUDA
GPU.

    python benchmarks/skinny_matmul.py [--rows 1 10] [--sweep]
    python benchmarks/skinny_matmul.py --model qwen3-tts --rows 1 16 64
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch
import torch.nn.functional as F
import triton
from stage_steps import copy_bandwidth

from omniflow.catalog.components import builtin_files

MODELS = {
    "qwen2.5-omni": "Qwen/Qwen2.5-Omni-7B",
    "qwen3-tts": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
}
STREAMED = 256 << 20  # bytes of distinct weights a timed graph cycles through, >> L2
SUB_STEPS = 15  # a Qwen3-TTS frame's code predictor passes


def components(model: str) -> dict[str, dict]:
    """Each stage's decoder config, its layer count the layers a step streams."""
    files = builtin_files(MODELS[model])["config.json"]
    if model == "qwen3-tts":
        talker = files["talker_config"]
        predictor = dict(talker["code_predictor_config"])
        predictor["num_hidden_layers"] *= SUB_STEPS
        return {"talker": talker, "code_predictor": predictor}
    return {"thinker": files["thinker_config"]["text_config"], "talker": files["talker_config"]}


def projections(config: dict) -> dict[str, tuple[int, int, str]]:
    """name -> (output columns, depth, how it runs)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    return {
        # (Qwen2's q/k/v always have a bias; Qwen3's config says whether)
        "q/k/v": (
            (heads + 2 * kv) * head_dim,
            hidden,
            "bias" if config.get("attention_bias", True) else "plain",
        ),
        "o": (hidden, heads * head_dim, "split"),
        "gate/up": (2 * inner, hidden, "gated"),
        "down": (hidden, inner, "split"),
    }


def graph_us(fn, layers: int, iters: int = 50) -> float:
    """Median microseconds a layer of `fn(layer)` over all layers, replayed from a graph."""
    from omniflow.kernels.timing import cuda_median_ms

    for layer in range(layers):  # compiles, and warms the allocator before capture
        fn(layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    return cuda_median_ms(graph.replay, iters) * 1e3 / layers


def ways(kind: str, rows: int, columns: int, depth: int, layers: int, tuning: dict):
    """(cuBLAS way, kernel way, weight bytes a layer): callables of a layer index."""
    from omniflow.kernels import rms_norm, silu_mul, skinny_matmul

    on = {"device": "cuda", "dtype": torch.bfloat16}
    weights = [torch.randn(columns, depth, **on) / depth**0.5 for _ in range(layers)]
    bias = torch.randn(columns, **on) if kind == "bias" else None
    x = torch.randn(rows, depth, **on)
    residual, norm = torch.randn(rows, columns, **on), torch.ones(columns, **on)
    kernel = skinny_matmul.skinny_matmul_triton
    if kind == "gated":
        return (
            lambda i: silu_mul.silu_mul_triton(F.linear(x, weights[i])),
            lambda i: kernel(x, weights[i], gated=True, **tuning),
            weights[0].nbytes,
        )
    if kind == "split":
        sizes = {k: v for k, v in tuning.items() if k in ("block_n", "block_k")}
        splits = skinny_matmul.split_count(x, weights[0], rms_norm.most_parts(columns), **sizes)
        return (
            lambda i: rms_norm.add_rms_norm_triton(residual, F.linear(x, weights[i]), norm, 1e-6),
            lambda i: rms_norm.add_rms_norm_triton(
                residual, kernel(x, weights[i], splits=splits, **tuning), norm, 1e-6
            ),
            weights[0].nbytes,
        )
    return (
        lambda i: F.linear(x, weights[i], bias),
        lambda i: kernel(x, weights[i], bias, **tuning),
        weights[0].nbytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-omni")
    parser.add_argument("--stages", nargs="+", help="default: all of the model's")
    parser.add_argument("--sweep", action="store_true", help="also time block sizes and depths")
    args = parser.parse_args()
    from omniflow.kernels.skinny_matmul import ROWS

    if max(args.rows) > ROWS:  # (a decode step of more rows runs cuBLAS: nothing to compare)
        parser.error(f"--rows: the kernel takes at most {ROWS} rows")
    if not torch.cuda.is_available():
        print("no CUDA GPU: the skinny kernel's speed only means something on one")
        return
    copy = copy_bandwidth("cuda", 1 << 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s (read + written)")
    header = f"{'stage':<14} {'projection':<8} {'rows':>4} {'MB':>6} {'cuBLAS us':>9} {'TB/s':>5}"
    print(f"{header} {'kernel us':>9} {'TB/s':>5} {'ratio':>5}")
    sweeps = []
    configs = components(args.model)
    for stage in args.stages or configs:
        config = configs[stage]
        for name, (columns, depth, kind) in projections(config).items():
            layers = max(2, min(config["num_hidden_layers"], STREAMED // (columns * depth * 2)))
            for rows in args.rows:
                cublas, kernel, nbytes = ways(kind, rows, columns, depth, layers, {})
                base, ours = graph_us(cublas, layers), graph_us(kernel, layers)
                print(
                    f"{stage:<14} {name:<8} {rows:>4} {nbytes / 1e6:>6.1f} {base:>9.1f}"
                    f" {nbytes / base / 1e6:>5.2f} {ours:>9.1f} {nbytes / ours / 1e6:>5.2f}"
                    f" {base / ours:>5.2f}"
                )
                if args.sweep:
                    sweeps.append((stage, name, rows, kind, columns, depth, layers, ours))
                torch.cuda.empty_cache()
    for stage, name, rows, kind, columns, depth, layers, default in sweeps:
        timed = []
        for block_n, block_k, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 5)):
            tuning = {"block_n": block_n, "block_k": block_k, "num_stages": stages}
            kernel = ways(kind, rows, columns, depth, layers, tuning)[1]
            # A tile too large for the SM's shared memory fails to launch: not a candidate.
            with contextlib.suppress(triton.runtime.errors.OutOfResources):
                timed.append((graph_us(kernel, layers), tuning))
            torch.cuda.empty_cache()
        best, tuning = min(timed, key=lambda t: t[0])
        print(
            f"sweep {stage} {name} rows {rows}: default {default:.1f} us, best {best:.1f} us {tuning}"
        )


if __name__ == "__main__":
    main()
