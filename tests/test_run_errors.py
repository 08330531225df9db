"""`omniflow run` and `compile` as a new user meets them: every mistake is one clear line and a
non-zero exit, found before any executor starts, with nothing written; Ctrl-C cancels
cleanly; an empty output is still a valid file."""

import os
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest
import torch

from omniflow.cli import main
from omniflow.runtime.shm_ring import segments
from tests.runtime.test_failures import finish, interruptible

ROOT = Path(__file__).parents[1]
GRAPHS = ROOT / "graphs"
SILENT = """
pipeline silent {
  stage mute = python(fn=tests.runtime.stages.silent, inputs="in:text", outputs="out:audio")
  input text: text -> mute
  mute.out -> output audio [rate=16000]
}
"""
OFFLINE_MODEL = """
pipeline chat {
  model "Qwen/Qwen2.5-0.5B-Instruct"
  stage lm = ar(max_batch=2)
  input prompt: chat -> lm
  lm.text -> output text [stream]
}
"""


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# (argv after "run --once", what the one error line says); none of them may start an executor.
MISTAKES = [
    (["omni_chat", "--input", "prompt=hi", "--param", "speaker=Bob"],
     "unknown speaker 'Bob'; the model has Chelsie, Ethan"),
    (["omni_chat", "--input", "prompt=hi", "--param", "max_tokenz=3"],
     "unknown parameter 'max_tokenz'"),
    (["omni_chat", "--input", "promt=hi"], "unknown input(s) promt; the pipeline takes prompt"),
    (["omni_chat"], "missing input 'prompt'"),
    (["omni_chat", "--input", "prompt=hi", "--param", "max_tokens=1e9"],
     "parameter 'max_tokens' must be int, not 1000000000.0"),
    (["omni_chat", "--input", "prompt=hi", "--param", "max_tokens=100000000"],
     "stage 'thinker' was compiled for max_tokens=2048"),
    (["omni_chat", "--input", "prompt=hi", "--param", "temperature=-1"],
     "parameter 'temperature' is out of its domain: temperature -1 (in [0, 100])"),
    (["text_to_image", "--input", "prompt=a cat", "--param", "height=100000"],
     "stage 'dit' was compiled for height=1024"),
    (["image_understanding", "--input", "prompt=hi", "--input", "image=/no/such.png"],
     "no readable image file at '/no/such.png'"),
    (["tts", "--input", "text=hi", "--input", "voice=Nobody"], "unknown speaker 'Nobody'"),
    (["omni_chat", "--input", "prompt=hi", "--out", "/dev/null/x"], "/dev/null is not a folder"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_models():
    """The tiny checkpoints the graphs run on, built before the runs (a first build prints its
    progress, which is not the mistake's line)."""
    from omniflow.checkpoints.tiny import build_tiny

    for name in ("qwen2.5-omni", "qwen2.5-vl", "tts", "text-to-image"):
        build_tiny(name)


@pytest.mark.parametrize("argv, message", MISTAKES, ids=[" ".join(m[0][1:3]) for m in MISTAKES])
@pytest.mark.usefixtures("tiny_models")
def test_a_mistake_is_one_line_before_any_work_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    name, *rest = argv
    args = ["run", "--once", str(GRAPHS / f"{name}.omni"), "--tiny", "--out", str(out), *rest]
    start = time.perf_counter()
    code, _, err = run(capsys, *args)
    assert code == 1
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("omniflow: error: ")
    assert not out.exists()
    assert time.perf_counter() - start < 30  # no executor started: seconds, not a model load


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--port", "70000", "expected a port, 0 to 65535, not 70000"),  # (it wrapped to 4464)
        ("--max-body-bytes", "-5", "expected at least 1, not -5"),  # (every request a 413)
        ("--max-queue-wait", "nan", "expected finite seconds above 0, not nan"),
        ("--drain-timeout", "-1", "expected finite seconds 0 or more, not -1"),
        ("--max-image-pixels", "lots", "expected a whole number, not 'lots'"),
        ("--max-image-pixels", "0", "expected at least 1, not 0"),
        ("--max-speech-sessions", "0", "expected at least 1, not 0"),
    ],
)
def test_a_serving_flag_out_of_its_range_is_refused_as_the_command_line_is_read(
    flag, value, says, capsys
):
    with pytest.raises(SystemExit) as refused:
        main(["run", str(GRAPHS / "tts.omni"), "--tiny", flag, value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"omniflow run: error: argument {flag}: {says}")
    assert err.count("\n") == 1 and "omniflow run -h" in err  # one line, not the usage


def test_param_values_are_json_else_text(tmp_path, capsys):
    # In process: executor processes would map the 2xH200 plan's gigabytes of rings.
    code, out, _ = run(capsys, "run", "--once", str(GRAPHS / "omni_chat.omni"), "--standin", "--devices", "2xH200",
                       "--mode", "inprocess", "--input", "prompt=hi", "--param", "speaker=Ethan",
                       "--param", "max_tokens=3", "--param", "seed=7", "--out", str(tmp_path))  # fmt: skip
    assert code == 0
    assert (tmp_path / "text.txt").read_text() in out


def test_the_seed_is_reported_and_replays_the_request(tmp_path, capsys):
    def once(*extra):
        code, _, err = run(capsys, "run", "--once", str(GRAPHS / "tts.omni"), "--tiny", "--mode", "inprocess",
                           "--input", "text=Good morning.", "--param", "max_tokens=24",
                           "--out", str(tmp_path), *extra)  # fmt: skip
        assert code == 0
        return err, (tmp_path / "audio.wav").read_bytes()

    err, first = once()
    seed = int(err.split("(replay: --param seed=")[1].split(")")[0])
    replay_err, replayed = once("--param", f"seed={seed}")
    assert f"seed {seed} " in replay_err and replayed == first


def test_an_empty_output_is_a_valid_file_and_the_run_says_so(tmp_path, capsys):
    source = tmp_path / "silent.omni"
    source.write_text(SILENT)
    code, _, err = run(capsys, "run", "--once", str(source), "--mode", "inprocess", "--input", "text=hi",
                       "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 0
    assert "audio: " in err and "empty" in err
    with wave.open(str(tmp_path / "out" / "audio.wav")) as audio:
        assert (audio.getnframes(), audio.getframerate()) == (0, 16000)


def test_a_missing_model_names_it_and_the_ways_to_provide_it_within_seconds(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    source = tmp_path / "chat.omni"
    source.write_text(OFFLINE_MODEL)
    start = time.perf_counter()
    code, _, err = run(capsys, "run", "--once", str(source), "--input", "prompt=hi", "--out",
                       str(tmp_path / "out"))  # fmt: skip
    assert code == 1 and time.perf_counter() - start < 10
    assert "model 'Qwen/Qwen2.5-0.5B-Instruct' is not on this machine" in err
    assert "--tiny" in err and "huggingface-cli download" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_plan_on_a_machine_without_gpus_is_a_clear_error(tmp_path, capsys):
    code, _, err = run(capsys, "run", "--once", str(GRAPHS / "omni_chat.omni"), "--tiny", "--devices",
                       "2xH200", "--input", "prompt=hi", "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 1 and "this machine has no CUDA device" in err
    assert "--devices cpu" in err and not (tmp_path / "out").exists()


def test_unwritable_plan_path_and_bad_key_value_are_usage_errors(capsys):
    code, _, err = run(capsys, "compile", str(GRAPHS / "tts.omni"), "-o", "/nonexistent/dir/p.json")
    assert code == 2 and "cannot write the plan to /nonexistent/dir/p.json" in err
    code, _, err = run(capsys, "run", "--once", str(GRAPHS / "tts.omni"), "--input", "text")
    assert code == 2 and "expected NAME=VALUE, not 'text'" in err


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr("omniflow.compiler.optimize_file", broken)
    code, _, err = run(capsys, "compile", str(GRAPHS / "tts.omni"))
    assert code == 1 and "internal error: ZeroDivisionError: injected" in err
    assert "--debug" in err and "Traceback" not in err
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "compile", str(GRAPHS / "tts.omni")])


def _segments_of(pids: set[int]) -> list[str]:
    """Shared-memory segments that these processes created (`omniflow-<pid>-...`)."""
    return [name for name, pid in segments().items() if pid in pids]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


TICKING = """pipeline ticking {
  stage src = python(fn=tests.runtime.stages.ticker, inputs="n:text", outputs="out:text")
  input n: text -> src
  src.out -> output text [stream]
}
"""


@pytest.mark.slow
def test_ctrl_c_cancels_cleanly_and_leaves_nothing_behind(tmp_path):
    # A reply that would stream for hours (a tick every 50 ms), so the interrupt always lands
    # mid-request however loaded the machine is.
    (tmp_path / "ticking.omni").write_text(TICKING)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "omniflow.cli", "run", "--once", str(tmp_path / "ticking.omni"),
         "--input", "n=1000000", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMNIFLOW_TEST_DELAY": "0.05"},
        preexec_fn=interruptible,
    )  # fmt: skip
    # Interrupt once the reply streams (the first tick reached the terminal).
    assert proc.stdout.read(1)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    pids = {proc.pid, *map(int, children.stdout.split())}
    assert len(pids) == 2  # the frontend and its executor
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 130
    assert err.strip().endswith("omniflow: interrupted") and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)) and _segments_of(pids) == []
