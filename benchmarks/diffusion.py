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

(a) runs over every `--size` and `--concurrency` given (issue 30: 512 and 1024, 4 and 8
concurrent), each against the DiT's FLOP bound on images/s ("of bound").
(c) one request end to end at `--e2e-size` (issue 30: 1024 x 1024, 50 steps, true CFG 4):
    its wall time and stages; at `--scaled` depth d < 1 also the real-size estimate (the
    DiT's and the text encoder's busy time / d, the VAE as measured).
(d) the same request with step caching at each `--cache` threshold (default 0.12): DiT
    steps computed and reused, E2E, and the image's distance from the uncached one (random
    weights: what the cache saves, not what it costs in quality).

    python benchmarks/diffusion.py --device cuda --scaled 0.5 --size 512 1024 \
        --concurrency 4 8 --e2e-size 1024 --e2e-steps 50 --cache 0.08 0.12 0.2

`--scaled DEPTH` builds (once, under $OMNIFLOW_CACHE/scaled/) a random-weight Qwen-Image at
the published widths with DEPTH x the text encoder's and the transformer's layers
(`omniflow.checkpoints.scaled`); on CUDA every stage runs in bf16. Depth 1 is 28.7 B
parameters, 57.7 GB in bf16: on the GPU host's 64 GiB disk put OMNIFLOW_CACHE on /dev/shm
(128 GiB of memory) or measure at 0.5 (29 GB) and read the estimate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from stage_steps import matmul_rate, release_memory

