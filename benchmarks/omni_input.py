"""Claim: hearing costs a spoken turn little: its first audio packet comes within 30 ms of
the same turn typed, for a 5 s utterance on an H200 (issue 28's goal), over HTTP and over a
realtime WebSocket session, as a user measures it.

Serves omni chat (graphs/omni_chat.omni: its audio tower is the `hearing` encoder stage)
with `omniflow run` and sends, side by side in rounds (each round every way once, in
turn, so that all see the same machine):

- chat (SSE, text and audio out), at each `--concurrency` c (c requests at once a round):
  - typed: a short text turn;
  - typed-long: a text turn of as many prompt tokens as the spoken one (the server's own
    `usage` counts), so the thinker prefills as much: what is left is the encoder stage;
  - spoken: a `--seconds` clip (16 kHz WAV, an `input_audio` part) and no text;
- realtime (`/v1/realtime`, one session, c = 1): the clip appended to the input buffer in
  100 ms pieces, then `input_audio_buffer.commit` and `response.create`, timed from the
  commit to the first `response.audio.delta`; against a typed `conversation.item.create`
  timed from its `response.create`.

It prints TTFT, TTFP and E2E medians per way, what spoken adds to TTFP against each typed
way (median over rounds of the per-round median difference), and the `hearing` stage's step
time a spoken request from `/metrics` (`omniflow_stage_gen_time_seconds`).

With `--trace FILE` it then profiles more rounds of typed-long and spoken at c = 1 (the
server's own profiler, `POST /start_profile`, with the CUDA kernels on a GPU) into FILE and
prints where each way's first audio packet waited: the mean of each component of the
requests' TTFP critical paths (omniflow.profiler.analysis), and for the spoken requests'
`hearing` steps, the step against the GPU kernels inside it.

    python benchmarks/omni_input.py --tiny --rounds 3                 # on the tiny models
    python benchmarks/omni_input.py --devices 1xH200 --scaled 1       # real size, random weights

`--scaled DEPTH` serves a random-weight Qwen2.5-Omni at the real widths and DEPTH x its layers
(`omniflow.checkpoints.scaled`, built once into the cache). Random weights rarely end a
reply: each one runs to `--max-tokens` text tokens and `--audio-tokens` codes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.load import on_models, prompt_tokens, sized_prompt  # noqa: E402
from benchmarks.serve import Server, chat_deltas, print_paths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRAPH = ROOT / "graphs" / "omni_chat.omni"
HEARD = 16000
TYPED = "Tell me about the sea."


def utterance(seconds: float) -> np.ndarray:
    """A clip as long as a spoken turn: a voiced chirp with noise, 16 kHz mono float (random
    weights make nothing of real speech; the encoder's cost depends on the length alone)."""
    t = np.arange(int(HEARD * seconds)) / HEARD
    noise = np.random.default_rng(0).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * (140 + 60 * t) * t) + 0.05 * noise).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def wav(samples: np.ndarray) -> bytes:
    import torch

    from omniflow.media import wav_bytes

    return wav_bytes(torch.from_numpy(samples), HEARD)


# --- chat over HTTP --------------------------------------------------------------------------
def chat_body(model: str, content, limits: dict, stream: bool = True) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, **limits}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def chat(client: httpx.AsyncClient, body: dict) -> dict:
    began = time.perf_counter()
    first_text = first_audio = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for now, text, audio in chat_deltas(reply):
            if text and first_text is None:
                first_text = now
            if audio and first_audio is None:
                first_audio = now
    ended = time.perf_counter()
    return {
        "ttft": None if first_text is None else (first_text - began) * 1e3,
        "ttfp": None if first_audio is None else (first_audio - began) * 1e3,
        "e2e": (ended - began) * 1e3,
    }


async def chat_ways(base: str, model: str, clip: np.ndarray, limits: dict) -> dict[str, dict]:
    """Each chat way's request body, the typed-long turn sized by the server's counts."""
    spoken = [{"type": "input_audio",
               "input_audio": {"data": base64.b64encode(wav(clip)).decode(), "format": "wav"}}]  # fmt: skip
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        heard = await prompt_tokens(client, chat_body(model, spoken, {}, stream=False))
        long_text = await sized_prompt(client, model, heard)
        typed_long = await prompt_tokens(client, chat_body(model, long_text, {}, stream=False))
    print(f"prompt tokens: spoken {heard}, typed-long {typed_long}", flush=True)
    return {
        "typed": chat_body(model, TYPED, limits),
        "typed-long": chat_body(model, long_text, limits),
        "spoken": chat_body(model, spoken, limits),
    }


