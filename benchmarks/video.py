"""Wan2.2 on the step-wise denoiser (issues 30 and 40): what a DiT step costs against its FLOP
roofline, what a video costs end to end (in the engine and over HTTP, with the GPU's peak
memory), what step caching saves, and what batching concurrent videos gives against the
DiT's compute bound.

(a) One denoising step of a guided request at `--width`, `--height` and `--frames`: its
    conditional and unconditional rows (the video's tokens and 512 text tokens each) as one
    forward of each expert (A14B: the high-noise `transformer` and the low-noise
    `transformer_2`; on CUDA on the backend's fused blocks, and beside it the same forward
    on diffusers' blocks; a timestep per row as text-to-video runs, and for TI2V one per
    token as its image-to-video runs), and the DiffusionSteps backend's own step (the
    forward, CFG and UniPC's update, text-to-video), against the forward's FLOPs (`omniflow.catalog.costs`' Wan DiT count: every projection and MLP of
    every block, self-attention over the video's tokens, cross-attention over the text's)
    over the matmul rate measured in the same run (8192^3 in bf16 on CUDA).
(b) One video through the compiled graph in the engine (executor processes), `--steps`
    steps: its wall time and each stage's time inside its steps (on CUDA first what each
    executor's loads left on its GPU: torch's reserved bytes, those in tensors); at
    `--scaled` depth d < 1, also the real-size estimate (the DiT's and the text encoder's
    busy time / d, the VAE's as measured: a step's per-layer work does not depend on the
    depth).
(c) Step caching: the same video at each `--cache` threshold: DiT steps computed and
    reused, the first-block distances the cache saw, and the frames' distance from the
    uncached video. On random weights this says what is saved, not what it costs in
    quality: that needs the real weights.
(d) `--concurrency` videos at once against the same videos one after another (videos/s),
    beside the DiT's bound (steps x pair FLOPs / matmul rate).
(e) One video through the HTTP server (`omniflow run` on the same graph, its own executor
    processes) as the peer's client makes it: `POST /v1/videos` (multipart; image-to-video
    with an `input_reference` PNG), the job polled (`GET /v1/videos/{id}`: each change of
    status and progress, with its time), the MP4 fetched and decoded (PyAV: frames, size),
    its wall time.
(f) The VAE's decode of one video's latents (random, seeded), a latent frame a step as the
    vae stage runs it, with the VAE loaded at each of `--vae-dtypes` through the stage's
    own loader: seconds, and the frames' largest and mean distance from the first dtype's
    (random weights: how far the frames move, not what a viewer sees).
On CUDA (b) and (e) report the GPU's peak memory in use while they run (nvidia-smi sampled
every 0.2 s: every process on the device, this one's CUDA context included).
`--parts` picks among them (default a to e; (d) also needs `--concurrency` > 0).

    python benchmarks/video.py                                      # tiny T2V, CPU smoke run
    python benchmarks/video.py --device cuda --scaled 0.5           # T2V-A14B, 20 of 40 layers
    python benchmarks/video.py --device cuda --model ti2v --scaled 1   # TI2V-5B, real size
    python benchmarks/video.py --parts e                            # tiny T2V over HTTP, CPU
    python benchmarks/video.py --device cuda --model ti2v --scaled 1 --width 1280 --height 704 \
        --frames 121 --parts f --vae-dtypes float32 bfloat16        # TI2V's VAE at two dtypes

`--scaled DEPTH` builds once, under $OMNIFLOW_CACHE/scaled/, a random-weight Wan2.2 at the
published widths with DEPTH x each expert's and the text encoder's layers
(`omniflow.families.wan.checkpoints.build_scaled`): T2V/I2V-A14B at depth 1 is 69 GB in bf16
(more than the GPU host's 64 GiB disk: use 0.5, 35 GB, or put OMNIFLOW_CACHE on /dev/shm),
TI2V-5B 23 GB. On CUDA the text encoder and the DiT run in bf16, the VAE in float32 (the
first of `--vae-dtypes`).
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from diffusion import first_step, timed_ms
from PIL import Image
from serve import Server
from stage_steps import matmul_rate

from omniflow.backends.diffusion import DiffusionSteps, load_pipeline, pack_prompts, pipeline_code
from omniflow.backends.dit_blocks import modules_forward
from omniflow.catalog.components import load_component_config, video_frames
from omniflow.catalog.costs import estimate_cost
from omniflow.catalog.resolve import model_path
from omniflow.checkpoints.scaled import scaled_checkpoint
from omniflow.compiler import compile_source
from omniflow.families.wan.checkpoints import REAL_I2V, REAL_T2V, REAL_TI2V
from omniflow.kernels.timing import kernel_table
from omniflow.runtime import control
from omniflow.runtime.engine import Engine
from omniflow.runtime.stage import Call, InputStream, StageSpec

GRAPHS = Path(__file__).parents[1] / "graphs"
MODELS = {  # name -> (graph, real model, tiny checkpoint)
    "t2v": ("text_to_video", REAL_T2V, "tiny:wan2.2-t2v"),
    "i2v": ("image_to_video", REAL_I2V, "tiny:wan2.2-i2v"),
    "ti2v": ("text_to_video", REAL_TI2V, "tiny:wan2.2-ti2v"),
}
PROMPT = "A cat walks on the grass, realistic style"
NEGATIVE = "blurry, low quality"
TEXT_TOKENS = 512  # every Wan prompt is padded to 512 rows


def graph_text(
    model: str, checkpoint: str, cuda: bool, size: dict[str, int], vae_dtype: str = "float32"
) -> str:
    """The model's example graph on `checkpoint`, compiled for videos of `size` (its `height`,
    `width` and `num_frames` params: the stages' memory and buffers are sized for them);
    TI2V-5B has one expert: no boundary or second scale, and its own flow_shift. On CUDA the
    encoder and DiT in bf16; the VAE in `vae_dtype`."""
    text = (GRAPHS / f"{MODELS[model][0]}.omni").read_text(encoding="utf-8")
    text = re.sub(r'model "[^"]+"', f'model "{checkpoint}"', text, count=1)
    for param, value in size.items():
        text, found = re.subn(rf"param {param} = \d+", f"param {param} = {value}", text)
        assert found == 1, param
    if model == "ti2v":
        for old in (
            "guidance_scale_2=$guidance_scale_2,\n                            ",
            "boundary_ratio=$boundary_ratio, flow_shift=$flow_shift,\n                            ",
            "  param guidance_scale_2 = 3.0\n  param boundary_ratio = 0.875\n",
            "  param flow_shift = 3.0\n",
        ):
            text = text.replace(old, "")
    if cuda:
        for stage in ("encoder(", "diffusion("):
            text = text.replace(stage, f'{stage}dtype="bfloat16", ')
    return text.replace('vae(component="vae"', f'vae(component="vae", dtype="{vae_dtype}"')


def frames_of(frames: int) -> int:
    """The frames a Wan2.2 video asked for with `frames` is made with (its VAE: 4 a latent)."""
    return video_frames(frames, 4)


def request_of(model: str, args, seed: int = 0, **more) -> tuple[dict, dict]:
    inputs = {"prompt": PROMPT, "negative_prompt": NEGATIVE}
    if model == "i2v":
        generator = torch.Generator().manual_seed(seed)
        inputs["image"] = torch.randint(0, 256, (args.height, args.width, 3), generator=generator)
        inputs["image"] = inputs["image"].to(torch.uint8)
    params = {"steps": args.steps, "height": args.height, "width": args.width,
              "num_frames": args.frames, "guidance_scale": 4.0, "seed": seed, **more}  # fmt: skip
    return inputs, params


def pair_flops(model_dir: str, part: str, tokens: int) -> float:
    """FLOPs of one forward of an expert over a request's cond and uncond rows."""
    config = load_component_config(model_dir, part)
    cost = estimate_cost(config, max_batch=1, max_len=tokens, context_len=TEXT_TOKENS)
    return 2 * cost.flops_per_item


