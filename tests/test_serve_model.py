"""A model picked by name: `--model` serves another model of a graph's family in place of its
model line, and `omniflow serve MODEL` picks the example graph that serves the model's family
and architecture (tests/test_supported.py: which graph that is)."""

import json
import wave
from pathlib import Path

import pytest

from omniflow.checkpoints.tiny import build_tiny
from omniflow.cli import main
from omniflow.families import published_configs
from omniflow.supported import supported_models

ROOT = Path(__file__).parents[1]
BASE = "Qwen/Qwen3-TTS-12Hz-1.7B-Base"
# Models an example graph serves though it names another: each through --model.
SIBLINGS = [m for m in supported_models() if m.graph and not m.named]


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _plan_models(out: str) -> set[str]:
    plan = json.loads(out)
    return {plan["model"]} | {s["model"] for s in plan["stages"] if s.get("model")}


def test_model_replaces_the_graphs_model_line(capsys):
    code, out, err = cli(capsys, "compile", "qwen3_tts", "--devices", "1xH200", "--json",
                         "--model", BASE)  # fmt: skip
    assert code == 0, err
    assert _plan_models(out) == {BASE}
    code, out, err = cli(capsys, "compile", "qwen3_tts", "--devices", "1xH200", "--json")
    assert BASE not in _plan_models(out)  # the graph as written


@pytest.mark.parametrize("sibling", SIBLINGS, ids=lambda m: m.model)
def test_every_model_listed_on_its_familys_graph_compiles_with_model(sibling, capsys):
    """What docs/models.md promises: tiny here, and at real size where its config ships."""
    build_tiny(sibling.tiny)
    graph = f"graphs/{sibling.graph}.omni"
    code, out, err = cli(capsys, "compile", graph, "--tiny", "--json", "--model", sibling.model)
    assert code == 0, err
    assert f"tiny:{sibling.tiny}" in _plan_models(out)
    if sibling.model in published_configs():
        code, out, err = cli(capsys, "compile", graph, "--devices", "8xH200", "--json",
                             "--model", sibling.model)  # fmt: skip
        assert code == 0, err
        assert sibling.model in _plan_models(out)


def test_a_model_of_another_family_is_refused_naming_the_graph_that_serves_it(capsys):
    code, out, err = cli(capsys, "compile", "qwen3_tts", "--devices", "1xH200",
                         "--model", "Qwen/Qwen-Image")  # fmt: skip
    assert code == 1 and out == ""
    assert err == (
        "omniflow: error: --model Qwen/Qwen-Image: pipeline 'qwen3_tts' serves qwen3_tts "
        "models, and Qwen/Qwen-Image is a qwen_image model; graphs/text_to_image.omni serves "
        "it\n"
    )


@pytest.mark.parametrize(
    "paths", [["graphs/tts.omni", "graphs/qwen3_tts.omni"], []], ids=["two", "none"]
)
def test_model_takes_one_omni_pipeline(paths, capsys):
    code, _, err = cli(capsys, "run", *paths, "--model", BASE, "--once")
    assert code == 2 and "--model replaces the model line of one .omni pipeline" in err


def test_serve_an_unknown_model_suggests_the_closest(capsys):
    code, _, err = cli(capsys, "serve", "Qwen/Qwen3-TTS-12Hz-1.7B-Bas")
    assert code == 1
    assert err.startswith(
        "omniflow: error: no example graph serves 'Qwen/Qwen3-TTS-12Hz-1.7B-Bas'; did you mean "
        f"'{BASE}'?"
    )


@pytest.mark.parametrize(
    "argv, graph",
    [(["serve", BASE], "qwen3_tts_clone"), (["run", "qwen3_tts", "--model", BASE], "qwen3_tts")],
    ids=["its-own-graph", "its-familys-graph"],
)
def test_the_base_checkpoint_checks_requests_as_a_clone_model(argv, graph, capsys, tmp_path):
    """The Base checkpoint (voice clones), served by name on the graph written for it, or by
    --model on graphs/qwen3_tts.omni, written for CustomVoice: either way the family's check
    of a request against the Base checkpoint answers, before any work."""
    build_tiny("qwen3-tts-base")
    code, _, err = cli(capsys, *argv, "--tiny", "--once", "--input", "text=Hello",
                       "--out", str(tmp_path / "out"))  # fmt: skip
    assert code == 1
    if argv[0] == "serve":
        assert f"serving {BASE} on {ROOT / f'graphs/{graph}.omni'}" in err
    assert "voice cloning (Base) needs ref_audio" in err and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_serve_a_model_end_to_end_writes_its_audio(capsys, tmp_path):
    build_tiny("qwen3-tts-voicedesign")
    code, _, err = cli(capsys, "serve", "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign", "--tiny",
                       "--once", "--input", "text=Hello", "--input", "instructions=A calm voice",
                       "--param", "max_tokens=8", "--out", str(tmp_path))  # fmt: skip
    assert code == 0, err
    with wave.open(str(tmp_path / "audio.wav")) as audio:
        assert audio.getnframes() > 0
