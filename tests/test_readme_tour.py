"""The README's tour is what the files and commands give, so that it cannot drift: the block
labelled `# graphs/omni_chat.omni` is that file, the plan printed under it is what the
command it names prints, and the mistake shown is what `compile` says of that file with
'talker' misspelled. Only what depends on the terminal is fixed: the width (80 columns, what
a pipe gets) and the blanks rich pads each line with. The executor processes the README says
the default pipeline runs in are its plan's, and its Python examples (the Python API, a
launched engine) run and print what they say. Its client snippets are run against a server
by tests/server/test_readme.py."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import omniflow

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
GRAPH = ROOT / "graphs" / "omni_chat.omni"


README_BLOCKS = re.findall(r"^```([a-z]*)\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def fenced_block(first_line: str) -> str:
    """The one fenced block of the README whose first line is `first_line`, fences left out."""
    found = [b for _, b in README_BLOCKS if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"{len(found)} README blocks start with {first_line!r}"
    return found[0]


def omniflow_cli(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` (`omniflow ...` as the README writes it) run with this interpreter."""
    program, *args = shlex.split(command)
    assert program == "omniflow"
    return subprocess.run(
        [sys.executable, "-P", "-m", "omniflow.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
        timeout=120,
    )


def unpadded(text: str) -> str:
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def test_the_tour_shows_the_graph_file_as_it_is():
    assert (
        fenced_block("# graphs/omni_chat.omni") == "# graphs/omni_chat.omni\n" + GRAPH.read_text()
    )


def test_the_plan_shown_is_what_its_command_prints():
    command = re.search(r"`(omniflow compile [^`]+)` \(or `make plan`\) prints:", README)
    assert command, "the README names the command whose plan it shows"
    done = omniflow_cli(command.group(1), ROOT)
    assert done.returncode == 0, done.stderr
    assert fenced_block("pipeline omni_chat: stages") == unpadded(done.stdout)
    makefile = (ROOT / "Makefile").read_text()  # `make plan` is the same command
    devices = re.search(r"^DEVICES \?= (\S+)$", makefile, re.MULTILINE).group(1)
    plan_recipe = "omniflow compile graphs/omni_chat.omni --devices $(DEVICES)"
    assert plan_recipe in makefile
    assert command.group(1) == plan_recipe.replace("$(DEVICES)", devices)


def test_the_mistake_shown_is_what_compile_says(tmp_path):
    shown = fenced_block("$ omniflow compile omni_chat.omni    # with 'talker' misspelled")
    command, said = shown.split("\n", 1)
    source = GRAPH.read_text()
    assert source.count("-> talker ") == 1
    (tmp_path / "omni_chat.omni").write_text(source.replace("-> talker ", "-> talkr "))
    done = omniflow_cli(command.removeprefix("$ ").split("#")[0], tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == said


def test_the_executor_processes_the_readme_names_are_the_plans():
    assert "On a CPU it runs in four executor processes" in README

    def executors(devices: str) -> list[list[str]]:
        plan = omniflow.compile(GRAPH, devices=devices, tiny=True)
        return [[s.name for s in p.stages] for p in plan.programs if p.stages]

    assert executors("cpu") == [["hearing"], ["vision"], ["thinker", "talker"], ["code2wav"]]
    assert executors("1xH200") == [["hearing", "vision", "thinker", "talker", "code2wav"]]
    assert len(executors("2xH200")) == 2  # one process per GPU


def python_block(needle: str) -> str:
    found = [b for lang, b in README_BLOCKS if lang == "python" and needle in b]
    assert len(found) == 1, needle
    return found[0]


def run_python(source: str) -> str:
    done = subprocess.run(
        [sys.executable, "-P", "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_python_api_example_prints_the_graph_as_omni():
    printed = run_python(python_block("omniflow.Pipeline("))
    assert printed.startswith('pipeline chat {\n  model "Qwen/Qwen2.5-0.5B-Instruct"\n')
    assert "  lm.text -> output text [stream]\n" in printed


@pytest.mark.slow
def test_the_launch_example_generates_and_streams():
    printed = run_python(python_block("omniflow.launch(")).splitlines()
    text, seed = printed[0].rsplit(" ", 1)
    assert text and int(seed) >= 0
    chunks = [line.split() for line in printed[1:]]
    assert {output for output, _, _ in chunks} == {"text", "audio"}
    for output in ("text", "audio"):  # each output's chunks count up and the last ends it
        mine = [(int(index), end) for name, index, end in chunks if name == output]
        assert [i for i, _ in mine] == list(range(len(mine)))
        assert [end for _, end in mine] == ["False"] * (len(mine) - 1) + ["True"]
