"""Semantic errors: each program parses but is not a valid graph; the error points at the
right line and column, says what is wrong, and hints at a fix where one helps."""

import pytest

from omniflow.compiler import graph_from_source
from omniflow.errors import GraphError

HEAD = 'pipeline p {\n  model "Qwen/Qwen2.5-0.5B-Instruct"\n  param n = 16\n'
BASE = """  stage lm = ar(max_batch=4)
  stage voc = vocoder(model="Qwen/Qwen3-TTS-12Hz-1.7B-Base", component="code2wav")
  input prompt: chat -> lm
  lm.codes -> voc [stream, chunk=auto, context=4]
  voc.audio -> output audio
"""

# (program body after HEAD, line, col, message substring, hint substring or None)
CASES = [
    (
        "  stage lm = ar(max_batch=4)\n  input prompt: chat -> lmm\n  lm.text -> output t\n",
        5,
        25,
        "unknown stage 'lmm'",
        "did you mean 'lm'?",
    ),
    (
        "  stage lm = arr(max_batch=4)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        14,
        "unknown stage kind 'arr'",
        "did you mean 'ar'?",
    ),
    (
        "  stage lm = ar(max_bacth=4)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        17,
        "unknown parameter of ar 'max_bacth'",
        "did you mean 'max_batch'?",
    ),
    (
        "  stage lm = ar(flavour=4)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        17,
        "unknown parameter of ar 'flavour'",
        "valid: model, component, max_batch",
    ),
    (
        '  stage lm = ar(max_batch="four")\n  input prompt: chat -> lm\n  lm.text -> output t\n',
        4,
        27,
        "'max_batch' must be int",
        None,
    ),
    (
        "  stage lm = ar(max_batch=0)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        27,
        "'max_batch' must be at least 1, not 0",  # (was a failed cost pass, no place)
        None,
    ),
    (
        "  stage lm = ar(max_len=0)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        25,
        "'max_len' must be between 1 and 1048576, not 0",  # (was 1.04858e+06)
        None,
    ),
    (
        "  stage lm = ar(max_tokens=$m)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        28,
        "unknown parameter '$m'",
        "declare it with `param m = ...`",
    ),
    (
        "  stage lm = ar(max_batch=4)\n  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        5,
        3,
        "'lm' is already defined",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.txt -> output t\n",
        6,
        3,
        "'lm' has no output port 'txt'",
        "did you mean 'text'?",
    ),
    (
        "  stage lm = ar()\n  stage voc = vocoder()\n  input prompt: chat -> lm\n  lm.text -> voc\n  voc.audio -> output a\n",
        7,
        3,
        "type mismatch: lm.text gives text, but voc takes no text",
        "voc inputs: codes (codes), hidden (hidden)",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  input other: chat -> lm\n  lm.text -> output t\n",
        6,
        24,
        "lm.prompt already has a producer (prompt)",
        "name another port",
    ),
    (
        "  stage a = ar()\n  stage b = ar()\n  input prompt: chat -> a\n  a.hidden -> b\n  b.hidden -> a.embeds\n  b.text -> output t\n",
        8,
        3,
        "cycle: a -> b -> a",
        "pipelines are acyclic",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> output t\n  lm.tokens -> output t\n",
        7,
        16,
        "output 't' is already used",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> output t [stream, chunkk=2]\n",
        6,
        32,
        "unknown edge attribute 'chunkk'",
        "did you mean 'chunk'?",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.hidden -> map(gainn(2)) -> output t\n",
        6,
        20,
        "unknown map op 'gainn'",
        "did you mean 'gain'?",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.hidden -> map(clamp(1)) -> output t\n",
        6,
        20,
        "'clamp' takes 2 argument(s) (lo, hi), got 1",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.hidden -> map(clamp(1, -1)) -> output t\n",
        6,
        20,
        "'clamp' needs lo <= hi, not 1, -1",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> map(gain(2)) -> output t\n",
        6,
        3,
        "map needs a tensor port, but this edge carries text",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.hidden -> output t [whole, chunk=4]\n",
        6,
        3,
        "cannot be both whole and streamed",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.hidden -> output t [context=4]\n",
        6,
        3,
        "left context needs a streamed edge",
        "add `stream`",
    ),
    (
        "  stage lm = ar()\n  stage t = ar()\n  input prompt: chat -> lm\n  lm.hidden -> t [adapter=qwen_omni.thinker_to_talkr]\n  t.text -> output x\n",
        7,
        3,
        "unknown adapter 'qwen_omni.thinker_to_talkr'",
        "did you mean 'qwen_omni.thinker_to_talker'?",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  input unused: text\n  lm.text -> output t\n",
        6,
        3,
        "input 'unused' is not connected",
        "guidance companion",
    ),
    (
        "  stage lm = ar()\n  stage idle = ar()\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        5,
        3,
        "stage 'idle' has no input",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> output t\n  colocate lm, ghost\n",
        7,
        16,
        "unknown stage 'ghost'",
        None,
    ),
    (
        "  stage lm = ar() @ gpu:1\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        21,
        "unknown device 'gpu:1'",
        "use cpu, cuda or cuda:N",
    ),
    (
        "  stage f = python()\n  input prompt: chat -> f\n  f.out -> output t\n",
        4,
        3,
        "stage 'f' needs 'fn'",
        "add `fn=...`",
    ),
    (
        "  stage a = ar() @ cuda:0\n  stage b = ar() @ cuda:1\n  input prompt: chat -> a\n  a.hidden -> b\n  b.text -> output t\n  colocate a, b\n",
        9,
        3,
        "cannot colocate stages pinned to cuda:0, cuda:1",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.text -> output t\n  prompt.out -> output u\n  lm -> output v\n",
        8,
        3,
        "'lm' has several outputs; name one",
        "write lm.PORT",
    ),
    (
        '  stage lm = ar(decode="grahps")\n  input prompt: chat -> lm\n  lm.text -> output t\n',
        4,
        24,
        "'decode' must be one of auto, graphs, static, eager",
        "did you mean 'graphs'?",
    ),
    (
        '  stage lm = ar(role="prefill")\n  input prompt: chat -> lm\n  lm.text -> output t\n',
        4,
        17,
        "splitting an ar stage into prefill and decode stages is not supported yet",
        "remove `role=...`",
    ),
    (
        "  stage lm = ar(replicas=2)\n  input prompt: chat -> lm\n  lm.text -> output t\n",
        4,
        17,
        "replicas are not supported yet: each stage runs as one copy on its devices",
        "remove `replicas=...`",
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  input clip: audio -> lm.audio\n"
        "  lm.text -> output t\n",
        6,
        24,
        "ar stages take no audio yet: an ar stage takes media as embeddings from an encoder "
        "stage (into `embeds`)",
        None,
    ),
    (
        "  stage lm = ar()\n  input prompt: chat -> lm\n  lm.kv -> output cache\n"
        "  lm.text -> output t\n",
        6,
        3,
        "passing a KV cache between stages is not supported yet",
        None,
    ),
    (
        "  stage enc = encoder()\n  stage dit = diffusion(cfg=negativ)\n  stage vae = vae()\n  input prompt: text -> enc\n  input negative: text\n"
        "  enc.hidden -> dit\n  dit.latents -> vae\n  vae.image -> output image\n",
        5,
        29,
        "cfg names 'negativ', which is not an input",
        "did you mean 'negative'?",
    ),
]


