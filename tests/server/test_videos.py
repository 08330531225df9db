"""Video jobs over HTTP, as the peer's ComfyUI client drives them (peer_api.md §2.5), against
a real `omniflow run` of the tiny Wan2.2 text-to-video and image-to-video pipelines: a
multipart create with every value a string answers at once with an id and a status; the
job is polled to completed (with progress) and its content is an H.264 MP4 of the asked
frames, size and rate; `input_reference` makes it image-to-video; the same seed gives the
same video (its frames within a pixel level), also from `/v1/videos/sync`; a job outlives
its client; the store is bounded (429) and results expire; DELETE cancels a running job in
every stage; a request the pipeline cannot take is a 400 at once, one that fails in a stage
a failed job."""

import io
import json
import shlex
import subprocess
import time

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from omniflow.media import decode_video
from omniflow.server.errors import APIError
from omniflow.server.videos import page_of
from tests.server.conftest import GRAPHS, HERE, wait_until

TTL_S = 3.0
PIPELINES = [str(GRAPHS / "text_to_video.omni"), str(GRAPHS / "image_to_video.omni"),
             str(HERE / "reel.omni")]  # fmt: skip
SMALL = ["--param", "steps=2", "--param", "height=32", "--param", "width=32",
         "--param", "num_frames=5"]  # fmt: skip
# What the peer's client sends besides its prompt and size: every value as str(v).
PEER = {"num_frames": "5", "fps": "8", "num_inference_steps": "2", "seed": "5",
        "guidance_scale": "4.0", "guidance_scale_2": "3.0", "boundary_ratio": "0.875",
        "flow_shift": "5.0", "negative_prompt": "blurry"}  # fmt: skip


@pytest.fixture(scope="module")
def server(request):
    from tests.server.conftest import ServerProcess

    server = ServerProcess(
        [
            *PIPELINES,
            "--tiny",
            "--mode",
            "inprocess",
            *SMALL,
            "--max-video-jobs",
            "3",
            "--video-ttl",
            str(TTL_S),
        ]  # fmt: skip
    )
    yield server
    server.stop_cleanly()


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


