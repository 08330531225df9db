"""Claim: an AR stage's decode step runs near its roofline once it is replayed from CUDA
graphs over a static KV cache, where the eager step is bound by the host.

For each AR stage of Qwen2.5-Omni at real size (random bf16 weights made in memory,
`omniflow.families.qwen2_5_omni.checkpoints.scaled_stage`; the thinker as the omni pipeline runs it, with
text and `hidden` outputs, greedy; the talker's decoder with its sampling defaults), and
each decode mode of the transformers backend, drives the backend itself: `batch` requests
of `--prompt` tokens are prefilled together (that step timed too, after one untimed
prefill of the same shape), then `--steps` decode steps are timed on the host (each
`backend.step` ends with sampled ids on the host: on the eager path its own step's, on the
static ones those of a step launched before it, while its own runs; a static step is
timed from when it may run, `step_when_ready`, so in a steady run of steps its wall time
is a step's either way). "eager" is the dynamic-cache path (the CPU
default), "graphs" the static cache with a CUDA graph replayed per step on the fused
kernels (the CUDA default), "graphs-unfused" the same graphs over the model's own modules
op by op. Also times the graph replay alone (CUDA events, no host work around it).

The roofline of a step: the bytes it must read, the weights its decode touches (layers,
final norm, head, input projection) plus the keys and values of its rows, divided by the
copy bandwidth measured in the same run (a device-to-device copy, bytes read + written per
second); or, if larger, its FLOPs (2 x weights x rows) divided by the bf16 matmul rate
measured in the same run (8192^3).

    python benchmarks/stage_steps.py                       # real size, batches 1 and 10
    python benchmarks/stage_steps.py --depth 0.25 --batches 1 4 --steps 16
    python benchmarks/stage_steps.py --modes graphs --batches 1 --kernels 12   # what bounds a replay

`--checkpoint DIR` measures Qwen3-Omni's thinker from a built checkpoint instead (the
random-weight build at real size, `omniflow models build-scaled
Qwen/Qwen3-Omni-30B-A3B-Instruct`, or tiny:qwen3-omni's folder for a CPU smoke run), loaded
as the serving stage loads it (`omniflow.families.qwen3_omni.thinker_talker.load`). Its
layers are sparse MoE blocks: a step reads the attention, router and norms of every layer
and, of its experts, only those its rows pick; the roofline counts the distinct experts
`batch` tokens pick in a layer when each picks top_k of E uniformly,
E (1 - (1 - k / E)^batch) (a random router's picks; a trained one's are no more spread).

    python benchmarks/stage_steps.py --checkpoint /dev/shm/q3 --batches 1 32 --modes graphs
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable

import torch

from omniflow.backends import static_decode
from omniflow.backends.tapped_decoder import untapped
from omniflow.backends.transformers_ar import Component, TransformersAR, cache_columns
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni.checkpoints import scaled_stage
from omniflow.kernels import fused_moe
from omniflow.kernels.timing import kernel_table
from omniflow.runtime.stage import Call, InputStream, StageSpec

SOURCES = {
    "thinker": """
pipeline steps {{
  model "tiny:qwen2.5-omni"
  stage thinker = ar(component="thinker", max_batch={batch}, max_len={max_len},
                     max_tokens={max_tokens}, decode="{decode}")
  input prompt: tokens -> thinker
  thinker.text -> output text [stream]
  thinker.tokens -> output tokens [stream]
  thinker.hidden -> output hidden [stream]
}}
""",
    "talker": """
