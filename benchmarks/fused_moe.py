"""Claim: a Qwen3-Omni MoE decode step through the fused kernels (`omniflow.kernels.fused_moe`)
takes at most 1.5x the time its touched weights take to read, at batch 1 and 32.

For one MoE layer of the real-size Qwen3-Omni-30B-A3B thinker (shapes from the published
config: H 2048, 128 experts, 8 a token, I 768; `--stage talker` for the talker's, which adds
its shared expert), random bf16 weights, at 1, 8, 32 and 256 tokens of a decode step
(`[tokens, 1, H]`), each way timed over `--layers` layers, each its own weights and router
(so the experts stream from HBM, not from L2), and printed per layer:

- fused: `moe_forward(block, x)` (the router's linear, the routing kernel
  `omniflow.kernels.moe_route`, the two kernels, the sum), replayed from a CUDA graph as a
  decode step runs it, and called eagerly;
- "ops-routed": the same layer routed by the torch ops the routing kernel replaces
  (`route`: softmax, topk, sum, div, cast; `align`: 3 ops at one token, 14 otherwise),
  replayed from a graph: the layer before `moe_route`, timed beside it in the same run;
- transformers' own block forward, with its `grouped_mm` experts implementation ("HF gmm":
  replayed from a graph where it captures, and eagerly) and its `eager` one ("HF eager": an
  expert at a time, with a host sync);
- the torch reference (`moe_forward(block, x, moe=fused_moe.reference)`), eagerly;
- the routing alone (the router's linear, then the kernel, or `route` and `align`),
  replayed from a graph.

Under each batch's row, the kernels one layer launches, fused and ops-routed (torch.profiler
on an eager call: a graph replays the same kernels).

Next to them: the distinct experts the tokens touch (averaged over the layers), the MB those
experts (plus the router, and the talker's shared expert) hold, and the time to read them at
`--bandwidth` (default 4.8e12 B/s, the H200's HBM3e figure) and at the copy rate measured in
the same run; `x read` is the fused graph's time over the read time at `--bandwidth`, the
figure the claim is about. At a prefill's sizes (`--tokens 2500 20000`: one 2,500-token
prompt, eight of them) the layer is bound by its FLOPs instead: `x FLOPs` is the fused graph's
time over the routed experts' and router's FLOPs at the matmul rate measured in the same run.
`--sweep` also times block sizes, depths and (at a prefill's sizes, where an expert gets 128
entries or more) warps, and prints the best per batch (36 or 32 tilings a batch, each
compiled: minutes; pass fewer `--tokens`). Asserts nothing about speed. Needs a CUDA GPU.

    python benchmarks/fused_moe.py [--tokens 1 8 32 256] [--stage thinker] [--sweep]
    python benchmarks/fused_moe.py --tokens 2500 20000 --layers 2 --sweep   # prefill
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools

import torch
from stage_steps import copy_bandwidth, matmul_rate
from triton.runtime.errors import OutOfResources

from omniflow.catalog.components import builtin_files
from omniflow.errors import OmniflowError
from omniflow.kernels.timing import launches

REAL = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
H200_BANDWIDTH = 4.8e12  # B/s, HBM3e, NVIDIA's H200 figure


def moe_config(stage: str) -> dict:
    """The fields of the published config that the stage's MoE block reads."""
    files = builtin_files(REAL)["config.json"]
    text = files["thinker_config"]["text_config"] if stage == "thinker" else files["talker_config"]
    text = text.get("text_config", text)
    keys = ["hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"]
    keys += ["norm_topk_prob"] + (["shared_expert_intermediate_size"] if stage == "talker" else [])
    return {key: text[key] for key in keys}


