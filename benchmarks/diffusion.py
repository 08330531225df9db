"""Claim (issue 12, §7): on the text-to-image pipeline at real width, concurrent requests
batched across denoising steps give >= 3x the throughput of the same requests served one
after another (512 x 512, true CFG), and a DiT step at 1024 x 1024 runs within 1.5x of its
FLOP roofline, the true-CFG pair as one batched forward.

Measures, in one run on one checkpoint:

(a) `--concurrency` text-to-image requests (a negative prompt, guidance 4) through the
    compiled `graphs/text_to_image.omni` served by the engine all at once, and the same
    requests sent one after another to the same engine, `--rounds` times each way, in
    turn: images/s of the median rounds and their ratio (and each round's), beside
    the DiT's compute bound (steps x FLOPs of a request's pair forward / matmul rate).
    With each, every stage's steps, mean batch and time inside its steps (the executors'
    counters, `Engine.inspect`): where the requests' wall time went.
(b) one DiT step at 1024 x 1024 of one guided request: its cond and uncond rows (4096
    image tokens and `--text-tokens` prompt tokens each) in one transformer forward, the
    same rows as two forwards, the pair through diffusers' own blocks (on CUDA the
    backend runs them on fused kernels), and the DiffusionSteps backend's own step (counting
    its forwards and their rows), against the roofline: the forward's FLOPs
    (`omniflow.catalog.costs`: every matmul of both streams of every layer, and attention's
    QK^T and PV over the joint sequence) / the matmul rate measured in the same run
    (8192^3 on CUDA, in the DiT's dtype). CUDA events on a GPU, perf_counter on a CPU.

    python benchmarks/diffusion.py                              # tiny checkpoint, CPU
    python benchmarks/diffusion.py --device cuda --scaled 0.25  # real width, 15 of 60 DiT layers
    ... --kernels 12   # (b): each way's 12 costliest kernels of the pair forward

`--scaled DEPTH` builds (once, under $OMNIFLOW_CACHE/scaled/) a random-weight Qwen-Image at
the published widths with DEPTH x the text encoder's and the transformer's layers
(`omniflow.checkpoints.scaled`); on CUDA every stage runs in bf16.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from pathlib import Path

import torch
from stage_steps import matmul_rate

from omniflow.backends.diffusion import DiffusionSteps, pack_prompts
from omniflow.catalog.components import load_component_config
from omniflow.catalog.costs import estimate_cost
from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.compiler import compile_graph, load_graph
from omniflow.families.qwen_image.checkpoints import REAL_IMAGE
from omniflow.families.qwen_image.fused_blocks import modules_forward
from omniflow.kernels.timing import kernel_table
from omniflow.runtime.engine import Engine
from omniflow.runtime.stage import Call, InputStream, StageSpec

GRAPH = Path(__file__).parents[1] / "graphs" / "text_to_image.omni"
NEGATIVE = "blurry, low quality"
STEP_SIZE = 1024  # (b)'s image side


def plan_for(model_dir: str | None, cuda: bool):
    graph = load_graph(GRAPH)
    graph = graph.copy() if model_dir else use_tiny_models(graph)
    if model_dir:
        graph.model = model_dir
    if cuda:  # diffusers loads float32 unless told
        for stage in graph.stages:
            stage.params["dtype"] = "bfloat16"
    return compile_graph(graph, "1xH200" if cuda else "cpu")


def pair_flops(model_dir: str, size: int, text_tokens: int) -> tuple[float, int]:
    """FLOPs of one transformer forward over a request's cond and uncond rows, and the
    image tokens of a row."""
    config = load_component_config(model_dir, "transformer")
    tokens = config.image_tokens(size, size)
    cost = estimate_cost(config, max_batch=1, max_len=tokens, context_len=text_tokens)
    return 2 * cost.flops_per_item, tokens


def timed_ms(fn, device: str, repeats: int) -> float:
    """Median ms of `fn()` after two warm-up calls: CUDA events on a GPU, else perf_counter."""
    times = []
    for _ in range(repeats + 2):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def step_rows(plan, device: str, text_tokens: int, repeats: int, kernels: int = 0):
    """(b): [(variant, forwards, rows per forward, ms)] of one DiT step at STEP_SIZE (on CUDA
    the backend's blocks are fused; "diffusers' blocks" runs the modules' forward); with
    `kernels`, each way's costliest kernels of the pair forward."""
    backend = DiffusionSteps(StageSpec.from_channels(plan.stage("dit"), plan.channels), device)
    transformer, dtype = backend.transformer, backend.transformer.dtype
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randn(text_tokens, config.joint_attention_dim, generator=generator)] * 2
    tokens = (STEP_SIZE // backend.patch_pixels) ** 2
    latents = torch.randn(2, tokens, config.in_channels, generator=generator)
    latents, text = latents.to(device, dtype), torch.stack(prompts).to(device, dtype)
    timestep = torch.full((2,), 0.5, device=device, dtype=dtype)
    side = STEP_SIZE // backend.patch_pixels

    def forward(rows: slice):
        with torch.no_grad():
            n = len(range(2)[rows])
            transformer(hidden_states=latents[rows], timestep=timestep[rows],
                        encoder_hidden_states=text[rows], encoder_hidden_states_mask=None,
                        img_shapes=[[(1, side, side)]] * n, guidance=None, return_dict=False)  # fmt: skip

    def timed_pair(label: str) -> float:
        if kernels and device.startswith("cuda"):
            print(f"  pair forward, {label}: its {kernels} costliest kernels")
            kernel_table(lambda: forward(slice(0, 2)), kernels, calls=2)
        return timed_ms(lambda: forward(slice(0, 2)), device, repeats)

    pair = timed_pair("fused blocks")
    with modules_forward(transformer):
        modules = timed_pair("diffusers' blocks")
    apart = timed_ms(lambda: (forward(slice(0, 1)), forward(slice(1, 2))), device, repeats)
    # The backend's own step of one guided request, its forwards watched.
    cond = InputStream("hidden")
    cond.push(pack_prompts([p.to(dtype) for p in prompts]), end=True)
    params = {"steps": repeats + 8, "height": STEP_SIZE, "width": STEP_SIZE, "true_cfg_scale": 4.0}
    call = Call("step", params, {"cond": cond})
    seen = []
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(len(kwargs["hidden_states"])), with_kwargs=True
    )
    backend.step([call])  # prepares the request, then its first step
    assert call.error is None, call.error
    seen.clear()
    served = timed_ms(lambda: backend.step([call]), device, repeats)
    hook.remove()
    assert len(set(seen)) == 1, seen
    forwards = len(seen) // (repeats + 2)
    return [
        ("pair, one forward", 1, 2, pair),
        ("pair, diffusers' blocks", 1, 2, modules),
        ("cond, uncond apart", 2, 1, apart),
        ("backend step", forwards, seen[0], served),
    ]