pipeline steps {{
  model "tiny:qwen2"
  stage talker = ar(max_batch={batch}, max_len={max_len}, max_tokens={max_tokens},
                    decode="{decode}")
  input prompt: tokens -> talker
  talker.tokens -> output tokens [stream]
}}
""",
}
# Qwen3-Omni's thinker (`--checkpoint`): the same stage on tiny:qwen3-omni's plan (the
# component loaded from the checkpoint takes the tiny one's place).
SOURCES["qwen3-thinker"] = SOURCES["thinker"].replace("tiny:qwen2.5-omni", "tiny:qwen3-omni")
# The sampling each stage runs with in the omni pipeline: the thinker greedy (omni_chat's
# temperature 0), the talker with generate's talker defaults (the component's own).
PARAMS = {"thinker": {"temperature": 0.0}, "qwen3-thinker": {"temperature": 0.0}, "talker": {}}


def backend_for(stage: str, component, mode: str, slots: int, max_len: int, max_tokens: int):
    decode, _, unfused = mode.partition("-")
    source = SOURCES[stage].format(
        batch=slots, max_len=max_len, max_tokens=max_tokens, decode="eager" if unfused else decode
    )
    device = str(component.head.weight.device)
    plan = compile_source(source, devices="1xH200" if device.startswith("cuda") else "cpu")
    spec = StageSpec.from_channels(plan.stages[0], plan.channels)
    start = time.perf_counter()
    backend = TransformersAR(spec, device, component=component)
    if unfused:  # the static decoder of `decode`, on the model's own modules
        plain = static_decode.StaticDecoder(
            component,
            slots=backend.capacity,
            columns=cache_columns(spec.plan, static_decode.kv_bytes_per_token(component.decoder)),
            device=device,
            capture=decode == "graphs",
            extra=type(component).step_extra is not Component.step_extra,
            fused=False,
        )
        backend.decode, backend.static = mode, plain
    sync(device)
    return backend, time.perf_counter() - start


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def close_stage(backend: TransformersAR, captured: int, cuda: bool) -> None:
    """Tear down a measured `ar` stage: check that serving it captured no graph beyond the
    `captured` of its load, close it and release its memory for the next one measured."""
    static = backend.static
    if static is not None:  # serving captured nothing new
        assert static.captures == captured, (static.captures, captured)
    backend.close()
    release_memory(cuda)


def release_memory(cuda: bool) -> None:
    """Collect what was dropped now (cycles too) and, on `cuda`, give the caching
    allocator's free blocks back to the device, so the next thing measured loads into it."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def new_calls(stage: str, batch: int, prompt: int, steps: int, vocab: int, tag: str) -> list[Call]:
    """`batch` requests of `prompt` random ids, each good for `steps` decode steps and more."""
    generator = torch.Generator().manual_seed(batch)
    calls = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt,), generator=generator)
        stream = InputStream("tokens")
        stream.push(ids, end=True)
        params = {"max_tokens": steps + 8, **PARAMS[stage]}
        calls.append(Call(f"{stage}-{batch}-{tag}-{i}", params, {"prompt": stream}))
    return calls


def prefill_ms(backend, calls: list[Call]) -> float:
    """Wall ms of the step that prefills `calls` together (the device finished); the calls
    are dropped again."""
    device = str(backend.device)
    sync(device)
    start = time.perf_counter()
    backend.step(calls)
    sync(device)
    took = (time.perf_counter() - start) * 1e3
    for call in calls:
        backend.drop(call)
    return took


def step_when_ready(backend: TransformersAR, calls: list[Call]) -> None:
    """One decode step of `calls`, the wait for it to be able to run included: the static
    path reads each step's ids back without waiting, and a `backend.step` while the steps
    in flight have not landed returns having done nothing (the executor's loop polls
    `ready` first, as here)."""
    while calls and not any(backend.ready(call) for call in calls):
        pass
    backend.step(calls)