def build_blocks(stage: str, layers: int) -> list[torch.nn.Module]:
    """transformers' MoE block of the stage at real size, `layers` of them, random bf16
    weights on the GPU (each matrix scaled by its fan-in)."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as configs
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as models

    config_class, block_class = {
        "thinker": (configs.Qwen3OmniMoeTextConfig, models.Qwen3OmniMoeThinkerTextSparseMoeBlock),
        "talker": (
            configs.Qwen3OmniMoeTalkerTextConfig,
            models.Qwen3OmniMoeTalkerTextSparseMoeBlock,
        ),
    }[stage]
    g = torch.Generator("cuda").manual_seed(0)
    blocks = []
    for _ in range(layers):
        settings = config_class(**moe_config(stage))  # each block its own: the implementation
        settings._experts_implementation = "eager"
        with torch.device("cuda"):
            block = block_class(settings).to(torch.bfloat16)
        with torch.no_grad():
            for param in block.parameters():
                drawn = torch.randn(param.shape, generator=g, device="cuda")
                param.copy_(drawn / param.shape[-1] ** 0.5)
        blocks.append(block)
    return blocks


def touched(block: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(distinct experts the tokens pick, bytes of weights a forward reads for them)."""
    from omniflow.kernels import fused_moe

    flat = x.reshape(-1, x.shape[-1])
    ids, _ = fused_moe.route(flat @ block.gate.weight.T, block.gate.top_k, False)
    experts = ids.unique().numel()
    per_expert = block.experts.gate_up_proj[0].nbytes + block.experts.down_proj[0].nbytes
    other = block.gate.weight.nbytes
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        other += sum(p.nbytes for p in shared.parameters()) + block.shared_expert_gate.weight.nbytes
    return experts, experts * per_expert + other


def layer_flops(block: torch.nn.Module, tokens: int) -> int:
    """FLOPs of the layer's router and routed experts (gate/up, then down) over `tokens`;
    the talker's shared expert and its gate added."""
    experts = block.experts
    inner, width = experts.gate_up_proj.shape[1] // 2, experts.gate_up_proj.shape[2]
    flops = 2 * tokens * width * (block.gate.weight.shape[0] + 3 * inner * block.gate.top_k)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        flops += 2 * tokens * sum(p.numel() for p in shared.parameters() if p.dim() == 2)
        flops += 2 * tokens * block.shared_expert_gate.weight.numel()
    return flops


def per_layer_us(fn, layers: int, graph: bool, iters: int = 30) -> float | None:
    """Median microseconds a layer of `fn(layer)` over all layers, from a CUDA graph's replay
    or called eagerly; None where `fn` fails to capture or run, or refuses the sizes (the
    routing kernel past one program's tile)."""
    from omniflow.kernels.timing import cuda_median_ms

    def run() -> None:
        for layer in range(layers):
            fn(layer)

    try:
        with torch.no_grad():
            run()  # compiles, and warms the allocator before a capture
            if not graph:
                return cuda_median_ms(run, iters) * 1e3 / layers
            replay = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replay):
                run()
            return cuda_median_ms(replay.replay, iters) * 1e3 / layers
    except (RuntimeError, NotImplementedError, OmniflowError, OutOfResources):
        torch.cuda.synchronize()
        return None


