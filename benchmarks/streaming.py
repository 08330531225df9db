"""Claim: streaming edges give a first audio packet after a small fraction of a request's
end-to-end time, and concurrent serving multiplies throughput over the monolithic model.

On the omni chat pipeline (thinker -> talker -> code2wav) with the same weights, measures
time to first audio packet (TTFP), end-to-end latency (E2E) and the playback stall (how
long a listener who starts playing at the first packet waits for later ones) at
concurrency 1, 4 and 10,
for (a) the compiled plan with streaming edges (chunk=auto), (b) the same pipeline with
whole-output edges, and (c) the HF transformers model's own generate, one request at a
time. Prints ratios measured side by side in one run.

    python benchmarks/streaming.py              # tiny models, CPU
    python benchmarks/streaming.py --devices 1xH200 --scaled 0.5   # real widths, half the layers
    python benchmarks/streaming.py --devices 1xH200 --model-dir DIR  # any Qwen2.5-Omni checkpoint
    python benchmarks/streaming.py --devices 1xH200 --scaled 1 --decode eager graphs  # before/after
    python benchmarks/streaming.py --devices 2xH200 --also-devices 1xH200 --scaled 1   # 2 GPUs vs 1
    python benchmarks/streaming.py --devices 1xH200 --scaled 1 --prompt-tokens 100 \
        --max-tokens 100 --audio-tokens 1250 --baseline-requests 0   # 25 s replies, no HF run

`--decode` runs each variant once per decode mode of the AR stages ("auto": graphs on CUDA,
eager on CPU; "eager": the dynamic cache; "graphs": static cache + CUDA graphs), so one
table holds the eager and the graph-captured pipeline side by side.

    python benchmarks/streaming.py --profile [--rounds 6]   # profiling on vs off
    python benchmarks/streaming.py --breakdown   # where each concurrency's TTFP went

`--breakdown` profiles the measured round at each concurrency and prints the median of
each component of the requests' TTFP critical paths (`omniflow.profiler.analysis`): a
stage's steps, its waiting (its executor busy with other work, or idle), the edges'
hand-offs; what each stage's steps took until the median first packet; and the chunks
a listener's playback waited for (which chunk, how many requests, after how much audio).
`--prefill-tokens N ...` runs the AR stages at each prefill budget (1: every request
prefilled alone), side by side.

`--profile` measures instead what profiling costs the streaming plan: TTFP and E2E at each
concurrency, in rounds alternating profiled and not on one engine (`profile_overhead.py`).

`--scaled DEPTH` builds (once, under $OMNIFLOW_CACHE/scaled/) a random-weight Qwen2.5-Omni at
the real model's widths with DEPTH x its layer counts (`omniflow.checkpoints.scaled`).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import threading
import time
from pathlib import Path

import torch
from profile_overhead import interleaved, ratio_rows

from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.compiler import compile_graph, graph_from_source
from omniflow.families.qwen2_5_omni.checkpoints import REAL_OMNI
from omniflow.profiler.analysis import parse_trace, timelines
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.engine import Engine

GRAPH = Path(__file__).parents[1] / "graphs" / "omni_chat.omni"
PROMPTS = [f"Tell me about topic number {i}, briefly." for i in range(10)]


def whole_edges(text: str) -> str:
    """The same pipeline with every edge carrying whole outputs (no streaming)."""
    text = re.sub(r"\[stream, chunk=1, (adapter=[\w.]+)\]", r"[\1]", text)
    text = text.replace("[stream, chunk=auto, context=25]", "")
    return re.sub(r"(output \w+) \[stream\]", r"\1", text)


def plan_for(
    text: str,
    devices: str,
    model: str | None,
    audio_tokens: int,
    decode: str,
    prefill_tokens: int | None = None,
    lookahead: int | None = None,
):
    graph = graph_from_source(text, str(GRAPH))
    graph = graph.copy() if model else use_tiny_models(graph)
    if model:
        graph.model = model
    # Random weights rarely say end-of-speech: bound the talker so every variant does equal work.
    graph.node("talker").params["max_tokens"] = audio_tokens
    for name in ("thinker", "talker"):
        if decode != "auto":
            graph.node(name).params["decode"] = decode
        if prefill_tokens is not None:
            graph.node(name).params["prefill_tokens"] = prefill_tokens
    if lookahead is not None:
        graph.node("code2wav").params["lookahead"] = lookahead
    return compile_graph(graph, devices)


def ttfp_breakdown(trace: dict, output: str = "audio") -> tuple[list[str], list[str]]:
    """Where a round's TTFP went: the components of the requests' critical paths to
    `output`'s first chunk (each its median over the requests, largest first), and each
    stage's steps from the first request's arrival to the median first chunk."""
    profile = parse_trace(trace)
    requests = [r for r in timelines(profile) if output in r.path_ttfp]
    paths = [r.path_ttfp[output] for r in requests]
    names = {name for path in paths for name in path}
    medians = {n: statistics.median(path.get(n, 0.0) for path in paths) / 1e3 for n in names}
    parts = [f"{n} {ms:.1f}" for n, ms in sorted(medians.items(), key=lambda kv: -kv[1]) if ms >= 1]
    t0 = min(r.t0 for r in requests)
    until = t0 + statistics.median(r.ttfp[output] for r in requests)
    steps = []
    for stage in profile.stages:
        durs = [s.dur / 1e3 for s in profile.steps.get(stage, ()) if t0 <= s.ts < until]
        if durs:
            steps.append(
                f"{stage} {len(durs)} steps, {sum(durs):.1f} ms (median {statistics.median(durs):.2f}"
                f", longest {max(durs):.1f})"
            )
    return parts, steps


def long_prompts(tokenizer_dir: str, tokens: int) -> list[str]:
    """PROMPTS, each repeated until it is at least `tokens` tokens long."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for prompt in PROMPTS:
        text = prompt
        while len(tokenizer(text)["input_ids"]) < tokens:
            text = f"{text} {prompt}"
        out.append(text)
    return out