async def chat_rounds(base: str, ways: dict, clients: int, rounds: int) -> dict[str, list]:
    """`rounds` rounds; in each, every way's `clients` requests at once, one way after the
    other (the order turning each round): {way: [per-round results]}."""
    out = {way: [] for way in ways}
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=1800, limits=limits) as client:
        names = list(ways)
        for r in range(rounds + 1):  # round 0 warms every way up
            for way in names[r % len(names) :] + names[: r % len(names)]:
                results = await asyncio.gather(*(chat(client, ways[way]) for _ in range(clients)))
                if r:
                    out[way].append(results)
    return out


# --- a realtime session ----------------------------------------------------------------------
async def realtime_rounds(base: str, model: str, clip: np.ndarray, text_tokens: int, rounds: int):
    """{"typed": [...], "spoken": [...]}: per round one response each way, each in a session
    of its own (a one-turn conversation), timed from the event that starts it (the commit
    for spoken, `response.create` for typed) to its first audio delta and to its end."""
    url = base.replace("http", "ws", 1) + f"/v1/realtime?model={model}"
    out = {"typed": [], "spoken": []}
    for r in range(rounds + 1):  # round 0 warms both up
        for way in ("typed", "spoken") if r % 2 else ("spoken", "typed"):
            result = await realtime_turn(url, way, pcm16(clip), text_tokens)
            if r:
                out[way].append([result])
    return out


