"""What the README and docs/ show of files and commands is what the files and commands give,
so that it cannot drift: the README tour's block labelled `# graphs/omni_chat.omni`, and
docs/language.md's copy, are that file; the plan printed under the tour's `compile` command
is what it prints, as are docs/architecture.md's executors and devices tables; every mistake shown
(README, docs/language.md) is what `compile` says of graphs/omni_chat.omni with that
mistake made in it. Only what depends on the terminal is fixed: the width (80 columns, what
a pipe gets) and the blanks rich pads each line with. The executor processes the README says
the default pipeline runs in are its plan's, and its Python examples (the Python API, a
launched engine) run and print what they say; the tiny builds docs/language.md and
docs/models.md name are those there are; every command-line option is documented, and
every repository path the docs name exists. The README's client snippets are run against a server
by tests/server/test_readme.py, docs/server.md's by tests/server/test_server_examples.py."""

import argparse
import json
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
LANGUAGE = (ROOT / "docs" / "language.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
GRAPH = ROOT / "graphs" / "omni_chat.omni"

# Each mistake the docs show, by its message: the edit of graphs/omni_chat.omni that makes it.
MISTAKES = {
    "unknown stage 'talkr'": ("-> talker ", "-> talkr "),
    "unexpected '=>'": ("thinker.hidden -> talker", "thinker.hidden => talker"),
    "unexpected ':', expected '='": ("param temperature = 0.0", "param temperature: 0.0"),
    "unexpected 'stage', expected ')' or ','": ("use_audio_in_video=$use_audio_in_video)", "use_audio_in_video=$use_audio_in_video"),
}  # fmt: skip


def fenced(doc: str, lang: str = "") -> list[str]:
    """The bodies of `doc`'s fenced blocks of language `lang` ("": plain blocks)."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", doc, re.MULTILINE | re.DOTALL)


def only(blocks: list[str], needle: str) -> str:
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"{len(found)} blocks have {needle!r}"
    return found[0]


def omniflow_cli(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` (`omniflow ...` as the docs write it) run with this interpreter."""
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


def printed_plan(command: str) -> str:
    done = omniflow_cli(command, ROOT)
    assert done.returncode == 0, done.stderr
    return "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())


def test_the_graph_shown_is_the_file_as_it_is():
    graph = GRAPH.read_text()
    assert only(fenced(README), "# graphs/omni_chat.omni\n") == "# graphs/omni_chat.omni\n" + graph
    assert "Here is `graphs/omni_chat.omni`, as it is in the repository:" in LANGUAGE
    assert only(fenced(LANGUAGE), "pipeline omni_chat {") == graph


def test_the_readmes_plan_is_what_its_command_prints():
    command = re.search(r"`(omniflow compile [^`]+)` \(or `make plan`\) prints:", README)
    assert command, "the README names the command whose plan it shows"
    assert only(fenced(README), "pipeline omni_chat: stages") == printed_plan(command.group(1))
    makefile = (ROOT / "Makefile").read_text()  # `make plan` is the same command
    devices = re.search(r"^DEVICES \?= (\S+)$", makefile, re.MULTILINE).group(1)
    plan_recipe = "omniflow compile graphs/omni_chat.omni --devices $(DEVICES)"
    assert plan_recipe in makefile
    assert command.group(1) == plan_recipe.replace("$(DEVICES)", devices)


def test_the_architecture_docs_executors_are_what_compile_prints():
    command = "omniflow compile graphs/omni_chat.omni --devices 1xH200"
    assert f"(`{command}`): ``` executors" in " ".join(ARCHITECTURE.split())  # the doc names it
    assert only(fenced(ARCHITECTURE), "executors\nexecutor ") in printed_plan(command)
    assert only(fenced(ARCHITECTURE), "devices\ndevice ") in printed_plan(command)


def shown_mistakes() -> list[tuple[str, str, str]]:
    """(doc, message, block) for each block of README and docs/language.md showing an error."""
    return [
        (name, message, block)
        for name, doc in (("README", README), ("language.md", LANGUAGE))
        for block in fenced(doc)
        for message in MISTAKES
        if f": error: {message}\n" in block
    ]


def test_every_mistake_shown_is_one_this_test_makes():
    shown = [block for _, _, block in shown_mistakes()]
    every = [b for doc in (README, LANGUAGE) for b in fenced(doc) if re.search(r":\d+: error: ", b)]
    assert sorted(shown) == sorted(every)
    assert {message for _, message, _ in shown_mistakes()} == set(MISTAKES)


@pytest.mark.parametrize(
    ("message", "block"),
    [(message, block) for _, message, block in shown_mistakes()],
    ids=[f"{doc}: {message}" for doc, message, _ in shown_mistakes()],
)
def test_the_mistake_shown_is_what_compile_says(message, block, tmp_path):
    """A block is the error alone (the command: `omniflow compile` of the file it names) or
    a `$ omniflow compile FILE    # ...` line and the error."""
    if block.startswith("$ "):
        command, said = block.split("\n", 1)
        command = command.removeprefix("$ ").split("#")[0]
    else:
        said = block
        command = "omniflow compile " + block.split(":")[0]
    path = tmp_path / shlex.split(command)[-1]
    old, new = MISTAKES[message]
    source = GRAPH.read_text()
    assert source.count(old) == 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source.replace(old, new))
    done = omniflow_cli(command, tmp_path)
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


