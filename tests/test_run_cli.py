"""`omniflow run`: one request through a real engine, outputs written as files people open."""

import io
import json
import re
import shlex
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omniflow.cli import main
from omniflow.devices import this_machine
from omniflow.media import decode_video, mp4_bytes, pcm16, png_bytes, wav_bytes


def test_run_writes_text_and_a_playable_wav(tmp_path, capsys):
    # In process: executor processes would map the 2xH200 plan's gigabytes of rings (the
    # CLI's own executor processes: test_profile_writes_..., and tests/test_examples.py).
    code = main(["run", "--once", "graphs/omni_chat.omni", "--devices", "2xH200", "--standin", "--mode", "inprocess",
                 "--input", "prompt=hello", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    text = (tmp_path / "text.txt").read_text()
    assert text.startswith("w") and text in capsys.readouterr().out
    with wave.open(str(tmp_path / "audio.wav")) as audio:
        assert (audio.getnchannels(), audio.getsampwidth(), audio.getframerate()) == (1, 2, 24000)
        assert audio.getnframes() > 0 and audio.getnframes() % 480 == 0  # whole codec frames


@pytest.mark.slow
def test_the_readmes_once_command_as_written_finishes_in_seconds(tmp_path, capsys):
    """The README's `--once` line, run as written (its out/ here): its limits keep the
    tiny model's random text and speech short (the request itself takes seconds), where the
    graph's defaults (2048 tokens) ran for a minute and a half."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (command,) = re.findall(r"`(omniflow run graphs/omni_chat\.omni --once [^`]*)`", readme)
    argv = shlex.split(command.replace("\n", " "))[1:]
    assert argv[-2:] == ["--out", "out/"] and "max_tokens=24" in argv
    began = time.monotonic()
    assert main([*argv[:-1], str(tmp_path / "out")]) == 0
    assert time.monotonic() - began < 120  # most of it the executors' start on 2 busy cores
    text = (tmp_path / "out" / "text.txt").read_text()
    assert text and text in capsys.readouterr().out
    # The speech: up to 240 codes (random weights may end it at once).
    with wave.open(str(tmp_path / "out" / "audio.wav")) as audio:
        assert audio.getframerate() == 24000


def test_run_writes_a_png_with_parameter_overrides(tmp_path):
    code = main(["run", "--once", "graphs/text_to_image.omni", "--devices", "2xH200", "--standin", "--mode", "inprocess",
                 "--input", "prompt=a cat", "--param", "steps=2", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    image = Image.open(tmp_path / "image.png")
    assert image.size == (1024, 1024) and image.mode == "RGB"


def test_bad_request_is_a_clean_error(tmp_path, capsys):
    code = main(
        [
            "run",
            "--once",
            "graphs/tts.omni",
            "--standin",
            "--devices",
            "2xH200",
            "--input",
            "txt=hi",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 1
    assert "unknown input(s) txt; the pipeline takes text, voice" in capsys.readouterr().err


@pytest.mark.skipif(this_machine() != "cpu", reason="omni_chat fits a GPU machine")
def test_run_without_devices_is_for_this_machine_as_compile_is(tmp_path, capsys):
    """No --devices: this machine's devices (here a CPU), as `compile` detects them; a graph
    too big for it gets compile's one line, once or served, before anything is written."""
    assert main(["compile", "graphs/omni_chat.omni"]) == 1
    compiled = capsys.readouterr().err
    assert "does not fit this machine (cpu): needs a GPU: try --devices 1xH200" in compiled
    once = ["--once", "--input", "prompt=hi", "--out", str(tmp_path / "chat")]
    for flags in (once, ["--port", "0"]):  # one request; a server
        assert main(["run", "graphs/omni_chat.omni", *flags]) == 1
        assert capsys.readouterr().err == compiled
    assert not (tmp_path / "chat").exists()
    code = main(["run", "graphs/tts.omni", "--once", "--standin", "--mode", "inprocess",
                 "--input", "text=hello", "--out", str(tmp_path / "tts")])  # fmt: skip
    assert code == 0 and (tmp_path / "tts" / "audio.wav").is_file()


def test_media_encoders_round_trip():
    samples = torch.tensor([[0.0, 0.5], [-1.0, 2.0]])
    assert pcm16(samples).tolist() == [0, 16384, -32767, 32767]
    assert wav_bytes(samples, 16000)[:4] == b"RIFF"
    pixels = torch.arange(2 * 3 * 3, dtype=torch.uint8).reshape(1, 2, 3, 3)
    image = Image.open(io.BytesIO(png_bytes(pixels)))
    assert torch.equal(torch.from_numpy(np.array(image)), pixels[0])


def test_an_mp4_encode_reports_each_frame_written():
    """What a video job's last phase shows: every frame, as its packet is written."""
    frames = torch.randint(0, 256, (12, 32, 48, 3), generator=torch.Generator().manual_seed(0))
    heard = []
    data = mp4_bytes(
        frames.to(torch.uint8), 8, on_frame=lambda done, total: heard.append((done, total))
    )
    assert heard == [(i, 12) for i in range(1, 13)]
    assert decode_video(data)[0].shape == (12, 32, 48, 3)


def test_models_cli_lists_and_builds_tiny_checkpoints(tmp_path, capsys):
    assert main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("qwen2", "qwen2.5-omni", "text-to-image", "tts"))
    assert main(["models", "build-tiny", "qwen2", "--out", str(tmp_path / "lm")]) == 0
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "lm"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    assert model.config.model_type == "qwen2"
    assert main(["models", "build-tiny", "qwen7"]) == 1
    assert "unknown tiny model 'qwen7'" in capsys.readouterr().err


def test_profile_writes_a_trace_and_a_report_of_the_request(tmp_path, capsys):
    code = main(["run", "graphs/tts.omni", "--once", "--devices", "2xH200", "--standin",
                 "--input", "text=hello there", "--out", str(tmp_path / "out"),
                 "--profile", str(tmp_path / "prof")])  # fmt: skip
    assert code == 0
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e["name"].endswith(" step")}
    assert steps == {"codec_lm step", "decoder step"}
    assert (tmp_path / "prof" / "report.html").read_text().lstrip().lower().startswith("<!doctype")
    assert "profile: " in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU profile where there is none")
def test_profile_gpu_without_cuda_says_so_before_running(tmp_path, capsys):
    code = main(["run", "graphs/tts.omni", "--once", "--devices", "2xH200", "--standin",
                 "--input", "text=hello", "--out", str(tmp_path / "out"),
                 "--profile", str(tmp_path / "prof"), "--profile-gpu"])  # fmt: skip
    assert code == 1
    assert "--profile-gpu needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "prof" / "trace.json").exists()


def test_run_from_a_checkout_without_safe_path(tmp_path):
    """`python -m omniflow.cli` in this repository puts its root first on sys.path, where its
    kernels/ would shadow PyPI's `kernels` (which transformers imports) in the executors,
    which take the CLI's path: the CLI moves the working directory after installed packages."""
    root = Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "omniflow.cli", "run", "graphs/qwen3_tts.omni", "--tiny", "--once",
         "--input", "text=Hi", "--param", "max_tokens=4", "--out", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with wave.open(str(tmp_path / "audio.wav")) as audio:
        assert audio.getnframes() > 0
