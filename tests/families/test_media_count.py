"""The omni families' media count (`Family.media_tokens`: `towers.MediaCount`), which
admission counts a request's media with from their sizes alone, gives each item the
embeddings its tower's own `prepare` makes of it: clips about the feature hop and the 30 s
window, pictures about the processors' pixel bounds, videos as their files' bytes (sampled
at the processor's fps from what the header declares) and as frames. What it cannot read
counts 0 (its stage refuses it, saying why)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniflow.checkpoints.tiny import build_tiny
from omniflow.families.qwen2_5_omni import towers
from omniflow.families.qwen3_omni import towers as qwen3_towers
from omniflow.media import mp4_bytes
from tests.families import media_inputs as media

FAMILIES = {"qwen2.5-omni": towers, "qwen3-omni": qwen3_towers}
# Clips of a window's samples (400), a hop's (160) about their edges, and about 30 s.
SAMPLES = (400, 401, 559, 560, 16000, 16159, 479_999, 480_000, 480_161, 500_000)
PICTURES = ((1, 3), (3, 1), (56, 84), (57, 85), (300, 40), (2000, 1500))


def stage(component: str) -> SimpleNamespace:
    """What the hook reads of a stage's plan."""
    return SimpleNamespace(kind="encoder", component=component)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(its towers module, its tiny checkpoint, the audio tower, the vision tower)."""
    module, path = FAMILIES[request.param], str(build_tiny(request.param))
    loaded = {c: module.load(path, c, torch.float32) for c in ("audio_tower", "visual")}
    return module, path, loaded["audio_tower"], loaded["visual"]


def test_a_tower_stage_counts_with_its_towers_arithmetic(family):
    module, path, audio, vision = family
    count = module.media_tokens(stage("audio_tower"), path)
    assert type(count) is audio.counting is vision.counting
    assert module.media_tokens(stage("thinker"), path) is None


def test_a_clips_count_is_its_towers(family):
    module, path, audio, _ = family
    count = module.media_tokens(stage("audio_tower"), path)
    for samples in SAMPLES:
        clip = 0.4 * torch.sin(torch.arange(samples) * 0.13)
        assert count("audio", clip) == audio.prepare("audio", clip).tokens, samples


def test_a_pictures_count_is_its_towers(family):
    module, path, _, vision = family
    count = module.media_tokens(stage("visual"), path)
    for h, w in PICTURES:
        picture = media.image(h * w, h, w)
        assert count("image", picture) == vision.prepare("image", picture).tokens, (h, w)


@pytest.mark.parametrize("frames", [2, 5, 9, 16])
def test_a_videos_count_is_its_towers(family, frames):
    """A file at 4 fps (sampled down to the processor's 2) and its frames as they are."""
    module, path, _, vision = family
    count = module.media_tokens(stage("visual"), path)
    clip = media.frames(frames)
    data = torch.frombuffer(bytearray(mp4_bytes(clip, 4)), dtype=torch.uint8)
    for video in (data, clip):
        assert count("video", video) == vision.prepare("video", video).tokens > 0


def test_what_it_cannot_read_counts_nothing(family):
    module, path, _, _ = family
    count = module.media_tokens(stage("visual"), path)
    assert count("video", torch.zeros(64, dtype=torch.uint8)) == 0  # no video file
    assert count("image", media.image(0, 1, 201)) == 0  # past the processor's aspect ratio
