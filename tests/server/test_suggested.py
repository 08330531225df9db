"""The requests a starting server suggests trying (`  try NAME: curl ...` on its stderr,
omniflow/server/suggested.py), pasted as printed against the shared tiny server: each
answers 200, in seconds, and names the small sizes and limits that make it quick (the
pipelines' defaults are their real models'). Video: tests/server/test_videos.py; voice
clones: tests/server/test_qwen3_tts_serving.py."""

import json
import shlex
import subprocess
import time

import pytest

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