def step_times(
    backend, stage: str, batch: int, prompt: int, steps: int, vocab: int, kernels: int = 0
):
    """Wall ms of the step that prefills `batch` requests together, median wall ms of a
    decode step over them, and of the graph replay alone (None without graphs); with
    `kernels`, prints the prefill's and the replay's costliest kernels."""
    fresh = iter(range(1 << 30))

    def prefill() -> float:
        return prefill_ms(backend, new_calls(stage, batch, prompt, steps, vocab, str(next(fresh))))

    prefill()  # the first prefill of a shape pays one-time set-up (heuristics, compiles)
    prefill_took = prefill()
    if kernels:
        print(f"  prefill of {batch}:")
        kernel_table(prefill, kernels, calls=2)
    calls = new_calls(stage, batch, prompt, steps, vocab, "timed")
    backend.step(calls)  # prefill every request
    for _ in range(3):  # warm up
        step_when_ready(backend, calls)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step_when_ready(backend, calls)
        times.append(time.perf_counter() - start)
        for call in calls:
            call.emitted.clear()
    assert not any(c.finished or c.error for c in calls), [c.error for c in calls]
    replay = None
    static = backend.static
    if static is not None and static.graphs:
        rows = len(backend.rows)
        longest = max(s.length for s in backend.rows)
        # A step's graphs: the LM's step at its buckets, then its finish.
        replay_step = functools.partial(static.replay, *static.buckets(rows, longest))
        with torch.inference_mode():  # (the buffer was made in inference mode)
            static.active.zero_()  # after the steps queued: no row advances in the replays below
        replay = replay_ms(replay_step)
        if kernels:
            print(f"  decode replay at {batch}:")
            kernel_table(replay_step, kernels)
    kv = sum(s.length for s in backend.rows)
    for call in calls:
        backend.drop(call)
    return prefill_took, statistics.median(times) * 1e3, replay, kv


def replay_ms(replay: Callable[[], None]) -> float:
    """The median ms of 10 calls of `replay` (graph replays; CUDA events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(10):
        begin.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        replays.append(begin.elapsed_time(end))
    return statistics.median(replays)


def _seconds(fn, device: str, repeats: int = 12) -> float:
    """Median seconds of `fn()` (after two warm-up calls)."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    """Bytes per second a copy within the device moves (read + written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), device)


