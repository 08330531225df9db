"""Claims: the HTTP server adds little to a request (goals: <= 2 ms to its time to first
packet at concurrency 1 and <= 5 % at concurrency 10, issue 29), and streamed edges bring the first audio packet
forward; plus the serving figures vLLM-Omni's benchmarks print (TTFP, E2E, real-time
factor, audio and request throughput: mean, median, p90, p99) at concurrency 1, 4 and 10.

Three parts, in one run (from the repository root: the overhead part serves the test
suite's python-stage pipeline, tests/server/probe.omni):

- overhead: the same streamed requests (100 words, one every 5 ms), c at a time
  (`--overhead-levels`, default 1 and 10), through `engine.stream` in this process and
  over HTTP (SSE) to `omniflow run` serving the same pipeline, each with its own executor
  process; a python stage, so the pipeline itself costs almost nothing;
- load: omni chat (streamed SSE, text and audio) and TTS (Qwen3-TTS, graphs/qwen3_tts.omni,
  streamed speech) over HTTP at concurrency 1, 4 and 10 (benchmarks/tts_serve.py measures
  Qwen3-TTS at real size);
- streaming: omni chat as written against the same pipeline with its audio path's edges
  whole (`omni_chat_whole`: the vocoder decodes once the talker has finished), at
  concurrency 1 and 4.

    python benchmarks/serve.py [--tiny] [--devices cpu] [--requests 200] [--parts overhead,load,streaming]
    python benchmarks/serve.py --url http://127.0.0.1:8091 --parts load   # a running server
    python benchmarks/serve.py --devices 1xH200 --scaled 1 --parts overhead,load,streaming

`--scaled DEPTH` serves omni chat on a random-weight Qwen2.5-Omni at the real model's widths
and DEPTH x its layers (`omniflow.checkpoints.scaled`, built once into the cache) instead of
the tiny models; the TTS pipeline is left out then (benchmarks/tts_serve.py has it). The talker
is bounded to `CHAT["max_audio_tokens"]` codes, since random weights rarely end speech.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
# The probe pipeline's python stages live in tests.server.stages: its executors import them
# from the engine's sys.path (after installed packages: the root's kernels/ would shadow).
sys.path.append(str(ROOT))
GRAPHS = ROOT / "graphs"
PROBE = ROOT / "tests" / "server" / "probe.omni"
RATE = 24000
CHAT = {"max_tokens": 24, "max_audio_tokens": 240}
TTS = {"max_tokens": 96}


# --- statistics ------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def print_paths(title: str, paths: dict[str, list[dict[str, float]]]) -> None:
    """The mean ms of each component of each group's critical paths (component -> µs, as
    `omniflow.profiler.analysis.RequestTimeline.path_ttfp` gives them)."""
    print(title)
    parts = sorted({part for group in paths.values() for path in group for part in path})
    print(f"{'component':>40} " + " ".join(f"{group:>11}" for group in paths))
    for part in parts:
        means = [sum(p.get(part, 0) for p in g) / max(len(g), 1) / 1e3 for g in paths.values()]
        print(f"{part:>40} " + " ".join(f"{m:11.1f}" for m in means))


def print_profile(server: Server, model: str, rounds: dict, trace: Path, gpu: bool) -> None:
    """`rounds` (name -> (run, requests): `run()` sends the round's requests and returns the
    client's results, dicts with "ttfp" in ms) one after another under the server's profiler
    for pipeline `model`, the trace in `trace`; prints the mean TTFP critical path of each
    round's requests, the client's TTFP beside it, and each stage's steps (count, mean batch,
    median / p90 / max ms, and the median of the steps in which a request started: a prefill
    and first output); with `gpu`, where the kernels' time went (the GPU's busy share of the
    rounds, each stage's stream's, their costliest kernels)."""
    from omniflow.profiler.analysis import timelines
    from omniflow.profiler.gpu_time import format_gpu_time, gpu_time

    measured = {}  # round -> the client's results

    def run() -> None:
        for name, (send, _) in rounds.items():
            measured[name] = send()

    profile, written = server.profiled(run, trace, gpu, model)
    spoken = [r for r in timelines(profile) if "audio" in r.path_ttfp]  # by start
    paths, start = {}, 0
    for name, (_, total) in rounds.items():
        paths[name] = [r.path_ttfp["audio"] for r in spoken[start : start + total]]
        start += total
    print_paths(f"\n{model}: TTFP critical path, mean ms (trace: {trace})", paths)
    # The path runs from the request's inputs going out of the frontend to its first audio
    # taken there: the rest of what the client saw is the HTTP server's (parsing, admission,
    # streaming the bytes out) and the client's own.
    client = [statistics.fmean(r["ttfp"] for r in measured[name] if r.get("ttfp") is not None)
              for name in rounds]  # fmt: skip
    engine = [statistics.fmean(sum(p.values()) for p in paths[name]) / 1e3 for name in rounds]
    print(f"{'TTFP at the client':>40} " + " ".join(f"{c:11.1f}" for c in client))
    print(f"{'outside the path (HTTP and client)':>40} "
          + " ".join(f"{c - e:11.1f}" for c, e in zip(client, engine, strict=True)))  # fmt: skip
    by_id = {r.id: r for r in spoken}
    sides = [outside_sides(measured[name], by_id) for name in rounds]
    if all(sides):  # results that carry their request ids and send times
        for row, side in (("before it: sent -> inputs out", 0), ("after it: audio -> client", 1)):
            print(f"{row:>40} " + " ".join(f"{s[side]:11.1f}" for s in sides))
    print(f"\n{'stage':>13} {'steps':>6} {'batch':>6} {'med ms':>7} {'p90':>7} {'max':>7} "
          f"{'start med':>9}")  # fmt: skip
    for stage, steps in profile.steps.items():
        seen: set[str] = set()
        starts = []  # the steps in which a request stepped first (a prefill, its first output)
        for step in steps:
            new = {rid for rid, _, _ in step.calls} - seen
            seen |= new
            if new:
                starts.append(step.dur / 1e3)
        ms = [step.dur / 1e3 for step in steps]
        batch = statistics.fmean(step.batch for step in steps)
        first = statistics.median(starts) if starts else float("nan")
        print(f"{stage:>13} {len(steps):6d} {batch:6.1f} {statistics.median(ms):7.2f} "
              f"{percentile(ms, 0.9):7.2f} {max(ms):7.2f} {first:9.2f}")  # fmt: skip
    if gpu:
        print("\nwhere the GPU's time went (kernels of the rounds above):")
        print(format_gpu_time(gpu_time(written)))


def outside_sides(results: list[dict], timelines: dict) -> tuple[float, float] | None:
    """The mean ms outside a round's critical paths split in two, for client results with
    "id" (the request's x-request-id), "sent" (`time.monotonic()` as it was sent: the trace's
    clock, one for every process of the host) and "ttfp" (ms): from sending to the request's
    inputs leaving the frontend (the client's connection and send, the HTTP server, the
    admission), and from its first audio taken at the frontend to the client holding it."""
    before, after = [], []
    for result in results:
        timeline = timelines.get(result.get("id"))
        if timeline is None or result.get("sent") is None or result.get("ttfp") is None:
            continue
        if "audio" not in timeline.first_out:
            continue
        sent_us = result["sent"] * 1e6
        before.append((timeline.t0 - sent_us) / 1e3)
        after.append((sent_us + result["ttfp"] * 1e3 - timeline.first_out["audio"]) / 1e3)
    return (statistics.fmean(before), statistics.fmean(after)) if before else None


def summary(values: list[float]) -> str:
    if not values:
        return "       -        -        -        -"
    return (
        f"{statistics.fmean(values):8.1f} {statistics.median(values):8.1f} "
        f"{percentile(values, 0.9):8.1f} {percentile(values, 0.99):8.1f}"
    )


# --- servers ---------------------------------------------------------------------------------
class Server:
    """`omniflow run ARGS` on a free port, once it says it is ready; its stderr goes to `log`
    (a file, whose end an early exit shows) or nowhere."""

    def __init__(self, args: list[str], log: Path | None = None):
        self.log = log.open("w+") if log is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "omniflow.cli", "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log or subprocess.DEVNULL,
            cwd=ROOT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for line in self.proc.stdout:
            if line.startswith("omniflow: ready at "):
                self.base = line.split(" at ", 1)[1].strip()
                return
        code = self.proc.wait()
        if self.log is not None:
            self.log.seek(0)
        said = f":\n{self.log.read()[-3000:]}" if self.log is not None else ""
        raise RuntimeError(f"the server exited {code}{said}")

    def profiled(self, run, file: Path, gpu: bool = False, model: str | None = None):
        """`run()` (requests to this server) under the server's own profiler (`POST
        /start_profile`, with the CUDA kernels if `gpu`; of pipeline `model`, which a server
        of several must be told), its trace written to `file`: the trace parsed
        (`omniflow.profiler.analysis.Profile`) and the trace itself."""
        from omniflow.profiler.analysis import parse_trace

        query = {"model": model} if model else {}
        post = partial(httpx.post, params=query, timeout=300)
        post(f"{self.base}/start_profile", json={"gpu": gpu}).raise_for_status()
        run()
        post(f"{self.base}/stop_profile").raise_for_status()
        trace = httpx.get(f"{self.base}/profile/trace.json", params=query, timeout=300).json()
        file.write_text(json.dumps(trace))
        return parse_trace(trace), trace

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        if self.log is not None:
            self.log.close()


def omni_chat_variants(folder: Path, whole: bool, model: str | None) -> list[Path]:
    """graphs/omni_chat.omni, on `model` (a checkpoint folder) when given, and with `whole`
    also `omni_chat_whole`: the same with its talker -> vocoder -> audio edges whole."""
    text = (GRAPHS / "omni_chat.omni").read_text()
    if model is not None:
        text = re.sub(r'model "[^"]+"', f"model {json.dumps(model)}", text, count=1)
    variants = {"omni_chat": text}
    if whole:
        text = text.replace("pipeline omni_chat", "pipeline omni_chat_whole")
        text = text.replace("[stream, chunk=auto, context=25, ", "[")
        variants["omni_chat_whole"] = text.replace("-> output audio [stream]", "-> output audio")
    paths = []
    for name, source in variants.items():
        paths.append(folder / f"{name}.omni")
        paths[-1].write_text(source)
    return paths


# --- one request over HTTP -------------------------------------------------------------------
def session(base: str, connections: int | None, timeout: float = 1800) -> aiohttp.ClientSession:
    """The timed requests' client: aiohttp, as the peer's benchmark clients send (httpx's
    client adds ~0.5 ms to a first packet at c=1 and ~9 at c=16 on a 2-core machine:
    benchmarks/http_clients.py); `connections` at most (None: any number)."""
    return aiohttp.ClientSession(
        base_url=base,
        connector=aiohttp.TCPConnector(limit=connections or 0),
        timeout=aiohttp.ClientTimeout(total=timeout),
    )


async def chat_request(client: aiohttp.ClientSession, model: str, seed: int, extra: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "stream": True,
            "seed": seed, **extra}  # fmt: skip
    began = time.perf_counter()
    first_text = first_audio = None
    audio_bytes = 0
    async with client.post("/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for now, text, audio in chat_deltas(reply):
            if text and first_text is None:
                first_text = now
            if audio:
                first_audio = first_audio or now
                audio_bytes += len(audio)
    return _timings(began, first_text, first_audio, audio_bytes / 2 / RATE)


class StreamFailed(RuntimeError):
    """A streamed reply ended with the server's error event (its message)."""


async def chat_deltas(reply: aiohttp.ClientResponse):
    """A streamed chat reply's deltas as they arrive: (time, text, audio bytes) each; an
    error event raises `StreamFailed`."""
    async for raw in reply.content:  # (line by line)
        line = raw.decode()
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise StreamFailed(event["error"]["message"])
        if not event["choices"]:
            continue
        delta, now = event["choices"][0]["delta"], time.perf_counter()
        audio = (delta.get("audio") or {}).get("data")
        yield now, delta.get("content"), base64.b64decode(audio) if audio else b""


async def speech_request(client: aiohttp.ClientSession, model: str, seed: int, extra: dict) -> dict:
    body = {"model": model, "input": "Good morning, and welcome to the show.",
            "response_format": "pcm", "stream": True, "seed": seed, **extra}  # fmt: skip
    began = time.perf_counter()
    first_audio = None
    audio_bytes = 0
    async with client.post("/v1/audio/speech", json=body) as reply:
        reply.raise_for_status()
        async for data in reply.content.iter_any():
            if data:
                first_audio = first_audio or time.perf_counter()
                audio_bytes += len(data)
    return _timings(began, None, first_audio, audio_bytes / 2 / RATE)


def _timings(began, first_text, first_audio, audio_s) -> dict:
    ended = time.perf_counter()
    return {
        "e2e": (ended - began) * 1e3,
        "ttft": None if first_text is None else (first_text - began) * 1e3,
        "ttfp": None if first_audio is None else (first_audio - began) * 1e3,
        "audio_s": audio_s,
        "rtf": (ended - began) / audio_s if audio_s else None,
    }


async def load(base: str, request, model: str, extra: dict, concurrency: int, total: int):
    """`total` requests from `concurrency` clients; (results, wall seconds)."""
    results = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    async with session(base, concurrency, timeout=600) as client:

        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await request(client, model, 1000 + i, extra))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - began


def report_load(title: str, results: list[dict], wall: float) -> None:
    audio = sum(r["audio_s"] for r in results)
    print(f"\n{title}: {len(results)} requests in {wall:.1f} s; "
          f"request throughput {len(results) / wall:.2f} req/s, "
          f"audio throughput {audio / wall:.2f} s of audio per s")  # fmt: skip
    print(f"{'metric':18} {'mean':>8} {'median':>8} {'p90':>8} {'p99':>8}")
    for key, label in (("ttfp", "TTFP ms"), ("ttft", "TTFT ms"), ("e2e", "E2E ms")):
        values = [r[key] for r in results if r[key] is not None]
        if values:
            print(f"{label:18} {summary(values)}")
    rtf = [r["rtf"] for r in results if r["rtf"] is not None]
    if rtf:
        print(f"{'RTF':18} " + " ".join(f"{v:8.3f}" for v in (
            statistics.fmean(rtf), statistics.median(rtf), percentile(rtf, 0.9),
            percentile(rtf, 0.99))))  # fmt: skip


# --- parts -----------------------------------------------------------------------------------
def overhead(requests: int, levels: tuple[int, ...]) -> None:
    """The same streamed requests through engine.stream here and over HTTP (SSE), at each
    concurrency in `levels`: rounds of that many requests at once, alternating one path and
    the other so that both see the same machine. Each request streams 100 words, one every
    5 ms (tests/server/stages.py's `many`), as a decode would."""
    from omniflow.compiler import compile_file
    from omniflow.runtime.engine import Engine

    text = "many 100"
    body = {"model": "probe", "messages": [{"role": "user", "content": text}], "stream": True}

    async def in_process(engine) -> tuple[float, float]:
        began = time.perf_counter()
        first = None
        async for chunk in engine.stream({"prompt": text}):
            if chunk.value is not None and first is None:
                first = time.perf_counter()
        return (first - began) * 1e3, (time.perf_counter() - began) * 1e3

    async def over_http(client: aiohttp.ClientSession) -> tuple[float, float]:
        began = time.perf_counter()
        first = None
        async with client.post("/v1/chat/completions", json=body) as reply:
            async for line in reply.content:
                if first is None and b'"content": "w' in line:
                    first = time.perf_counter()
        return (first - began) * 1e3, (time.perf_counter() - began) * 1e3

    async def alternate(engine, base: str, concurrency: int) -> tuple[list, list]:
        here, http = [], []
        rounds = max(4, requests // concurrency)
        async with session(base, concurrency, timeout=60) as client:
            for i in range(rounds + 4):  # the first 4 rounds of each warm up
                a = await asyncio.gather(*(in_process(engine) for _ in range(concurrency)))
                b = await asyncio.gather(*(over_http(client) for _ in range(concurrency)))
                if i >= 4:
                    here.append(a)
                    http.append(b)
        return here, http

    server = Server([str(PROBE)])
    try:
        with Engine(compile_file(PROBE), "process") as engine:
            runs = {c: asyncio.run(alternate(engine, server.base, c)) for c in levels}
    finally:
        server.stop()
    print("\noverhead: streamed 100-word requests (5 ms a word), python-stage pipeline; "
          "rounds of c requests at once, the two paths alternating")  # fmt: skip
    print(f"{'c':>3} {'path':14} {'first chunk ms: median':>23} {'p90':>7} {'end ms: median':>15}"
          f" {'p90':>7}")  # fmt: skip
    for concurrency, (here, http) in runs.items():
        for name, rounds in (("engine.stream", here), ("HTTP SSE", http)):
            first = [r[0] for rows in rounds for r in rows]
            end = [r[1] for rows in rounds for r in rows]
            print(f"{concurrency:>3} {name:14} {statistics.median(first):23.3f}"
                  f" {percentile(first, 0.9):7.3f} {statistics.median(end):15.3f}"
                  f" {percentile(end, 0.9):7.3f}")  # fmt: skip

        first_ms, end_ms = _paired_added(0, here, http), _paired_added(1, here, http)
        print(f"    HTTP adds (median of paired rounds): {first_ms:.3f} ms to the first chunk, "
              f"{end_ms:.3f} ms end to end")  # fmt: skip


def _paired_added(key: int, here: list, http: list) -> float:
    """What HTTP adds to figure `key`: per round, the median over its requests one way
    minus the other; the median over rounds."""
    return statistics.median(
        statistics.median(r[key] for r in b) - statistics.median(r[key] for r in a)
        for a, b in zip(here, http, strict=True)
    )


def serving(
    base: str | None, parts: set[str], tiny: bool, devices: str, scaled: float | None
) -> None:
    server = None
    model = None
    if scaled:
        from omniflow.checkpoints.scaled import scaled_checkpoint
        from omniflow.families.qwen2_5_omni.checkpoints import REAL_OMNI

        model = str(scaled_checkpoint(REAL_OMNI, scaled, "cuda" if devices != "cpu" else "cpu"))
    with tempfile.TemporaryDirectory() as folder:
        if base is None:
            chats = omni_chat_variants(Path(folder), "streaming" in parts, model)
            pipelines = [str(p) for p in chats] + (
                [] if model else [str(GRAPHS / "qwen3_tts.omni")]
            )
            flags = ["--tiny"] if tiny and not model else []
            server = Server([*pipelines, *flags, "--devices", devices])
            base = server.base
        try:
            if "load" in parts:
                for concurrency in (1, 4, 10):
                    total = max(8, 2 * concurrency)
                    for name, request, served, extra in (
                        ("omni chat", chat_request, "omni_chat", CHAT),
                        ("tts", speech_request, "qwen3_tts", TTS),
                    ):
                        if served == "qwen3_tts" and model:
                            continue
                        asyncio.run(load(base, request, served, extra, 1, 1))  # warm-up
                        results, wall = asyncio.run(
                            load(base, request, served, extra, concurrency, total)
                        )
                        report_load(f"{name}, concurrency {concurrency}", results, wall)
            if "streaming" in parts:
                for concurrency in (1, 4):
                    for model in ("omni_chat", "omni_chat_whole"):
                        asyncio.run(load(base, chat_request, model, CHAT, 1, 1))
                        results, wall = asyncio.run(
                            load(base, chat_request, model, CHAT, concurrency, 8)
                        )
                        report_load(f"{model}, concurrency {concurrency}", results, wall)
        finally:
            if server is not None:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (load part only); default: start one")
    parser.add_argument("--tiny", action="store_true", default=True)
    parser.add_argument("--real", dest="tiny", action="store_false", help="the graphs' models")
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--requests", type=int, default=200, help="overhead part: requests")
    parser.add_argument(
        "--overhead-levels", default="1,10", help="overhead part: concurrencies, e.g. 1,10"
    )
    parser.add_argument("--parts", default="overhead,load,streaming")
    parser.add_argument(
        "--scaled",
        type=float,
        metavar="DEPTH",
        help="omni chat on a real-width random-weight model",
    )
    args = parser.parse_args()
    parts = set(re.split(r"[, ]+", args.parts))
    print(f"omniflow serving benchmark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    if "overhead" in parts and args.url is None:
        overhead(args.requests, tuple(int(c) for c in args.overhead_levels.split(",")))
    if parts & {"load", "streaming"}:
        serving(args.url, parts, args.tiny, args.devices, args.scaled)


if __name__ == "__main__":
    main()