def with_experts(block: torch.nn.Module, implementation: str):
    """`block`'s forward with its experts on transformers' `implementation`."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        block.experts.config._experts_implementation = implementation
        return block(x)

    return forward


# The ways whose kernels a layer launches are printed under each batch's row (counted on an
# eager call of the layer the graph captures).
LAUNCHES = ("fused graph", "ops-routed graph")


def width(name: str) -> int:
    return max(12, len(name))


def ways(blocks, xs) -> dict[str, tuple]:
    """name -> (callable of a layer index, whether to replay it from a graph)."""
    from omniflow.kernels import fused_moe, moe_route

    def routing(router):
        def run(layer: int):
            block, x = blocks[layer], xs[layer].reshape(-1, xs[layer].shape[-1])
            entries = x.shape[0] * block.gate.top_k
            # the rows a block as the layer aligns them (a prefill's tiles' past 128 an expert)
            block_m = fused_moe.tiles(entries, block.gate.num_experts)["block_m"]
            return router(x @ block.gate.weight.T, block.gate.top_k, True, block_m)

        return run

    ops_routed = functools.partial(fused_moe.fused_moe_triton, router=moe_route.reference)
    return {
        "fused graph": (lambda i: fused_moe.moe_forward(blocks[i], xs[i]), True),
        "fused eager": (lambda i: fused_moe.moe_forward(blocks[i], xs[i]), False),
        "ops-routed graph": (
            lambda i: fused_moe.moe_forward(blocks[i], xs[i], moe=ops_routed),
            True,
        ),
        "HF gmm graph": (lambda i: with_experts(blocks[i], "grouped_mm")(xs[i]), True),
        "HF gmm eager": (lambda i: with_experts(blocks[i], "grouped_mm")(xs[i]), False),
        "HF eager": (lambda i: with_experts(blocks[i], "eager")(xs[i]), False),
        "reference": (
            lambda i: fused_moe.moe_forward(blocks[i], xs[i], moe=fused_moe.reference),
            False,
        ),
        "routing kernel graph": (routing(moe_route.moe_route_triton), True),
        "routing ops graph": (routing(moe_route.reference), True),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--stage", choices=["thinker", "talker"], default="thinker")
    parser.add_argument("--layers", type=int, default=4, help="layers cycled through a timing")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="B/s")
    parser.add_argument("--sweep", action="store_true", help="also time block sizes and depths")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: the fused MoE kernels' speed only means something on one")
        return
    copy, rate = copy_bandwidth("cuda", 1 << 30), matmul_rate("cuda")
    config = moe_config(args.stage)
    print(
        f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s (read + written),"
        f" matmul {rate / 1e12:.0f} TFLOP/s;"
        f" read times at {args.bandwidth / 1e12:.2f} TB/s. {args.stage} MoE layer {config},"
        f" {args.layers} layers a timing, microseconds a layer ('-': did not run)"
    )
    blocks = build_blocks(args.stage, args.layers)
    names = list(ways(blocks, [None] * args.layers))
    header = f"{'tokens':>6} {'experts':>7} {'MB':>6} {'read':>6} {'x read':>6} {'x copy':>6}"
    header += f" {'x FLOPs':>7}"
    print(header + "".join(f" {name:>{width(name)}}" for name in names))
    g = torch.Generator("cuda").manual_seed(1)
    for tokens in args.tokens:
        xs = [
            torch.randn(tokens, 1, config["hidden_size"], generator=g, device="cuda").bfloat16()
            for _ in blocks
        ]
        counts = [touched(block, x) for block, x in zip(blocks, xs, strict=True)]
        experts = sum(c[0] for c in counts) / len(counts)
        nbytes = sum(c[1] for c in counts) / len(counts)
        read_us, copy_us = nbytes / args.bandwidth * 1e6, nbytes / copy * 1e6
        flops_us = layer_flops(blocks[0], tokens) / rate * 1e6
        timed = {
            name: per_layer_us(fn, args.layers, graph)
            for name, (fn, graph) in ways(blocks, xs).items()
        }
        fused = timed["fused graph"]
        ratios = (
            f" {fused / read_us:>6.2f} {fused / copy_us:>6.2f} {fused / flops_us:>7.2f}"
            if fused
            else f" {'-':>6} {'-':>6} {'-':>7}"
        )
        cells = "".join(
            f" {t:>{width(name)}.1f}" if t else f" {'-':>{width(name)}}"
            for name, t in timed.items()
        )
        print(f"{tokens:>6} {experts:>7.1f} {nbytes / 1e6:>6.1f} {read_us:>6.1f}{ratios}{cells}")
        layer = ways(blocks, xs)
        with torch.no_grad():
            counted = {name: launches(functools.partial(layer[name][0], 0)) for name in LAUNCHES}
        print("    kernels a layer: " + ", ".join(f"{n} {c:.0f}" for n, c in counted.items()))
        if args.sweep:
            sweep(blocks, xs, tokens, fused)
        torch.cuda.empty_cache()


def sweep(blocks, xs, tokens: int, default: float | None) -> None:
    """Times the fused graph over block sizes and pipeline depths (and, at a prefill's sizes,
    warps); prints the best."""
    from omniflow.kernels import fused_moe

    timed = []
    entries = tokens * blocks[0].gate.top_k
    if entries >= 128 * blocks[0].gate.num_experts:  # a prefill's: tiles for many rows
        grid = itertools.product((64, 128), (64, 128), (32, 64), (3, 4), (4, 8))
    else:
        least = fused_moe.block_m_for(entries, blocks[0].gate.num_experts)
        rows = sorted({least, min(64, 2 * least)})
        grid = itertools.product(rows, (16, 32, 64), (64, 128, 256), (3, 4), (4,))
    for block_m, block_n, block_k, stages, warps in grid:
        tuning = {"block_m": block_m, "block_n": block_n, "block_k": block_k}
        tuning |= {"num_stages": stages, "num_warps": warps}
        moe = functools.partial(fused_moe.fused_moe_triton, **tuning)

        def step(i: int, moe=moe):
            return fused_moe.moe_forward(blocks[i], xs[i], moe=moe)

        # A tile too large for the SM's shared memory fails to launch: not a candidate.
        with contextlib.suppress(OutOfResources):
            us = per_layer_us(step, len(blocks), graph=True)
            if us is not None:
                timed.append((us, tuning))
        torch.cuda.empty_cache()
    best, tuning = min(timed, key=lambda t: t[0])
    shown = f"{default:.1f}" if default else "-"
    print(f"    sweep, {tokens} tokens: default {shown} us, best {best:.1f} us {tuning}")


if __name__ == "__main__":
    main()
