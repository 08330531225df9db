"""The peer's image requests (its ComfyUI client's shapes: every diffusion field at the top
level, true CFG with a negative prompt, VAE tiling and slicing) served on one GPU as on the
CPU: graphs/text_to_image.omni on tiny models, one server on cuda:0 (the one-executor plan,
fused DiT blocks, attention chosen at load) and one on the CPU, the same requests; the
images agree up to the GPU's arithmetic (its own blocks and kernels, not bit-equal)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.server.conftest import GRAPHS

# 320 px: past the tiny VAE's 256 px tile, so tiling splits the decode.
SIZE = 320
BODIES = [
    {"negative_prompt": "blurry", "true_cfg_scale": 4.0, "vae_use_tiling": False},
    {"negative_prompt": "blurry", "true_cfg_scale": 4.0, "vae_use_tiling": True},
    {"true_cfg_scale": 1.0, "vae_use_slicing": True, "vae_use_tiling": False},
]


def image_of(server, extra: dict) -> np.ndarray:
    body = {"model": "text_to_image", "prompt": "a red boat", "size": f"{SIZE}x{SIZE}",
            "response_format": "b64_json", "n": 1, "num_inference_steps": 2,
            "guidance_scale": 7.5, "seed": 9, **extra}  # fmt: skip
    with server.client(timeout=300) as http:
        reply = http.post("/v1/images/generations", json=body)
    assert reply.status_code == 200, reply.text
    data = base64.b64decode(reply.json()["data"][0]["b64_json"])
    image = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)
    assert image.shape == (SIZE, SIZE, 3)
    return image


@pytest.mark.gpu
def test_the_peers_image_requests_give_the_cpus_images_on_a_gpu(start_server):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    graph = str(GRAPHS / "text_to_image.omni")
    gpu = start_server(graph, "--tiny", "--devices", "1xH200")
    cpu = start_server(graph, "--tiny", "--devices", "cpu", "--mode", "inprocess")
    for extra in BODIES:
        on_gpu, on_cpu = image_of(gpu, extra), image_of(cpu, extra)
        assert np.abs(on_gpu - on_cpu).mean() < 8, extra
        assert np.corrcoef(on_gpu.ravel(), on_cpu.ravel())[0, 1] > 0.95, extra
    gpu.stop_cleanly()
    cpu.stop_cleanly()
