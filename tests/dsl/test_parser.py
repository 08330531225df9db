"""The parser on valid programs: the example graphs, every construct, and the spans."""

from pathlib import Path

import pytest

from omniflow import dsl
from omniflow.ir.values import Param

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
EXAMPLES = sorted(GRAPHS.glob("*.omni"))

# Snapshots of two examples: the detailed checks below must not move when graphs/ is edited.
OMNI_CHAT = """\
# Omni chat (Qwen2.5-Omni): the thinker streams hidden states into the talker, whose
# codec tokens stream into the token2wav vocoder. Text and audio both stream out.
pipeline omni_chat {
  model "Qwen/Qwen2.5-Omni-7B"
  param max_tokens = 2048
  param temperature = 0.0

  stage thinker  = ar(component="thinker", max_batch=32, max_tokens=$max_tokens, temperature=$temperature)
  stage talker   = ar(component="talker", max_batch=32)
  stage code2wav = vocoder(component="token2wav", max_batch=64)

  input prompt: chat -> thinker
  thinker.hidden -> talker   [stream, chunk=1, adapter=qwen_omni.thinker_to_talker]
  talker.codes   -> code2wav [stream, chunk=auto, context=25]
  code2wav.audio -> map(gain(0.9) | clamp(-1, 1) | pcm16) -> output audio [rate=24000]
  thinker.text   -> output text [stream]
}
"""
TEXT_TO_IMAGE = """\
pipeline text_to_image {
  model "Qwen/Qwen-Image"
  param steps = 50
  param guidance_scale = 4.0

  stage encoder = encoder(component="text_encoder", max_batch=16)
  stage dit     = diffusion(component="transformer", max_batch=8, steps=$steps,
                            guidance=$guidance_scale, cfg=negative_prompt,
                            height=1024, width=1024)
  stage vae     = vae(component="vae", max_batch=8)

  input prompt: text -> encoder
  input negative_prompt: text = " "
  encoder.hidden -> dit
  dit.latents    -> vae
  vae.image      -> map(denorm | to_uint8) -> output image
}
"""


def program(*lines: str) -> dsl.ast.Pipeline:
    return dsl.parse("pipeline p {\n" + "\n".join(lines) + "\n}\n", "t.omni")


def attrs(items: list[dsl.ast.Attr]) -> dict:
    return {a.key: a.value for a in items}


def name(dotted: str) -> dsl.ast.Name:
    return dsl.ast.Name(dotted, span=None)  # spans are not compared


def ref(param: str) -> Param:
    return Param(param)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_parses(path):
    pipeline = dsl.parse_file(path)
    assert pipeline.name == path.stem
    assert pipeline.span.path == str(path)
    assert pipeline.stages and pipeline.flows and pipeline.inputs
    declared = {s.name for s in pipeline.stages} | {i.name for i in pipeline.inputs}
    for flow in pipeline.flows:
        assert flow.source.node in declared
        assert isinstance(flow.target, dsl.ast.OutputRef) or flow.target.node in declared


def test_omni_chat():
    p = dsl.parse(OMNI_CHAT)
    assert [m.model for m in p.models] == ["Qwen/Qwen2.5-Omni-7B"]
    assert [(x.name, x.default) for x in p.params] == [("max_tokens", 2048), ("temperature", 0.0)]
    assert isinstance(p.params[1].default, float)
    assert [(s.name, s.kind, s.device) for s in p.stages] == [
        ("thinker", "ar", None),
        ("talker", "ar", None),
        ("code2wav", "vocoder", None),
    ]
    assert attrs(p.stages[0].args) == {
        "component": "thinker",
        "max_batch": 32,
        "max_tokens": ref("max_tokens"),
        "temperature": ref("temperature"),
    }
    assert [(i.name, i.type, i.default) for i in p.inputs] == [("prompt", "chat", None)]

    prompt, hidden, codes, audio, text = p.flows
    assert (prompt.source.node, prompt.source.port) == ("prompt", None)
    assert (prompt.target.node, prompt.target.port) == ("thinker", None)
    assert (hidden.source.node, hidden.source.port) == ("thinker", "hidden")
    assert attrs(hidden.attrs) == {
        "stream": None,
        "chunk": 1,
        "adapter": name("qwen_omni.thinker_to_talker"),
    }
    assert attrs(codes.attrs) == {"stream": None, "chunk": dsl.ast.AUTO, "context": 25}
    assert [(op.name, op.args) for op in audio.maps] == [
        ("gain", [0.9]),
        ("clamp", [-1, 1]),
        ("pcm16", []),
    ]
    assert isinstance(audio.target, dsl.ast.OutputRef) and audio.target.name == "audio"
    assert attrs(audio.attrs) == {"rate": 24000}
    assert text.target.name == "text" and attrs(text.attrs) == {"stream": None}
    assert p.constraints == []


