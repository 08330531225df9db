"""The ASGI app: routes, auth, the body limit, errors in OpenAI's schema, metrics.

`Server` holds what every handler needs (the served pipelines by model id, the config,
the metrics, the stats log); `create_app(server)` makes the FastAPI app. A request goes:
parse and check (400s name the field) -> route by `model` (404 naming the served ones;
400 when that pipeline does not answer this endpoint) -> admit against the plan
(`engine.admit`: 400 naming the bound) -> take an admission slot (503 + Retry-After at
once when none is free) -> run, whole or streamed. A client that goes away cancels its
request in every stage; its slot is released when its handler ends.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import anyio
import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.websockets import WebSocket

from omniflow.media import VIDEO_MIME
from omniflow.profiler.dashboard import URLS as DASHBOARD_URLS
from omniflow.profiler.dashboard import Dashboard
from omniflow.runtime.gpu_timeline import ProfileError
from omniflow.runtime.prompts import PromptTooLong
from omniflow.runtime.requests import RequestError
from omniflow.server import (
    chat,
    images,
    media_in,
    realtime,
    speech,
    speech_stream,
    videos,
    voices,
)
from omniflow.server.auth import bearer_matches
from omniflow.server.errors import APIError, bad_request, error_body
from omniflow.server.log_stats import StatsLog
from omniflow.server.metrics import Metrics
from omniflow.server.protocol import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    SpeechRequest,
    parse_form,
    parse_json,
    validation_error,
)
from omniflow.server.run import Run
from omniflow.server.served import ENDPOINTS, Served
from omniflow.server.voices import UploadedVoice, VoiceStore

log = logging.getLogger("omniflow.server")
CLIENT_GONE = 499  # the status metrics record for a request whose client went away
OPEN_PATHS = ("/health",)
DOC_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8091
    api_key: str | None = None
    protect_metrics: bool = False
    max_body_bytes: int = 32 << 20
    max_media_bytes: int = 20 << 20
    allow_remote_media: bool = False
    allowed_media_dirs: tuple[str, ...] = ()  # resolved (media_in.allowed_dirs)
    max_image_pixels: int = 8192 * 8192  # an image's width x height, before it is decoded
    max_audio_seconds: float = 600.0  # an audio clip's length, before it is decoded
    max_video_pixels: int = 120 * 30 * 1280 * 720  # a video's frames x width x height
    drain_timeout_s: float = 30.0
    max_video_jobs: int = 32  # video jobs held at once: queued, running or kept (429 beyond)
    video_ttl_s: float = 3600.0  # how long a finished video job (and its MP4) is kept
    max_realtime_sessions: int = 64  # /v1/realtime sessions at once (beyond: closed, 1013)
    max_realtime_text: int = 256 << 10  # characters of text one realtime session holds
    realtime_idle_timeout_s: float = 600.0  # a realtime session idle this long is closed
    max_speech_sessions: int = 64  # speech stream sessions at once (beyond: closed, 1013)
    speech_idle_timeout_s: float = 600.0  # a speech stream session idle this long is closed


class Server:
    def __init__(
        self,
        served: list[Served],
        config: ServerConfig,
        metrics: Metrics,
        stats_log: StatsLog | None = None,
        voice_store: VoiceStore | None = None,
    ):
        self.served = {s.name: s for s in served}
        self.voices = voice_store or VoiceStore()
        self.config = config
        self.metrics = metrics
        self.stats_log = stats_log or StatsLog(None, None)
        self.draining = False
        self.started = time.time()
        self.sessions: collections.Counter[str] = collections.Counter()  # open, by path
        self.videos = videos.VideoJobs(self, config.max_video_jobs, config.video_ttl_s)

    @property
    def in_flight(self) -> int:
        return sum(s.inflight for s in self.served.values())

    def start_draining(self) -> None:
        self.draining = True
        for s in self.served.values():
            s.draining = True

    def route(self, model, capability: str | None) -> Served:
        names = ", ".join(self.served)
        if model is None or model == "":
            # The one served pipeline, or the one that answers this endpoint.
            able = [s for s in self.served.values() if capability in (None, *s.capabilities)]
            candidates = list(self.served.values()) if len(self.served) == 1 else able
            if not candidates:
                endpoint = ENDPOINTS.get(capability, capability)
                raise bad_request(
                    f"no pipeline served here answers {endpoint} (served: {names})",
                    param="model",
                    code="unsupported",
                )
            if len(candidates) != 1:
                which = ", ".join(s.name for s in candidates) or names
                raise APIError(
                    404,
                    f"no 'model' given and this server serves several: {which}; name one",
                    param="model",
                    code="model_not_found",
                )
            served = candidates[0]
        elif not isinstance(model, str) or model not in self.served:
            raise APIError(
                404,
                f"model {model!r} is not served here; served: {names}",
                param="model",
                code="model_not_found",
            )
        else:
            served = self.served[model]
        if capability is not None and capability not in served.capabilities:
            able = [s.name for s in self.served.values() if capability in s.capabilities]
            hint = f"; for {ENDPOINTS[capability]} use {', '.join(able)}" if able else ""
            raise bad_request(f"{served.describe()}{hint}", param="model", code="unsupported")
        return served

    def admit(self, served: Served, inputs: dict, params, outputs: set[str]) -> object:
        """The request checked against the plan (`engine.admit`): a 400 naming what does not
        fit; `param` names the request field that set the parameter, where one did. It runs
        only the stages its `outputs` depend on: a chat asking for text alone starts no
        talker and no vocoder."""
        for port in served.inputs_of("text"):
            if inputs.get(port.name) == "":  # the runtime cannot send an empty text
                if port.default is None:
                    raise bad_request(
                        f"input '{port.name}' of pipeline '{served.name}' must not be empty",
                        param=port.name,
                    )
                inputs[port.name] = port.default
        # Scoped only where it asks for some of the outputs: one for all of them is admitted
        # unscoped, as before.
        asked = frozenset(outputs)
        every = frozenset(o.name for o in served.plan.outputs)
        try:
            admitted = served.engine.admit(
                inputs, params.result(), asked if asked < every else None
            )
        except RequestError as err:
            chat = served.chat_input
            field = "messages" if chat is not None and err.field == chat.name else err.field
            names = {**params.input_fields, **params.source}
            param = names.get(field, field) if field else None
            # OpenAI's code for a prompt past the model's context.
            code = "context_length_exceeded" if isinstance(err, PromptTooLong) else "invalid_value"
            raise bad_request(str(err), param=param, code=code) from None
        return admitted

    async def fetch_media(self, url: str, where: str) -> bytes:
        return await media_in.fetch(
            url,
            where,
            allow_remote=self.config.allow_remote_media,
            allowed=self.config.allowed_media_dirs,
            max_bytes=self.config.max_media_bytes,
        )

    def finish(self, run: Run | None, model: str, endpoint: str, status: int, began: float):
        metrics = self.metrics
        metrics.observe_request(model, endpoint, status, time.perf_counter() - began)
        if run is None or status == CLIENT_GONE:
            return
        timeline, name = run.timeline, run.served.name
        if status < 400:
            if (ttft := timeline.seconds(timeline.first_text)) is not None:
                metrics.ttft.labels(name).observe(ttft)
            if (ttfp := timeline.seconds(timeline.first_audio)) is not None:
                metrics.ttfp.labels(name).observe(ttfp)
            if timeline.audio_seconds and timeline.ended is not None:
                metrics.rtf.labels(name).observe(
                    (timeline.ended - timeline.began) / timeline.audio_seconds
                )
                metrics.underrun.labels(name).observe(timeline.playback.underrun)
        metrics.audio_seconds.labels(name).inc(timeline.audio_seconds)
        metrics.text_tokens.labels(name).inc(timeline.text_tokens)
        stats = run.served.stats.take(run.request_id)
        if self.stats_log.enabled and timeline.ended is not None:
            self.stats_log.log(run, endpoint, status, stats)


# --- responses that hold an admission slot ----------------------------------------------------
class HeldStream(StreamingResponse):
    """A streamed reply that releases its slots and records its metrics when it ends, however
    it ends, and that stops (cancelling its request) as soon as its client goes away."""

    def __init__(self, content: AsyncIterator[bytes], on_end: Callable, **kwargs):
        super().__init__(content, **kwargs)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        status = CLIENT_GONE
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    nonlocal status
                    await self.stream_response(send)
                    status = self.status_code
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except OSError:
            pass  # the client went away while we were sending
        finally:
            await self.on_end(status)


async def until_disconnect(request: Request, work):
    """`await work`, unless the client goes away first: then `work` is cancelled (and with it
    the request in every stage, or its wait in the admission queue) and ClientDisconnect is
    raised."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnect()
    return task.result()


