"""Claim: an omni chat pipeline stays real time under load, as the peer's benchmark client
measures it: every request served (queued rather than refused), the first audio packet
soon, and no playback gaps for a listener who starts at the first packet.

Serves one chat graph with `omniflow run` and sends the peer's workload over HTTP (SSE,
text and audio): `--prompt-tokens` of prompt, `--max-tokens` text tokens, `--audio-tokens`
talker codes, from `c` clients at once for each `--concurrency` c (closed loop, `--rounds`
requests each). Per level it prints TTFT, TTFP (median and p90), E2E, RTF (medians), audio
seconds per wall second, the playback underrun (p90, p99: `omniflow.server.playback`, the
same arithmetic the server exports), how many requests got 503, and how many ended with
the server's error event instead (the first one's message under the row).

`--orders slack arrival` serves the graph once per vocoder `order` (whose window a step
decodes first), one after the other in the same run, and prints their rows together.

`--trace FILE` then runs a round at each `--trace-concurrency` (default 1 and 10) under the
server's own profiler (`--trace-gpu`: with the CUDA kernels) into FILE, and prints where the
rounds' first packets waited (the mean TTFP critical path, beside the client's TTFP) and
each stage's steps, as benchmarks/tts_serve.py does.

    python benchmarks/load.py --tiny --concurrency 1 4                    # on the tiny models
    python benchmarks/load.py --devices 1xH200 --scaled 1 --concurrency 1 10 32 64
    python benchmarks/load.py --graph graphs/qwen3_omni.omni --devices 1xH200 --scaled 1

`--max-batch STAGE=N` and `--set STAGE.PARAM=VALUE` serve the graph with those stages'
arguments set (`omniflow run --set`: a smaller GPU's batches; `thinker.prefill_tokens=2560`).

`--scaled DEPTH` serves the graph on a random-weight build of its model at the real widths
and DEPTH x its layers (`omniflow.checkpoints.scaled`, built once into the cache). Its
tokenizer is the tiny checkpoint's (a few hundred tokens beside the real vocabulary), so
most ids the random weights sample decode to no text: TTFT there is the first text that
decodes, later than the first token (TTFP, which needs no text, can come first).

`--preset a|b` is one of the peer's two published Qwen3-Omni workloads (issue 39), on
graphs/qwen3_omni.omni: (a) 2,500 prompt tokens, 900 text tokens with their audio, at
c = 1, 8, 16, 32; (b) 100 in, 100 out at c = 1, 10. The audio is capped at
CODES_PER_TEXT_TOKEN codes a text token (a random-weight talker never ends its speech by
itself). Flags given beside a preset override its values:

    python benchmarks/load.py --preset a --devices 1xH200 --scaled 1
    python benchmarks/load.py --preset b --devices 1xH100 --scaled 1 \
        --max-batch hearing=2 vision=2 thinker=8 talker=8 code2wav=8 \
        --set thinker.max_len=3072 talker.max_len=3072              # fits 80 GB
    python benchmarks/load.py --preset b --tiny --prompt-tokens 20 --max-tokens 8 \
        --audio-tokens 16 --concurrency 1 2                               # a CPU check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.serve import (  # noqa: E402
    Server,
    StreamFailed,
    chat_deltas,
    percentile,
    print_profile,
    session,
)
from omniflow.server.playback import Playback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RATE = 24000
# The speech of a text token, in 12.5 Hz codec frames: English speech runs ~3 tokens a
# second, ~4 frames a token.
CODES_PER_TEXT_TOKEN = 4
# The peer's workloads: prompt tokens, text tokens, concurrency levels (on Qwen3-Omni).
PRESETS = {
    "a": {"prompt_tokens": 2500, "max_tokens": 900, "concurrency": [1, 8, 16, 32]},
    "b": {"prompt_tokens": 100, "max_tokens": 100, "concurrency": [1, 10]},
}
PRESET_GRAPH = ROOT / "graphs" / "qwen3_omni.omni"
# Without a preset.
DEFAULTS = {
    "graph": str(ROOT / "graphs" / "omni_chat.omni"),
    "concurrency": [1, 10],
    "prompt_tokens": 100,
    "max_tokens": 100,
    "audio_tokens": 1250,
}


def workload_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with what was not given filled from its preset (if any), then the defaults."""
    preset = {}
    if args.preset:
        preset = {**PRESETS[args.preset], "graph": str(PRESET_GRAPH)}
        preset["audio_tokens"] = preset["max_tokens"] * CODES_PER_TEXT_TOKEN
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    return args


def prompt_of(words: int) -> str:
    """A user turn of `words` short common words (about one token each under the real
    models' tokenizers; `sized_prompt` counts them on the server)."""
    vocabulary = [
        "tell",
        "me",
        "about",
        "the",
        "sea",
        "and",
        "the",
        "ships",
        "that",
        "sail",
        "on",
        "it",
        "at",
        "night",
    ]
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