def test_text_to_image_multiline_stage_and_unrouted_input():
    p = dsl.parse(TEXT_TO_IMAGE)
    dit = p.stages[1]
    assert (dit.name, dit.kind) == ("dit", "diffusion")
    assert attrs(dit.args) == {
        "component": "transformer",
        "max_batch": 8,
        "steps": ref("steps"),
        "guidance": ref("guidance_scale"),
        "cfg": name("negative_prompt"),
        "height": 1024,
        "width": 1024,
    }
    negative = p.inputs[1]
    assert (negative.name, negative.type, negative.default) == ("negative_prompt", "text", " ")
    # An input without `->` adds no flow: only `prompt` feeds a stage directly.
    assert [f.source.node for f in p.flows] == ["prompt", "encoder", "dit", "vae"]
    assert [op.name for op in p.flows[-1].maps] == ["denorm", "to_uint8"]


def test_input_with_default_and_route():
    p = program('input voice: text = "Vivian" -> codec_lm.voice')
    voice = p.inputs[0]
    assert (voice.name, voice.type, voice.default) == ("voice", "text", "Vivian")
    (flow,) = p.flows
    assert (flow.source.node, flow.target.node, flow.target.port) == ("voice", "codec_lm", "voice")


def test_device_and_constraints():
    p = program(
        "stage a = ar() @ cuda:1",
        "stage b = ar() @ cpu",
        "stage c = vae()",
        "colocate a, b",
        "separate a, b, c",
    )
    assert [s.device for s in p.stages] == ["cuda:1", "cpu", None]
    assert [(c.kind, [n for n, _ in c.stages]) for c in p.constraints] == [
        ("colocate", ["a", "b"]),
        ("separate", ["a", "b", "c"]),
    ]
    assert p.stages[0].args == []


def test_values():
    p = program(
        'param s = "a\\"b\\\\c\\nd"',
        "param i = -7",
        "param j = +3",
        "param f = 1.5",
        "param g = -1e-3",
        "param h = .5",
        "param e = 2E3",
        "param t = true",
        "param u = false",
        "param a = auto",
        "param r = $other",
        "param n = torch.float16",
        'param l = [1, [2.0, "x"], [], [true, $k, a.b]]',
    )
    values = {x.name: x.default for x in p.params}
    assert values == {
        "s": 'a"b\\c\nd',
        "i": -7,
        "j": 3,
        "f": 1.5,
        "g": -0.001,
        "h": 0.5,
        "e": 2000.0,
        "t": True,
        "u": False,
        "a": dsl.ast.AUTO,
        "r": ref("other"),
        "n": name("torch.float16"),
        "l": [1, [2.0, "x"], [], [True, ref("k"), name("a.b")]],
    }
    assert type(values["i"]) is int and type(values["e"]) is float


def test_strings_keep_unicode_and_hashes():
    p = program('model "Qwen/模型 # not a comment"')
    assert p.models[0].model == "Qwen/模型 # not a comment"


def test_map_groups_and_arguments():
    p = program("a.x -> map(f) -> map(g(1, -2.5) | h()) -> b.y [window=4]")
    (flow,) = p.flows
    assert [(op.name, op.args) for op in flow.maps] == [("f", []), ("g", [1, -2.5]), ("h", [])]
    assert (flow.target.node, flow.target.port) == ("b", "y")
    assert attrs(flow.attrs) == {"window": 4}


def test_input_route_takes_maps_and_attrs():
    p = program("input mic: audio -> map(gain(2)) -> asr.audio [stream, chunk=160]")
    (flow,) = p.flows
    assert (flow.source.node, flow.source.port) == ("mic", None)
    assert [op.name for op in flow.maps] == ["gain"]
    assert attrs(flow.attrs) == {"stream": None, "chunk": 160}


def test_statements_keep_source_order():
    p = program(
        "b -> c",
        "input x: text -> a",
        "a -> b",
        "stage c = k()",
        "stage a = k()",
    )
    assert [(f.source.node, f.target.node) for f in p.flows] == [("b", "c"), ("x", "a"), ("a", "b")]
    assert [s.name for s in p.stages] == ["c", "a"]


