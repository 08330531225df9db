"""`pip install .` ships the example graphs: a wheel built from this checkout carries every
graphs/*.omni as omniflow/graphs/, and an installed omniflow, run outside any checkout, finds
its default pipeline and a graph named by its stem. Built offline (no build isolation:
setuptools is in the venv)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from omniflow.cli import main
from omniflow.examples import find_pipeline

ROOT = Path(__file__).parents[1]
GRAPHS = sorted((ROOT / "graphs").glob("*.omni"))
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), "."],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob("omniflow-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (put on PYTHONPATH to use it)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [*PIP, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def _python(target: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run(
        [sys.executable, "-P", *argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_the_wheel_carries_every_example_graph(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert GRAPHS and {f"omniflow/graphs/{g.name}" for g in GRAPHS} <= names


def test_an_installed_omniflow_finds_its_default_pipeline_and_graphs_by_name(installed, tmp_path):
    found = _python(
        installed, tmp_path, "-c",
        "import omniflow; from omniflow.server.launch import default_pipeline;"
        "from omniflow.examples import find_pipeline;"
        "print(omniflow.__file__); print(default_pipeline()); print(find_pipeline('qwen3_tts'))",
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    module, default, by_name = found.stdout.split()
    package = installed / "omniflow"
    assert Path(module) == package / "__init__.py"  # the installed copy, not this checkout
    assert Path(default) == package / "graphs/omni_chat.omni"
    assert Path(by_name).read_text() == (ROOT / "graphs/qwen3_tts.omni").read_text()
    assert Path(by_name).parent == package / "graphs"


def test_an_installed_omniflow_compiles_a_graph_named_by_its_stem(installed, tmp_path):
    result = _python(installed, tmp_path, "-m", "omniflow.cli", "compile", "tts", "--devices",
                     "2xH200")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pipeline tts: stages" in result.stdout


def test_in_a_checkout_names_and_paths_both_find_graphs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert find_pipeline("qwen3_tts") == ROOT / "graphs/qwen3_tts.omni"
    assert find_pipeline("graphs/qwen3_tts.omni") == Path("graphs/qwen3_tts.omni")
    assert find_pipeline("no_such_graph") is None and find_pipeline("qwen3_tts.json") is None
    assert main(["compile", "tts.omni", "--devices", "2xH200"]) == 0
    assert "pipeline tts: stages" in capsys.readouterr().out
    assert main(["compile", "no_such_graph"]) == 2
    assert capsys.readouterr().err == "omniflow: error: no such file: no_such_graph\n"