async def prompt_tokens(client: aiohttp.ClientSession, body: dict) -> int:
    """The prompt tokens the server counts for a chat request `body` (its `usage`; one token
    answered)."""
    async with client.post("/v1/chat/completions", json={**body, "max_tokens": 1}) as reply:
        reply.raise_for_status()
        return (await reply.json())["usage"]["prompt_tokens"]


async def sized_prompt(client: aiohttp.ClientSession, model: str, tokens: int) -> str:
    """The shortest user turn of `prompt_of` words with at least `tokens` prompt tokens by the
    server's count (the chat template's included): a word is one token or more, and more
    under a random-weight build's small tokenizer than under the real model's. Each count
    is a request answering one token and one audio code (a random-weight talker would
    otherwise speak to its limit)."""
    low, high = 1, tokens
    while low < high:
        mid = (low + high) // 2
        body = {"model": model, "messages": [{"role": "user", "content": prompt_of(mid)}],
                "max_audio_tokens": 1}  # fmt: skip
        low, high = (mid + 1, high) if await prompt_tokens(client, body) < tokens else (low, mid)
    return prompt_of(low)


async def chat(client: aiohttp.ClientSession, model: str, seed: int, workload: dict) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": workload["prompt"]}],
        "modalities": ["text", "audio"],
        "audio": {"format": "pcm16"},
        "stream": True,
        "seed": seed,
        "max_tokens": workload["max_tokens"],
        "max_audio_tokens": workload["audio_tokens"],
    }
    began = time.perf_counter()
    first_text = first_audio = None
    playback, audio_s = Playback(), 0.0
    async with client.post("/v1/chat/completions", json=body) as reply:
        if reply.status == 503:
            await reply.read()
            return {"refused": True, "failed": None}
        if not reply.ok:  # the workload itself is refused: no figure to measure
            raise SystemExit(f"{reply.status}: {(await reply.read()).decode()[:500]}")
        try:
            async for now, text, audio in chat_deltas(reply):
                if text and first_text is None:
                    first_text = now
                if audio:
                    first_audio = first_audio or now
                    seconds = len(audio) / 2 / RATE
                    playback.arrived(now, seconds)
                    audio_s += seconds
        except StreamFailed as err:  # counted, and said once under the table
            return {"refused": False, "failed": str(err)}
    ended = time.perf_counter()
    return {
        "refused": False,
        "failed": None,
        "ttft": None if first_text is None else (first_text - began) * 1e3,
        "ttfp": None if first_audio is None else (first_audio - began) * 1e3,
        "e2e": ended - began,
        "rtf": (ended - began) / audio_s if audio_s else None,
        "audio_s": audio_s,
        "underrun": playback.underrun,
    }