def run_engine(
    engine: Engine, concurrency: int, max_tokens: int, audio: list | None = None
) -> tuple[list[float], list[float], float]:
    """TTFP of each of `concurrency` requests sent at once that had audio (a random-weight
    talker may say none), E2E of each, and the wall time; with
    `audio`, each request's audio chunks as (seconds since it was sent, samples) into it."""
    ttfp, e2e = [None] * concurrency, [None] * concurrency
    chunks = [[] for _ in range(concurrency)]

    def one(i: int) -> None:
        start = time.perf_counter()
        for chunk in engine.stream_sync({"prompt": PROMPTS[i]}, {"max_tokens": max_tokens}):
            if chunk.output == "audio" and chunk.value is not None:
                arrived = time.perf_counter() - start
                chunks[i].append((arrived, chunk.value.numel()))
                if ttfp[i] is None:
                    ttfp[i] = arrived
        e2e[i] = time.perf_counter() - start

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if audio is not None:
        audio[:] = chunks
    return [t for t in ttfp if t is not None], e2e, time.perf_counter() - start


def playback_waits(chunks: list[tuple[float, int]], rate: int) -> list[tuple[int, float, float]]:
    """Where a listener who plays a request's audio from its first chunk on waits: (chunk
    index, seconds of audio played before it, seconds waited) for each chunk that arrives
    after the audio ahead of it has played."""
    waits, end, played = [], None, 0.0
    for i, (arrived, samples) in enumerate(chunks):
        end = arrived if end is None else end
        if arrived > end:
            waits.append((i, played, arrived - end))
        end = max(end, arrived) + samples / rate
        played += samples / rate
    return waits


def playback_stall(chunks: list[tuple[float, int]], rate: int) -> float:
    """Seconds a listener who plays a request's audio from its first chunk on waits for the
    chunks after it: 0 when each arrives before the audio ahead of it has played."""
    return sum(wait for _, _, wait in playback_waits(chunks, rate))


def stall_points(audio: list[list[tuple[float, int]]], rate: int) -> list[str]:
    """The chunks the requests' playback waited for, most waited-for first: the chunk's
    index, how many requests waited there, the audio played before it and the median wait."""
    by_chunk: dict[int, list[tuple[float, float]]] = {}
    for chunks in audio:
        for i, played, wait in playback_waits(chunks, rate):
            by_chunk.setdefault(i, []).append((played, wait))
    ranked = sorted(by_chunk.items(), key=lambda kv: -sum(w for _, w in kv[1]))
    return [
        f"chunk {i} ({len(waits)} requests, after {statistics.median(p for p, _ in waits):.1f} s"
        f" of audio): {statistics.median(w for _, w in waits):.2f} s"
        for i, waits in ranked[:4]
    ]