def step_rows(plan, device: str, args, kernels: int):
    """(a): [(variant, ms, flops)] of one guided step per expert, and the backend's step."""
    spec = StageSpec.from_channels(plan.stage("dit"), plan.channels)
    backend = DiffusionSteps(spec, device)
    pipe = backend.pipe
    transformer = pipe.transformer
    config, dtype = transformer.config, transformer.dtype
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor_spatial
    latent = (frames_of(args.frames) - 1) // pipe.vae_scale_factor_temporal + 1
    shape = (2, config.in_channels, latent, args.height // scale, args.width // scale)
    hidden = torch.randn(shape, generator=generator).to(device, dtype)
    text = torch.randn(2, TEXT_TOKENS, config.text_dim, generator=generator).to(device, dtype)
    tokens = latent * (args.height // scale // 2) * (args.width // scale // 2)
    # A timestep per row, as a text-to-video step runs; TI2V's image-to-video runs one per
    # token (`expand_timesteps`: the image's frame at 0), measured beside it.
    timesteps = {"": torch.full((2,), 500.0, device=device)}
    if pipe.config.expand_timesteps:
        timesteps[", a timestep per token"] = torch.full((2, tokens), 500.0, device=device)
    rows = []
    for part, (label, timestep) in itertools.product(
        ("transformer", "transformer_2"), timesteps.items()
    ):
        expert = getattr(pipe, part, None)
        if expert is None:
            continue

        def forward(expert=expert, timestep=timestep):
            with torch.no_grad():
                expert(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                       return_dict=False)  # fmt: skip

        if kernels and device.startswith("cuda"):
            print(f"  {part} pair forward: its {kernels} costliest kernels")
            kernel_table(forward, kernels, calls=2)
        model_dir = model_path(plan.stage("dit").model)
        flops = pair_flops(model_dir, part, tokens)
        rows.append((f"{part}, pair{label}", timed_ms(forward, device, args.repeats), flops))
        if backend.attention is not None:  # the blocks are fused: diffusers' own beside them
            with modules_forward(expert.blocks):
                rows.append((f"{part}, diffusers' blocks{label}",
                             timed_ms(forward, device, args.repeats), flops))  # fmt: skip
    # The backend's own step of one guided request (the forward, CFG, UniPC's update).
    cond = InputStream("hidden")
    cond.push(pack_prompts([text[0], text[1]]), end=True)
    params = {"steps": 1000, "height": args.height, "width": args.width,
              "frames": frames_of(args.frames), "guidance_scale": 4.0, "seed": 0}  # fmt: skip
    inputs = {"cond": cond}
    if "image" in spec.inputs:
        image = InputStream("image")
        image.push(torch.zeros(args.height, args.width, 3, dtype=torch.uint8), end=True)
        inputs["image"] = image
    call = Call("step", params, inputs)
    first_step(backend, call)
    rows.append(("backend step", timed_ms(lambda: backend.step([call]), device, args.repeats),
                 rows[0][2]))  # fmt: skip
    kernel = "diffusers' blocks" if backend.attention is None else backend.attention.kernel
    return rows, tokens, kernel


class PeakGpuMemory:
    """Inside: the GPU's memory in use, every process's (nvidia-smi), sampled every 0.2 s;
    `peak_gib` after (None without nvidia-smi)."""

    def __init__(self, cuda: bool):
        self.command = shutil.which("nvidia-smi") if cuda else None
        self.peak_gib = None
        self.stopping = threading.Event()

    def sample(self) -> None:
        query = [self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                 str(torch.cuda.current_device())]  # fmt: skip
        while not self.stopping.wait(0.2):
            used = subprocess.run(query, capture_output=True, text=True).stdout.strip()
            if used:
                gib = int(used.splitlines()[0]) / 1024  # MiB
                self.peak_gib = gib if self.peak_gib is None else max(self.peak_gib, gib)

    def __enter__(self):
        if self.command:
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        if self.command:
            self.thread.join()
        return False

    def __str__(self) -> str:
        return "n/a" if self.peak_gib is None else f"{self.peak_gib:.1f} GiB"


def serve_video(graph: str, args, cuda: bool) -> None:
    """(e): one video through `omniflow run`'s /v1/videos, as a job."""
    folder = Path(tempfile.mkdtemp(prefix="video-serve-"))
    (folder / "video.omni").write_text(graph, encoding="utf-8")
    start = time.perf_counter()
    devices = "1xH200" if cuda else "cpu"
    server = Server([str(folder / "video.omni"), "--devices", devices], log=folder / "server.log")
    print(f"\n(e) one video over HTTP: server up in {time.perf_counter() - start:.1f} s "
          f"(its log: {folder / 'server.log'})")  # fmt: skip
    try:
        with httpx.Client(base_url=server.base, timeout=600) as client, PeakGpuMemory(cuda) as peak:
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            fields = {"model": model, "prompt": PROMPT, "negative_prompt": NEGATIVE,
                      "size": f"{args.width}x{args.height}", "num_frames": args.frames,
                      "num_inference_steps": args.steps, "guidance_scale": 4.0, "seed": 0}  # fmt: skip
            files = {}
            if args.model == "i2v":
                png = io.BytesIO()
                Image.new("RGB", (args.width, args.height), (90, 140, 60)).save(png, "PNG")
                files = {"input_reference": ("image.png", png.getvalue(), "image/png")}
            start = time.perf_counter()
            reply = client.post("/v1/videos", data={k: str(v) for k, v in fields.items()},
                                files=files or None)  # fmt: skip
            job = reply.raise_for_status().json()
            seen = None
            print(f"{'s':>7} {'status':>12} {'progress':>8}")
            while True:
                now = (job["status"], job["progress"])
                if now != seen:
                    print(f"{time.perf_counter() - start:7.2f} {now[0]:>12} {now[1]:>8}")
                    seen = now
                if job["status"] not in ("queued", "in_progress"):
                    break
                time.sleep(0.2)
                job = client.get(f"/v1/videos/{job['id']}").raise_for_status().json()
            done = time.perf_counter() - start
            if job["status"] != "completed":
                sys.exit(f"the video job ended {job['status']}: {job.get('error')}")
            mp4 = client.get(f"/v1/videos/{job['id']}/content").raise_for_status().content
            wall = time.perf_counter() - start
        import av  # PyAV decodes the MP4 here alone: (a)-(d) run where it is not installed

        with av.open(io.BytesIO(mp4)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        height, width = frames[0].shape[:2]
        print(f"job completed in {done:.2f} s; MP4 fetched at {wall:.2f} s: {len(mp4) / 1e6:.2f} MB,"
              f" {len(frames)} frames of {width}x{height}; peak GPU memory {peak}")  # fmt: skip
        if (len(frames), width, height) != (args.frames, args.width, args.height):
            sys.exit(f"expected {args.frames} frames of {args.width}x{args.height}")
    finally:
        server.stop()


def serve(engine: Engine, requests, concurrent: bool) -> tuple[float, list]:
    """Seconds to serve `requests` all at once or one after another, and their videos."""
    out = [None] * len(requests)

    def one(i: int) -> None:
        out[i] = engine.generate(*requests[i])["video"]

    start = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(requests)):
            one(i)
    return time.perf_counter() - start, out


def spent(engine: Engine, before: dict) -> dict:
    """Each stage's (steps, seconds in step(), calls, counters) since `before`."""
    now = {
        name: (t.steps, t.step_ns, t.calls, dict(t.counters))
        for inspection in engine.inspect().values()
        for name, t in inspection.stages.items()
    }
    out = {}
    for name, (steps, ns, calls, counters) in now.items():
        b = before.get(name, (0, 0, 0, {}))
        diff = {k: v - b[3].get(k, 0) for k, v in counters.items()}
        out[name] = (steps - b[0], (ns - b[1]) / 1e9, calls - b[2], diff)
    return out


def snapshot(engine: Engine) -> dict:
    return {
        name: (t.steps, t.step_ns, t.calls, dict(t.counters))
        for inspection in engine.inspect().values()
        for name, t in inspection.stages.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    parser.add_argument("--model", default="t2v", choices=sorted(MODELS))
    parser.add_argument("--scaled", type=float, metavar="DEPTH",
                        help="a random-weight Wan2.2 at real widths, DEPTH x layers (default: tiny)")  # fmt: skip
    parser.add_argument("--width", type=int, default=None, help="default: 832 (CUDA), 48 (CPU)")
    parser.add_argument("--height", type=int, default=None, help="default: 480 (CUDA), 32 (CPU)")
    parser.add_argument("--frames", type=int, default=None, help="default: 81 (CUDA), 9 (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="(b)-(d); default 10 (CUDA), 12")
    parser.add_argument("--repeats", type=int, default=5, help="(a)'s timed steps")
    parser.add_argument("--kernels", type=int, default=0, help="(a): the N costliest kernels")
    parser.add_argument("--cache", type=float, nargs="*", default=[0.1, 0.5, 1.0, 1.5],
                        help="(c)'s thresholds (none: skip)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=2, help="(d); 0: skip")
    parser.add_argument("--parts", nargs="+", default=list("abcde"), choices=list("abcdef"),
                        help="which parts to run (default a to e)")  # fmt: skip
    parser.add_argument("--vae-dtypes", nargs="+", default=["float32"], metavar="DTYPE",
                        choices=["float32", "bfloat16", "float16"],
                        help="the VAE's dtypes: the first for (b) to (e), all in (f)")  # fmt: skip
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("benchmarks/video.py: --device cuda, but torch sees no CUDA device")
    args.width = args.width or (832 if cuda else 48)
    args.height = args.height or (480 if cuda else 32)
    args.frames = frames_of(args.frames or (81 if cuda else 9))
    args.steps = args.steps or (10 if cuda else 12)
    torch.set_num_threads(1)  # the engine's executors get the cores
    _, real, tiny = MODELS[args.model]
    model_dir = str(scaled_checkpoint(real, args.scaled, args.device)) if args.scaled else tiny
    size = {"height": args.height, "width": args.width, "num_frames": args.frames}
    graph = graph_text(args.model, model_dir, cuda, size, args.vae_dtypes[0])
    plan = compile_source(graph, devices="1xH200" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rate = matmul_rate(args.device, 8192 if cuda else 512, dtype)
    if cuda:  # its operands' memory back to the GPU: the peak columns count every process's
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}: {str(dtype)[6:]} matmul {rate / 1e12:.2f} TFLOP/s; {args.model} {model_dir}")
    print(f"video {args.width}x{args.height}, {args.frames} frames")

    rows = []
    if "a" in args.parts:
        rows, tokens, kernel = step_rows(plan, args.device, args, args.kernels)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(f"\n(a) one guided DiT step: cond + uncond rows of {tokens} video + {TEXT_TOKENS} "
              f"text tokens; the blocks' attention: {kernel}")  # fmt: skip
        print(f"{'variant':>56} {'GFLOP':>10} {'roof ms':>9} {'ms':>9} {'vs roof':>8}")
        for label, ms, flops in rows:
            roof = flops / rate * 1e3
            print(f"{label:>56} {flops / 1e9:10.1f} {roof:9.2f} {ms:9.2f} {ms / roof:7.2f}x")
    if set(args.parts) & set("bcd"):
        engine_parts(plan, args, rows, rate, cuda)
    if "e" in args.parts:
        serve_video(graph, args, cuda)
    if "f" in args.parts:
        vae_dtypes(args, model_dir, cuda, size)


def vae_dtypes(args, model_dir: str, cuda: bool, size: dict[str, int]) -> None:
    """(f): one video's latents decoded a latent frame a step with the VAE at each dtype."""
    print("\n(f) the VAE's decode of one video's latents, a latent frame a step")
    print(f"{'dtype':>9} {'latent frames':>13} {'s':>7} {'frames max|d|':>14} {'mean|d|':>8}")
    first, latents = None, None
    devices = "1xH200" if cuda else "cpu"
    for dtype in args.vae_dtypes:
        plan = compile_source(graph_text(args.model, model_dir, cuda, size, dtype), devices)
        spec = StageSpec.from_channels(plan.stage("vae"), plan.channels)
        code = pipeline_code(spec)
        pipe = load_pipeline(spec, args.device, ("vae",), code)
        if latents is None:
            latent_frames = (args.frames - 1) // pipe.vae_scale_factor_temporal + 1
            spatial = pipe.vae_scale_factor_spatial
            shape = (1, pipe.vae.config.z_dim, latent_frames, args.height // spatial,
                     args.width // spatial)  # fmt: skip
            latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        on_device = latents.to(args.device, pipe.vae.dtype)
        with torch.no_grad():
            code.decode_in_steps(pipe.vae, on_device).advance()  # cuDNN's plans for its shapes
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            decoding = code.decode_in_steps(pipe.vae, on_device)
            while decoding.done < decoding.total:
                decoding.advance()
            frames = decoding.result().cpu()
            seconds = time.perf_counter() - began
        first = frames if first is None else first
        d = (frames - first).abs()
        print(f"{dtype:>9} {decoding.total:>13} {seconds:7.2f} {d.max():14.4f} {d.mean():8.5f}")
        del pipe, on_device, decoding
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def engine_parts(plan, args, rows, rate: float, cuda: bool) -> None:
    """(b), (c) and (d), on one engine."""
    start = time.perf_counter()
    said = []
    with Engine(plan, "process", on_loaded=said.append) as engine:
        warm = request_of(args.model, args, 0, steps=2)
        engine.generate(*warm)
        print(f"\nengine up and one 2-step video served in {time.perf_counter() - start:.1f} s")
        for memory in (m for m in said if isinstance(m, control.Memory)):
            print(*memory.lines(f"after load, {memory.about}"))
        before = snapshot(engine)
        with PeakGpuMemory(cuda) as peak:
            wall, (video,) = serve(engine, [request_of(args.model, args)], concurrent=False)
        stages = spent(engine, before)
        print(f"\n(b) one video, {args.steps} steps, guidance 4: {wall:.2f} s; peak GPU memory "
              f"{peak}")  # fmt: skip
        print(f"{'stage':>8} {'steps':>6} {'busy s':>8} {'of wall':>8}")
        for stage, (steps, busy, _, _) in stages.items():
            print(f"{stage:>8} {steps:>6} {busy:8.2f} {busy / wall:7.0%}")
        if args.scaled and args.scaled < 1:
            scaled = sum(stages[s][1] for s in ("dit", "encoder") if s in stages)
            estimate = wall + scaled * (1 / args.scaled - 1)
            print(f"real-size estimate (DiT and text encoder busy time / {args.scaled:g}): "
                  f"{estimate:.2f} s")  # fmt: skip

        if args.cache and "c" in args.parts:
            print(f"\n(c) step caching, {args.steps} steps (random weights: what it saves, not "
                  "what it costs in quality)")  # fmt: skip
            print(f"{'threshold':>9} {'computed':>9} {'reused':>7} {'forwards saved':>15} "
                  f"{'wall s':>7} {'frames max|d|':>14} {'mean|d|':>8}")  # fmt: skip
            for threshold in [0.0, *args.cache]:
                before = snapshot(engine)
                took, (got,) = serve(
                    engine, [request_of(args.model, args, cache_threshold=threshold)], False
                )
                counters = spent(engine, before)["dit"][3]
                computed = counters.get("steps_computed", 0)
                reused = counters.get("steps_reused", 0)
                diff = (got.int() - video.int()).abs().float()
                saved = reused / max(computed + reused, 1)
                print(f"{threshold:9.3g} {computed:9d} {reused:7d} {saved:14.0%} {took:7.2f} "
                      f"{diff.max():14.0f} {diff.mean():8.2f}")  # fmt: skip

        if args.concurrency and "d" in args.parts and rows:
            n = args.concurrency
            requests = [request_of(args.model, args, seed=i) for i in range(n)]
            walls = {False: [], True: []}
            for _ in range(2):
                for concurrent in (False, True):
                    walls[concurrent].append(serve(engine, requests, concurrent)[0])
            pair = sum(f for label, _, f in rows if "pair" in label) / max(
                1, sum("pair" in label for label, _, _ in rows)
            )
            bound = rate / (args.steps * pair)
            print(f"\n(d) {n} videos, {args.steps} steps each (median of 2 rounds each way)")
            print(f"{'variant':>12} {'wall s':>8} {'videos/s':>9} {'of bound':>9}")
            for concurrent, label in ((False, "sequential"), (True, "concurrent")):
                wall = statistics.median(walls[concurrent])
                print(f"{label:>12} {wall:8.2f} {n / wall:9.4f} {n / wall / bound:8.0%}")
            print(f"{'DiT bound':>12} {'':>8} {bound:9.4f}  (steps x pair FLOPs / matmul rate)")


if __name__ == "__main__":
    main()