# --- the app ------------------------------------------------------------------------------------
class StartProfile(msgspec.Struct, forbid_unknown_fields=True):
    """POST /start_profile's body (`engine.start_profile`'s options)."""

    gpu: bool = False
    stages: list[str] | None = None
    requests: list[str] | None = None


def _sync(handler: Callable[[Request], Response]):
    """A plain (thread-pool) endpoint of `handler(request)`."""

    def endpoint(request: Request) -> Response:
        return handler(request)

    return endpoint


def create_app(server: Server) -> FastAPI:
    app = FastAPI(
        title="omniflow",
        summary="OpenAI-compatible serving of .omni pipelines",
        version="0.1.0",
    )
    server.app = app

    def observed(endpoint: str, handler):
        async def run(request: Request) -> Response:
            began = time.perf_counter()
            context = {"model": "-", "began": began}
            try:
                response = await handler(request, context)
            except APIError as err:
                server.finish(context.get("run"), context["model"], endpoint, err.status, began)
                raise
            except ClientDisconnect:
                server.finish(context.get("run"), context["model"], endpoint, CLIENT_GONE, began)
                return Response(status_code=CLIENT_GONE)
            if not isinstance(response, HeldStream):
                server.finish(
                    context.get("run"), context["model"], endpoint, response.status_code, began
                )
            return response

        return run

    def held(context, slot, endpoint: str, body, media_type: str, headers=None) -> HeldStream:
        run = context["run"]
        run.timeline.queued = slot.waited

        run.start()

        async def on_end(status: int) -> None:
            await run.close()
            slot.release()
            if run.error is not None and status != CLIENT_GONE:
                status = run.error.status
            server.finish(run, context["model"], endpoint, status, context["began"])

        return HeldStream(body, on_end, media_type=media_type, headers=headers)

    async def whole(request: Request, context, slot, work):
        context["run"].timeline.queued = slot.waited
        try:
            return await until_disconnect(request, work)
        finally:
            slot.release()

    async def admit_json(request: Request, context, capability: str, parse):
        """A JSON request's pipeline (routed by its `model` among those with `capability`),
        its job (`parse(server, served, body)`), admitted, and a slot on the pipeline."""
        body = parse_json(await request.body())
        served = server.route(body.get("model"), capability)
        context["model"] = served.name
        job = await parse(server, served, body)
        admitted = server.admit(served, job.inputs, job.params, job.outputs)
        slot = await until_disconnect(request, served.acquire())
        return served, job, admitted, slot

    # --- POST /v1/chat/completions -----------------------------------------------------------
    async def chat_completions(request: Request, context) -> Response:
        _, job, admitted, slot = await admit_json(request, context, "chat", chat.parse)
        run = context["run"] = chat.make_run(job, admitted, chat.new_id(), context["began"])
        headers = {"x-omniflow-seed": str(run.seed), "x-request-id": run.request_id}
        if job.request.stream:
            headers["Cache-Control"] = "no-cache"
            return held(context, slot, ENDPOINTS["chat"], chat.events(job, run),
                        "text/event-stream", headers)  # fmt: skip
        reply = await whole(request, context, slot, chat.answer(job, run))
        return JSONResponse(reply, headers=headers)

    # --- POST /v1/audio/speech ------------------------------------------------------------------
    async def audio_speech(request: Request, context) -> Response:
        served, job, admitted, slot = await admit_json(request, context, "speech", speech.parse)
        run = context["run"] = Run(
            served, admitted, chat.new_id().replace("chatcmpl", "speech"), job.outputs,
            context["began"],
        )  # fmt: skip
        headers = {"x-omniflow-seed": str(run.seed), "x-request-id": run.request_id}
        if job.sse:
            headers["Cache-Control"] = "no-cache"
        if job.stream:
            return held(context, slot, ENDPOINTS["speech"],
                        _ended_on_error(run, speech.streamed(job, run)), job.media_type, headers)  # fmt: skip
        data = await whole(request, context, slot, speech.whole(job, run))
        return Response(data, media_type=job.media_type, headers=headers)

    # --- POST /v1/images/generations and /v1/images/edits ---------------------------------------
    async def image_reply(request: Request, context, served, job) -> Response:
        asked = job.requests()
        admitted = [
            server.admit(served, inputs, _Fixed(params, job.params), {job.image_port.name})
            for inputs, params in asked
        ]
        slot = await until_disconnect(request, served.acquire(len(admitted)))
        prefix = chat.new_id().replace("chatcmpl", "img")
        runs = [
            Run(served, a, f"{prefix}-{i}", {job.image_port.name}, context["began"])
            for i, a in enumerate(admitted)
        ]
        context["run"] = runs[0]
        reply = await whole(request, context, slot, images.answer(job, runs))
        for run in runs[1:]:
            served.stats.take(run.request_id)
        return JSONResponse(reply, headers={"x-omniflow-seed": str(runs[0].seed)})

    async def images_generations(request: Request, context) -> Response:
        body = parse_json(await request.body())
        served = server.route(body.get("model"), "images")
        context["model"] = served.name
        return await image_reply(request, context, served, images.parse_generation(served, body))

    async def images_edits(request: Request, context) -> Response:
        what = "an edit is a multipart/form-data request (fields and an 'image' file)"
        form = await parse_form(request, what, max_files=4, max_fields=64)
        try:
            model = form.get("model")
            served = server.route(model if isinstance(model, str) else None, "edits")
            context["model"] = served.name
            job = await images.parse_edit(server, served, form)
        finally:
            await form.close()
        return await image_reply(request, context, served, job)

    # --- /v1/audio/voices ----------------------------------------------------------------------
    def speech_pipelines(model) -> list[Served]:
        if model:
            return [server.route(model, "speech")]
        return [s for s in server.served.values() if "speech" in s.capabilities]

    async def list_voices(request: Request, context) -> Response:
        """The named speakers of every speech pipeline (or `?model=`'s), and its uploads."""
        data = []
        for s in speech_pipelines(request.query_params.get("model")):
            data += [{"name": n, "type": "builtin", "model": s.name} for n in s.speakers]
            data += [v.entry() for v in server.voices.of(s.name)]
        return JSONResponse({"object": "list", "voices": [v["name"] for v in data], "data": data})

    async def upload_voice(request: Request, context) -> Response:
        """A reference clip (`audio`, a file), its transcript (`ref_text`) and a `name`:
        encoded once by the plan's voice encoder stage and kept (`omniflow.server.voices`)."""
        what = "an upload is a multipart/form-data request ('name', 'audio' file, 'ref_text')"
        form = await parse_form(request, what, 2, 16, kinds="multipart/form-data")
        try:
            model = form.get("model")
            served = server.route(model if isinstance(model, str) else None, "speech")
            context["model"] = served.name
            unknown = sorted(set(form) - {"model", "name", "audio", "file", "ref_text"})
            if unknown:
                raise bad_request(
                    f"unknown field '{unknown[0]}'; an upload takes name, audio (or file), "
                    "ref_text and model",
                    param=unknown[0],
                )
            given = [key for key, _ in form.multi_items()]
            twice = sorted({key for key in given if given.count(key) > 1})
            if twice or {"audio", "file"} <= set(given):
                where = twice[0] if twice else "file"
                raise bad_request(
                    f"'{where}' is given twice: an upload is one clip ('audio' or 'file'), "
                    "one name and one transcript",
                    param=where,
                )
            name = voices.check_name(form.get("name"))
            if name.lower() in (n.lower() for n in served.speakers):
                raise bad_request(
                    f"'name': {name!r} is one of the model's own speakers", param="name"
                )
            field = "audio" if "audio" in form else "file"
            clip = form.get(field)
            if clip is None or isinstance(clip, str):
                raise bad_request("'audio': the reference clip, as a file", param="audio")
            data = await clip.read()
            ref_text = form.get("ref_text") or ""
            if not isinstance(ref_text, str):
                raise bad_request("'ref_text' must be text", param="ref_text")
        finally:
            await form.close()
        entry = await speech.clone_entry(served)
        if entry is None:
            raise bad_request(
                f"pipeline '{served.name}' clones no voices: its models have no voice encoder "
                "(serve a checkpoint that clones voices)",
                param="model",
                code="unsupported",
            )
        server.voices.check_room(served.name, name)  # before any stage encodes the clip
        samples, rate = await speech.decode_reference(server, data, field)
        clip = "data:;base64," + base64.b64encode(data).decode("ascii")
        inputs = await entry.encode(clip, ref_text, field)
        voice = UploadedVoice(name, served.name, inputs, ref_text, len(samples) / rate)
        server.voices.add(voice)
        return JSONResponse(voice.entry(), status_code=201)

    async def delete_voice(request: Request, context) -> Response:
        name = request.path_params["name"]
        for s in speech_pipelines(request.query_params.get("model")):
            if server.voices.remove(s.name, name) is not None:
                context["model"] = s.name
                return JSONResponse({"name": name, "deleted": True})
        raise APIError(404, f"no uploaded voice {name!r}", param="name", code="voice_not_found")

    # --- /v1/videos: jobs, and one video at once ---------------------------------------------
    async def video_request(request: Request, context) -> videos.VideoRequest:
        fields, files = await videos.read_fields(server, request)
        model = fields.get("model")
        served = server.route(model if isinstance(model, str) else None, "videos")
        context["model"] = served.name
        return videos.parse(server, served, fields, files)

    async def videos_create(request: Request, context) -> Response:
        job = server.videos.create(await video_request(request, context))
        headers = {"x-omniflow-seed": str(job.request.admitted.seed)}
        return JSONResponse(job.describe(), headers=headers)

    async def videos_sync(request: Request, context) -> Response:
        video = await video_request(request, context)
        served = video.served
        slot = await until_disconnect(request, served.acquire())
        run = context["run"] = Run(
            served, video.admitted, "video_" + chat.new_id()[9:], {served.video_port.name},
            context["began"],
        )  # fmt: skip

        async def make() -> bytes:
            frames = await run.last(served.video_port.name, "video")
            return await asyncio.to_thread(videos.mp4_bytes, frames, video.fps)

        data = await whole(request, context, slot, make())
        headers = {"x-omniflow-seed": str(run.seed), "x-request-id": run.request_id}
        return Response(data, media_type=VIDEO_MIME, headers=headers)

    async def videos_list(request: Request, context) -> Response:
        jobs, more = server.videos.page(request.query_params)
        data = [await server.videos.describe(job) for job in jobs]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        page = {"data": data, "first_id": first, "last_id": last, "has_more": more}
        return JSONResponse({"object": "list", **page})

    async def videos_get(request: Request, context) -> Response:
        job = server.videos.get(request.path_params["video_id"])
        context["model"] = job.served.name
        return JSONResponse(await server.videos.describe(job))

    async def videos_content(request: Request, context) -> Response:
        job = server.videos.get(request.path_params["video_id"])
        context["model"] = job.served.name
        if job.status != "completed":
            why = job.error["message"] if job.error else f"it is {job.status}"
            raise APIError(409, f"video job '{job.id}' has no content: {why}", code=job.status)
        return Response(job.content, media_type=VIDEO_MIME)

    async def videos_delete(request: Request, context) -> Response:
        return JSONResponse(await server.videos.delete(request.path_params["video_id"]))

    # --- GET endpoints -------------------------------------------------------------------------
    def model_entry(s: Served) -> dict:
        return {
            "id": s.name,
            "object": "model",
            "created": int(server.started),
            "owned_by": "omniflow",
            "root": s.plan.model,
            "endpoints": [ENDPOINTS[c] for c in s.capabilities],
            "max_in_flight": s.limit,
        }

    async def list_models(request: Request, context) -> Response:
        return JSONResponse(
            {"object": "list", "data": [model_entry(s) for s in server.served.values()]}
        )

    async def get_model(request: Request, context) -> Response:
        """OpenAI's `models.retrieve`: one entry of the list, or a 404 naming `model`."""
        model = request.path_params["model"]
        if model == "":  # `/v1/models/`: the list, as before this route took the slash
            return await list_models(request, context)
        if model not in server.served:
            raise APIError(
                404,
                f"model {model!r} is not served here; served: {', '.join(server.served)}",
                param="model",
                code="model_not_found",
            )
        context["model"] = model
        return JSONResponse(model_entry(server.served[model]))

    async def health(request: Request, context) -> Response:
        if server.draining:
            return JSONResponse(
                {"status": "draining"}, status_code=503, headers={"Retry-After": "5"}
            )
        key = server.config.api_key
        holder = not key or bearer_matches(request.headers.get("authorization", ""), key)
        # A pipeline whose engine stopped answers every request with a 503: the server is
        # not healthy until it is restarted, and says which (to key holders) and why.
        stopped = {n: why for n, s in server.served.items() if (why := s.engine.stopped)}
        if stopped:
            body = {"status": "failed", "failed": stopped} if holder else {"status": "failed"}
            return JSONResponse(body, status_code=503)
        if not holder:
            return JSONResponse({"status": "ok"})  # what it serves is for key holders
        return JSONResponse({"status": "ok", "models": list(server.served)})

    def metrics_endpoint(request: Request) -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    def inspect(request: Request) -> Response:
        """Every served pipeline's live engine state (`engine.inspect()`): the requests each
        stage holds, ring slots held, chunks queued. For tests and debugging."""
        out = {}
        for name, s in server.served.items():
            # The server's own counts stand even when the executors are too busy to answer.
            out[name] = {"in_flight": s.inflight, "limit": s.limit, "queued": len(s.waiting)}
            try:
                found = s.engine.inspect(timeout=5)
            except Exception as err:
                out[name]["error"] = str(err)
                continue
            out[name]["executors"] = {e: msgspec.to_builtins(i) for e, i in found.items()}
        return JSONResponse(out)

    dashboards: dict[str, Dashboard] = {}

    def dashboard_of(request: Request) -> Dashboard:
        """The dashboard of the pipeline `?model=` names (the only one, if one is served)."""
        served = server.route(request.query_params.get("model"), None)
        if served.name not in dashboards:
            query = f"?model={served.name}"
            urls = {key: url + query for key, url in DASHBOARD_URLS.items()}
            dashboards[served.name] = Dashboard(served.engine, urls)
        return dashboards[served.name]

    def found(value, respond):
        if value is None:
            raise APIError(404, "no profile has been stopped yet: POST /stop_profile first")
        return respond(value)

    # Plain functions: inspecting and stopping a profile block, so they take pool threads.
    dashboard_routes = [
        ("/dashboard", "GET", lambda r: HTMLResponse(dashboard_of(r).page())),
        ("/dashboard.json", "GET", lambda r: JSONResponse(dashboard_of(r).snapshot())),
        ("/stop_profile", "POST", lambda r: JSONResponse(dashboard_of(r).stop_profile())),
        ("/profile/trace.json", "GET", lambda r: found(dashboard_of(r).trace(), JSONResponse)),
        ("/profile/report.html", "GET", lambda r: found(dashboard_of(r).report(), HTMLResponse)),
    ]

    posts = {
        ENDPOINTS["chat"]: (chat_completions, ChatCompletionRequest, "Chat: text and audio"),
        ENDPOINTS["speech"]: (audio_speech, SpeechRequest, "Text to speech"),
        ENDPOINTS["images"]: (images_generations, ImageGenerationRequest, "Text to image"),
        ENDPOINTS["edits"]: (images_edits, None, "Image edit (multipart)"),
        ENDPOINTS["videos"]: (videos_create, None, "Create a video job (multipart or JSON)"),
        ENDPOINTS["videos"] + "/sync": (videos_sync, None, "Make one video, answer its MP4"),
    }
    for path, (handler, _, summary) in posts.items():
        app.add_api_route(path, observed(path, handler), methods=["POST"], summary=summary)
    video_paths = [
        ("/v1/videos", "GET", videos_list),
        ("/v1/videos/{video_id}", "GET", videos_get),
        ("/v1/videos/{video_id}/content", "GET", videos_content),
        ("/v1/videos/{video_id}", "DELETE", videos_delete),
    ]
    for path, method, handler in video_paths:
        app.add_api_route(path, observed(path, handler), methods=[method])
    app.add_api_route("/v1/models", observed("/v1/models", list_models), methods=["GET"])
    # `:path`: a served name may be a checkpoint's path, slashes and all.
    model_path = "/v1/models/{model:path}"
    app.add_api_route(model_path, observed(model_path, get_model), methods=["GET"])
    voices_path = "/v1/audio/voices"
    app.add_api_route(voices_path, observed(voices_path, list_voices), methods=["GET"])
    app.add_api_route(
        voices_path, observed(voices_path, upload_voice), methods=["POST"],
        summary="Upload a voice (multipart: name, audio, ref_text)",
    )  # fmt: skip
    app.add_api_route(
        voices_path + "/{name}", observed(voices_path, delete_voice), methods=["DELETE"]
    )

    async def speech_socket(websocket: WebSocket) -> None:
        await speech_stream.SpeechSession(server, websocket).serve()

    app.add_api_websocket_route(speech_stream.PATH, speech_socket)

    async def realtime_socket(websocket: WebSocket) -> None:
        await realtime.RealtimeSession(server, websocket).serve()

    app.add_api_websocket_route(realtime.PATH, realtime_socket)
    app.add_api_route("/health", observed("/health", health), methods=["GET"])
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.add_api_route("/debug/inspect", inspect, methods=["GET"], include_in_schema=False)
    for path, method, handler in dashboard_routes:
        app.add_api_route(path, _sync(handler), methods=[method], include_in_schema=False)

    async def start_profile(request: Request) -> Response:
        """POST /start_profile, its body optional: {"gpu": true} adds the GPU stages' CUDA
        kernel timeline (a plan without any is a 400 saying so); {"stages": [...]} and
        {"requests": [...]} (id prefixes) narrow what is recorded (an unknown stage: 400)."""
        try:
            options = msgspec.json.decode(await request.body() or b"{}", type=StartProfile)
        except msgspec.MsgspecError as err:
            raise APIError(
                400,
                'POST /start_profile takes {"gpu": bool, "stages": [str], "requests": [str]}: '
                f"{err}",
            ) from None
        dashboard = dashboard_of(request)
        start = partial(dashboard.start_profile, options.gpu, options.stages, options.requests)
        try:
            state = await anyio.to_thread.run_sync(start)
        except ProfileError as err:
            raise APIError(400, str(err), param=err.param) from None
        return JSONResponse(state)

    app.add_api_route("/start_profile", start_profile, methods=["POST"], include_in_schema=False)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: "method not allowed"}.get(
            err.status_code, str(err.detail)
        )
        return JSONResponse(
            error_body(err.status_code, message), status_code=err.status_code, headers=err.headers
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error in %s", request.url.path)
        return JSONResponse(
            error_body(500, f"internal error: {type(err).__name__}: {err}"), status_code=500
        )

    app.add_middleware(Guard, server=server)
    app.openapi = partial(_openapi, app, posts, server)
    return app


class _Fixed:
    """Parameters already resolved (an image's own seed), with the sources of the job's."""

    def __init__(self, values: dict, params):
        self.values = values
        self.source = params.source
        self.input_fields = params.input_fields

    def result(self) -> dict:
        return self.values


async def _ended_on_error(run: Run, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A streamed body that ends early (its status recorded) when the pipeline fails."""
    try:
        async for data in body:
            yield data
    except APIError as err:
        run.error = err


# --- auth and body size ---------------------------------------------------------------------
class BodyTooLarge(APIError):
    """A body that grew past the limit as it arrived (chunked, or longer than declared): a
    413 wherever it is read (a form's parser lets it through: `parse_form`)."""

    def __init__(self, limit: int):
        super().__init__(
            413, f"the body is over this server's limit of {limit} bytes", code="too_large"
        )


class Guard:
    """Pure ASGI middleware: `Authorization: Bearer KEY` (compared in constant time) on every
    path but /health (and /metrics unless --protect-metrics), and the body size limit (413)."""

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self.server.config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = config.api_key
        if (
            key
            and self._protected(scope["path"])
            and not bearer_matches(headers.get("authorization", ""), key)
        ):
            await _send_error(
                send,
                APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                ),
            )
            return
        limit = config.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await _send_error(send, BodyTooLarge(limit))
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge as err:
            if not started:
                await _send_error(send, err)

    def _protected(self, path: str) -> bool:
        if path in OPEN_PATHS or path in DOC_PATHS:
            return False
        return not (path == "/metrics" and not self.server.config.protect_metrics)


async def _send_error(send, err: APIError) -> None:
    response = err.response()
    await send(
        {"type": "http.response.start", "status": err.status, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


# --- the OpenAPI schema -----------------------------------------------------------------------
def _openapi(app: FastAPI, posts: dict, server: Server) -> dict:
    """FastAPI's schema with our request bodies (the handlers read raw bodies, to check
    them against the pipeline: FastAPI cannot see their models); `model` lists the served
    pipelines that answer each endpoint."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error = {
        "description": "an error, in OpenAI's schema",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    components["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    }
    capability = {path: name for name, path in ENDPOINTS.items()}
    capability[ENDPOINTS["videos"] + "/sync"] = "videos"
    for path, (_, model, _) in posts.items():
        operation = schema["paths"][path]["post"]
        names = [s.name for s in server.served.values() if capability[path] in s.capabilities]
        served = {"type": "string", "enum": names} if names else {"type": "string"}
        if model is None and capability[path] == "videos":
            content = {"multipart/form-data": {"schema": _video_schema(served)}}
        elif model is None:
            content = {"multipart/form-data": {"schema": _edit_schema(served)}}
        else:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            body["properties"]["model"] = served
            for param, default in _served_params(server, capability[path]).items():
                body["properties"].setdefault(param, _json_type(default))
            body["additionalProperties"] = False
            if len(server.served) > 1:
                body.setdefault("required", []).append("model")
            components[model.__name__] = body
            content = {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            }
        operation["requestBody"] = {"required": True, "content": content}
        operation["responses"] = {
            "200": {"description": "the reply"},
            **{str(code): error for code in (400, 401, 404, 413, 503)},
        }
    app.openapi_schema = schema
    return schema


def _served_params(server: Server, capability: str) -> dict:
    """The parameters of the pipelines that answer `capability`, with their defaults: a
    request may set them at the top level."""
    found = {}
    for s in server.served.values():
        if capability in s.capabilities:
            found.update({k: s.plan.params.get(k, 0) for k in s.plan.limits})
    return found


def _json_type(default) -> dict:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return {"type": kind.get(type(default), "string"), "description": "a pipeline parameter"}


def _edit_schema(served: dict) -> dict:
    fields = {
        name: {"type": {str: "string", int: "string", float: "string", bool: "string",
                        dict: "string"}[kind]}
        for name, kind in images.EDIT_FIELDS.items()
    }  # fmt: skip
    fields["model"] = served
    fields["image"] = {"type": "string", "format": "binary"}
    fields["mask"] = {"type": "string", "format": "binary"}
    return {"type": "object", "properties": fields, "required": ["model", "image", "prompt"]}


def _video_schema(served: dict) -> dict:
    fields = {name: {"type": "string"} for name in videos.VIDEO_FIELDS}
    fields["model"] = served
    fields[videos.IMAGE_FIELD] = {"type": "string", "format": "binary"}
    return {"type": "object", "properties": fields, "required": ["model", "prompt"]}