def test_comments_anywhere_and_trailing_comma():
    p = dsl.parse(
        "# header\n"
        "pipeline p { # after the brace\n"
        "  stage a = ar(  # inside the call\n"
        "    x=1,  # first\n"
        "    y=[1, # inside a list\n"
        "       2],\n"
        "  ) @ cuda  # after the device\n"
        "  a.out -> # mid-flow\n"
        "    output o [stream] # end\n"
        "}# after the pipeline",
    )
    (stage,) = p.stages
    assert attrs(stage.args) == {"x": 1, "y": [1, 2]}
    assert stage.device == "cuda"
    assert p.flows[0].target.name == "o"


def test_whitespace_is_insignificant():
    p = dsl.parse('pipeline p{model"m"param x=1 stage s=k(a=1)@cuda:0 s.o->output o colocate s,s}')
    assert (p.models[0].model, p.params[0].default, p.stages[0].device) == ("m", 1, "cuda:0")
    assert p.constraints[0].kind == "colocate"


def test_reserved_words_may_be_attribute_keys():
    p = program('stage t = ar(model="org/name", input=1, auto)')
    assert attrs(p.stages[0].args) == {"model": "org/name", "input": 1, "auto": None}


def test_empty_pipeline():
    p = dsl.parse("pipeline nothing {}")
    assert p.name == "nothing" and p.stages == [] and p.flows == []


def test_windows_line_endings():
    p = dsl.parse("pipeline p {\r\n  a -> b\r\n}\r\n")
    assert p.flows[0].span.line_text == "  a -> b"


# --- spans ---------------------------------------------------------------------------


def where(span) -> tuple:
    return span.line, span.col, span.end_col


def test_spans_in_omni_chat():
    p = dsl.parse(OMNI_CHAT, "omni_chat.omni")
    line13 = "  thinker.hidden -> talker   [stream, chunk=1, adapter=qwen_omni.thinker_to_talker]"
    hidden = p.flows[1]
    assert hidden.span.line_text == line13
    assert where(hidden.source.span) == (13, 3, 17)  # thinker.hidden
    assert where(hidden.target.span) == (13, 21, 27)  # talker
    assert where(hidden.span) == (13, 3, len(line13) + 1)
    stream, chunk, adapter = hidden.attrs
    assert where(stream.span) == (13, 31, 37) and stream.value_span is None
    assert where(chunk.span) == (13, 39, 46)  # chunk=1
    assert where(chunk.value_span) == (13, 45, 46)
    assert where(adapter.value.span) == (13, 56, 83)

    thinker = p.stages[0]
    assert where(thinker.kind_span) == (8, 20, 22)  # ar
    max_tokens = thinker.args[2].value
    assert where(max_tokens.span) == (8, 69, 80)  # $max_tokens

    audio = p.flows[3]
    assert where(audio.maps[1].span) == (15, 37, 49)  # clamp(-1, 1)
    assert where(audio.target.span) == (15, 62, 74)  # output audio
    assert where(p.span) == (3, 1, 19)  # pipeline omni_chat
    assert str(hidden.target.span) == "omni_chat.omni:13:21"


def test_input_spans():
    p = program('  input voice: text = "V" -> tts.voice')
    decl, flow = p.inputs[0], p.flows[0]
    assert where(decl.span) == (2, 3, 39)
    assert where(decl.type_span) == (2, 16, 20)
    assert where(flow.source.span) == (2, 9, 14)  # the input's name
    assert flow.span == decl.span


def test_multiline_statement_span_covers_its_first_line():
    p = dsl.parse(TEXT_TO_IMAGE)
    dit = p.stages[1]
    first = '  stage dit     = diffusion(component="transformer", max_batch=8, steps=$steps,'
    assert dit.span.line_text == first
    assert where(dit.span) == (7, 3, len(first) + 1)
    guidance = dit.args[3]
    assert (guidance.span.line, guidance.span.col) == (8, 29)


def test_device_and_constraint_spans():
    p = program("stage a = ar() @ cuda:1", "colocate a, talkr")
    assert where(p.stages[0].device_span) == (2, 18, 24)
    (a, a_span), (talkr, talkr_span) = p.constraints[0].stages
    assert where(talkr_span) == (3, 13, 18)
    assert str(talkr_span) == "t.omni:3:13"


def test_multiline_value_span_stops_at_end_of_line():
    p = program("param x = [1,", "  2]")
    assert where(p.params[0].span) == (2, 1, 14)


@pytest.mark.parametrize("word", sorted(dsl.parser.KEYWORDS))
def test_every_reserved_word_may_be_a_key(word):
    p = program(f"stage s = ar({word}=1)", f"s -> t [{word}]")
    assert p.stages[0].args[0].key == word and p.flows[0].attrs[0].key == word
