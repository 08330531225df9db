"""`omniflow run [PIPELINE ...]`: compile, check, start every pipeline's engine, then serve
them over HTTP until SIGINT or SIGTERM.

Everything that can fail without loading a model fails first, as one line: the port
(bound before anything loads), the pipeline files, names served twice, `--param` and
`--max-in-flight` values, devices, models and speakers (`preflight`). Then the engines
start, all at once, each stage's load reported as it finishes.

Stopping: the first SIGINT or SIGTERM stops admitting (503 with Retry-After, /health
503) and waits for the requests in flight, up to `--drain-timeout`; a second one stops at
once. Then the engines close (their executors exit and unlink their rings), and the
command exits 0.

Executors ignore a terminal's Ctrl-C (SIGINT is blocked in the threads that start them,
and a blocked signal stays blocked in the processes they spawn), so Ctrl-C drains the
server instead of killing its stages under the requests in flight; they still stop with
the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from omniflow.errors import OmniflowError
from omniflow.examples import DEFAULT_GRAPH, find_pipeline
from omniflow.plan import Plan
from omniflow.runtime.heap import freeze_startup_heap
from omniflow.server import media_in
from omniflow.server.app import Server, ServerConfig, create_app
from omniflow.server.log_stats import StatsLog
from omniflow.server.metrics import Metrics
from omniflow.server.served import ENDPOINTS, QUEUE_PER_SLOT, Served, capacity
from omniflow.server.suggested import suggested_requests
from omniflow.server.voices import VoiceStore


class ServeError(OmniflowError):
    """The server cannot start as asked (port, pipelines, flags)."""


def default_pipeline() -> Path:
    """graphs/omni_chat.omni of the working directory, else the one omniflow carries."""
    found = find_pipeline(f"graphs/{DEFAULT_GRAPH}.omni")
    if found is None:
        raise ServeError(
            f"no pipeline given and graphs/{DEFAULT_GRAPH}.omni is not here; name a .omni file "
            "or a plan JSON: omniflow run PIPELINE.omni"
        )
    return found


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads (a busy port fails in a second)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ServeError(f"--host {host}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {err.strerror}; pick another --port"
        ) from None
    sock.set_inheritable(False)
    return sock


def load_plan(
    path: str, devices: str, tiny: bool, model: str | None = None, settings: Sequence[str] = ()
) -> Plan:
    """A plan JSON as written, or a .omni file compiled (`model`: in place of its own;
    `settings`: stage arguments set, `--set`)."""
    if path.endswith(".json"):
        try:
            return Plan.from_json(Path(path).read_bytes())
        except OSError as err:
            raise ServeError(f"cannot read plan {path}: {err.strerror}") from None
    from omniflow.compiler import compile_file

    return compile_file(
        path, devices=devices, tiny=tiny, progress=True, model=model, settings=settings
    )


def pipeline_settings(paths: list[str], settings: Sequence[str]) -> list[list[str]]:
    """Each served .omni file's `--set [PIPELINE.]STAGE.KEY=VALUE` settings (the CLI has
    refused them beside a plan JSON). A lone file's go to it as given: its compile checks
    them, so it is not parsed here too."""
    if not settings or len(paths) == 1:
        return [list(settings) for _ in paths]
    from omniflow.compiler import settings_by_pipeline
    from omniflow.dsl.parser import parse_file

    return settings_by_pipeline([parse_file(path) for path in paths], settings)


def param_defaults(items: list[str], plans: list[Plan], checks: dict) -> dict[str, dict]:
    """`--param [PIPELINE.]NAME=VALUE`: the values a pipeline's requests start from (JSON,
    else the text). Without a pipeline prefix it applies to every served pipeline that
    declares NAME. Checked against each plan now (and the speakers: the families' own
    checks need a whole request)."""
    from omniflow.runtime.requests import RequestError, Voice, admit

    by_name = {p.pipeline: p for p in plans}
    out: dict[str, dict] = {name: {} for name in by_name}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ServeError(f"--param: expected [PIPELINE.]NAME=VALUE, not '{item}'")
        target, dot, rest = key.partition(".")
        if dot and target in by_name:
            key, targets = rest, [by_name[target]]
        else:
            targets = [p for p in plans if key in p.limits]
        if not targets or key not in targets[0].limits:
            raise ServeError(f"--param {item}: no served pipeline has a parameter '{key}'")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        for plan in targets:
            out[plan.pipeline][key] = value
    for name, values in out.items():
        plan = by_name[name]
        stand_ins = {  # the inputs a request must give, so that only parameters are checked
            p.name: "x" if p.type in ("text", "chat") else [0]
            for p in plan.inputs
            if p.default is None
        }
        try:
            voices = tuple(c for c in checks[name] if isinstance(c, Voice))
            admit(plan, stand_ins, values, voices)
        except RequestError as err:
            raise ServeError(f"--param for pipeline '{name}': {err}") from None
    return out


def per_pipeline(flag: str, items: list[str], defaults: dict[str, int], low: int) -> dict[str, int]:
    """A count per served pipeline from `flag [PIPELINE=]N` items (N alone: every
    pipeline), else its default; each at least `low`."""
    counts = dict(defaults)
    for item in items:
        target, _, text = item.rpartition("=")
        if target and target not in counts:
            raise ServeError(f"{flag} {item}: no served pipeline '{target}' ({', '.join(counts)})")
        if not text.isdigit() or int(text) < low:
            raise ServeError(f"{flag} {item}: expected a count of at least {low}")
        for name in [target] if target else list(counts):
            counts[name] = int(text)
    return counts


def start_engines(
    plans: list[Plan],
    checks: dict,
    mode: str,
    backends: str,
    console: Console,
    stats: dict | None = None,
    load: str = "sequential",
):
    """Every plan's engine, started at once (with executor processes; one after the other
    with threads); SIGINT blocked in their threads (so in their executors) and an
    interrupt here stops those already started. With `stats` (pipeline -> its stats hook,
    filled in once the pipelines are served), the engines keep per-request tables."""
    from omniflow.runtime.engine import Engine

    engines, errors = {}, {}

    def loaded(pipeline: str, message) -> None:
        for line in message.lines(f"{pipeline}/{message.about}"):
            console.print(line)

    def build(plan: Plan) -> None:
        try:
            engines[plan.pipeline] = Engine(
                plan,
                mode,
                backends,
                checks=checks[plan.pipeline],
                on_loaded=lambda message: loaded(plan.pipeline, message),
                on_stats=None if stats is None else lambda tables: stats[plan.pipeline](tables),
                load=load,
            )
        except BaseException as err:  # reported below, in the main thread
            errors[plan.pipeline] = err

    def build_all() -> None:  # in one process, one at a time: model imports are not
        for plan in plans:  # thread-safe (transformers' lazy modules)
            build(plan)

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        threads = [
            threading.Thread(target=build, args=(p,), name=f"start-{p.pipeline}", daemon=True)
            for p in plans
        ]
        if mode == "inprocess":
            threads = [threading.Thread(target=build_all, name="start", daemon=True)]
        for thread in threads:
            thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.1)
    except KeyboardInterrupt:
        close_engines(dict(engines))
        raise
    if errors:
        close_engines(engines)
        raise next(iter(errors.values()))
    return engines


def close_engines(engines: dict) -> None:
    threads = [threading.Thread(target=e.close, daemon=True) for e in engines.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def _remove_own_segments() -> None:
    """Rings this process created and an engine that never finished starting left behind."""
    from omniflow.runtime.shm_ring import SEGMENT_PREFIX, SHM_DIR

    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}{os.getpid()}-*"):
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def _sigterm_interrupts():
    """During start-up, SIGTERM stops like Ctrl-C does (by default it would kill the
    process without unwinding, leaving the engines' rings behind)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def media_limits(args) -> dict:
    """The `ServerConfig` fields of the media flags: the allowed directories, resolved, and
    the size limits given (the others keep their defaults)."""
    try:
        limits = {"allowed_media_dirs": media_in.allowed_dirs(args.allowed_media_dir)}
    except media_in.MediaDirError as err:
        raise ServeError(str(err)) from None
    for name in ("max_image_pixels", "max_audio_seconds", "max_video_pixels"):
        if (value := getattr(args, name)) is not None:  # (each above 0: the parser's types)
            limits[name] = value
    return limits


def serve(args) -> int:
    console = Console(stderr=True, highlight=False)
    paths = list(args.paths) or [str(default_pipeline())]
    tiny = args.tiny or not args.paths
    api_key = args.api_key or os.environ.get("OMNIFLOW_API_KEY") or None
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key,
        protect_metrics=args.protect_metrics,
        max_body_bytes=args.max_body_bytes,
        max_media_bytes=min(args.max_body_bytes, 64 << 20),
        allow_remote_media=args.allow_remote_media,
        **media_limits(args),
        drain_timeout_s=args.drain_timeout,
        max_video_jobs=args.max_video_jobs,
        video_ttl_s=args.video_ttl,
        max_realtime_sessions=args.max_realtime_sessions,
        max_realtime_text=args.max_realtime_text,
        realtime_idle_timeout_s=args.realtime_idle_timeout,
        max_speech_sessions=args.max_speech_sessions,
        speech_idle_timeout_s=args.speech_idle_timeout,
    )
    sock = bind(args.host, args.port)
    engines: dict = {}
    try:
        with _sigterm_interrupts():
            settings = pipeline_settings(paths, args.set)
            plans = [
                load_plan(path, args.devices, tiny, args.model, own)
                for path, own in zip(paths, settings, strict=True)
            ]
            names = [p.pipeline for p in plans]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ServeError(
                    f"pipeline name {', '.join(twice)} is served twice; each is served under "
                    "its name, so rename one"
                )
            backends = "standin" if args.standin else "auto"
            checks = {p.pipeline: () if args.standin else _preflight(p) for p in plans}
            defaults = param_defaults(args.param, plans, checks)
            limits = per_pipeline(
                "--max-in-flight", args.max_in_flight, {p.pipeline: capacity(p) for p in plans}, 1
            )
            queues = per_pipeline(
                "--max-queue", args.max_queue, {n: QUEUE_PER_SLOT * k for n, k in limits.items()}, 0
            )
            stats = {} if args.log_stats or args.log_stats_json else None
            engines = start_engines(plans, checks, args.mode, backends, console, stats, args.load)
        metrics = Metrics()
        served = [
            Served(
                p.pipeline,
                p,
                engines[p.pipeline],
                limits[p.pipeline],
                metrics,
                defaults[p.pipeline],
                checks[p.pipeline],
                max_queue=queues[p.pipeline],
                max_wait_s=args.max_queue_wait,
            )
            for p in plans
        ]
        if stats is not None:
            stats.update({s.name: s.stats for s in served})
        stats_log = StatsLog(console if args.log_stats else None, args.log_stats_json)
        server = Server(served, config, metrics, stats_log, VoiceStore(args.max_voices))
        app = create_app(server)
        port = sock.getsockname()[1]
        freeze_startup_heap()
        _print_ready(console, server, args.host, port)
        _run_uvicorn(app, server, sock, console, access_log=args.access_log)
    finally:
        sock.close()
        close_engines(engines)
        _remove_own_segments()
    console.print("omniflow: stopped")
    return 0