@pytest.mark.parametrize("body,line,col,message,hint", CASES, ids=[c[3][:40] for c in CASES])
def test_semantic_error(body, line, col, message, hint):
    with pytest.raises(GraphError) as info:
        graph_from_source(HEAD + body + "}\n", "bad.omni")
    err = info.value
    assert message in err.message
    assert (err.span.line, err.span.col) == (line, col), err.render()
    if hint:
        assert hint in (err.hint or ""), err.render()
    assert err.render().startswith(f"bad.omni:{line}:{col}: error: ")


def test_base_program_is_valid():
    graph = graph_from_source(HEAD + BASE + "}\n", "ok.omni")
    assert [n.name for n in graph.stages] == ["lm", "voc"]


def test_missing_model_is_an_error():
    with pytest.raises(GraphError, match="stage 'lm' has no model"):
        graph_from_source(
            "pipeline p {\n stage lm = ar()\n input x: chat -> lm\n lm.text -> output t\n}\n"
        )


def test_rendered_error_has_caret_under_the_name():
    with pytest.raises(GraphError) as info:
        graph_from_source(
            HEAD
            + "  stage talker = ar()\n  input prompt: chat -> talkr\n  talker.text -> output t\n}\n",
            "x.omni",
        )
    lines = info.value.render().splitlines()
    assert lines[0] == "x.omni:5:25: error: unknown stage 'talkr'"
    assert lines[1] == "    input prompt: chat -> talkr"
    assert lines[2] == "  " + " " * 24 + "^^^^^"
    assert lines[3] == "hint: did you mean 'talker'?"