def png(width: int = 40, height: int = 24) -> bytes:
    pixels = (np.arange(height * width * 3).reshape(height, width, 3) * 5 % 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def create(http, model="text_to_video", image: bytes | None = None, **fields) -> httpx.Response:
    data = {"model": model, "prompt": "A cat walks on the grass", "width": "32", "height": "32",
            **PEER, **fields}  # fmt: skip
    files = {"input_reference": ("image.png", image, "image/png")} if image else None
    return http.post("/v1/videos", data=data, files=files)


# How far two videos of one seed may be apart: a pixel level on average. The CPU's matrix
# products round differently with their buffers' alignment (a run's allocations), and that
# may move a pixel of the tiny model's output by a level, so the encoded bytes can differ.
SAME_VIDEO = 1.0


def frames_of(mp4: bytes) -> torch.Tensor:
    return decode_video(mp4)[0].float()


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean absolute difference of two videos' decoded pixels, in levels."""
    return (a - b).abs().mean().item()


def finished(http, job_id: str, timeout: float = 60.0) -> dict:
    """Poll as the peer's client does (faster) until the job completes or fails."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/videos/{job_id}").json()
        seen.append((job["status"], job["progress"]))
        if job["status"] in ("completed", "failed"):
            job["seen"] = seen
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {seen[-3:]}")


def test_a_peer_text_to_video_job_completes_with_an_h264_mp4(server, http):
    reply = create(http)
    assert reply.status_code == 200, reply.text
    job = reply.json()
    assert job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
    assert job["object"] == "video" and job["model"] == "text_to_video"
    done = finished(http, job["id"])
    assert done["status"] == "completed" and done["progress"] == 100, done
    assert done["error"] is None and done["seed"] == 5 and done["size"] == "32x32"
    progress = [p for _, p in done["seen"]]
    assert progress == sorted(progress)
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames, fps, codec = decode_video(content.content)
    assert frames.shape == (5, 32, 32, 3) and fps == 8 and codec == "h264"
    assert frames.float().std() > 1
    listed = http.get("/v1/videos").json()["data"]
    assert job["id"] in [j["id"] for j in listed]
    paged = OpenAI(base_url=server.url, api_key="unused", max_retries=0).videos.list(limit=1)
    assert [video.id for video in paged] == [j["id"] for j in listed]  # a page at a time
    deleted = http.delete(f"/v1/videos/{job['id']}")
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{job['id']}").status_code == 404


@pytest.mark.parametrize("asked, made", [(8, 9), (6, 5), (3, 1)])
def test_a_job_reports_the_frames_its_video_has(http, asked, made):
    """Wan's VAE decodes a first frame and four a latent frame: 8 frames asked make 9, 6
    make 5 and 3 make 1, as diffusers' pipeline makes them; the job says so from the start
    (it said 8, and 0.875 s), and the MP4 has them."""
    job = create(http, num_frames=str(asked)).json()
    assert job["num_frames"] == made and job["seconds"] == f"{(made - 1) / 8:g}"
    assert finished(http, job["id"])["status"] == "completed"
    frames, _, _ = decode_video(http.get(f"/v1/videos/{job['id']}/content").content)
    assert frames.shape[0] == made
    assert http.delete(f"/v1/videos/{job['id']}").status_code == 200  # the store holds 3


def test_a_list_page_is_read_as_openais_cursor_pages():
    ids = [f"video_{i}" for i in range(5)]  # oldest first
    assert page_of(ids, {}) == (ids[::-1], False)  # newest first
    assert page_of(ids, {"limit": "2"}) == (["video_4", "video_3"], True)
    assert page_of(ids, {"limit": "2", "after": "video_3"}) == (["video_2", "video_1"], True)
    after = {"order": "asc", "limit": "3", "after": "video_1"}
    assert page_of(ids, after) == (["video_2", "video_3", "video_4"], False)
    for query, param in [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                         ({"limit": "101"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "video_9"}, "after"), ({"limt": "2"}, "limt")]:  # fmt: skip
        with pytest.raises(APIError) as refused:
            page_of(ids, query)
        assert refused.value.status == 400 and refused.value.param == param


def test_progress_moves_through_the_vae_decode_frame_by_frame(http):
    """The final phase reports too: the VAE decodes a latent frame a step, and the job's
    progress moves through 85..95 as it does (it used to sit at the denoiser's last value
    for the whole decode), then through the MP4's encode, to 100."""
    reply = create(http, width="256", height="256", num_frames="33", num_inference_steps="1")
    assert reply.status_code == 200, reply.text
    done = finished(http, reply.json()["id"], timeout=180)
    assert done["status"] == "completed", done
    progress = [p for _, p in done["seen"]]
    assert progress == sorted(progress) and progress[-1] == 100
    decoding = {p for p in progress if 85 <= p < 95}
    assert len(decoding) >= 2, progress  # seen moving, not one value for the whole decode
    job_id = reply.json()["id"]
    frames, _, _ = decode_video(http.get(f"/v1/videos/{job_id}/content").content)
    assert frames.shape == (33, 256, 256, 3)
    assert http.delete(f"/v1/videos/{job_id}").status_code == 200  # the store holds 3


def test_the_suggested_video_request_finishes_in_seconds(server, http):
    """The `curl` line the server prints at start-up, run as pasted: a small video (not the
    pipeline's 832x480, 81 frames, 40 steps: minutes on a CPU), done in seconds."""
    (line,) = server.suggested("text_to_video")
    assert server.suggested("image_to_video") == []  # it needs an image: none suggested
    began = time.monotonic()
    created = subprocess.run([*shlex.split(line), "-s"], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    job = json.loads(created.stdout)
    done = finished(http, job["id"], timeout=120)
    assert done["status"] == "completed" and done["size"] == "256x256", done
    assert time.monotonic() - began < 60
    frames, _, _ = decode_video(http.get(f"/v1/videos/{job['id']}/content").content)
    assert frames.shape == (9, 256, 256, 3)
    assert http.delete(f"/v1/videos/{job['id']}").status_code == 200


def test_the_same_seed_gives_the_same_video_and_sync_gives_it_too(http):
    first = finished(http, create(http, seed="11").json()["id"])
    second = finished(http, create(http, seed="11").json()["id"])
    other = finished(http, create(http, seed="12").json()["id"])
    videos = {
        name: frames_of(http.get(f"/v1/videos/{job['id']}/content").content)
        for name, job in (("first", first), ("second", second), ("other", other))
    }
    data = {"model": "text_to_video", "prompt": "A cat walks on the grass", "width": "32",
            "height": "32", **PEER, "seed": "11"}  # fmt: skip
    sync = http.post("/v1/videos/sync", data=data)
    assert sync.status_code == 200 and sync.headers["x-omniflow-seed"] == "11"
    same = [distance(videos["first"], v) for v in (videos["second"], frames_of(sync.content))]
    apart = distance(videos["first"], videos["other"])
    assert max(same) <= SAME_VIDEO < apart, (same, apart)
    for job in (first, second, other):
        http.delete(f"/v1/videos/{job['id']}")


def test_input_reference_makes_it_image_to_video(http):
    job = finished(http, create(http, "image_to_video", image=png()).json()["id"])
    assert job["status"] == "completed", job
    frames, _, _ = decode_video(http.get(f"/v1/videos/{job['id']}/content").content)
    assert frames.shape == (5, 32, 32, 3)
    http.delete(f"/v1/videos/{job['id']}")
    refused = create(http, "text_to_video", image=png())
    assert refused.status_code == 400 and "image to video: image_to_video" in refused.text
    missing = create(http, "image_to_video")
    assert missing.status_code == 400 and "input_reference" in missing.json()["error"]["param"]
    data = {"model": "image_to_video", "prompt": "A cat", **PEER}
    two = [("input_reference", ("a.png", png(), "image/png"))] * 2
    twice = http.post("/v1/videos", data=data, files=two)
    assert twice.status_code == 400 and "one image per request" in twice.text
    # An image past the plan's buffer is refused naming the field it came in.
    large = create(http, "image_to_video", image=png(2048, 1024))
    assert large.status_code == 400 and large.json()["error"]["param"] == "input_reference"
    far = create(http, seconds="1e9")
    assert far.status_code == 400 and "at most 600" in far.json()["error"]["message"]


def test_a_job_outlives_its_client(server):
    with server.client() as client:
        job_id = create(client).json()["id"]
    with server.client() as client:  # another connection, later
        assert finished(client, job_id)["status"] == "completed"
        client.delete(f"/v1/videos/{job_id}")


@pytest.mark.parametrize(
    "fields, message, param",
    [
        ({"num_frames": "many"}, "must be an integer", "num_frames"),
        ({"colour": "red"}, "unknown field 'colour'", "colour"),
        ({"fps": "0"}, "'fps' must be 1 to 240", "fps"),
        ({"size": "big"}, "WIDTHxHEIGHT", "size"),
        ({"height": "40"}, "multiple of 16", "height"),  # what the DiT takes (its patch)
        ({"num_inference_steps": "5000"}, "at most 1000", "num_inference_steps"),
    ],
)
def test_a_request_the_pipeline_cannot_take_is_a_400_at_once(http, fields, message, param):
    reply = create(http, **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_a_request_that_fails_in_a_stage_is_a_failed_job(http):
    reply = http.post("/v1/videos", data={"model": "reel", "prompt": "fail, please"})
    job = finished(http, reply.json()["id"])
    assert job["status"] == "failed" and "failing as asked" in job["error"]["message"]
    content = http.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 409 and "failing as asked" in content.text
    http.delete(f"/v1/videos/{job['id']}")
    made = finished(
        http, http.post("/v1/videos", data={"model": "reel", "prompt": "a"}).json()["id"]
    )
    assert made["status"] == "completed"  # the same pipeline, asked nothing odd
    frames, _, _ = decode_video(http.get(f"/v1/videos/{made['id']}/content").content)
    assert frames.shape[0] == 4
    http.delete(f"/v1/videos/{made['id']}")  # the store holds 3


def test_the_store_is_bounded_delete_cancels_everywhere_and_results_expire(http):
    slow = {"num_inference_steps": "400"}  # seconds of steps on the tiny model
    jobs = [create(http, **slow).json()["id"] for _ in range(3)]
    full = create(http)
    assert full.status_code == 429 and full.headers["retry-after"] == "5"
    assert "--max-video-jobs 3" in full.json()["error"]["message"]
    running = jobs[0]
    wait_until(lambda: http.get(f"/v1/videos/{running}").json()["status"] == "in_progress", 30)
    wait_until(lambda: http.get(f"/v1/videos/{running}").json()["progress"] > 5, 30, 0.1)

    def held() -> set[str]:
        found = http.get("/debug/inspect").json()
        return {
            rid
            for pipeline in found.values()
            for executor in pipeline.get("executors", {}).values()
            for calls in executor["calls"].values()
            for rid in calls
        }

    assert running in held()
    for job_id in jobs:
        assert http.delete(f"/v1/videos/{job_id}").json()["deleted"] is True
    wait_until(lambda: not set(jobs) & held())  # cancelled in every stage
    done = finished(http, create(http).json()["id"])
    assert http.get(f"/v1/videos/{done['id']}").status_code == 200
    assert done["expires_at"] - done["completed_at"] in (int(TTL_S), int(TTL_S) + 1)
    time.sleep(TTL_S + 0.5)
    assert http.get(f"/v1/videos/{done['id']}").status_code == 404


def test_progress_reads_the_stage_working_on_the_job():
    # Every stage holds a request from its admission: the VAE, waiting for latents, holds it
    # through the whole denoise, which must not read as the denoise done.
    from omniflow.compiler import compile_file
    from omniflow.runtime.control import Inspection
    from omniflow.server.videos import live_progress

    plan = compile_file(GRAPHS / "text_to_video.omni", devices="cpu", tiny=True)

    def progress(calls: dict, steps: dict) -> int | None:
        found = {"e": Inspection("e", calls, 0, 0, progress=steps)}
        return live_progress(plan, "r", found)

    everywhere = {"encoder": ["r"], "dit": ["r"], "vae": ["r"]}
    assert progress(everywhere, {}) == 2  # encoding
    assert progress(everywhere, {"dit": {"r": [1, 4]}}) == 5 + 80 // 4
    assert progress({"vae": ["r"]}, {}) == 85  # denoised, the decode not started
    assert progress({"vae": ["r"]}, {"vae": {"r": [7, 21]}}) == 85 + 10 * 7 // 21
    assert progress({"dit": ["s"]}, {}) is None
