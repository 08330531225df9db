"""Qwen3-TTS-12Hz served over HTTP, measured the way the peer's speech benchmark client
measures it: `POST /v1/audio/speech` with `stream: true` and `response_format: pcm`, at
concurrency 1, 16 and 64 (CustomVoice), and a voice clone at concurrency 1 (Base, the
reference clip inline as an mp3 data URI, as the peer sends it; and once more naming a
voice uploaded beforehand, which encodes nothing per request).

Metrics, per request, as the peer defines them:

- TTFP: from the POST to the first non-empty audio bytes;
- E2E: from the POST to the body's last byte; audio seconds = bytes / 2 / 24000;
- RTF = E2E / audio seconds;
- audio throughput (per level) = the level's audio seconds / its wall time;
- playback underrun: a listener starts playing at the first packet and plays every packet
  as it comes; the seconds it waits, in all, for packets that come after the audio before
  them has played out (0: a gapless stream). The table gives its p99 over the level.

Goals (issue 37, one H200, real size; TTFP and RTF medians unless said): c=1 TTFP <= 15 ms
and RTF <= 0.05; c=16 TTFP <= 50 ms and RTF <= 0.1; c=64 TTFP p99 <= 300 ms, RTF <= 0.3,
audio throughput >= 200 audio-s/s, p99 underrun <= 100 ms; a voice clone at c=1 TTFP <= 60
ms with the reference inline, <= 30 ms naming an uploaded voice. The script prints each
figure beside its goal.

Open loop (`--open-loop`, or `--rates R ...`): requests arrive as a Poisson process at R
requests/s for `--duration` seconds, whatever the server has yet to finish, each speaking
one of a fixed set of everyday English sentences (arrival times and sentences drawn from
`--seed`), as the independent speech-serving benchmark runs every engine. Per rate: p50,
p95 and p99 TTFP, RTF, and the share of streams with any playback gap: a stream has one
when at some moment the audio it has received is less than the wall time since its first
packet (a playback underrun above zero). Then the highest rate tried at which no stream
had a gap and no request failed, every lower rate too. Goals (issue 37, one H200, real
size): p95 TTFP <= 34 ms at 10 requests/s and <= 77 ms at 20, no stream with a gap.

    # on a GPU: real-size random-weight checkpoints (built once into the cache), then:
    omniflow models build-scaled Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice
    omniflow models build-scaled Qwen/Qwen3-TTS-12Hz-1.7B-Base
    python benchmarks/tts_serve.py --devices 1xH200
    python benchmarks/tts_serve.py --devices 1xH200 --rates 1 5 10 20 --duration 60
    # anywhere (slowly on a CPU): the tiny checkpoints, to check the script works
    python benchmarks/tts_serve.py --tiny --levels 1,4 --requests 4
    python benchmarks/tts_serve.py --tiny --rates 0.5 2 --duration 10

With `--trace FILE` it then profiles one more round at c = 1 (`--trace-requests`, one at a
time) and one at each other of `--trace-levels` (default 16: 16 at once) with the server's
own profiler (`POST /start_profile`; `--trace-gpu` adds the CUDA kernels) into FILE, and
prints where each level's first packet waited (the mean of each component of the requests'
TTFP critical paths, omniflow.profiler.analysis) and each stage's steps (count, mean batch,
median / p90 / max ms, and the median of the steps in which a request started: the talker's
prefill and first frame). Unless `--no-clone`, the voice clone pipeline too, into FILE's
`-clone` sibling: `--trace-requests` clones at c = 1 with the reference inline, then as many
naming an uploaded voice.

The timed requests go out through aiohttp, as the peer's speech benchmark client sends them:
httpx's client adds ~1 ms to each request's first bytes at c=1 and several at c=16, on
the client's side of the wire (`python benchmarks/http_clients.py` shows both side by
side against a server that answers at once).

The server is `omniflow run` on graphs/qwen3_tts.omni and graphs/qwen3_tts_clone.omni
(their copies for the scaled folders, the CustomVoice one with `max_batch` raised to the
largest level so that no request is refused, the clone one as written; `--as-shipped`
keeps the graph's own, and the requests it cannot take at once wait in its admission
queue, four per request it serves), in executor processes; `--url` measures a running one
instead (its pipelines named by `--model` and `--clone-model`). The scaled checkpoints never
end speech (their end-of-speech row is zero), so every request speaks `--frames` frames; the
tiny ones end where their random weights do.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.serve import Server, percentile, print_profile, session  # noqa: E402
from omniflow.server.playback import Playback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "graphs" / "qwen3_tts.omni"
CLONE_GRAPH = ROOT / "graphs" / "qwen3_tts_clone.omni"
RATE = 24000
CUSTOM = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
BASE = "Qwen/Qwen3-TTS-12Hz-1.7B-Base"
TEXT = (
    "Good morning, and welcome to the show. Today we talk about the sea, the ships "
    "that cross it, and the people who keep its lighthouses burning through the night."
)
REF_TEXT = "The quick brown fox jumps over the lazy dog."
# The open loop's sentences: everyday English, a few words to two short clauses.
SENTENCES = (
    "Good morning! Did you sleep well?",
    "Could you pass me the salt, please?",
    "The train to the city leaves at half past eight.",
    "I'll call you back in five minutes.",
    "Don't forget to buy milk on your way home.",
    "It looks like it's going to rain this afternoon.",
    "Thank you so much for your help yesterday.",
    "Where did you park the car?",
    "Let's meet for coffee on Friday.",
    "The meeting has been moved to Thursday at ten.",
    "Please turn the music down a little.",
    "My phone battery is almost empty.",
    "We need to leave in ten minutes if we want to catch the bus.",
    "Have you seen my keys anywhere?",
    "The restaurant on the corner makes the best pizza in town.",
    "Happy birthday! I hope you have a wonderful day.",
)
# Open loop (issue 37): rate -> p95 TTFP bound (ms); no stream may have a gap.
OPEN_LOOP_GOALS = {10.0: 34.0, 20.0: 77.0}
GOALS = {  # (level, metric) -> (bound, "<=" or ">="): issue 37's
    ("CustomVoice c=1", "ttfp"): (15.0, "<="),
    ("CustomVoice c=1", "rtf"): (0.05, "<="),
    ("CustomVoice c=16", "ttfp"): (50.0, "<="),
    ("CustomVoice c=16", "rtf"): (0.1, "<="),
    ("CustomVoice c=64", "ttfp_p99"): (300.0, "<="),
    ("CustomVoice c=64", "rtf"): (0.3, "<="),
    ("CustomVoice c=64", "throughput"): (200.0, ">="),
    ("CustomVoice c=64", "underrun"): (0.1, "<="),
    ("clone c=1", "ttfp"): (60.0, "<="),
    ("clone (uploaded voice) c=1", "ttfp"): (30.0, "<="),
}


# --- requests -------------------------------------------------------------------------------
async def speak(client: aiohttp.ClientSession, body: dict) -> dict:
    """One streamed PCM request, timed as the peer times it."""
    began, sent = time.perf_counter(), time.monotonic()  # (monotonic: the server's trace clock)
    first, audio_s, playback = None, 0.0, Playback()
    async with client.post("/v1/audio/speech", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{reply.status}: {(await reply.read())[:300]!r}")
        async for data in reply.content.iter_any():
            if data:
                now, seconds = time.perf_counter(), len(data) / 2 / RATE
                first = first or now
                playback.arrived(now, seconds)
                audio_s += seconds
    ended = time.perf_counter()
    return {
        "id": reply.headers.get("x-request-id"),
        "sent": sent,
        "ttfp": (first - began) * 1e3 if first else None,
        "e2e": (ended - began) * 1e3,
        "audio_s": audio_s,
        "rtf": (ended - began) / audio_s if audio_s else None,
        "underrun": playback.underrun,
    }


async def level(base: str, body: dict, concurrency: int, total: int) -> tuple[list, float]:
    """`total` requests from `concurrency` clients at once; (results, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    results: list[dict] = []
    async with session(base, concurrency) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await speak(client, {**body, "seed": 1000 + i}))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - began