def matmul_rate(device: str, n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n matrix product in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _seconds(lambda: a @ b, device)


def decode_weight_bytes(component, batch: int) -> int:
    """Bytes of the weights one decode step of `batch` rows reads: the decoder's layers and
    final norm, the head, and the input projection where the component has one; of a
    sparse MoE layer's experts, those `batch` tokens pick (`picked_experts`)."""
    decoder, _ = untapped(component.decoder)
    modules = [decoder.layers, decoder.norm, component.head]
    projection = getattr(component.model, "thinker_to_talker_proj", None)
    if projection is not None:
        modules.append(projection)
    total = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    for layer in decoder.layers:
        if fused_moe.routed(layer.mlp):
            experts = layer.mlp.experts
            stacks = (experts.gate_up_proj, experts.down_proj)
            per_expert = sum(w[0].numel() * w.element_size() for w in stacks)
            unread = experts.gate_up_proj.shape[0] - picked_experts(layer.mlp, batch)
            total -= unread * per_expert
    return total


def picked_experts(block, batch: int) -> float:
    """Distinct experts `batch` tokens pick when each picks top_k of E uniformly."""
    count, top_k = block.experts.gate_up_proj.shape[0], block.gate.top_k
    return count * (1 - (1 - top_k / count) ** batch)


def load_stage(stage: str, args):
    """The stage's component: Qwen3-Omni's thinker from `--checkpoint`, else the scaled
    Qwen2.5-Omni stage made in memory."""
    if stage != "qwen3-thinker":
        return scaled_stage(stage, args.depth, args.device)
    from omniflow.families.qwen3_omni.thinker_talker import load

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return load(args.checkpoint, "thinker", args.device, dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=float, default=1.0, help="layers x the real model's")
    parser.add_argument("--stages", nargs="+", default=["thinker", "talker"])
    parser.add_argument("--checkpoint", help="a Qwen3-Omni build: measure its thinker")
    parser.add_argument(
        "--modes", nargs="+", help="default: eager graphs-unfused graphs (off CUDA: eager static)",
        choices=["eager", "static", "static-unfused", "graphs", "graphs-unfused"],
    )  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--slots", type=int, default=32, help="the stage's max_batch")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu: a smoke run"
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="print each replay's N costliest kernels",
    )
    args = parser.parse_args()
    if args.checkpoint:
        args.stages = ["qwen3-thinker"]
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    args.modes = args.modes or (
        ["eager", "graphs-unfused", "graphs"] if cuda else ["eager", "static"]
    )
    if cuda:
        bandwidth, rate = copy_bandwidth(args.device), matmul_rate(args.device)
        name = torch.cuda.get_device_name()
    else:
        bandwidth, rate = copy_bandwidth("cpu", 256 << 20), matmul_rate("cpu", 1024)
        name = "cpu"
    print(
        f"{name}: copy {bandwidth / 1e12:.3f} TB/s (read + written), "
        f"bf16 matmul {rate / 1e12:.1f} TFLOP/s"
    )
    rows = []
    for stage in args.stages:
        component = load_stage(stage, args)
        per_token = 0
        # Prompt ids: text the tokenizer has, or codec ids.
        vocab = len(component.tokenizer) if stage != "talker" else 8192
        for mode in args.modes:
            backend, load_s = backend_for(
                stage, component, mode, args.slots, args.prompt, args.steps + 16
            )
            static = backend.static
            note = f"{mode}: set up in {load_s:.2f} s"
            if static is not None:
                per_token = static_decode.kv_bytes_per_token(component.decoder)
                note += (
                    f", {static.captures} graphs ({len(static.batch_buckets)} batch x "
                    f"{len(static.length_buckets)} length buckets), cache {static.slots} x "
                    f"{static.columns} columns ({static.keys.numel() * 2 * static.keys.element_size() / 2**30:.1f} GiB)"
                )
            print(f"{stage} {note}", flush=True)
            captured = static.captures if static is not None else 0
            for batch in args.batches:
                prefill, step_ms, replay_ms, kv = step_times(
                    backend, stage, batch, args.prompt, args.steps, vocab, args.kernels
                )
                weights = decode_weight_bytes(component, batch)
                read = weights + kv * per_token
                # (each row multiplies by a token's weights: of a MoE layer, its top_k experts)
                per_row = decode_weight_bytes(component, 1) / component.head.weight.element_size()
                flops = 2 * per_row * batch
                roof_ms = max(read / bandwidth, flops / rate) * 1e3
                rows.append((stage, mode, batch, prefill, step_ms, replay_ms, roof_ms, weights))
                print(
                    f"  batch {batch:>3}: prefill {prefill:.1f} ms, step {step_ms:8.2f} ms"
                    + (f", replay {replay_ms:.2f} ms" if replay_ms is not None else "")
                    + f", roofline {roof_ms:.2f} ms",
                    flush=True,
                )
            close_stage(backend, captured, cuda)
        del component
        release_memory(cuda)
    print()
    print(
        f"{'stage':>8} {'mode':>14} {'batch':>5} {'prefill ms':>10} {'step ms':>9} "
        f"{'replay ms':>10} {'roofline ms':>12} {'step/roof':>10} {'vs batch 1':>11}"
    )
    first = {}
    for stage, mode, batch, prefill, step_ms, replay_ms, roof_ms, _ in rows:
        first.setdefault((stage, mode), step_ms)
        replay = f"{replay_ms:10.2f}" if replay_ms is not None else f"{'-':>10}"
        print(
            f"{stage:>8} {mode:>14} {batch:>5} {prefill:10.1f} {step_ms:9.2f} {replay} "
            f"{roof_ms:12.2f} {step_ms / roof_ms:9.2f}x {step_ms / first[stage, mode]:10.2f}x"
        )
    print(
        "(prefill: wall time of the step that prefills the batch's prompts together; step: "
        "median wall time of a decode step (a backend step, ids on the host); replay: the "
        "CUDA graph alone; roofline: (decode weights + KV read) / copy bandwidth, or FLOPs / matmul rate if "
        "larger; weights: "
        + ", ".join(f"{r[0]} at {r[2]} {r[7] / 1e9:.2f} GB" for r in rows if r[1] == rows[0][1])
        + ")"
    )


if __name__ == "__main__":
    main()
