"""What the benchmark's HTTP client adds to a first packet: httpx's and aiohttp's clients
side by side against a server that answers at once, so that all the time measured is the
client's, the loopback's and the HTTP server's.

The speech benchmark's TTFP goals are milliseconds (issue 37: 15 ms at c=1, 50 at c=16),
so the client that times them matters. The peer's speech benchmark client sends with
aiohttp; benchmarks/tts_serve.py does too. This script prints the time from each POST to
its first body bytes (a streamed reply, as `/v1/audio/speech` streams PCM), alternating the
two clients round by round at each concurrency, and their ratio.

    python benchmarks/http_clients.py                # c = 1 and 16, 20 rounds each
    python benchmarks/http_clients.py --concurrency 1 16 64 --rounds 40
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
import httpx

SERVER = """
import asyncio, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

async def audio():
    yield b"\\0" * 1920  # a first packet at once, the next 20 ms later, as a stream's would
    await asyncio.sleep(0.02)
    yield b"\\0" * 1920

async def speech(request):
    await request.body()
    return StreamingResponse(audio(), media_type="audio/pcm")

app = Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"])])
uvicorn.run(app, port=int(sys.argv[1]), log_level="warning")
"""
BODY = {"model": "tts", "input": "Good morning, and welcome to the show.", "stream": True,
        "response_format": "pcm"}  # fmt: skip


async def first_bytes_httpx(client: httpx.AsyncClient) -> float:
    began, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/audio/speech", json=BODY) as reply:
        async for data in reply.aiter_raw():
            first = first or (time.perf_counter() - began if data else None)
    return first


async def first_bytes_aiohttp(client: aiohttp.ClientSession) -> float:
    began, first = time.perf_counter(), None
    async with client.post("/v1/audio/speech", json=BODY) as reply:
        async for data in reply.content.iter_any():
            first = first or (time.perf_counter() - began if data else None)
    return first


async def rounds(base: str, name: str, concurrency: int, count: int) -> list[float]:
    """`count` rounds of `concurrency` requests at once (after one unmeasured round that
    opens the connections): each request's seconds to its first bytes."""
    if name == "httpx":
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        client = httpx.AsyncClient(base_url=base, limits=limits, timeout=60)
        request = first_bytes_httpx
    else:
        connector = aiohttp.TCPConnector(limit=concurrency)
        client = aiohttp.ClientSession(base_url=base, connector=connector)
        request = first_bytes_aiohttp
    async with client:
        times: list[float] = []
        for round_ in range(count + 1):
            got = await asyncio.gather(*(request(client) for _ in range(concurrency)))
            times += got if round_ else []
        return times


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=20, help="rounds a client, each level")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.post(f"{base}/v1/audio/speech", json=BODY, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        print(f"{'c':>4} {'client':>8} {'mean ms':>8} {'median':>7} {'p90':>7}")
        for concurrency in args.concurrency:
            seen: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
            for _ in range(2):  # alternated, so that neither has the machine's quieter half
                for name in seen:
                    seen[name] += asyncio.run(rounds(base, name, concurrency, args.rounds // 2))
            for name, times in seen.items():
                ms = sorted(t * 1e3 for t in times)
                print(f"{concurrency:4d} {name:>8} {statistics.fmean(ms):8.2f} "
                      f"{statistics.median(ms):7.2f} {ms[int(0.9 * (len(ms) - 1))]:7.2f}")  # fmt: skip
            ratio = statistics.fmean(seen["httpx"]) / statistics.fmean(seen["aiohttp"])
            print(f"{concurrency:4d} httpx / aiohttp, mean: {ratio:.2f}x")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