def arrivals(rate: float, duration: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process at `rate` per second
    within `duration`."""
    times, t = [], rng.exponential(1 / rate)
    while t < duration:
        times.append(t)
        t += rng.exponential(1 / rate)
    return times


async def open_loop(base: str, body: dict, rate: float, duration: float, seed: int) -> dict:
    """Requests arriving at `rate` per second for `duration` seconds, each sent when it
    arrives whatever is still running, each one of SENTENCES (arrivals and sentences drawn
    from `seed` and the rate); their results (a failed one: its error), the wall seconds
    until the last ended, and how late the latest was sent after its arrival."""
    rng = np.random.default_rng([seed, round(rate * 1000)])
    times = arrivals(rate, duration, rng)
    sentences = rng.integers(len(SENTENCES), size=len(times))
    late: list[float] = []
    async with session(base, None) as client:
        began = time.perf_counter()

        async def arrive(i: int, at: float) -> dict:
            await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
            late.append(time.perf_counter() - began - at)
            request = {**body, "input": SENTENCES[sentences[i]], "seed": seed * 100_000 + i}
            try:
                return await speak(client, request)
            except (RuntimeError, aiohttp.ClientError) as err:
                return {"error": f"{type(err).__name__}: {err}"}

        results = await asyncio.gather(*(arrive(i, at) for i, at in enumerate(times)))
        wall = time.perf_counter() - began
    return {"rate": rate, "results": results, "wall": wall, "late": max(late, default=0.0)}


def reference_clip(seconds: float = 5.0) -> bytes:
    """A 5 s reference as the peer sends one: an mp3 (a chirp with noise; random weights
    make no use of real speech)."""
    import torch

    from omniflow.media import audio_bytes

    t = np.arange(int(RATE * seconds)) / RATE
    noise = np.random.default_rng(0).standard_normal(len(t))
    samples = (0.3 * np.sin(2 * np.pi * (180 + 120 * t) * t) + 0.05 * noise).astype(np.float32)
    return audio_bytes(torch.from_numpy(samples), RATE, "mp3")


def graph_variant(folder: Path, graph: Path, model: str | None, batch: int) -> Path:
    """`graph` (its pipeline named as its file) on `model` (a checkpoint folder or hub id;
    None: as written), every stage's max_batch at least `batch`."""
    text = graph.read_text()
    if model is not None:
        text = re.sub(r'model "[^"]+"', f"model {json.dumps(model)}", text, count=1)
    text = re.sub(r"max_batch=(\d+)", lambda m: f"max_batch={max(int(m.group(1)), batch)}", text)
    path = folder / graph.name
    path.write_text(text)
    return path


# --- the run --------------------------------------------------------------------------------
def custom_voice(model: str, frames: int) -> dict:
    """The CustomVoice request body, as the peer's client sends it."""
    return {"model": model, "input": TEXT, "voice": "Vivian", "language": "English",
            "stream": True, "response_format": "pcm", "max_new_tokens": frames}  # fmt: skip


def measure(args, base: str, model: str, clone_model: str | None) -> None:
    """The chosen mode's runs against the server at `base`, and their report."""
    body = custom_voice(model, args.frames)
    asyncio.run(level(base, body, 1, 2))  # warm-up: first requests compile and allocate
    if args.rates:
        runs = []
        for rate in args.rates:
            runs.append(asyncio.run(open_loop(base, body, rate, args.duration, args.seed)))
            print(f"  done: {rate:g} requests/s ({len(runs[-1]['results'])} requests, "
                  f"{runs[-1]['wall']:.1f} s)", flush=True)  # fmt: skip
        report_open_loop(runs)
    else:
        report(run_levels(args, base, body, clone_model))


def run_levels(args, base: str, body: dict, clone_model: str | None) -> list[tuple]:
    rows = []
    for concurrency in args.levels:
        total = args.requests or max(8, 2 * concurrency)
        results, wall = asyncio.run(level(base, body, concurrency, total))
        rows.append((f"CustomVoice c={concurrency}", results, wall))
        print(f"  done: CustomVoice c={concurrency} ({total} requests, {wall:.1f} s)", flush=True)
    if clone_model is None:
        return rows
    inline, uploaded, name = clone_bodies(base, clone_model, args.frames)
    total = args.requests or 8
    asyncio.run(level(base, inline, 1, 2))
    results, wall = asyncio.run(level(base, inline, 1, total))
    rows.append(("clone c=1", results, wall))
    results, wall = asyncio.run(level(base, uploaded, 1, total))
    rows.append(("clone (uploaded voice) c=1", results, wall))
    httpx.delete(f"{base}/v1/audio/voices/{name}", params={"model": clone_model})
    print("  done: voice clone c=1", flush=True)
    return rows


def clone_bodies(base: str, clone_model: str, frames: int) -> tuple[dict, dict, str]:
    """A voice clone's request bodies: with the reference inline (an mp3 data URI, as the
    peer sends it), and naming a voice uploaded now; and that voice's name."""
    clip = reference_clip()
    uri = "data:audio/mpeg;base64," + base64.b64encode(clip).decode()
    inline = {"model": clone_model, "input": TEXT, "task_type": "Base", "language": "English",
              "ref_audio": uri, "ref_text": REF_TEXT, "stream": True, "response_format": "pcm",
              "max_new_tokens": frames}  # fmt: skip
    name = f"bench-{os.getpid()}"
    upload = httpx.post(
        f"{base}/v1/audio/voices",
        data={"model": clone_model, "name": name, "ref_text": REF_TEXT},
        files={"audio": ("ref.mp3", clip, "audio/mpeg")},
        timeout=600,
    )
    upload.raise_for_status()
    named = {k: v for k, v in inline.items() if k not in ("ref_audio", "ref_text")}
    return inline, {**named, "voice": name}, name


def played(server: Server, rounds: dict) -> dict:
    """`rounds` (name -> (body, concurrency, requests)) as `print_profile` takes them: name
    -> (a call that runs the round and returns its results, its requests)."""
    return {
        name: (lambda r=(body, c, n): asyncio.run(level(server.base, *r))[0], n)
        for name, (body, c, n) in rounds.items()
    }


def traced(args, server: Server, model: str, clone_model: str | None) -> None:
    """Profiled rounds (see the module docstring): CustomVoice at c = 1 and at each of
    `--trace-levels`, and with a clone pipeline, a voice clone at c = 1 with its reference
    inline and named."""
    body = custom_voice(model, args.frames)
    rounds = {"c=1": (body, 1, args.trace_requests)}
    rounds |= {f"c={c}": (body, c, c) for c in args.trace_levels if c > 1}
    print_profile(server, model, played(server, rounds), args.trace, args.trace_gpu)
    if clone_model is None:
        return
    inline, uploaded, name = clone_bodies(server.base, clone_model, args.frames)
    clones = {
        "inline": (inline, 1, args.trace_requests),
        "named": (uploaded, 1, args.trace_requests),
    }
    trace = args.trace.with_name(f"{args.trace.stem}-clone{args.trace.suffix}")
    print_profile(server, clone_model, played(server, clones), trace, args.trace_gpu)
    httpx.delete(f"{server.base}/v1/audio/voices/{name}", params={"model": clone_model})


def report(rows: list[tuple]) -> None:
    head = (
        f"{'level':28} {'n':>4} {'TTFP ms med':>11} {'p99':>8} {'RTF med':>8} {'p99':>7} "
        f"{'E2E s med':>9} {'audio-s/s':>9} {'underrun p99 s':>14}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name, results, wall in rows:
        ttfp = [r["ttfp"] for r in results if r["ttfp"] is not None]
        rtf = [r["rtf"] for r in results if r["rtf"] is not None]
        e2e = [r["e2e"] / 1e3 for r in results]
        audio = sum(r["audio_s"] for r in results)
        under = [r["underrun"] for r in results]
        print(
            f"{name:28} {len(results):4d} {statistics.median(ttfp):11.1f} "
            f"{percentile(ttfp, 0.99):8.1f} {statistics.median(rtf):8.3f} "
            f"{percentile(rtf, 0.99):7.3f} {statistics.median(e2e):9.2f} "
            f"{audio / wall:9.2f} {percentile(under, 0.99):14.3f}"
        )
    found = {name: summarise(results, wall) for name, results, wall in rows}
    print("\ngoals (issue 37, one H200, real size):")
    for (name, metric), (bound, sense) in GOALS.items():
        if name not in found:
            continue
        value = found[name][metric]
        met = value <= bound if sense == "<=" else value >= bound
        print(
            f"  {name:18} {metric:10} {value:10.3f} {sense} {bound:<8g} {'met' if met else 'MISSED'}"
        )


def open_loop_summary(run: dict) -> dict:
    """A rate's figures: TTFP and RTF percentiles over the requests that succeeded, the
    share of streams with a playback gap, failures, audio throughput."""
    done = [r for r in run["results"] if "error" not in r]
    ttfp = [r["ttfp"] for r in done if r["ttfp"] is not None]
    rtf = [r["rtf"] for r in done if r["rtf"] is not None]
    return {
        "n": len(run["results"]),
        "failed": len(run["results"]) - len(done),
        "ttfp": [percentile(ttfp, q) for q in (0.5, 0.95, 0.99)],
        "rtf": [percentile(rtf, q) for q in (0.5, 0.95)],
        "gaps": sum(r["underrun"] > 0 for r in done) / len(done) if done else float("nan"),
        "underrun": percentile([r["underrun"] for r in done], 0.99),
        "throughput": sum(r["audio_s"] for r in done) / run["wall"],
        "late": run["late"],
    }


def highest_gap_free(summaries: dict[float, dict]) -> float | None:
    """The highest rate at which, as at every lower rate tried, no stream had a gap and no
    request failed."""
    best = None
    for rate in sorted(summaries):
        figures = summaries[rate]
        if figures["failed"] or figures["gaps"] != 0:
            break
        best = rate
    return best


def report_open_loop(runs: list[dict]) -> None:
    head = (
        f"{'req/s':>6} {'n':>4} {'failed':>6} {'TTFP ms p50':>11} {'p95':>8} {'p99':>8} "
        f"{'RTF p50':>7} {'p95':>6} {'gaps %':>6} {'underrun p99 s':>14} {'audio-s/s':>9} "
        f"{'late ms':>7}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    summaries = {run["rate"]: open_loop_summary(run) for run in runs}
    for rate, f in summaries.items():
        print(
            f"{rate:6g} {f['n']:4d} {f['failed']:6d} {f['ttfp'][0]:11.1f} {f['ttfp'][1]:8.1f} "
            f"{f['ttfp'][2]:8.1f} {f['rtf'][0]:7.3f} {f['rtf'][1]:6.3f} {100 * f['gaps']:6.1f} "
            f"{f['underrun']:14.3f} {f['throughput']:9.2f} {1e3 * f['late']:7.1f}"
        )
    best = highest_gap_free(summaries)
    print(
        "\nhighest gap-free rate: "
        + (f"{best:g} requests/s" if best is not None else f"none (gaps at {min(summaries):g})")
    )
    print("goals (issue 37, one H200, real size):")
    for rate, bound in OPEN_LOOP_GOALS.items():
        if rate not in summaries:
            continue
        f = summaries[rate]
        met = f["ttfp"][1] <= bound and f["gaps"] == 0 and not f["failed"]
        print(
            f"  {rate:g} requests/s: p95 TTFP {f['ttfp'][1]:.1f} ms <= {bound:g}, streams with "
            f"a gap {100 * f['gaps']:.1f} % = 0: {'met' if met else 'MISSED'}"
        )


def summarise(results: list[dict], wall: float) -> dict:
    """A level's figures the goals name: median and p99 TTFP, median RTF, audio
    throughput, p99 underrun."""
    ttfp = [r["ttfp"] for r in results if r["ttfp"] is not None]
    return {
        "ttfp": statistics.median(ttfp),
        "ttfp_p99": percentile(ttfp, 0.99),
        "rtf": statistics.median([r["rtf"] for r in results if r["rtf"] is not None]),
        "throughput": sum(r["audio_s"] for r in results) / wall,
        "underrun": percentile([r["underrun"] for r in results], 0.99),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1xH200", help="what to compile for (default 1xH200)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoints (any machine)")
    parser.add_argument("--scaled", type=float, default=1.0, metavar="DEPTH",
                        help="the real-size builds' depth (default 1: the real layer counts)")  # fmt: skip
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels (CustomVoice)")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: max(8, 2 x concurrency))")  # fmt: skip
    parser.add_argument("--frames", type=int, default=128,
                        help="max_new_tokens: frames of 80 ms each request speaks (default 128)")  # fmt: skip
    parser.add_argument("--no-clone", action="store_true", help="skip the voice clone level")
    parser.add_argument("--as-shipped", action="store_true",
                        help="the graph's max_batch as written (requests past what it serves "
                             "at once wait in its admission queue)")  # fmt: skip
    parser.add_argument("--open-loop", action="store_true",
                        help="Poisson arrivals at each of --rates instead of the levels")  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="+", metavar="R",
                        help="open loop at these requests/s (default 1 5 10 20)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=60.0, metavar="T",
                        help="open loop: seconds of arrivals at each rate (default 60)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0,
                        help="open loop: draws the arrivals, the sentences and the requests' seeds")  # fmt: skip
    parser.add_argument("--url", help="a running server instead of starting one")
    parser.add_argument("--model", default="qwen3_tts", help="with --url: the CustomVoice pipeline")
    parser.add_argument("--clone-model", default="qwen3_tts_clone", help="with --url: the Base one")
    parser.add_argument(
        "--trace",
        type=Path,
        help="profile a c=1 round and --trace-levels' into this file (and clones)",
    )
    parser.add_argument(
        "--trace-levels", default="16", help="--trace's rounds past c=1 (default 16)"
    )
    parser.add_argument("--trace-requests", type=int, default=4, help="the c=1 round's requests")
    parser.add_argument("--trace-gpu", action="store_true", help="the trace has the CUDA kernels")
    args = parser.parse_args()
    if args.trace and args.url:
        parser.error("--trace profiles the server this script starts (not with --url)")
    args.levels, args.trace_levels = (
        [int(c) for c in re.split(r"[, ]+", levels) if c]
        for levels in (args.levels, args.trace_levels)
    )
    if args.open_loop and not args.rates:
        args.rates = [1.0, 5.0, 10.0, 20.0]
    if args.rates and (min(args.rates) <= 0 or args.duration <= 0):
        parser.error("--rates and --duration must be positive")
    if args.tiny and args.devices == "1xH200":
        args.devices = "cpu"
    if not args.tiny and args.url is None:
        import torch

        if not torch.cuda.is_available():
            print(
                "tts_serve: no CUDA device here. The real-size run needs a GPU "
                "(python benchmarks/tts_serve.py --devices 1xH200); on a CPU run the tiny "
                "checkpoints: python benchmarks/tts_serve.py --tiny --levels 1,4 --requests 4",
                file=sys.stderr,
            )
            return 2
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"omniflow Qwen3-TTS serving benchmark, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{platform.node()}, {os.cpu_count()} CPUs, {gpu}")  # fmt: skip
    print(f"command: {' '.join(sys.argv)}")
    clone_model = None if args.no_clone or args.rates else args.clone_model
    if args.url is not None:
        measure(args, args.url, args.model, clone_model)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        custom = base = None
        if not args.tiny:
            from omniflow.checkpoints.scaled import scaled_checkpoint

            custom = str(scaled_checkpoint(CUSTOM, args.scaled, "cuda"))
            if clone_model is not None:
                base = str(scaled_checkpoint(BASE, args.scaled, "cuda"))
        batch = 1 if args.as_shipped else max(args.levels)
        graphs = [graph_variant(Path(folder), GRAPH, custom, batch)]
        if clone_model is not None:  # its rounds are one request at a time: as written
            graphs.append(graph_variant(Path(folder), CLONE_GRAPH, base or BASE, 1))
        flags = ["--tiny"] if args.tiny else []
        print(f"serving {', '.join(g.stem for g in graphs)} on {args.devices} ...", flush=True)
        log = Path(folder) / "server.log"
        server = Server([*map(str, graphs), *flags, "--devices", args.devices], log)
        try:
            measure(args, server.base, "qwen3_tts", clone_model)
            if args.trace:
                traced(args, server, "qwen3_tts", clone_model)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
