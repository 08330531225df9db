"""Video jobs, as OpenAI's video API and the peer's clients use them: `POST /v1/videos`
creates a job and answers at once; `GET /v1/videos/{id}` is its state (queued, in_progress
with progress, completed, failed with the error); `GET /v1/videos/{id}/content` its H.264
MP4; `DELETE /v1/videos/{id}` cancels it (in every stage) and forgets it; `GET /v1/videos`
lists them; `POST /v1/videos/sync` runs one and answers with the MP4 itself.

A request is multipart (the peer sends every value as a string; `input_reference`, an
image file, makes it image-to-video) or JSON. Its fields reach the pipeline's parameters as
an image request's do (params.py): `prompt` and `negative_prompt` its text inputs, `size`
"WxH" or `width`/`height`, `num_frames` (or OpenAI's `seconds`, as `seconds` x `fps` + 1
frames), `num_inference_steps`, `seed`, and the model's own knobs (`guidance_scale`,
`guidance_scale_2`, `boundary_ratio`, `flow_shift`, ...). `fps` is the MP4's frame rate
(default: the video output's `fps`). Everything is checked against the plan when the job is
created: a mistake is a 400 then, never a failed job.

A job is the server's, not its client's: it runs as a task of the server's event loop,
which survives the client's disconnect. It waits (queued) for an admission slot of its
pipeline, runs (in_progress: `progress` 0-100 follows its denoiser's steps, then the VAE's
frames, from `engine.inspect()`, then the MP4's frames as they are encoded: no phase sits
still for its whole length), and keeps its MP4 until it expires (`--video-ttl`, from its end). The
store is bounded (`--max-video-jobs`: jobs queued, running or kept): a create beyond it is
a 429 with Retry-After, and while the server drains a 503; queued jobs fail when it stops.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

import anyio
from starlette.datastructures import UploadFile

from omniflow.catalog.components import load_component_config, video_frames
from omniflow.media import mp4_bytes
from omniflow.server.errors import APIError, bad_request, busy
from omniflow.server.images import ascii_digits, take_fields, uploaded_image
from omniflow.server.params import Params, parse_form_value
from omniflow.server.protocol import FORM_TYPES, merge_extra_body, parse_form, parse_json
from omniflow.server.run import Run

# Fields of a video request and their types (a multipart form's values arrive as strings).
VIDEO_FIELDS = {
    "model": str, "prompt": str, "negative_prompt": str, "size": str, "width": int,
    "height": int, "num_frames": int, "seconds": float, "fps": int, "num_inference_steps": int,
    "seed": int, "guidance_scale": float, "guidance_scale_2": float, "boundary_ratio": float,
    "flow_shift": float, "true_cfg_scale": float, "n": int, "vae_use_slicing": bool,
    "vae_use_tiling": bool, "lora": dict, "extra_body": dict, "user": str,
}  # fmt: skip
IMAGE_FIELD = "input_reference"
# The longest video `seconds` may ask for (its frames are then checked against the plan's).
MAX_SECONDS = 600
DEFAULT_FPS = 16
STATUSES = ("queued", "in_progress", "completed", "failed")
# How long a job's live progress is reused before the engine is inspected again.
PROGRESS_CACHE_S = 0.5
# A job's progress (0-100) through its phases: the stages before the denoiser; the
# denoiser's steps; a stage after it, by its own steps where it reports them (the VAE's
# frames); the MP4's frames, encoded here. 100: done.
BEFORE_DENOISING = 2
DENOISING = (5, 85)
AFTER_DENOISING = (85, 95)
ENCODING = (95, 99)


@dataclass
class VideoRequest:
    """A video request checked against its pipeline: its inputs, parameters and admission."""

    served: object
    inputs: dict
    params: Params
    admitted: object
    fps: int
    size: str
    frames: int


@dataclass
class VideoJob:
    id: str
    request: VideoRequest
    created_at: float
    status: str = "queued"
    progress: int = 0
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    error: dict | None = None
    content: bytes | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    checked: float = 0.0  # when progress was last read from the engine

    @property
    def served(self):
        return self.request.served

    @property
    def request_id(self) -> str:
        """The engine's id of the job's request: the job's own."""
        return self.id

    def describe(self) -> dict:
        request = self.request
        return {
            "id": self.id,
            "object": "video",
            "model": request.served.name,
            "status": self.status,
            "progress": self.progress,
            "created_at": int(self.created_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "expires_at": None if self.expires_at is None else int(self.expires_at),
            "size": request.size,
            "seconds": f"{(request.frames - 1) / request.fps:g}" if request.fps else None,
            "num_frames": request.frames,
            "fps": request.fps,
            "seed": request.admitted.seed,
            "error": self.error,
        }


# --- parsing ---------------------------------------------------------------------------------
async def read_fields(server, request) -> tuple[dict, dict]:
    """A video request's fields (typed) and its input image, from a multipart form or JSON."""
    if request.headers.get("content-type", "").startswith(FORM_TYPES):
        form = await parse_form(request, "a video request is a form or JSON", 4, 64)
        try:
            return await _form_fields(server, form)
        finally:
            await form.close()
    body = merge_extra_body(parse_json(await request.body()))
    if IMAGE_FIELD in body:
        raise bad_request(f"'{IMAGE_FIELD}': send the image as a multipart file", param=IMAGE_FIELD)
    return body, {}


async def _form_fields(server, form) -> tuple[dict, dict]:
    fields, files = {}, {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name != IMAGE_FIELD:
                raise bad_request(
                    f"'{name}': the only file a video request takes is '{IMAGE_FIELD}'",
                    param=name,
                )
            if IMAGE_FIELD in files:
                raise bad_request(f"'{name}': one image per request", param=name)
            files[IMAGE_FIELD] = await uploaded_image(server, name, value)
            continue
        if name in fields:
            raise bad_request(f"'{name}' is given twice", param=name)
        fields[name] = value
    return fields, files


def parse(server, served, fields: dict, files: dict) -> VideoRequest:
    """The request as `served` would run it: a 400 for anything that does not fit."""
    params = Params(served)
    fields = dict(fields)
    typed = {}
    for name, value in fields.items():
        like = VIDEO_FIELDS.get(name)
        if like is None and isinstance(value, str):
            param = params.target(name)
            like = type(served.plan.params[param]) if param in served.plan.params else str
        typed[name] = parse_form_value(name, value, like) if isinstance(value, str) else value
    typed.update(merge_extra_body({"extra_body": typed.pop("extra_body", None)}))
    typed.pop("model", None)
    port = served.video_port
    image = served.input_named("image", "image")
    if files.get(IMAGE_FIELD) is not None and image is None:
        raise bad_request(_no_image(server, served), param=IMAGE_FIELD)
    if image is not None and image.default is None and IMAGE_FIELD not in files:
        raise bad_request(
            f"'{IMAGE_FIELD}': pipeline '{served.name}' makes a video from an image: send it "
            f"as the multipart file '{IMAGE_FIELD}'",
            param=IMAGE_FIELD,
        )
    inputs = dict(files and {"image": files[IMAGE_FIELD]})
    if files:  # a refusal of the image names the field it came in
        params.input_fields["image"] = IMAGE_FIELD
    prompt = served.prompt_input
    if "prompt" not in typed:
        raise bad_request("'prompt' is missing", param="prompt")
    inputs[prompt.name] = typed.pop("prompt")
    fps = typed.pop("fps", None)
    fps = int(port.attrs.get("fps", DEFAULT_FPS)) if fps is None else fps
    if not isinstance(fps, int) or not 1 <= fps <= 240:
        raise bad_request(f"'fps' must be 1 to 240, not {fps!r}", param="fps")
    seconds = typed.pop("seconds", None)
    if seconds is not None:
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not (0 < seconds <= MAX_SECONDS)
        ):
            raise bad_request(
                f"'seconds' must be above 0 and at most {MAX_SECONDS}, not {seconds!r}",
                param="seconds",
            )
        typed.setdefault("num_frames", int(round(seconds * fps)) + 1)
    take_fields(served, typed, inputs, params)
    admitted = server.admit(served, inputs, params, {served.video_port.name})
    values = {**served.plan.params, **params.result()}
    frames = _frames(served, params.result())
    width, height = values.get("width"), values.get("height")
    shown = f"{width}x{height}" if width and height else "auto"
    return VideoRequest(served, inputs, params, admitted, fps, shown, frames)


def _frames(served, values: dict) -> int:
    """The frames the request's video will have: its diffusion stage's `frames`, as its VAE
    decodes them (`video_frames`, by the temporal factor the compiler sizes its latents by:
    6 asked make 5, 8 make 9)."""
    for stage in served.plan.stages:
        frames = stage.params.get("frames")
        if frames is not None:
            name = getattr(frames, "name", None)
            if name is not None:
                frames = values.get(name, served.plan.params.get(name, 1))
            config = load_component_config(stage.model, stage.component)
            return video_frames(int(frames), config.vae_temporal_factor)
    return 1


def _no_image(server, served) -> str:
    able = [
        s.name
        for s in server.served.values()
        if "videos" in s.capabilities and s.input_named("image", "image") is not None
    ]
    where = f"; image to video: {', '.join(able)}" if able else ""
    return (
        f"'{IMAGE_FIELD}': pipeline '{served.name}' makes videos from text and takes no input "
        f"image{where}"
    )


# --- the store -------------------------------------------------------------------------------
# `GET /v1/videos`'s page size: by default, and at most (OpenAI's list endpoints' bounds).
PAGE_SIZE, MOST_PAGED = 20, 100


def page_of(ids: list[str], query) -> tuple[list[str], bool]:
    """The page of job `ids` (oldest first) that list `query` (a mapping) asks for, as
    OpenAI's cursor pages are read: `order` desc (newest first, the default) or asc, at
    most `limit` (1 to MOST_PAGED, PAGE_SIZE by default), after the job `after`; and
    whether more follow. A 400 naming a bad or unknown query parameter."""
    unknown = sorted(set(query) - {"after", "limit", "order"})
    if unknown:
        raise bad_request(
            f"unknown query parameter '{unknown[0]}': GET /v1/videos takes after, limit and order",
            param=unknown[0],
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be asc or desc, not {order!r}", param="order")
    limit = query.get("limit", str(PAGE_SIZE))
    if not (ascii_digits(limit) and 1 <= int(limit) <= MOST_PAGED):
        raise bad_request(f"'limit' must be 1 to {MOST_PAGED}, not {limit!r}", param="limit")
    ordered = ids if order == "asc" else ids[::-1]
    if "after" in query:
        if query["after"] not in ordered:
            raise bad_request(
                f"'after': no video job '{query['after']}' is held (unknown, deleted or expired)",
                param="after",
            )
        ordered = ordered[ordered.index(query["after"]) + 1 :]
    return ordered[: int(limit)], len(ordered) > int(limit)


class VideoJobs:
    """The server's video jobs: bounded, each run by a task of the server's loop, kept until
    it expires."""

    def __init__(self, server, limit: int, ttl_s: float):
        self.server = server
        self.limit = limit
        self.ttl_s = ttl_s
        self.jobs: dict[str, VideoJob] = {}

    def _sweep(self) -> None:
        now = time.time()
        for job_id, job in list(self.jobs.items()):
            if job.expires_at is not None and now >= job.expires_at:
                del self.jobs[job_id]

    def create(self, request: VideoRequest) -> VideoJob:
        self._sweep()
        if self.server.draining:
            raise busy("the server is shutting down and takes no new jobs", retry_after=5)
        if len(self.jobs) >= self.limit:
            raise APIError(
                429,
                f"this server holds {len(self.jobs)} video jobs, its limit "
                f"(--max-video-jobs {self.limit}): retry once one has ended and expired, or "
                "DELETE finished ones",
                code="too_many_jobs",
                headers={"Retry-After": "5"},
            )
        job = VideoJob("video_" + secrets.token_hex(12), request, time.time())
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        return job

    def get(self, job_id: str) -> VideoJob:
        self._sweep()
        job = self.jobs.get(job_id)
        if job is None:
            raise APIError(
                404, f"no video job '{job_id}' (unknown, deleted or expired)", code="not_found"
            )
        return job

    async def describe(self, job: VideoJob) -> dict:
        if job.status == "in_progress" and time.monotonic() - job.checked > PROGRESS_CACHE_S:
            job.checked = time.monotonic()
            try:
                found = await anyio.to_thread.run_sync(job.served.engine.inspect)
            except Exception:  # the state is still the job's; progress is a courtesy
                found = {}
            progress = live_progress(job.served.plan, job.request_id, found)
            if progress is not None and job.status == "in_progress":
                job.progress = max(job.progress, progress)
        return job.describe()

    async def delete(self, job_id: str) -> dict:
        job = self.get(job_id)
        del self.jobs[job_id]
        if job.task is not None and not job.task.done():
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    def page(self, query) -> tuple[list[VideoJob], bool]:
        """`GET /v1/videos`'s page of the jobs held (`page_of` reads the query)."""
        self._sweep()
        held = sorted(self.jobs.values(), key=lambda j: j.created_at)
        ids, more = page_of([job.id for job in held], query)
        return [self.jobs[i] for i in ids], more

    async def close(self) -> None:
        """The server stops: every job still queued or running is cancelled."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job: VideoJob) -> None:
        served, server = job.served, self.server
        began = time.perf_counter()
        slot = None
        run = None
        status = 500
        try:
            while slot is None:  # queued until the pipeline admits it, however long that is
                if server.draining:
                    raise APIError(503, "the server stopped before the job started", code="stopped")
                try:
                    slot = await served.acquire()
                except APIError:  # the admission queue is full, or its wait bound passed
                    await asyncio.sleep(0.05)
            job.status, job.started_at = "in_progress", time.time()
            run = Run(served, job.request.admitted, job.request_id, {served.video_port.name}, began)
            video = await run.last(served.video_port.name, "video")
            job.progress = max(job.progress, ENCODING[0])

            def encoded(done: int, total: int) -> None:
                job.progress = max(job.progress, _within(ENCODING, done, total))

            job.content = await asyncio.to_thread(
                mp4_bytes, video, job.request.fps, on_frame=encoded
            )
            job.status, job.progress, status = "completed", 100, 200
        except APIError as err:
            job.status, status = "failed", err.status
            job.error = {"code": err.code or "failed", "message": err.message}
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as err:  # an encoder or runtime bug: the job fails, the server stays
            job.status = "failed"
            job.error = {"code": "internal_error", "message": f"{type(err).__name__}: {err}"}
        finally:
            if run is not None:
                await run.close()
            if slot is not None:
                slot.release()
            job.completed_at = time.time()
            job.expires_at = job.completed_at + self.ttl_s
            server.finish(run, served.name, "/v1/videos", status, began)


def live_progress(plan, request_id: str, found: dict) -> int | None:
    """The job's progress from the engine's inspection (module constants: BEFORE_DENOISING,
    DENOISING, AFTER_DENOISING): by the furthest stage that reports steps of its request,
    else by the first stage that holds it; None where no stage does, or the pipeline has no
    denoiser. Every stage holds a request from its admission: the VAE holds it, waiting for
    latents, through the whole denoise (that read 85 % from the denoiser's first step)."""
    names = [s.name for s in plan.stages]
    denoisers = [s.name for s in plan.stages if s.kind == "diffusion"]
    where = [
        (names.index(stage), getattr(inspection, "progress", {}).get(stage, {}).get(request_id))
        for inspection in found.values()
        for stage, calls in getattr(inspection, "calls", {}).items()
        if request_id in calls and stage in names
    ]
    if not where or not denoisers:
        return None
    stepping = [(index, steps) for index, steps in where if steps is not None]
    first = min(index for index, _ in where)
    index, steps = max(stepping, key=lambda found: found[0]) if stepping else (first, None)
    if index < names.index(denoisers[0]):
        return BEFORE_DENOISING
    phase = DENOISING if names[index] in denoisers else AFTER_DENOISING
    return phase[0] if steps is None else _within(phase, *steps)


def _within(phase: tuple[int, int], done: int, total: int) -> int:
    """The progress `done` of `total` steps into `phase` (its first and last percent)."""
    low, high = phase
    return low + int((high - low) * done / max(total, 1))
