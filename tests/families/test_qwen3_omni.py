"""Qwen3-Omni as three stages (`omniflow.families.qwen3_omni`) on tiny:qwen3-omni against
the unsplit model's own `Qwen3OmniMoeForConditionalGeneration.generate`, greedy: the same
text tokens, the same talker frames (all 16 codebooks: the talker's first and the code
predictor's 15), and code2wav's audio; the same
seed giving the same bytes; the example graph run through the runtime.

Where `generate` and the stages differ, by design, and how the tests line them up:
- `generate` runs the code predictor in the step that feeds a frame back, so a talker
  stopped by `talker_max_new_tokens=N` yields N - 1 frames; the talker stage emits each
  frame when it samples it, so `max_tokens=N - 1` gives those same N - 1 frames. Before an
  end of speech both give the same frames.
- `generate` hard-codes two things the tiny checkpoint has to meet or the reference to
  pass: it suppresses the talker's ids `vocab_size - 1024 ..` but the end of speech (so the
  tiny codec vocabulary keeps the published 1024 specials after its 128 codes), and it ends
  the thinker at 151645, the published `<|im_end|>` (`reference_generate` passes the tiny
  one's).
- `generate` decodes audio with `code2wav.chunked_decode(codes, 300, 25)`; below 300 frames
  that is the whole decode, `code2wav(codes)`, n x 1920 - 555 samples. The stage emits 1920
  samples per frame: the last frame's 555 samples that no decode computes are zeros.

Measured on 2 CPU cores (max |a - b|, waveforms of std ~0.3 clamped to +-1): the loaded
code2wav's whole decode against the unsplit model's, 0 (bit-equal); against `generate`'s
waveform, 0. Tolerance 1e-4. code2wav streamed with its carried state:
test_qwen3_omni_code2wav.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from omniflow.backends.static_decode import COLUMN_QUANTUM
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.checkpoints.tiny import MANIFEST, build_tiny
from omniflow.compiler import compile_file, compile_source
from omniflow.families.qwen3_omni import REAL_MODEL, speakers
from omniflow.families.qwen3_omni.checkpoints import (
    ACCEPT_HIDDEN_LAYER,
    prompt_ids,
    reference_generate,
)
from omniflow.families.qwen3_omni.code2wav import code2wav_field, load
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestFailed
from omniflow.runtime.stage import Call, InputStream
from tests.gpu_wiring import stage_spec
from tests.runtime.test_readback import land_late

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "qwen3_omni.omni"
TOLERANCE = 1e-4
# generate's talker_max_new_tokens; the talker stage's max_tokens is one less (see above).
TALKER_TOKENS = 40
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# (chat, thinker max_tokens, speaker): the first two end their speech with the talker's end
# of speech (the first one far past its 3 words of text: tts eos, then tts pad rows), the
# third runs to max_tokens; it has a system turn and an earlier assistant turn, which the
# talker does not read, and two user turns, which it does.
CASES = [
    ("Good morning", 3, "Ethan"),
    ("Hello! How are you today?", 8, "Chelsie"),
    (
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hello! How are you today?"},
            {"role": "assistant", "content": "I am fine, thank you."},
            {"role": "user", "content": "Tell me a short story about a robot."},
        ],
        6,
        "Aiden",
    ),
]
SOURCE = f"""
pipeline q3_ar {{
  model "tiny:qwen3-omni"
  param max_tokens = 8
  param speaker = "Ethan"
  stage thinker = ar(component="thinker", max_batch=4, max_tokens=$max_tokens, temperature=0.0)
  stage talker  = ar(component="talker", max_batch=4, max_tokens={TALKER_TOKENS - 1},
                    temperature=0.0, speaker=$speaker)
  input prompt: chat -> thinker
  thinker.hidden -> talker [stream, chunk=1, adapter=qwen3_omni.thinker_to_talker]
  thinker.text -> output text [stream]
  thinker.tokens -> output tokens [stream]
  talker.tokens -> output codec_tokens [stream]
  talker.codes -> output codes [stream, adapter=qwen3_omni.talker_to_code2wav]
}}
"""


def chat(messages) -> list[dict]:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else messages


@pytest.fixture(scope="module")
def path() -> Path:
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="module")
def model(path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def references(path, model):
    return [
        reference_generate(
            path, messages, n, speaker=speaker, talker_max_new_tokens=TALKER_TOKENS, model=model
        )
        for messages, n, speaker in CASES
    ]


@pytest.fixture(scope="module")
def plan():
    return compile_source(SOURCE, devices="cpu")


def run_case(run, case) -> dict:
    messages, n, speaker = case
    return run({"prompt": chat(messages)}, {"max_tokens": n, "speaker": speaker})


def assert_matches(out: dict, ref) -> None:
    assert out["tokens"].reshape(-1).tolist() == ref.text_ids.tolist()
    assert out["text"] == ref.text
    assert out["codes"].dtype == torch.int64 and out["codes"].shape[1:] == (16,)
    assert torch.equal(out["codes"], ref.codes)


def test_stages_give_generates_text_and_frames(plan, references):
    outs = [run_case(Interpreter(plan).run, case) for case in CASES]
    for out, ref in zip(outs, references, strict=True):
        assert_matches(out, ref)
    # The cases cover both ends of speech: the talker's end-of-speech id, and max_tokens.
    lengths = [len(ref.codes) for ref in references]
    assert lengths[0] < TALKER_TOKENS - 1 and lengths[1] < TALKER_TOKENS - 1
    assert lengths[2] == TALKER_TOKENS - 1
    eos = 128 + 102  # the codec end of speech: the published 2150 - 2048 past the codes
    assert [int(out["codec_tokens"][-1]) for out in outs[:2]] == [eos, eos]


def test_the_static_path_gives_generates_text_and_frames(references):
    """The thinker and the talker on the static decode path (MoE layers with no host
    readback, the talker's frames completed inside its step: what CUDA captures) give
    `generate`'s text and frames, to the end of speech and to max_tokens."""
    source = SOURCE.replace("temperature=0.0)", 'temperature=0.0, decode="static")')
    source = source.replace("speaker=$speaker)", 'speaker=$speaker, decode="static")')
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    assert {interpreter.backends[s].decode for s in ("thinker", "talker")} == {"static"}
    for case, ref in zip(CASES, references, strict=True):
        assert_matches(run_case(interpreter.run, case), ref)


def test_a_thinker_prompt_at_max_len_fits_the_talkers_cache(path):
    """A thinker prompt at its max_len, with the talker's whole max_tokens, fits the
    talker's static cache: the talker's prompt is 6 rows longer than the thinker's (the
    family's `added_positions`), which a cache of max_len + max_tokens columns alone would
    lack: the talker refused such a request after the thinker had run."""
    from transformers import AutoTokenizer

    messages = chat("Hello! How are you today?")
    length = prompt_ids(AutoTokenizer.from_pretrained(path), messages).shape[1]
    talker_tokens = COLUMN_QUANTUM - length  # max_len + max_tokens: one quantum exactly
    source = SOURCE.replace(
        "max_batch=4, max_tokens=$", f"max_batch=4, max_len={length}, max_tokens=$"
    )
    source = source.replace(
        f"max_tokens={TALKER_TOKENS - 1},", f"max_len={length}, max_tokens={talker_tokens},"
    ).replace("temperature=0.0)", 'temperature=0.0, decode="static")')
    source = source.replace("speaker=$speaker)", 'speaker=$speaker, decode="static")')
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    talker = interpreter.backends["talker"]
    assert talker.static.columns >= length + 6 + talker_tokens
    out = interpreter.run({"prompt": messages}, {"max_tokens": 2})
    assert out["codes"].shape[0] > 0 and out["codes"].shape[1:] == (16,)


def test_the_talker_takes_thinker_items_once_their_roles_land(references, monkeypatch):
    """On a GPU the roles of the thinker's items (where its prompt ends) reach the host a
    while after the items arrive, and nothing waits for them (`RoleRows`): the talker takes
    a chunk once its roles have landed and the loop polls meanwhile; likewise where the
    prompt's turns and media are (its markers, found on the device). Here, on the static
    path, every read-back (roles, markers, tokens) lands three polls late, as a busy GPU's
    would: `generate`'s text and frames all the same."""
    source = SOURCE.replace("temperature=0.0)", 'temperature=0.0, decode="static")')
    source = source.replace("speaker=$speaker)", 'speaker=$speaker, decode="static")')
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    held_back = land_late(monkeypatch)
    for case, ref in zip(CASES, references, strict=True):
        assert_matches(run_case(interpreter.run, case), ref)
    role_copies = [c for c in held_back if c.value.dtype.is_floating_point]
    assert role_copies, "no thinker item's roles were held back"
    marker_copies = [c for c in held_back if c.value.dtype == torch.bool]
    assert len(marker_copies) == len(CASES), "not every prompt's markers were held back"


def test_batched_in_one_engine_each_request_gets_its_own_frames(plan, references):
    """All cases at once: the thinker and the talker batch them, and the code predictor runs
    for every talker row of a step in one batch, rows joining and leaving at other steps."""
    with Engine(plan, "inprocess") as engine, ThreadPoolExecutor(len(CASES)) as pool:
        outs = list(pool.map(lambda case: run_case(engine.generate, case), CASES))
    for out, ref in zip(outs, references, strict=True):
        assert_matches(out, ref)


def test_thinker_items_carry_the_accepted_layer_and_the_embeddings(plan, path, model):
    """The thinker's `hidden` items are `generate`'s `hidden_states[accept_hidden_layer]`
    and `hidden_states[0]` (the input embeddings) at every position it feeds, and a role
    row: 0 for the prompt, 1 for the generated tokens."""
    from transformers import AutoTokenizer

    thinker = TransformersAR(stage_spec(plan, "thinker"), "cpu")
    messages = chat("Tell me a short story.")
    call = Call("t", {"max_tokens": 5}, {"prompt": InputStream("chat")})
    call.inputs["prompt"].push(messages, end=True)
    while not call.finished:
        thinker.step([call])
    items = torch.cat([v for port, v in call.emitted if port == "hidden"])
    tokens = torch.cat([v for port, v in call.emitted if port == "tokens"]).reshape(-1)
    ids = prompt_ids(AutoTokenizer.from_pretrained(path), messages)
    fed = torch.cat([ids[0], tokens[:-1]])  # the last token is never fed back
    assert items.shape == (len(fed), 3, 64)
    with torch.no_grad():
        states = model.thinker(input_ids=fed[None], output_hidden_states=True).hidden_states
    assert model.config.talker_config.accept_hidden_layer == ACCEPT_HIDDEN_LAYER
    assert (items[:, 0] - states[ACCEPT_HIDDEN_LAYER][0]).abs().max() < 1e-5
    assert torch.equal(items[:, 1], states[0][0])
    assert items[:, 2, 0].tolist() == [0.0] * ids.shape[1] + [1.0] * (len(tokens) - 1)


def test_the_talker_needs_a_known_speaker_and_an_assistant_turn(plan):
    with pytest.raises(RequestFailed, match="unknown speaker 'Nobody'; this model has Aiden"):
        Interpreter(plan).run({"prompt": chat("hi")}, {"max_tokens": 3, "speaker": "Nobody"})
    text = compile_source(SOURCE.replace("input prompt: chat", "input prompt: text"), "cpu")
    with pytest.raises(RequestFailed, match="the prompt has none"):
        Interpreter(text).run({"prompt": "no chat template here"}, {"max_tokens": 3})


# --- code2wav -------------------------------------------------------------------------------


def test_code2wav_decodes_what_transformers_decodes(path, model, references):
    decoder = load(str(path), "code2wav", "cpu")
    assert (decoder.samples_per_frame, decoder.tail) == (1920, 555)
    assert (decoder.reach.context, decoder.reach.lookahead) == (152, 1)  # 2 x 71 + 10
    codes = references[2].codes  # 39 frames
    with torch.no_grad():
        whole = decoder.model(codes.T[None]).reshape(-1)
        theirs = model.code2wav(codes.T[None]).reshape(-1)
    assert len(theirs) == len(codes) * 1920 - 555
    assert torch.equal(whole, theirs)
    # generate's own audio: its chunked_decode, the whole decode below 300 frames.
    for ref in references:
        with torch.no_grad():
            mine = decoder.model(ref.codes.T[None]).reshape(-1)
        assert (mine[: len(ref.waveform)] - ref.waveform).abs().max() < TOLERANCE


def test_code2wavs_reach_in_the_published_config():
    """The real code2wav: 8 layers of 72-frame windows and the ConvNet, 578 frames back (what
    its carried state stands for: the graph plans no context), one ahead; 555 samples short
    at the end."""
    from transformers import Qwen3OmniMoeCode2Wav, Qwen3OmniMoeConfig

    from omniflow.catalog.components import builtin_files

    real = builtin_files(REAL_MODEL)["config.json"]
    config = Qwen3OmniMoeConfig(**{k: v for k, v in real.items() if k.endswith("_config")})
    with torch.device("meta"):
        model = Qwen3OmniMoeCode2Wav(config.code2wav_config)
    field, tail = code2wav_field(model)
    assert (field.per_frame, tail, -field.first) == (1920, 555, 555)
    assert field.last // field.per_frame == 578
    plan = compile_file(GRAPH, devices="cpu", tiny=True)
    codes = next(c for c in plan.channels if c.dst == "code2wav")
    assert codes.carries_state and codes.context == 0


# --- the example graph through the runtime ------------------------------------------------------


@pytest.fixture(scope="module")
def graph_plan():
    return compile_file(GRAPH, devices="cpu", tiny=True)


GREEDY = {"temperature": 0.0, "audio_temperature": 0.0, "max_audio_tokens": TALKER_TOKENS - 1}


def test_the_graph_runs_end_to_end_in_executor_processes(graph_plan, references):
    """graphs/qwen3_omni.omni on tiny:qwen3-omni, thinker+talker and code2wav in their own
    executor processes: generate's text, and its audio (as pcm16, after the graph's clamp)."""
    (messages, n, speaker), ref = CASES[1], references[1]
    with Engine(graph_plan, "process") as engine:
        out = engine.generate(
            {"prompt": chat(messages)}, {**GREEDY, "max_tokens": n, "speaker": speaker}
        )
    assert out["text"] == ref.text
    audio = out["audio"].reshape(-1)
    assert audio.dtype == torch.int16 and len(audio) == len(ref.codes) * 1920
    expected = (ref.waveform.clamp(-1, 1) * 32767).round()
    # pcm16's own rounding (1), and the streamed decode's float rounding (TOLERANCE).
    assert (audio[: len(expected)].float() - expected).abs().max() <= 1 + TOLERANCE * 32767
    assert not audio[len(expected) :].any()


def test_the_same_seed_gives_the_same_bytes(graph_plan):
    """Sampled (the talker at the graph's 0.9 with its code predictor's top-k/top-p, the
    thinker at 0.8): one seed, the same text and audio bytes; another seed, other audio."""
    interpreter = Interpreter(graph_plan)
    params = {"max_tokens": 6, "max_audio_tokens": 12, "temperature": 0.8}

    def run(seed):
        return interpreter.run({"prompt": chat("Hi")}, {**params, "seed": seed})

    first, again, other = run(7), run(7), run(8)
    assert first["text"] == again["text"]
    assert first["audio"].numpy().tobytes() == again["audio"].numpy().tobytes()
    assert first["audio"].numpy().tobytes() != other["audio"].numpy().tobytes()


def test_the_checkpoint_names_its_speakers(path):
    assert speakers(path) == ("Aiden", "Chelsie", "Ethan")


def test_compiled_for_one_and_two_h200s():
    """All five stages on one H200 with budgets; on two, the towers and code2wav get the
    second."""
    one = compile_file(GRAPH, devices="1xH200")
    assert {s.name: s.devices for s in one.stages} == {
        "hearing": ["cuda:0"],
        "vision": ["cuda:0"],
        "thinker": ["cuda:0"],
        "talker": ["cuda:0"],
        "code2wav": ["cuda:0"],
    }
    assert all(s.budget_bytes > s.weight_bytes > 0 for s in one.stages)
    assert sum(s.budget_bytes for s in one.stages) <= 140 * 2**30
    two = compile_file(GRAPH, devices="2xH200")
    assert {s.name: s.devices[0] for s in two.stages} == {
        "hearing": "cuda:1",
        "vision": "cuda:1",
        "thinker": "cuda:0",
        "talker": "cuda:0",
        "code2wav": "cuda:1",
    }
    towers = {c.src: list(c.item_shape) for c in two.channels if c.dst == "thinker"}
    # Audio embeddings; images' and videos' embeddings with 3 deepstack layers' features.
    assert towers["hearing"] == [1537, 2048] and towers["vision"] == [4097, 4 * 2048]
    hidden = next(c for c in one.channels if c.src == "thinker" and c.dst == "talker")
    assert list(hidden.item_shape) == [3, 2048]  # accept-layer state, embedding, role
    codes = next(c for c in one.channels if c.dst == "code2wav")
    assert list(codes.item_shape) == [16] and codes.carries_state and codes.context == 0


def test_an_unknown_speaker_is_refused_before_any_executor_starts(tmp_path, capsys):
    from omniflow.cli import main

    args = ["run", "--once", str(GRAPH), "--tiny", "--out", str(tmp_path / "out")]
    args += ["--input", "prompt=hi", "--param", "speaker=Bob"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "unknown speaker 'Bob'; the model has Aiden, Chelsie, Ethan" in err
    assert not (tmp_path / "out").exists()


def test_the_tiny_checkpoint_rebuilds_to_the_same_bytes(path, tmp_path):
    again = build_tiny("qwen3-omni", tmp_path / "qwen3-omni")
    files = json.loads((again / MANIFEST).read_text())["files"]
    cached = json.loads((path / MANIFEST).read_text())["files"]
    differ = sorted(n for n in files.keys() | cached.keys() if files.get(n) != cached.get(n))
    assert not differ, f"rebuilt with other bytes: {differ}"
    assert sum(entry["bytes"] for entry in files.values()) < 5_000_000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("component", ["thinker", "talker"])
def test_the_experts_run_on_the_fused_kernels_on_cuda(path, component, device):
    """Loaded on CUDA, the thinker's and the talker's MoE experts run on
    `omniflow.kernels.fused_moe` (on the CPU, on transformers' own); the logits agree with
    transformers' eager experts."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from omniflow.families.qwen3_omni.thinker_talker import load
    from omniflow.kernels import fused_moe

    model = load(str(path), component, device, torch.float32).model
    experts = model.config.get_text_config()._experts_implementation
    assert (experts == fused_moe.IMPLEMENTATION) == (device == "cuda")
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)  # the talker takes embeddings only
        fused = model(inputs_embeds=embeds).logits
        model.set_experts_implementation("eager")
        theirs = model(inputs_embeds=embeds).logits
    assert float((fused - theirs).abs().max()) < 1e-3 * float(theirs.abs().max())