def monolithic_latencies(
    model_dir: str, device: str, n: int, max_tokens: int, audio_tokens: int
) -> list[float]:
    """Seconds per request of the HF model's own generate (audio arrives at the end), for the
    first `n` prompts after one warm-up request."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    from omniflow.families.qwen2_5_omni.checkpoints import omni_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype="auto")
    model = model.to(device).eval()
    eos = [
        model.config.talker_config.tts_codec_pad_token_id,
        model.config.talker_config.tts_codec_end_token_id,
    ]
    latencies = []
    for i in [0, *range(n)]:
        ids = omni_prompt_ids(tokenizer, PROMPTS[i]).to(device)
        start = time.perf_counter()
        model.generate(ids, thinker_max_new_tokens=max_tokens,
                       thinker_do_sample=False, talker_do_sample=False, talker_eos_token_id=eos,
                       talker_max_new_tokens=audio_tokens)  # fmt: skip
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        latencies.append(time.perf_counter() - start)
    return latencies[1:]


def sequential(latencies: list[float], concurrency: int) -> tuple[list[float], list[float], float]:
    """`concurrency` requests served one at a time: each waits for those before it. Past the
    measured requests, their latencies repeat in turn."""
    done, clock = [], 0.0
    for i in range(concurrency):
        clock += latencies[i % len(latencies)]
        done.append(clock)
    return done, done, clock


def profile_overhead(plan, concurrency: list[int], max_tokens: int, rounds: int) -> None:
    print(f"{'conc':>4} {'metric':>6} {'off ms':>9} {'on ms':>9} {'on/off':>7}")
    with Engine(plan, "process") as engine:
        run_engine(engine, 1, max_tokens)  # warm up
        for c in concurrency:

            def run(c=c) -> dict[str, list[float]]:
                ttfp, e2e, _wall = run_engine(engine, c, max_tokens)
                return {"TTFP": ttfp, "E2E": e2e}

            samples, _recorded = interleaved(engine, run, rounds)
            for metric, off, on in ratio_rows(samples):
                print(f"{c:>4} {metric:>6} {off * 1e3:>9.1f} {on * 1e3:>9.1f} {on / off:>7.3f}")
    print(f"(medians of {rounds} rounds each way, alternating profiled and not)")


def model_arguments(max_tokens: int, audio_tokens: int) -> argparse.ArgumentParser:
    """The options every omni chat benchmark takes: where it runs, on which checkpoint, and
    how long a request is."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--model-dir", help="a Qwen2.5-Omni checkpoint (default: the tiny one)")
    parser.add_argument(
        "--scaled",
        type=float,
        metavar="DEPTH",
        help="a random-weight Qwen2.5-Omni at real widths and DEPTH x layers",
    )
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument(
        "--audio-tokens", type=int, default=audio_tokens, help="codec tokens per request"
    )
    return parser


def parse_model_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with `--scaled` built (once, into the cache) as `model_dir`; one torch
    thread here, so the executors have the cores."""
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.scaled:
        args.model_dir = str(scaled_checkpoint(REAL_OMNI, args.scaled, torch_device(args.devices)))
    return args


def swept(setting: str, value: int | None, values: list[int | None]) -> list[str]:
    """A variant's name part for one setting run at several values (None: its default)."""
    if len(values) < 2:
        return []
    return [f"{setting} {'default' if value is None else value}"]


def torch_device(devices: str) -> str:
    return "cpu" if devices == "cpu" else "cuda"