async def level(base: str, model: str, workload: dict, clients: int, rounds: int):
    """`clients` closed-loop clients, `rounds` requests each: (results, wall seconds)."""
    async with session(base, clients) as client:

        async def one_client(k: int) -> list[dict]:
            return [
                await chat(client, model, 1000 + k * rounds + r, workload) for r in range(rounds)
            ]

        began = time.perf_counter()
        results = await asyncio.gather(*(one_client(k) for k in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - began


async def sized(base: str, model: str, tokens: int) -> str:
    """`sized_prompt` on the server at `base`, said."""
    async with session(base, None, timeout=600) as client:
        prompt = await sized_prompt(client, model, tokens)
    print(f"prompt: {len(prompt.split())} words, {tokens} prompt tokens or just over", flush=True)
    return prompt


def report(order: str, clients: int, results: list[dict], wall: float) -> str:
    served = [r for r in results if not r["refused"] and not r["failed"]]
    refused = sum(r["refused"] for r in results)
    failed = [r["failed"] for r in results if r["failed"]]

    def col(key: str, q: float | None = None) -> str:
        values = [r[key] for r in served if r[key] is not None]
        if not values:
            return "-"
        value = statistics.median(values) if q is None else percentile(values, q)
        return f"{value:.0f}" if key in ("ttft", "ttfp") else f"{value:.2f}"

    audio = sum(r["audio_s"] for r in served)
    row = (
        f"{order:>8} {clients:>4} {len(served):>6} {refused:>4} {len(failed):>6} "
        f"{col('ttft'):>8} {col('ttfp'):>8} {col('ttfp', 0.9):>8} {col('e2e'):>7} "
        f"{col('rtf'):>6} {audio / wall:>8.2f} {col('underrun', 0.9):>8} {col('underrun', 0.99):>8}"
    )
    return row + (f"\n{'':>8} failed: {failed[0]}" if failed else "")


def traced(server: Server, model: str, workload: dict, args) -> None:
    """A round at each `--trace-concurrency` under the server's profiler (`--trace`), and
    where their first packets waited (`serve.print_profile`)."""

    def send(clients: int):
        return lambda: asyncio.run(level(server.base, model, workload, clients, args.rounds))[0]

    rounds = {f"c={c}": (send(c), c * args.rounds) for c in args.trace_concurrency}
    print_profile(server, model, rounds, args.trace, args.trace_gpu)


def on_models(source: str, scaled: float | None, tiny: bool, devices: str) -> tuple[str, list]:
    """A graph's source and the server flags for its models: the random-weight build of its
    model at `scaled` x its layers (built once into the cache), else its tiny models with
    `tiny`, else as written."""
    if scaled:
        from omniflow.checkpoints.scaled import scaled_checkpoint

        model = re.search(r'model "([^"]+)"', source).group(1)
        path = scaled_checkpoint(model, scaled, "cpu" if devices == "cpu" else "cuda")
        return source.replace(f'model "{model}"', f"model {json.dumps(str(path))}"), []
    return source, ["--tiny"] if tiny else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="one of the peer's workloads")
    parser.add_argument("--graph", help="the chat graph (default: omni_chat, or the preset's)")
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the graph's tiny models")
    parser.add_argument("--scaled", type=float, help="a random-weight build at DEPTH x layers")
    parser.add_argument("--concurrency", type=int, nargs="+")
    parser.add_argument("--rounds", type=int, default=1, help="requests each client sends")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--audio-tokens", type=int)
    parser.add_argument("--server-args", default="", help="more `omniflow run` flags")
    parser.add_argument("--max-batch", nargs="+", default=[], metavar="STAGE=N",
                        help="these stages' max_batch instead of the graph's")  # fmt: skip
    parser.add_argument("--set", nargs="+", default=[], metavar="STAGE.PARAM=VALUE",
                        help="these stages' parameters instead of the graph's, e.g. "
                        "thinker.prefill_tokens=2560")  # fmt: skip
    parser.add_argument(
        "--orders", nargs="+", choices=("slack", "arrival"), help="the vocoder orders to compare"
    )
    parser.add_argument(
        "--trace", type=Path, help="then profile a round at each --trace-concurrency into FILE"
    )
    parser.add_argument("--trace-concurrency", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--trace-gpu", action="store_true", help="the trace has the CUDA kernels")
    parser.add_argument("--server-log", metavar="DIR",
                        help="keep the server's log in DIR (ORDER-server.log), e.g. with "
                        "OMNIFLOW_SYNC_DEBUG=warn, the host syncs its stages' steps make")  # fmt: skip
    args = workload_args(parser.parse_args())
    source = Path(args.graph).read_text()
    settings = [
        f"{stage}.max_batch={batch}"
        for stage, _, batch in (b.partition("=") for b in args.max_batch)
    ] + args.set
    name = re.search(r"pipeline (\w+)", source).group(1)
    flags = ["--devices", args.devices, *args.server_args.split()]
    if settings:  # the server compiles the graph with them (`omniflow run --set`)
        flags += [arg for setting in settings for arg in ("--set", setting)]
    workload = {
        "prompt": None,  # sized by the first server's count
        "max_tokens": args.max_tokens,
        "audio_tokens": args.audio_tokens,
    }
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        source, models = on_models(source, args.scaled, args.tiny, args.devices)
        flags += models
        for order in args.orders or ["default"]:
            graph = Path(folder) / f"{order}-{Path(args.graph).name}"
            ordered = f'= vocoder(order="{order}", '
            graph.write_text(
                source if order == "default" else source.replace("= vocoder(", ordered)
            )
            # (its log: an exit before it is ready raises with its tail)
            log = Path(args.server_log or folder) / f"{order}-server.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            server = Server([str(graph), *flags], log=log)
            try:
                if workload["prompt"] is None:
                    workload["prompt"] = asyncio.run(sized(server.base, name, args.prompt_tokens))
                asyncio.run(level(server.base, name, {**workload, "audio_tokens": 24}, 1, 1))
                for clients in args.concurrency:
                    results, wall = asyncio.run(
                        level(server.base, name, workload, clients, args.rounds)
                    )
                    rows.append(report(order, clients, results, wall))
                    print(rows[-1], flush=True)
                if args.trace and order == (args.orders or ["default"])[0]:
                    traced(server, name, workload, args)
            finally:
                server.stop()
    preset = f"preset {args.preset}: " if args.preset else ""
    print(
        f"\n{preset}{name} on {args.devices}"
        f"{' (scaled ' + str(args.scaled) + ')' if args.scaled else ''}: "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} text tokens, "
        f"{args.audio_tokens} codes; {args.rounds} request(s) per client"
    )
    print(
        f"{'order':>8} {'c':>4} {'served':>6} {'503':>4} {'failed':>6} {'TTFT ms':>8} "
        f"{'TTFP ms':>8} {'p90':>8} {'E2E s':>7} {'RTF':>6} {'audio/s':>8} {'stall90':>8} "
        f"{'stall99':>8}"
    )
    print("\n".join(rows))
    if args.scaled:
        # The random-weight build carries the tiny checkpoint's tokenizer beside the real
        # vocabulary: most sampled ids decode to nothing, so the first text comes late.
        print("(TTFT: the first text that decodes, on the random-weight build's tiny tokenizer)")


if __name__ == "__main__":
    main()
