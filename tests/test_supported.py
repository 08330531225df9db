"""The models supported, one registry: `omniflow models list` and docs/models.md's table are
both made from the families and the example graphs, so neither can drift from them."""

import os
import re
import subprocess
import sys
from pathlib import Path

from omniflow import families
from omniflow.supported import (
    graph_models,
    serving_graph,
    supported_models,
    supported_models_markdown,
)

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs/models.md"
BLOCK = re.compile(
    r"(<!-- supported models: begin -->\n)(.*?)(<!-- supported models: end -->)", re.DOTALL
)


def test_the_docs_table_is_what_the_registry_makes():
    text = DOCS.read_text()
    if os.environ.get("OMNIFLOW_UPDATE_GOLDEN"):
        text = BLOCK.sub(lambda m: m[1] + supported_models_markdown() + m[3], text)
        DOCS.write_text(text)
    block = BLOCK.search(text)
    assert block, "docs/models.md has no supported-models block"
    assert block[2] == supported_models_markdown()


def test_every_model_a_family_names_is_listed_once_and_every_example_model_is_one():
    listed = [m.model for m in supported_models()]
    assert len(listed) == len(set(listed))
    assert set(families.counterparts()) | set(families.published_configs()) <= set(listed)
    assert set(graph_models().values()) <= set(listed)


def test_a_graph_serves_what_it_names_and_its_familys_siblings_of_the_same_architecture():
    assert serving_graph("Qwen/Qwen2.5-Omni-7B") == ("omni_chat", True)
    assert serving_graph("qwen/qwen2.5-omni-7b") == ("omni_chat", True)  # as the hub matches
    assert serving_graph("Qwen/Qwen2.5-Omni-3B") == ("omni_chat", False)
    # Same family, other classes: each of Qwen-Image's pipelines has its own graph.
    assert serving_graph("Qwen/Qwen-Image-Edit") == ("image_edit", True)
    # Qwen3-TTS: voice clones (Base) have their graph; VoiceDesign is served by CustomVoice's.
    assert serving_graph("Qwen/Qwen3-TTS-12Hz-1.7B-Base") == ("qwen3_tts_clone", True)
    assert serving_graph("Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign") == ("qwen3_tts", False)
    assert serving_graph("Qwen/Qwen2.5-0.5B-Instruct") == (None, False)  # no graph for it
    assert serving_graph("someone/unknown-model") == (None, False)


def test_models_list_shows_each_model_with_its_graph_and_whether_its_tiny_build_is_built(
    tmp_path, monkeypatch
):
    from omniflow.checkpoints.tiny import build_tiny, tiny_cache_dir

    cache = tmp_path / "cache"
    monkeypatch.setenv("OMNIFLOW_CACHE", str(cache))
    build_tiny("qwen2", tiny_cache_dir() / "qwen2")  # the smallest; every other is unbuilt here
    result = subprocess.run(
        [sys.executable, "-P", "-m", "omniflow.cli", "models", "list"],
        cwd=ROOT, env={**os.environ, "OMNIFLOW_CACHE": str(cache)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line}
    for m in supported_models():
        row = lines[m.model]
        graph = [m.graph, "(--model)"] if m.graph and not m.named else [m.graph or "-"]
        assert row[1 : 1 + len(graph)] == graph, row
        state = ["(built)"] if m.tiny == "qwen2" else ["(not", "built)"]
        assert row[1 + len(graph) :][:-1] == [m.tiny, *state], row
    assert lines["qwen2"][1] == "built" and lines["tts"][1:3] == ["not", "built"]