async def realtime_turn(url: str, way: str, audio: bytes, text_tokens: int) -> dict:
    import websockets

    async with websockets.connect(url, max_size=None) as ws:
        session = {"max_response_output_tokens": text_tokens}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        await _until(ws, "session.updated")
        if way == "typed":
            item = {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": TYPED}]}  # fmt: skip
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        else:
            piece = 2 * HEARD // 10  # 100 ms of PCM16, as a client sends while recording
            for at in range(0, len(audio), piece):
                chunk = base64.b64encode(audio[at : at + piece]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        began = time.perf_counter()
        if way == "spoken":
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        await _until(ws, "response.audio.delta")
        first = time.perf_counter()
        await _until(ws, "response.done")
        return {"ttfp": (first - began) * 1e3, "e2e": (time.perf_counter() - began) * 1e3}


async def _until(ws, kind: str) -> dict:
    """The session's next `kind` event (an error event raises)."""
    while True:
        event = json.loads(await ws.recv())
        if event["type"] == "error":
            raise RuntimeError(event["error"]["message"])
        if event["type"] == kind:
            return event


# --- the report ------------------------------------------------------------------------------
def median_of(results: list[list[dict]], key: str) -> float | None:
    values = [r[key] for rows in results for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def added(rounds: dict[str, list], way: str, against: str) -> float:
    """What `way` adds to TTFP against `against`: the median over rounds of the difference
    of their per-round medians."""
    return statistics.median(
        statistics.median(r["ttfp"] for r in b) - statistics.median(r["ttfp"] for r in a)
        for a, b in zip(rounds[against], rounds[way], strict=True)
    )


def hearing_seconds(base: str, model: str) -> float:
    """The seconds the `hearing` stage of `model` has stepped so far, from /metrics (the
    steps of requests without audio, which only pass through, included)."""
    spent = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        name, _, rest = line.partition("{")
        if name == "omniflow_stage_gen_time_seconds_sum" and (
            'stage="hearing"' in rest and f'model="{model}"' in rest
        ):
            spent += float(rest.rsplit(" ", 1)[1])
    return spent


def traced(server: Server, ways: dict, rounds: int, devices: str, file: Path) -> None:
    """`rounds` profiled rounds of typed-long and spoken at c = 1, the trace written to `file`;
    prints each way's mean TTFP critical path and the spoken requests' hearing steps."""
    from omniflow.profiler.analysis import timelines

    chosen = {w: ways[w] for w in ("typed-long", "spoken")}
    profile, trace = server.profiled(
        lambda: asyncio.run(chat_rounds(server.base, chosen, 1, rounds)), file, devices != "cpu"
    )
    heard = {rid for step in profile.steps.get("hearing", []) for rid, n, _ in step.calls if n}
    paths = {"typed-long": [], "spoken": []}
    for request in timelines(profile):
        if "audio" in request.path_ttfp:
            way = "spoken" if request.id in heard else "typed-long"
            paths[way].append(request.path_ttfp["audio"])
    print_paths(
        f"\nTTFP critical path, mean ms of {rounds + 1} profiled rounds at c = 1 (trace: {file})",
        paths,
    )
    kernels = _kernels(trace, profile.stage_executor.get("hearing"))
    for step in profile.steps.get("hearing", []):
        if any(n for _, n, _ in step.calls):
            inside = [k for k in kernels if step.ts <= k["ts"] < step.ts + step.dur]
            busy = sum(k["dur"] for k in inside) / 1e3
            print(f"hearing step of {step.batch}: {step.dur / 1e3:.1f} ms, "
                  f"{len(inside)} CUDA kernels busy {busy:.1f} ms")  # fmt: skip


def _kernels(trace: dict, executor: str | None) -> list[dict]:
    """The CUDA kernels of the executor named `executor` (trace.py: a process per executor,
    its kernels on a track per CUDA stream); none on a CPU."""
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    pids = {e["pid"] for e in meta if e["name"] == "process_name" and e["args"]["name"] == executor}
    tracks = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"
              and e["pid"] in pids and e["args"]["name"].endswith("kernels")}  # fmt: skip
    return [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e["tid"]) in tracks
    ]


def report(title: str, rounds: dict[str, list], against: tuple[str, ...]) -> None:
    print(f"\n{title}")
    print(f"{'way':>12} {'TTFT ms':>9} {'TTFP ms':>9} {'E2E ms':>9}")
    for way, results in rounds.items():
        cells = [median_of(results, key) for key in ("ttft", "ttfp", "e2e")]
        print(f"{way:>12} " + " ".join("        -" if v is None else f"{v:9.1f}" for v in cells))
    for other in against:
        print(f"spoken adds {added(rounds, 'spoken', other):7.1f} ms to TTFP against {other}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the graph's tiny models")
    parser.add_argument("--scaled", type=float, help="a random-weight build at DEPTH x layers")
    parser.add_argument("--seconds", type=float, default=5.0, help="the spoken clip's length")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--audio-tokens", type=int, default=64)
    parser.add_argument("--parts", default="chat,realtime")
    parser.add_argument("--trace", type=Path, help="profile more rounds into this trace file")
    args = parser.parse_args()
    source = GRAPH.read_text()
    flags = ["--devices", args.devices, "--param", f"max_audio_tokens={args.audio_tokens}"]
    limits = {"max_tokens": args.max_tokens, "max_audio_tokens": args.audio_tokens}
    clip = utterance(args.seconds)
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory() as folder:
        source, models = on_models(source, args.scaled, args.tiny, args.devices)
        flags += models
        graph = Path(folder) / GRAPH.name
        graph.write_text(source)
        server = Server([str(graph), *flags], log=Path(folder) / "server.log")
        what = f"{args.devices}{f', scaled {args.scaled:g}' if args.scaled else ''}"
        try:
            if "chat" in parts:
                ways = asyncio.run(chat_ways(server.base, "omni_chat", clip, limits))
                for clients in args.concurrency:
                    before = hearing_seconds(server.base, "omni_chat")
                    rounds = asyncio.run(chat_rounds(server.base, ways, clients, args.rounds))
                    spent = hearing_seconds(server.base, "omni_chat") - before
                    report(f"chat over HTTP, concurrency {clients}, {args.rounds} rounds ({what}; "
                           f"a {args.seconds:g} s clip; the hearing stage's steps "
                           f"{spent / (clients * args.rounds) * 1e3:.1f} ms a spoken request)",
                           rounds, ("typed", "typed-long"))  # fmt: skip
                if args.trace:
                    traced(server, ways, args.rounds, args.devices, args.trace)
            if "realtime" in parts:
                rounds = asyncio.run(
                    realtime_rounds(server.base, "omni_chat", clip, args.max_tokens, args.rounds)
                )
                report(f"realtime session, {args.rounds} rounds ({what}; commit -> first "
                       f"audio delta against response.create -> first audio delta)", rounds, ("typed",))  # fmt: skip
        finally:
            server.stop()


if __name__ == "__main__":
    main()