def _preflight(plan: Plan):
    from omniflow.runtime.preflight import preflight

    return preflight(plan)


def _print_ready(console: Console, server: Server, host: str, port: int) -> None:
    for s in server.served.values():
        outputs = ", ".join(
            f"{o.name} ({o.type}{', ' + str(o.attrs['rate']) + ' Hz' if o.attrs.get('rate') else ''})"
            for o in s.plan.outputs
        )
        endpoints = ", ".join(f"POST {ENDPOINTS[c]}" for c in s.capabilities) or "no endpoint"
        console.print(f"[bold]{s.name}[/]: {endpoints} · up to {s.limit} in flight", soft_wrap=True)
        executors = ", ".join(f"{p.name} ({', '.join(p.devices)})" for p in s.plan.executors)
        console.print(f"  executors: {executors}", soft_wrap=True)
        inputs = ", ".join(f"{p.name} ({p.type})" for p in s.plan.inputs)
        console.print(f"  inputs: {inputs} · outputs: {outputs}", soft_wrap=True)
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}"
    console.print(f"omniflow: serving {', '.join(server.served)} at {base}/v1", soft_wrap=True)
    console.print(
        f"  health: {base}/health · metrics: {base}/metrics · API docs: {base}/docs",
        soft_wrap=True,
    )
    for s in server.served.values():
        for i, line in enumerate(suggested_requests(s, base, bool(server.config.api_key))):
            label = f"try {s.name}:" if i == 0 else " " * len(f"try {s.name}:")
            console.print(f"  {label} {line}", soft_wrap=True, markup=False, highlight=False)
    print(f"omniflow: ready at {base}", flush=True)  # stdout: what scripts wait for


def _run_uvicorn(app, server: Server, sock: socket.socket, console: Console, access_log: bool):
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn, stopping our way: drain on the first signal, stop on the second, and no
        re-raised signal afterwards (the engines still have to close)."""

        drain_deadline: float | None = None
        announced = False

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {
                s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)
            }
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame) -> None:
            if self.drain_deadline is None:
                server.start_draining()
                self.drain_deadline = time.monotonic() + server.config.drain_timeout_s
            else:
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and not self.should_exit:
                if not self.announced:
                    self.announced = True
                    console.print(
                        f"omniflow: stopping: {server.in_flight} request(s) in flight, waiting up "
                        f"to {server.config.drain_timeout_s:g} s (again to stop now)",
                        soft_wrap=True,
                    )
                if server.in_flight == 0 or time.monotonic() >= self.drain_deadline:
                    self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=5,
    )
    if access_log:  # uvicorn's access lines are INFO, below the level the rest logs at
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    Uvicorn(config).run(sockets=[sock])  # uvloop and httptools where installed