from omniflow.backends.diffusion import DiffusionSteps, pack_prompts
from omniflow.backends.dit_blocks import modules_forward
from omniflow.catalog.components import load_component_config
from omniflow.catalog.costs import estimate_cost
from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.compiler import compile_graph, load_graph
from omniflow.families.qwen_image.checkpoints import REAL_IMAGE
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
    if backend.attention is not None:  # the attention="auto" choice, made at load
        print(f"the backend's fused blocks attend with {backend.attention.kernel}")
    transformer, dtype = backend.transformer, backend.transformer.dtype
    config = transformer.config
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randn(text_tokens, config.joint_attention_dim, generator=generator)] * 2
    patch_pixels = backend.pipe.vae_scale_factor * 2  # VAE scale x the 2x2 patch
    tokens = (STEP_SIZE // patch_pixels) ** 2
    latents = torch.randn(2, tokens, config.in_channels, generator=generator)
    latents, text = latents.to(device, dtype), torch.stack(prompts).to(device, dtype)
    timestep = torch.full((2,), 0.5, device=device, dtype=dtype)
    side = STEP_SIZE // patch_pixels

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
    with modules_forward(transformer.transformer_blocks):
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
    first_step(backend, call)
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


def first_step(backend: DiffusionSteps, call: Call) -> None:
    """The request's first step, once the stage would run it: its conditioning's header on
    the host (`ready`: copied without waiting, so on a GPU it lands a moment later). The
    step prepares the request, then runs its first denoising step."""
    deadline = time.monotonic() + 60
    while not backend.ready(call):
        assert time.monotonic() < deadline, "the request's conditioning never landed"
        time.sleep(0.001)
    backend.step([call])
    assert call.error is None, call.error


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


def request(i: int, size: int, steps: int, **more) -> tuple[dict, dict]:
    """A guided text-to-image request: true CFG 4 with a negative prompt."""
    inputs = {"prompt": f"a photo of object number {i} on a table", "negative_prompt": NEGATIVE}
    params = {"steps": steps, "height": size, "width": size, "true_cfg_scale": 4.0, "seed": i}
    return inputs, {**params, **more}


def totals(engine: Engine) -> dict[str, tuple[int, int, int, dict]]:
    """Each stage's (steps, ns in step(), calls, counters) so far."""
    return {
        name: (t.steps, t.step_ns, t.calls, dict(t.counters))
        for inspection in engine.inspect().values()
        for name, t in inspection.stages.items()
    }


def since(engine: Engine, before: dict) -> dict[str, tuple[int, float, int, dict]]:
    out = {}
    for name, (steps, ns, calls, counters) in totals(engine).items():
        b = before.get(name, (0, 0, 0, {}))
        diff = {k: v - b[3].get(k, 0) for k, v in counters.items()}
        out[name] = (steps - b[0], (ns - b[1]) / 1e9, calls - b[2], diff)
    return out


def batching(engine, args, rate: float, model_dir: str) -> None:
    """(a): for each size and concurrency, the requests served at once and one after
    another, alternating over `--rounds`; images/s beside the DiT's FLOP bound."""
    print(f"\n(a) {args.steps} steps, true CFG 4, {args.rounds} rounds each way (medians)")
    print(f"{'size':>6} {'n':>3} {'variant':>11} {'wall s':>8} {'images/s':>9} {'vs seq':>7} "
          f"{'of bound':>9}")  # fmt: skip
    busy = {}
    for size in args.size:
        bound = rate / (args.steps * pair_flops(model_dir, size, args.text_tokens)[0])
        for n in args.concurrency:
            requests = [request(i, size, args.steps) for i in range(n)]
            walls = {False: [], True: []}
            for _ in range(args.rounds):
                for concurrent in (False, True):
                    before = totals(engine)
                    walls[concurrent].append(serve(engine, requests, concurrent))
                    for stage, row in since(engine, before).items():
                        key = (size, n, concurrent, stage)
                        busy[key] = tuple(
                            a + b for a, b in zip(busy.get(key, (0, 0, 0)), row[:3], strict=True)
                        )
            wall = {way: statistics.median(times) for way, times in walls.items()}
            for concurrent, label in ((False, "sequential"), (True, "concurrent")):
                rate_n = n / wall[concurrent]
                print(f"{size:>6} {n:>3} {label:>11} {wall[concurrent]:8.2f} {rate_n:9.3f} "
                      f"{wall[False] / wall[concurrent]:6.2f}x {rate_n / bound:8.0%}")  # fmt: skip
            print(f"{size:>6} {n:>3} {'DiT bound':>11} {'':>8} {bound:9.3f}")
    print(f"\n{'size':>6} {'n':>3} {'variant':>11} {'stage':>8} {'steps':>6} {'batch':>6} "
          f"{'busy s':>7}")  # fmt: skip
    for (size, n, concurrent, stage), (count, seconds, calls) in busy.items():
        label = "concurrent" if concurrent else "sequential"
        batch = calls / count if count else 0.0
        print(f"{size:>6} {n:>3} {label:>11} {stage:>8} {count / args.rounds:6.0f} {batch:6.2f} "
              f"{seconds / args.rounds:7.2f}")  # fmt: skip
    print("(steps and busy: a round's, on average; busy: wall time inside the stage's step(), "
          "which includes GPU time only where the step waits for the GPU; batch: requests a "
          "step advanced, on average)")  # fmt: skip


def end_to_end(engine, args) -> None:
    """(c) and (d): one request at `--e2e-size` and `--e2e-steps`, uncached, then at each
    `--cache` threshold: its wall time, its stages' busy time, the DiT steps computed and
    reused, and its image's distance from the uncached one."""
    size, steps = args.e2e_size, args.e2e_steps
    print(f"\n(c) one request end to end: {size}x{size}, {steps} steps, true CFG 4")
    before = totals(engine)
    start = time.perf_counter()
    (base,) = engine.generate(*request(0, size, steps)).values()
    wall = time.perf_counter() - start
    stages = since(engine, before)
    print(f"E2E {wall:.2f} s")
    print(f"{'stage':>8} {'steps':>6} {'busy s':>8} {'of wall':>8}")
    for stage, (count, busy, _, _) in stages.items():
        print(f"{stage:>8} {count:>6} {busy:8.2f} {busy / wall:7.0%}")
    if args.scaled and args.scaled < 1:
        scaled = sum(stages[s][1] for s in ("dit", "encoder") if s in stages)
        print(f"real-size estimate (the DiT's and the text encoder's busy time / {args.scaled:g}):"
              f" {wall + scaled * (1 / args.scaled - 1):.2f} s")  # fmt: skip
    if not args.cache:
        return
    print(f"\n(d) step caching at {size}x{size}, {steps} steps (random weights: what it saves, "
          "not what it costs in quality)")  # fmt: skip
    print(f"{'threshold':>9} {'computed':>9} {'reused':>7} {'saved':>6} {'E2E s':>7} "
          f"{'est. real s':>11} {'image max|d|':>13} {'mean|d|':>8}")  # fmt: skip
    for threshold in [0.0, *args.cache]:
        before = totals(engine)
        start = time.perf_counter()
        (image,) = engine.generate(*request(0, size, steps, cache_threshold=threshold)).values()
        took = time.perf_counter() - start
        stages = since(engine, before)
        counters = stages["dit"][3]
        computed, reused = counters.get("steps_computed", 0), counters.get("steps_reused", 0)
        estimate = took
        if args.scaled and args.scaled < 1:
            scaled = sum(stages[s][1] for s in ("dit", "encoder") if s in stages)
            estimate = took + scaled * (1 / args.scaled - 1)
        diff = (image.int() - base.int()).abs().float()
        print(f"{threshold:9.3g} {computed:9d} {reused:7d} {reused / max(1, computed + reused):6.0%}"
              f" {took:7.2f} {estimate:11.2f} {diff.max():13.0f} {diff.mean():8.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    parser.add_argument(
        "--scaled", type=float, metavar="DEPTH",
        help="a random-weight Qwen-Image at real widths and DEPTH x layers (default: tiny)",
    )  # fmt: skip
    parser.add_argument("--size", type=int, nargs="+", default=[512], help="(a)'s image sides")
    parser.add_argument("--steps", type=int, default=20, help="(a)'s denoising steps")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4], help="(a)'s n")
    parser.add_argument("--rounds", type=int, default=3, help="(a)'s rounds each way")
    parser.add_argument("--text-tokens", type=int, default=32, help="(b)'s prompt tokens")
    parser.add_argument("--repeats", type=int, default=10, help="(b)'s timed steps")
    parser.add_argument("--kernels", type=int, default=0, help="(b): list the N costliest kernels")
    parser.add_argument("--e2e-size", type=int, default=0, help="(c)/(d)'s side; 0: skip them")
    parser.add_argument("--e2e-steps", type=int, default=50, help="(c)/(d)'s denoising steps")
    parser.add_argument("--cache", type=float, nargs="*", default=[0.12],
                        help="(d)'s step-cache thresholds (none: skip (d))")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b"], help="parts to skip")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("benchmarks/diffusion.py: --device cuda, but torch sees no CUDA device")
    torch.set_num_threads(1)  # the engine's executors get the cores
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

    if "b" not in args.skip:
        flops, tokens = pair_flops(model_dir, STEP_SIZE, args.text_tokens)
        steps = step_rows(plan, args.device, args.text_tokens, args.repeats, args.kernels)
        roof = flops / rate * 1e3
        print(f"\n(b) DiT step, {STEP_SIZE}x{STEP_SIZE}: cond + uncond rows of "
              f"{tokens} image + {args.text_tokens} text tokens; "
              f"{flops / 1e9:.1f} GFLOP, roofline {roof:.2f} ms")  # fmt: skip
        print(f"{'variant':>24} {'forwards':>8} {'rows':>4} {'ms':>9} {'vs roof':>8}")
        for label, forwards, rows, ms in steps:
            print(f"{label:>24} {forwards:>8} {rows:>4} {ms:9.2f} {ms / roof:7.2f}x")
        print("(ms: medians; vs roof: ms / (FLOPs / matmul rate); backend step: one guided "
              "request's DiffusionSteps.step, its forwards and their rows counted)")  # fmt: skip
        release_memory(cuda)

    start = time.perf_counter()
    with Engine(plan, "process") as engine:
        serve(engine, [request(0, min(args.size), 2)], concurrent=False)  # warm up
        print(f"\nengine up and one request served in {time.perf_counter() - start:.1f} s")
        if "a" not in args.skip:
            batching(engine, args, rate, model_dir)
        if args.e2e_size:
            end_to_end(engine, args)


if __name__ == "__main__":
    main()
