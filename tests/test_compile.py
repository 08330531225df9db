"""`omniflow compile`: golden printouts of every example's plan, JSON plans, the IR graph with
the passes' facts (`--graph`), exit codes."""

import json
import os
import re
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from omniflow.cli import EXIT_BROKEN_PIPE, main
from omniflow.compiler import (
    compile_file,
    compile_source,
    load_graph,
    optimize_file,
    settings_by_pipeline,
)
from omniflow.devices import human_bytes, this_machine
from omniflow.dsl.parser import parse_file
from omniflow.errors import GraphError
from omniflow.passes import facts
from omniflow.plan import PLAN_VERSION, Plan
from omniflow.report import render_plan

ROOT = Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "graphs").glob("*.omni"))
GOLDEN = ROOT / "tests" / "golden"


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_plan_printout_matches_golden(path, capsys):
    """Regenerate after an intended change with OMNIFLOW_UPDATE_GOLDEN=1."""
    code, out, err = _cli(
        capsys, "compile", str(path.relative_to(ROOT)), "--devices", "2xH200", "--width", "160"
    )
    assert code == 0, err
    golden = GOLDEN / f"{path.stem}.txt"
    if os.environ.get("OMNIFLOW_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert out == golden.read_text()


def _shown(fact) -> list[str]:
    """What of a fact's own fields the printout must show: names and numbers as one reads
    them (a fact type this does not know fails the test, so a new one is printed too)."""
    match fact:
        case True:  # a flag, set
            return ["yes"]
        case str():
            return [fact]
        case float():  # seconds (a step's audio)
            return [str(fact)]
        case tuple():  # a chunk schedule
            return [",".join(map(str, fact))]
        case facts.ModelFacts():
            configs = [fact.config, *([fact.image_encoder] if fact.image_encoder else []),
                       *fact.experts]  # fmt: skip
            return [c.model for c in configs] + [c.component or "" for c in configs]
        case facts.PortFacts():
            return [f"{port} {s.step} x{s.max_steps}" for port, s in fact.out.items()]
        case facts.OutputFacts():
            return [f"{k} {v}" for k, v in fact.attrs.items()]
        case facts.EdgeItem():
            return [f"{fact.item} x{fact.max_steps}"]
        case facts.CostFacts():
            shown = [human_bytes(fact.need), f"batch {fact.batch}", fact.cfg_input or ""]
            cost = fact.cost
            sizes = () if cost is None else (cost.weight_bytes, cost.kv_cache_bytes,
                                             cost.activation_bytes)  # fmt: skip
            return shown + [human_bytes(n) for n in sizes]
        case facts.Placement():
            return [*fact.devices, human_bytes(fact.budget)]
        case facts.PointwiseKernel():
            return [fact.kernel, f"{fact.in_dtype}->{fact.out_dtype}", fact.runs_in]
        case facts.Channel():
            ring = [str(fact.slots), human_bytes(fact.slot_bytes), human_bytes(fact.ring_bytes),
                    f"{fact.credits} credits", fact.device] if fact.slots else []  # fmt: skip
            return [fact.kind, *ring]
        case facts.DeviceUse():
            return [fact.name, human_bytes(fact.used), human_bytes(fact.usable),
                    human_bytes(fact.total)]  # fmt: skip
        case facts.ExecutorGroup():
            return [fact.name, *fact.devices, *fact.stages, *fact.reasons]
    raise AssertionError(f"the test does not know the fact {fact!r}")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_graph_printout_shows_every_fact_the_passes_wrote(path, capsys):
    """`omniflow compile --graph`: each node's and edge's line holds its facts, each graph
    fact has a line; checked against the fact objects of the same compile."""
    code, out, err = _cli(capsys, "compile", str(path), "--devices", "2xH200", "--graph")
    assert code == 0, err
    graph = optimize_file(path, "2xH200")
    lines = out.splitlines()

    def facts_of(*heads: str) -> str:
        """The facts part of the one line that starts with one of `heads`."""
        (line,) = [ln for ln in lines if ln.lstrip().startswith(heads)]
        return line.partition("  # ")[2]

    shown = 0
    for where, meta in [*((n, n.meta) for n in graph.nodes), *((e, e.meta) for e in graph.edges)]:
        name = where.name
        on_line = facts_of(f"input  {name}:", f"stage  {name} =", f"output {name} ",
                           f"output {name}(", f"edge   {name} :")  # fmt: skip
        for key, fact in meta.items():
            if fact is None or fact is False:  # no schedule (whole output), a flag unset
                continue
            assert f"{key}=" in on_line or not str(fact), (name, key, on_line)
            for text in _shown(fact):
                assert text in on_line, (name, key, text, on_line)
                shown += 1
    for key, fact in graph.meta.items():
        if key == "pass_times":  # how long this compile took: not a fact of the graph
            continue
        for item in fact if isinstance(fact, tuple) else (fact,):
            texts = [human_bytes(item)] if key.endswith("_bytes") else _shown(item)
            assert any(all(t in ln for t in texts) for ln in lines
                       if ln.startswith(f"  {key}: ")), (key, texts)  # fmt: skip
            shown += len(texts)
    assert shown > 20  # the passes wrote facts, and they were found
    # Before the passes there are no facts to show.
    assert "  # " not in str(load_graph(path))


def _plan_words(plan: Plan) -> set[str]:
    """Names a reader looks for in the printout: each must appear whole on one line."""
    return (
        {s.name for s in plan.stages}
        | {x.name for x in plan.executors}
        | {c.name for c in plan.channels}
        | {c.pointwise.kernel for c in plan.channels if c.pointwise}
        | {d.name for d in plan.devices}
    )


def _words(printout: str) -> set[str]:
    return {word for word in printout.split() if set(word) != {"─"}}  # rules vary in length


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_piped_printout_fits_80_columns_without_splitting_words(path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # piped, rich then assumes 80 columns
    code, narrow, err = _cli(capsys, "compile", str(path), "--devices", "2xH200")
    assert code == 0, err
    _, wide, _ = _cli(capsys, "compile", str(path), "--devices", "2xH200", "--width", "1000")
    lines = narrow.splitlines()
    assert max(map(len, lines)) <= 80, narrow
    # A word cut in two leaves pieces that no line of the unwrapped printout holds.
    assert _words(narrow) <= _words(wide), narrow
    for word in _plan_words(compile_file(path, devices="2xH200")):
        assert any(word in line for line in lines), f"'{word}' is split or missing:\n{narrow}"


LONG_NAMES = """pipeline p {
  model "Qwen/Qwen2.5-7B-Instruct"
  stage first_language_model = ar(max_batch=8)
  stage second_language_model = ar(max_batch=8)
  input user_prompt: chat -> first_language_model
  first_language_model.hidden -> second_language_model [stream, chunk=1]
  second_language_model.text -> output answer_text [stream]
}"""


def test_names_too_long_to_fit_fold_rather_than_the_values_beside_them():
    out = StringIO()
    render_plan(
        compile_source(LONG_NAMES, devices="2xH200"), Console(file=out, width=80, highlight=False)
    )
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert any("bfloat16[1, 3584]" in line for line in lines)  # the item stays whole


def test_omni_chat_plan_has_budgets_and_a_fused_executor():
    plan = compile_file(ROOT / "graphs/omni_chat.omni", devices="2xH200")
    assert {s.name for s in plan.stages} == {"hearing", "vision", "thinker", "talker", "code2wav"}
    assert all(s.budget_bytes >= s.need_bytes > 0 for s in plan.stages)
    assert ["thinker", "talker"] in [x.stage_names for x in plan.executors]


def test_one_gpu_prints_one_executor_with_each_stages_stream_priority(capsys):
    code, out, err = _cli(capsys, "compile", "graphs/omni_chat.omni", "--devices", "1xH200")
    assert code == 0, err
    table = out[out.index("executors") : out.index("edges")]
    rows = [line.split() for line in table.splitlines() if set(line.strip()) - {"─"}]
    executor = "hearing+vision+thinker+talker+code2wav"
    assert rows[2] == [executor, "cuda:0", "hearing", "0"]
    assert rows[3:7] == [["vision", "0"], ["thinker", "-1"], ["talker", "-2"], ["code2wav", "-3"]]
    assert rows[8][:5] == [executor, "one", "process", "per", "GPU:"]
    plan = compile_file(ROOT / "graphs/omni_chat.omni", devices="1xH200")
    assert {c.kind for c in plan.channels if c.src_executor == c.dst_executor} == {"local"}
    assert not any(c.kind == "cuda-ipc" for c in plan.channels)  # one process: no device rings


def test_the_devices_table_says_each_gpus_contexts_and_total(capsys):
    """One GPU: its five stages in one process, one CUDA context; the JSON plan and the
    printout both say so, and the total is the stages' budgets plus that context."""
    code, out, err = _cli(capsys, "compile", "graphs/omni_chat.omni", "--devices", "1xH200")
    assert code == 0, err
    table = out[out.index("\ndevices") :].splitlines()
    (row,) = [line.split() for line in table if line.startswith("cuda:0")]
    plan = compile_file(ROOT / "graphs/omni_chat.omni", devices="1xH200")
    (gpu,) = plan.devices
    budgets = sum(s.budget_bytes for s in plan.stages)
    assert (gpu.contexts, gpu.total_bytes) == (1, budgets + gpu.context_bytes)
    shown = [human_bytes(gpu.used_bytes), f"1 x {human_bytes(gpu.context_bytes)}"]
    assert " ".join(row).startswith(" ".join(["cuda:0", *shown, human_bytes(gpu.total_bytes)]))
    data = json.loads(plan.to_json())["devices"][0]
    assert (data["contexts"], data["total_bytes"]) == (1, gpu.total_bytes)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_plan_json_round_trips(path):
    plan = compile_file(path, devices="2xH200")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    data = json.loads(plan.to_json())
    assert data["version"] == PLAN_VERSION and data["pipeline"] == path.stem


def test_json_flag_and_output_file(tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    code, out, _ = _cli(
        capsys, "compile", "graphs/tts.omni", "--devices", "2xH200", "--json", "-o", str(out_file)
    )
    assert code == 0
    assert json.loads(out) == json.loads(out_file.read_text())
    params = json.loads(out)["stages"][0]["params"]
    assert params["max_tokens"] == {"type": "param", "name": "max_tokens"}  # per request


def test_compile_error_exits_1_with_location_caret_and_hint(tmp_path, capsys):
    bad = tmp_path / "typo.omni"
    text = (
        (ROOT / "graphs/omni_chat.omni")
        .read_text()
        .replace("-> talker   [stream", "-> talkr   [stream")
    )
    bad.write_text(text)
    code, out, err = _cli(capsys, "compile", str(bad))
    assert code == 1 and out == ""
    line_no = next(i for i, ln in enumerate(text.splitlines(), 1) if "talkr" in ln)
    col = text.splitlines()[line_no - 1].index("talkr") + 1
    lines = err.splitlines()
    assert lines[0] == f"{bad}:{line_no}:{col}: error: unknown stage 'talkr'"
    assert lines[2].strip() == "^^^^^" and lines[2].index("^") == lines[1].index("talkr")
    assert lines[3] == "hint: did you mean 'talker'?"


def test_an_unknown_model_exits_1_at_its_line_not_naming_the_pass(capsys, tmp_path):
    bad = tmp_path / "bad.omni"
    text = (ROOT / "graphs" / "tts.omni").read_text().replace('"tiny:tts"', '"tiny:ttz"')
    bad.write_text(text)
    code, out, err = _cli(capsys, "compile", str(bad))
    assert code == 1 and out == ""
    line_no = next(i for i, ln in enumerate(text.splitlines(), 1) if "tiny:ttz" in ln)
    lines = err.splitlines()
    assert lines[0].startswith(f"{bad}:{line_no}:3: error: unknown tiny model 'ttz'")
    assert lines[1].strip() == 'model "tiny:ttz"' and lines[2].strip().startswith("^")
    assert "pass '" not in err


def test_placement_failure_exits_1_naming_the_stage(capsys):
    code, _, err = _cli(capsys, "compile", "graphs/omni_chat.omni", "--devices", "cuda:0=8GiB")
    assert code == 1
    assert "pass 'place' failed: stage 'thinker' needs" in err


def test_set_gives_a_stage_argument_in_place_of_the_files_or_beside_them():
    settings = ["thinker.max_batch=8", "talker.max_len=3072", "talker.temperature=$temperature"]
    graph = load_graph("graphs/omni_chat.omni", settings)
    thinker, talker = graph.node("thinker").params, graph.node("talker").params
    assert thinker["max_batch"] == 8 and talker["max_len"] == 3072
    assert str(talker["temperature"]) == "$temperature"
    assert load_graph("graphs/omni_chat.omni").node("thinker").params["max_batch"] == 32


@pytest.mark.parametrize(
    ("setting", "message", "caret", "hint"),
    [
        ("thinker.max_batch=abc", "'max_batch' must be int, not abc", "abc", None),
        ("thinker.max_bach=8", "unknown parameter of ar 'max_bach'", "max_bach=8", "did you mean 'max_batch'?"),
        ("thinkr.max_batch=8", "pipeline 'omni_chat' has no stage 'thinkr'", "thinkr.max_batch=8", "did you mean 'thinker'?"),
        ("thinker.max_batch=", "a setting is [PIPELINE.]STAGE.KEY=VALUE", "thinker.max_batch=", "e.g. --set thinker.max_batch=8"),
        ("thinker.max_batch=8)", "unexpected ')'", ")", 'VALUE is written as in the .omni file'),
    ],
)  # fmt: skip
def test_a_bad_setting_is_an_error_pointing_at_it(capsys, setting, message, caret, hint):
    code, out, err = _cli(
        capsys, "compile", "graphs/omni_chat.omni", "--devices", "2xH200", "--set", setting
    )
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("--set:1:") and message in lines[0]
    assert lines[1].strip() == setting
    start = lines[2].index("^")
    assert lines[1][start : start + len(caret)] == caret and lines[2].count("^") == len(caret)
    assert hint is None or lines[3].startswith(f"hint: {hint}")


def test_a_gpu_too_small_is_told_the_batch_that_fits_and_set_makes_it_fit(capsys):
    """Qwen3-Omni's graph does not fit one H100 as written: the placement error names the
    thinker's batch that would fit beside what else it takes, and `--set` with smaller
    batches and lengths (load.py's H100 example) compiles it."""
    code, _, err = _cli(capsys, "compile", "graphs/qwen3_omni.omni", "--devices", "1xH100")
    assert code == 1 and "for its process's CUDA context" in err
    assert re.search(r"it alone would fit there \(--set thinker\.max_batch=\d+\)", err)
    lowered = [f"{stage}.max_batch={n}" for stage, n in (("hearing", 2), ("vision", 2), ("thinker", 8), ("talker", 8), ("code2wav", 8))]  # fmt: skip
    lowered += ["thinker.max_len=3072", "talker.max_len=3072"]
    flags = [arg for setting in lowered for arg in ("--set", setting)]
    code, out, _ = _cli(capsys, "compile", "graphs/qwen3_omni.omni", "--devices", "1xH100", *flags)
    assert code == 0 and "thinker" in out


def test_settings_of_several_pipelines_go_to_the_ones_they_name(capsys, tmp_path):
    """Served together, a setting naming its pipeline goes to it and one naming a stage alone
    to every pipeline with that stage; one that fits none is an error pointing at it (as is
    one naming another pipeline than a lone file's), and a plan JSON takes none."""
    tts, chat = (parse_file(f"graphs/{name}.omni") for name in ("tts", "omni_chat"))
    settings = ["omni_chat.talker.max_batch=4", "tts.codec_lm.max_batch=2"]
    settings += ["talker.max_len=512", "codec_lm.max_len=256"]
    assert settings_by_pipeline([tts, chat], settings) == [
        ["tts.codec_lm.max_batch=2", "codec_lm.max_len=256"],
        ["omni_chat.talker.max_batch=4", "talker.max_len=512"],
    ]
    graph = load_graph("graphs/omni_chat.omni", settings_by_pipeline([tts, chat], settings)[1])
    assert graph.node("talker").params["max_batch"] == 4
    assert graph.node("talker").params["max_len"] == 512
    for setting, message in (
        ("omni_chta.talker.max_batch=4", "no served pipeline is 'omni_chta'"),
        ("talkr.max_batch=4", "no served pipeline has a stage 'talkr'"),
        ("a.b.c.d=4", "a setting is [PIPELINE.]STAGE.KEY=VALUE"),
    ):
        with pytest.raises(GraphError, match=re.escape(message)) as caught:
            settings_by_pipeline([tts, chat], [setting])
        assert caught.value.span.line_text == setting
    code, _, err = _cli(
        capsys, "compile", "graphs/tts.omni", "--set", "omni_chat.talker.max_batch=4"
    )
    assert code == 1 and "this pipeline is 'tts', not 'omni_chat'" in err
    plan = tmp_path / "plan.json"
    plan.write_text(compile_file("graphs/tts.omni").to_json())
    code, _, err = _cli(capsys, "run", str(plan), "--set", "codec_lm.max_batch=4")
    assert code == 2 and "a plan JSON is compiled" in err
    # With no pipeline the default one is served, and the setting is checked against it.
    code, _, err = _cli(capsys, "run", "--port", "0", "--set", "thinkr.max_batch=4")
    assert code == 1 and "pipeline 'omni_chat' has no stage 'thinkr'" in err


@pytest.mark.parametrize(
    "argv",
    [["compile"], ["compile", "missing.omni"], ["frobnicate"], [],
     ["compile", "graphs/tts.omni", "--json", "--graph"]],  # one printout at a time
)  # fmt: skip
def test_usage_errors_exit_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2


def test_bad_device_list_is_a_compile_error(capsys):
    code, _, err = _cli(capsys, "compile", "graphs/tts.omni", "--devices", "3xTPU")
    assert code == 1 and "unknown accelerator 'TPU'" in err


def test_a_huge_device_count_fails_at_once(capsys):
    start = time.perf_counter()
    code, _, err = _cli(capsys, "compile", "graphs/tts.omni", "--devices", "1000000xH200")
    assert code == 1 and "one entry gives at most 64 GPUs" in err
    assert time.perf_counter() - start < 5  # it used to run for minutes


def test_console_script_runs():
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "omniflow.cli",
            "compile",
            "graphs/tts.omni",
            "--devices",
            "2xH200",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "pipeline tts: stages" in result.stdout


def test_the_language_guide_shows_omni_chat_as_it_is():
    guide = (ROOT / "docs/language.md").read_text()
    assert f"```\n{(ROOT / 'graphs/omni_chat.omni').read_text()}```" in guide


def test_an_audio_output_gets_its_vocoders_sample_rate():
    plan = compile_file(ROOT / "graphs/omni_chat.omni", devices="2xH200")
    assert next(o for o in plan.outputs if o.name == "audio").attrs["rate"] == 24000


def test_a_multi_node_plan_shows_edge_kinds_and_why_each_stage_is_where_it_is(capsys):
    code, out, err = _cli(
        capsys,
        "compile",
        "graphs/omni_chat.omni",
        "--devices",
        "node0=1xH100=20GiB,node1=2xH200",
        "--width",
        "160",
    )
    assert code == 0, err
    rows = [line.split()[:2] for line in out.splitlines()]
    assert ["talker.codes->code2wav.codes", "net"] in rows
    assert ["code2wav.audio->audio.in", "shm"] in rows
    assert "talker on node1/cuda:0: with thinker: per-token streams stay on one device" in out
    assert "code2wav on node0/cuda:0:" in out


def test_with_no_devices_compile_is_for_this_machine(capsys):
    code, out, err = _cli(capsys, "compile", "graphs/tts.omni", "--width", "160")
    assert code == 0, err
    first_device = this_machine().split(",")[0]
    assert re.search(rf"^{re.escape(first_device)} +[\d.]+ GiB", out, re.MULTILINE), out


@pytest.mark.skipif(this_machine() != "cpu", reason="omni_chat fits a GPU machine")
def test_a_graph_too_big_for_this_machine_says_in_one_line_which_flags_fit(capsys):
    code, out, err = _cli(capsys, "compile", "graphs/omni_chat.omni")
    assert code == 1 and out == ""
    assert err == (
        "omniflow: error: graphs/omni_chat.omni does not fit this machine (cpu): needs a GPU: "
        "try --devices 1xH200, or --tiny for the built-in tiny models\n"
    )
    assert (
        f"$ omniflow compile graphs/omni_chat.omni    # on a CPU-only machine\n{err}"
        in (ROOT / "README.md").read_text()
    )  # the README shows it as it is
    for flags in (["--devices", "1xH200"], ["--tiny"]):  # and each suggestion does compile
        code, out, err = _cli(capsys, "compile", "graphs/omni_chat.omni", *flags)
        assert code == 0 and "pipeline omni_chat" in out, err


def test_a_graph_that_fits_no_suggested_inventory_says_so(tmp_path, capsys):
    huge = tmp_path / "huge.omni"
    huge.write_text(
        "pipeline huge {\n  stage big = python(fn=tests.runtime.stages.silent, "
        'inputs="in:text", outputs="out:audio", memory="9TiB")\n'
        "  input text: text -> big\n  big.out -> output audio [rate=16000]\n}\n"
    )
    code, _, err = _cli(capsys, "compile", str(huge))
    assert code == 1
    assert err.count("\n") == 1 and "nor 1xH200 to 8xH200; give --devices" in err, err
    assert "stage 'big' needs 9216.0 GiB" in err, err  # why, as the placement says it


@pytest.mark.parametrize("printout", [[], ["--graph"]], ids=["tables", "graph"])
def test_a_reader_that_leaves_early_ends_the_printout_quietly(printout):
    """`omniflow compile ... | head`: the pipe closes before the plan is written; the command
    exits 141 as a tool killed by SIGPIPE does, and prints nothing about it."""
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "omniflow.cli", "compile", "graphs/tts.omni",
         "--devices", "2xH200", *printout],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()  # long before the child has compiled anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE and err == ""