def run_python(source: str) -> str:
    done = subprocess.run(
        [sys.executable, "-P", "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_python_api_example_prints_the_graph_as_omni():
    printed = run_python(only(fenced(README, "python"), "omniflow.Pipeline("))
    assert printed.startswith('pipeline chat {\n  model "Qwen/Qwen2.5-0.5B-Instruct"\n')
    assert "  lm.text -> output text [stream]\n" in printed


@pytest.mark.slow
def test_the_launch_example_generates_and_streams():
    printed = run_python(only(fenced(README, "python"), "omniflow.launch(")).splitlines()
    text, seed = printed[0].rsplit(" ", 1)
    assert text and int(seed) >= 0
    chunks = [line.split() for line in printed[1:]]
    assert {output for output, _, _ in chunks} == {"text", "audio"}
    for output in ("text", "audio"):  # each output's chunks count up and the last ends it
        mine = [(int(index), end) for name, index, end in chunks if name == output]
        assert [i for i, _ in mine] == list(range(len(mine)))
        assert [end for _, end in mine] == ["False"] * (len(mine) - 1) + ["True"]


def test_the_docs_name_every_tiny_build():
    from omniflow.checkpoints.tiny import list_tiny

    names = re.search(r"`omniflow models list`\s+prints the names \(([^)]*)\)", LANGUAGE)
    assert sorted(re.findall(r"`([^`]+)`", names.group(1))) == sorted(list_tiny())
    models = (ROOT / "docs" / "models.md").read_text()
    shown = re.search(r"^list_tiny\(\)  # (\[.*?\])$", models, re.MULTILINE | re.DOTALL).group(1)
    assert json.loads(re.sub(r"\n#\s+", " ", shown).replace("'", '"')) == list_tiny()


def test_every_command_line_option_is_documented():
    """Each option of each `omniflow` command is named, in code, in the README or docs/."""
    from omniflow.cli import make_parser

    docs = [README, *(p.read_text() for p in (ROOT / "docs").glob("*.md"))]
    fence = re.compile(r"^```\w*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    blocks = [block for doc in docs for block in fence.findall(doc)]
    spans = [span for doc in docs for span in re.findall(r"`([^`]+)`", fence.sub("", doc))]
    code = " ".join(blocks + spans)
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", code))
    commands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    undocumented = [
        f"{command} {action.option_strings[-1]}"
        for command, parser in commands.choices.items()
        for action in parser._actions
        if action.option_strings
        and action.help not in (argparse.SUPPRESS, "show this help message and exit")
        and not named & set(action.option_strings)
    ]
    assert undocumented == []


NOT_HERE = {
    "omniflow/graphs": "the installed package's copy of graphs/",
    "scripts/convert_wan_to_diffusers.py": "diffusers' own script",
}


def test_every_repository_path_the_docs_name_is_there():
    """A file or folder of this repository named in the README or docs/ exists (a glob
    matches, a module's function names its file; docs/testing.md names tests by their path
    in tests/)."""
    docs = {"README.md": README} | {
        f"docs/{p.name}": p.read_text()
        for p in (ROOT / "docs").glob("*.md")
        if p.name != "benchmarks-log.md"  # a dated log: what was there then
    }
    tops = "omniflow|tests|graphs|benchmarks|scripts|docs|dsl|kernels"
    missing = [
        f"{name}: {path}"
        for name, doc in docs.items()
        for path in set(re.findall(rf"(?<![\w/.-])((?:{tops})/[\w./*-]*\w)", doc))
        if path not in NOT_HERE
        and not list(ROOT.glob(path + "*"))
        and not list((ROOT / "tests").glob(path + "*"))  # docs/testing.md's table is in tests/
        and not (ROOT / (path.rsplit(".", 1)[0] + ".py")).exists()
    ]
    assert missing == []
