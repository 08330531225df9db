"""The requests a starting server suggests trying (`  try NAME: curl ...` on its stderr,
omniflow/server/suggested.py), pasted as printed against the shared tiny server: each
answers 200, in seconds, and names the small sizes and limits that make it quick (the
pipelines' defaults are their real models'); and the lines a stage's load prints. Video:
tests/server/test_videos.py; voice clones: tests/server/test_qwen3_tts_serving.py."""

import json
import re
import shlex
import subprocess
import time

import pytest

from omniflow.runtime import control

# Per pipeline: fields its suggestion must carry (what keeps it short on a CPU).
SIZED = {
    "omni_chat": {"max_tokens": 16, "max_audio_tokens": 240},
    "tts": {"max_new_tokens": 100},
    "text_to_image": {"size": "256x256", "num_inference_steps": 4},
}


def paste(line: str, reply_path) -> tuple[str, float]:
    """Run a suggested `curl` line as a shell would, its reply to `reply_path`: the status
    and the seconds it took."""
    began = time.monotonic()
    done = subprocess.run(
        [*shlex.split(line), "-s", "-o", str(reply_path), "-w", "%{http_code}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout, time.monotonic() - began


@pytest.mark.parametrize("pipeline", sorted(SIZED))
def test_each_suggestion_answers_in_seconds(served, pipeline, tmp_path):
    (line,) = served.suggested(pipeline)
    body = json.loads(shlex.split(line)[-1])
    assert body["model"] == pipeline and SIZED[pipeline].items() <= body.items(), body
    status, seconds = paste(line, tmp_path / "reply")
    assert status == "200", (tmp_path / "reply").read_text(errors="replace")
    assert seconds < 60


def test_a_pipeline_that_needs_a_file_gets_no_suggestion(served):
    assert served.suggested("image_understanding") == []  # every request brings an image


def test_the_start_up_says_each_stage_loaded_and_what_its_graph_capture_took(served):
    """A line a stage as its model loads; a stage that captures CUDA graphs (on a GPU) adds
    one saying how many and how long, the message its executor sends being what it prints."""
    log = served.startup_log()
    for stage in ("thinker", "talker", "code2wav"):
        assert re.search(rf"^loaded omni_chat/{stage} in [\d.]+ s$", log, re.MULTILINE), log
    assert "CUDA graphs" not in log  # none captured on a CPU
    assert "torch reserved" not in log  # no GPU to say what its executor holds of (Memory)
    loaded = control.decode(control.encode(control.Loaded("talker", 41.24, 33.08, 24)))
    assert loaded.lines("omni_chat/talker") == [
        "loaded omni_chat/talker in 41.2 s",
        "omni_chat/talker: captured 24 CUDA graphs in 33.1 s",
    ]
    work = "24 graphs, 6 warmed up: ..."  # (a static decoder's `capture_work().line()`)
    loaded = control.decode(control.encode(control.Loaded("talker", 41.24, 33.08, 24, work)))
    assert loaded.lines("omni_chat/talker")[2] == f"omni_chat/talker: capture ran {work}"