def main() -> None:
    parser = model_arguments(max_tokens=32, audio_tokens=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 10])
    parser.add_argument(
        "--decode", nargs="+", default=["auto"], choices=["auto", "eager", "static", "graphs"]
    )
    parser.add_argument("--variants", nargs="+", default=["streaming", "whole"])
    parser.add_argument(
        "--also-devices",
        metavar="INVENTORY",
        help="also run every variant compiled for this inventory, side by side (e.g. 1xH200 "
        "beside --devices 2xH200)",
    )
    parser.add_argument(
        "--baseline-requests",
        type=int,
        help="requests the sequential baseline measures (default: the largest concurrency)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, help="repeat each prompt until it is this many tokens long"
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=[None],
        help="the AR stages' prefill budgets to run side by side (1: each prompt alone)",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        nargs="+",
        default=[None],
        help="token2wav's lookaheads (codes) to run side by side (12: Qwen's own streaming)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="print each concurrency's TTFP critical path"
    )
    parser.add_argument("--profile", action="store_true", help="measure profiling on vs off")
    parser.add_argument("--rounds", type=int, default=6, help="with --profile: rounds each way")
    args = parse_model_arguments(parser)
    model_dir = args.model_dir or model_path("tiny:qwen2.5-omni")
    if args.prompt_tokens:
        PROMPTS[:] = long_prompts(model_dir, args.prompt_tokens)
    text = GRAPH.read_text()
    if args.profile:
        plan = plan_for(text, args.devices, args.model_dir, args.audio_tokens, args.decode[0])
        profile_overhead(plan, args.concurrency, args.max_tokens, args.rounds)
        return
    sources = {"streaming": text, "whole": whole_edges(text)}
    variants = {}
    inventories = [args.devices, *([args.also_devices] if args.also_devices else [])]
    budgets, lookaheads = args.prefill_tokens, args.lookahead
    for devices, decode, budget, lookahead, variant in itertools.product(
        inventories, args.decode, budgets, lookaheads, args.variants
    ):
        name = " ".join(
            [variant]
            + ([decode] if len(args.decode) > 1 else [])
            + swept("prefill", budget, budgets)
            + swept("lookahead", lookahead, lookaheads)
            + ([devices] if len(inventories) > 1 else [])
        )
        variants[name] = plan_for(
            sources[variant], devices, args.model_dir, args.audio_tokens, decode, budget, lookahead
        )
    rows, rtf, stall = {}, {}, {}
    for name, plan in variants.items():
        rate = next(o.attrs["rate"] for o in plan.outputs if o.name == "audio")
        start = time.perf_counter()
        with Engine(plan, "process") as engine:
            run_engine(engine, 1, args.max_tokens)  # warm up
            print(
                f"{name}: engine up and one request served in {time.perf_counter() - start:.1f} s",
                flush=True,
            )
            for c in args.concurrency:
                audio = []
                if args.breakdown:  # big enough that no event of the round is overwritten
                    engine.start_profile(capacity=1 << 20)
                rows[name, c] = ttfp, e2e, wall = run_engine(engine, c, args.max_tokens, audio)
                if args.breakdown:
                    parts, steps = ttfp_breakdown(chrome_trace(engine.stop_profile(), plan))
                    print(
                        f"  {name} at {c}: TTFP critical path, median ms: {', '.join(parts)}\n"
                        f"    steps before the median TTFP: {'; '.join(steps)}\n"
                        f"    playback waited for: {'; '.join(stall_points(audio, rate)) or '-'}",
                        flush=True,
                    )
                samples = [sum(n for _, n in chunks) for chunks in audio]
                rtf[name, c] = [
                    t / (n / rate) if n else float("inf") for t, n in zip(e2e, samples, strict=True)
                ]
                stall[name, c] = [playback_stall(chunks, rate) for chunks in audio]
                print(
                    f"  {name} at {c}: TTFP {statistics.median(ttfp) * 1e3:.1f} ms, "
                    f"E2E {statistics.median(e2e) * 1e3:.1f} ms, {c / wall:.2f} req/s, "
                    f"audio {statistics.median(samples) / rate:.1f} s, playback stalled "
                    f"{statistics.median(stall[name, c]):.2f} s (most {max(stall[name, c]):.2f})",
                    flush=True,
                )
    names = list(variants)
    if args.baseline_requests != 0:
        measured = args.baseline_requests or max(args.concurrency)
        latencies = monolithic_latencies(
            model_dir, torch_device(args.devices), measured, args.max_tokens, args.audio_tokens
        )
        names.append("hf sequential")
        for c in args.concurrency:
            rows["hf sequential", c] = sequential(latencies, c)
    wide = max(16, *map(len, names))
    print(
        f"{'variant':>{wide}} {'conc':>4} {'TTFP ms':>9} {'E2E ms':>9} {'TTFP/E2E':>9} {'RTF':>6} "
        f"{'stall s':>7} {'req/s':>7} {'vs hf':>7}"
    )
    for c in args.concurrency:
        hf_wall = rows["hf sequential", c][2] if "hf sequential" in names else None
        for name in names:
            ttfp, e2e, wall = rows[name, c]
            t, e = statistics.median(ttfp) * 1e3, statistics.median(e2e) * 1e3
            r = f"{statistics.median(rtf[name, c]):6.2f}" if (name, c) in rtf else f"{'-':>6}"
            st = f"{statistics.median(stall[name, c]):7.2f}" if (name, c) in stall else f"{'-':>7}"
            vs = f"{hf_wall / wall:>6.2f}x" if hf_wall else f"{'-':>7}"
            print(
                f"{name:>{wide}} {c:>4} {t:>9.1f} {e:>9.1f} {t / e:>8.1%} {r} {st} "
                f"{c / wall:>7.2f} {vs}"
            )
    print(
        "(medians over the concurrent requests; TTFP = first audio chunk; RTF = E2E / audio"
        " seconds; stall = seconds a listener playing from the first chunk waits for later"
        " ones; vs hf = throughput ratio against the HF model's generate served back to back)"
    )


if __name__ == "__main__":
    main()
