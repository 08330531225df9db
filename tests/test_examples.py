"""Every example pipeline in graphs/ runs end to end on the tiny models, as its file stands,
through `omniflow run --tiny` with executor processes, and writes outputs people open."""

import wave
from pathlib import Path

import pytest
import torch
from PIL import Image

from omniflow.cli import main
from omniflow.media import decode_video, wav_bytes

GRAPHS = Path(__file__).parents[1] / "graphs"

# Per example: inputs, parameter overrides (short outputs keep the suite fast), output files.
EXAMPLES = {
    "omni_chat": (["prompt=Hello! Who are you?"], ["max_tokens=4", "max_audio_tokens=40", "seed=2"],
                  ["text.txt", "audio.wav"]),
    "qwen3_omni": (["prompt=Hello! Who are you?"], ["max_tokens=4", "max_audio_tokens=24", "seed=2"],
                   ["text.txt", "audio.wav"]),
    "tts": (["text=Good morning."], ["max_tokens=24"], ["audio.wav"]),
    "qwen3_tts": (["text=Good morning.", "voice=Vivian"], ["max_tokens=8"], ["audio.wav"]),
    "qwen3_tts_clone": (["text=Good morning.", "ref_audio={clip}"],
                        ["max_tokens=8", "x_vector_only_mode=true"], ["audio.wav"]),
    "text_to_image": (["prompt=a red boat"], ["steps=2", "height=32", "width=32"], ["image.png"]),
    "image_understanding": (["image={image}", "prompt=What is this?"], ["max_tokens=4"],
                            ["text.txt"]),
    "image_edit": (["image={image}", "prompt=Make the cat blue."],
                   ["steps=2", "height=32", "width=32"], ["edited.png"]),
    "text_to_video": (["prompt=A cat walks on the grass"],
                      ["steps=2", "height=32", "width=32", "num_frames=5"], ["video.mp4"]),
    "image_to_video": (["image={image}", "prompt=A cat walks on the grass"],
                       ["steps=2", "height=32", "width=32", "num_frames=5"], ["video.mp4"]),
}  # fmt: skip


def test_the_examples_are_all_here():
    assert sorted(EXAMPLES) == sorted(p.stem for p in GRAPHS.glob("*.omni"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_on_tiny_models(name, tmp_path):
    image = tmp_path / "in.png"
    pixels = torch.randint(0, 256, (40, 56, 3), generator=torch.Generator().manual_seed(0))
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(image)
    clip = tmp_path / "voice.wav"  # a voice clone's reference: a 1.5 s rising tone
    seconds = torch.arange(36000) / 24000
    clip.write_bytes(
        wav_bytes(0.3 * torch.sin(2 * torch.pi * (180 + 120 * seconds) * seconds), 24000)
    )
    inputs, params, files = EXAMPLES[name]
    args = ["run", "--once", str(GRAPHS / f"{name}.omni"), "--tiny", "--out", str(tmp_path / "out")]
    args += [a for i in inputs for a in ("--input", i.format(image=image, clip=clip))]
    args += [a for p in params for a in ("--param", p)]
    assert main(args) == 0
    for file in files:
        path = tmp_path / "out" / file
        if file.endswith(".txt"):
            assert path.read_text()
        elif file.endswith(".wav"):
            with wave.open(str(path)) as audio:
                assert audio.getframerate() == 24000 and audio.getnframes() > 0
        elif file.endswith(".mp4"):
            frames, fps, codec = decode_video(path.read_bytes())
            assert frames.shape == (5, 32, 32, 3) and fps == 16 and codec == "h264"
        else:
            assert Image.open(path).size == (32, 32)