def stage_totals(engine: Engine) -> dict[str, tuple[int, int, int]]:
    """Each stage's counters so far: (steps, ns spent in step(), calls advanced)."""
    return {
        name: (t.steps, t.step_ns, t.calls)
        for inspection in engine.inspect().values()
        for name, t in inspection.stages.items()
    }


def serve(engine: Engine, requests: list[tuple[dict, dict]], concurrent: bool) -> float:
    """Seconds to serve `requests` all at once, or each after the one before."""

    def one(inputs: dict, params: dict) -> None:
        (image,) = engine.generate(inputs, params).values()
        assert image.shape[1:] == (params["height"], params["width"], 3), image.shape

    start = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=r) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for r in requests:
            one(*r)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    parser.add_argument(
        "--scaled", type=float, metavar="DEPTH",
        help="a random-weight Qwen-Image at real widths and DEPTH x layers (default: tiny)",
    )  # fmt: skip
    parser.add_argument("--size", type=int, default=512, help="(a)'s image side")
    parser.add_argument("--steps", type=int, default=20, help="(a)'s denoising steps")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="(a)'s rounds each way")
    parser.add_argument("--text-tokens", type=int, default=32, help="(b)'s prompt tokens")
    parser.add_argument("--repeats", type=int, default=10, help="(b)'s timed steps")
    parser.add_argument("--kernels", type=int, default=0, help="(b): list the N costliest kernels")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine's executors get the cores
    cuda = args.device.startswith("cuda")
    model_dir = (
        str(scaled_checkpoint(REAL_IMAGE, args.scaled, args.device))
        if args.scaled
        else model_path("tiny:text-to-image")
    )
    plan = plan_for(model_dir if args.scaled else None, cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    rate = matmul_rate(args.device, 8192 if cuda else 512, dtype)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}: {str(dtype)[6:]} matmul {rate / 1e12:.2f} TFLOP/s; checkpoint {model_dir}")

    flops, tokens = pair_flops(model_dir, STEP_SIZE, args.text_tokens)
    steps = step_rows(plan, args.device, args.text_tokens, args.repeats, args.kernels)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    requests = [
        ({"prompt": f"a photo of object number {i} on a table", "negative_prompt": NEGATIVE},
         {"steps": args.steps, "height": args.size, "width": args.size, "true_cfg_scale": 4.0,
          "seed": i})
        for i in range(args.concurrency)
    ]  # fmt: skip
    start = time.perf_counter()
    with Engine(plan, "process") as engine:
        serve(engine, requests[:1], concurrent=False)  # warm up
        print(f"engine up and one request served in {time.perf_counter() - start:.1f} s")
        # Rounds alternate the two ways, so drift on a shared machine reaches both alike.
        walls, busy = {False: [], True: []}, {False: {}, True: {}}
        for _ in range(args.rounds):
            for concurrent in (False, True):
                before = stage_totals(engine)
                walls[concurrent].append(serve(engine, requests, concurrent))
                after = stage_totals(engine)
                for name, now in after.items():
                    spent = [a - b for a, b in zip(now, before[name], strict=True)]
                    so_far = busy[concurrent].get(name, (0, 0, 0))
                    busy[concurrent][name] = tuple(map(sum, zip(so_far, spent, strict=True)))
    n = args.concurrency
    bound = rate / (args.steps * pair_flops(model_dir, args.size, args.text_tokens)[0])

    wall = {way: statistics.median(times) for way, times in walls.items()}
    rounds = " ".join(f"{a / b:.2f}x" for a, b in zip(walls[False], walls[True], strict=True))
    print(f"\n(a) {n} requests, {args.size}x{args.size}, {args.steps} steps, guidance 4, "
          f"{args.rounds} rounds each way (vs seq per round: {rounds})")  # fmt: skip
    print(f"{'variant':>12} {'wall s':>8} {'images/s':>9} {'vs seq':>7}")
    for concurrent, label in ((False, "sequential"), (True, "concurrent")):
        print(
            f"{label:>12} {wall[concurrent]:8.2f} {n / wall[concurrent]:9.3f} "
            f"{wall[False] / wall[concurrent]:6.2f}x"
        )
    print(f"{'DiT bound':>12} {'':>8} {bound:9.3f}  (steps x pair FLOPs / matmul rate)")
    print(f"\n{'variant':>12} {'stage':>8} {'steps':>6} {'batch':>6} {'busy s':>7} {'of wall':>8}")
    for concurrent, label in ((False, "sequential"), (True, "concurrent")):
        for stage, (count, ns, calls) in busy[concurrent].items():
            batch = calls / count if count else 0.0
            share = ns / 1e9 / sum(walls[concurrent])
            busy_s = ns / 1e9 / args.rounds
            print(
                f"{label:>12} {stage:>8} {count / args.rounds:>6.0f} {batch:6.2f} {busy_s:7.2f} "
                f"{share:7.0%}"
            )
    print("(wall s: the median round; steps and busy: a round's, on average; busy: wall time "
          "inside the stage's step(), which includes GPU time only where the step waits for the "
          "GPU; batch: requests a step advanced, on average)")  # fmt: skip

    roof = flops / rate * 1e3
    print(f"\n(b) DiT step, {STEP_SIZE}x{STEP_SIZE}: cond + uncond rows of "
          f"{tokens} image + {args.text_tokens} text tokens; "
          f"{flops / 1e9:.1f} GFLOP, roofline {roof:.2f} ms")  # fmt: skip
    print(f"{'variant':>24} {'forwards':>8} {'rows':>4} {'ms':>9} {'vs roof':>8}")
    for label, forwards, rows, ms in steps:
        print(f"{label:>24} {forwards:>8} {rows:>4} {ms:9.2f} {ms / roof:7.2f}x")
    print("(ms: medians; vs roof: ms / (FLOPs / matmul rate); backend step: one guided "
          "request's DiffusionSteps.step, its forwards and their rows counted)")  # fmt: skip


if __name__ == "__main__":
    main()
