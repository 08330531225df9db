"""graphs/image_understanding.omni on tiny:qwen2.5-vl: a vision encoder stage (the vision
tower alone) feeding a transformers `ar` stage (the language model, with Qwen2.5-VL's
multimodal RoPE positions) gives exactly what the unsplit
`Qwen2_5_VLForConditionalGeneration.generate` gives with greedy decoding on the same image
and prompt: the same tokens and text, under the reference interpreter and the engine in
both modes, one request at a time and several at once (images of different sizes batched
in one tower forward and in one decode batch); its end counts the image's placeholder
tokens in the prompt.

The plan is the example graph on its tiny counterpart with the language model's tokens
as an extra output, so tokens compare one by one."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from omniflow.backends.transformers_ar import TransformersAR
from omniflow.backends.vision import (
    MAX_MEDIA_INTEGERS,
    MEDIA_HEADER_COLUMNS,
    MediaItem,
    VisionBackendError,
    VisionEncoder,
    media_header,
    pack_image,
    pack_media,
    read_media_header,
    unpack_image,
    unpack_media,
)
from omniflow.catalog.resolve import use_tiny_models
from omniflow.checkpoints.tiny import build_tiny
from omniflow.cli import main
from omniflow.compiler import compile_graph, compile_source, graph_from_source
from omniflow.families.qwen2_5_vl.checkpoints import reference_vl_generate
from omniflow.hf_logging import quiet
from omniflow.media import png_bytes
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestFailed
from omniflow.runtime.stage import Call, InputStream
from tests.gpu_wiring import stage_spec

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "image_understanding.omni"
MAX_TOKENS = 12
# (image height, width, as a PNG path or a tensor, prompt): different patch grids.
IMAGES = [(56, 84, "png", "What is this?"), (112, 140, "tensor", "Describe the image.")]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[dict, object]]:
    """(request inputs, the image as the reference takes it) per case."""
    generator = torch.Generator().manual_seed(0)
    folder = tmp_path_factory.mktemp("images")
    out = []
    for i, (height, width, form, prompt) in enumerate(IMAGES):
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator).to(torch.uint8)
        image = pixels
        if form == "png":
            image = folder / f"image{i}.png"
            image.write_bytes(png_bytes(pixels))
            image = str(image)
        out.append(({"image": image, "prompt": prompt}, image))
    return out


@pytest.fixture(scope="module")
def references(cases):
    path = build_tiny("qwen2.5-vl")
    return [
        reference_vl_generate(path, inputs["prompt"], image, max_new_tokens=MAX_TOKENS)
        for inputs, image in cases
    ]


@pytest.fixture(scope="module")
def plan():
    source = GRAPH.read_text().replace(
        "llm.text -> output text [stream]",
        "llm.text -> output text [stream]\n  llm.tokens -> output tokens [stream]",
    )
    return compile_graph(use_tiny_models(graph_from_source(source, str(GRAPH))), "cpu")


def assert_matches(out: dict, ref) -> None:
    assert out["tokens"].reshape(-1).tolist() == ref.text_ids.tolist()
    assert out["text"] == ref.text


def run(generate, inputs) -> dict:
    return generate(inputs, {"max_tokens": MAX_TOKENS})


@pytest.fixture(scope="module")
def interpreter(plan):
    return Interpreter(plan)


def test_cases_have_different_grids(references):
    assert [r.image_grid_thw.tolist() for r in references] == [[[1, 4, 6]], [[1, 8, 10]]]
    assert all(len(r.text_ids) == MAX_TOKENS for r in references)


def test_interpreter_matches_generate(interpreter, cases, references):
    for (inputs, _), ref in zip(cases, references, strict=True):
        assert_matches(run(interpreter.run, inputs), ref)


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_engine_matches_generate(plan, cases, references, mode):
    inputs = [c[0] for c in cases]
    with Engine(plan, mode) as engine:
        for one, ref in zip(inputs, references, strict=True):
            assert_matches(run(engine.generate, one), ref)
        with ThreadPoolExecutor(len(inputs)) as pool:
            outs = list(pool.map(lambda one: run(engine.generate, one), inputs))
        for out, ref in zip(outs, references, strict=True):
            assert_matches(out, ref)
        # A bad image fails its own request only; one sent beside it still matches.
        bad = {**inputs[0], "image": torch.zeros(8, 8)}
        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(run, engine.generate, bad)
            good = pool.submit(run, engine.generate, inputs[1])
            with pytest.raises(RequestFailed, match="stage 'vision' failed.*uint8 tensor"):
                failing.result()
            assert_matches(good.result(), references[1])


def test_the_language_models_ending_counts_the_images_placeholder_tokens(plan, cases, references):
    """What a reply's usage reports of the image: its `<|image_pad|>` tokens in the prompt,
    one per merged patch of the processor's grid."""
    from transformers import AutoConfig

    merge = AutoConfig.from_pretrained(build_tiny("qwen2.5-vl")).vision_config.spatial_merge_size
    with Engine(plan, "inprocess") as engine:
        for (inputs, _), ref in zip(cases, references, strict=True):
            chunks = engine.stream_sync(inputs, {"max_tokens": MAX_TOKENS})
            (ending,) = [c.ending for c in chunks if c.end and c.output == "text"]
            assert ending.media == {"image": int(ref.image_grid_thw.prod()) // merge**2}


def _image_call(value) -> Call:
    call = Call("r", {}, {"image": InputStream("image")})
    call.inputs["image"].push(value, end=True)
    return call


def test_one_tower_forward_and_one_decode_batch_for_different_grids(plan, cases, references):
    """The stages driven directly: both images (and two bad ones) in one vision step, whose
    tower runs once; then both requests decode in one batch of the language model."""
    vision, llm = (stage_spec(plan, name) for name in ("vision", "llm"))
    encoder = VisionEncoder(vision, "cpu")
    forwards = []
    encoder.tower.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
    images = [_image_call(inputs["image"]) for inputs, _ in cases]
    bad = [_image_call("/no/such.png"), _image_call(torch.zeros(4, 4, 3))]
    encoder.step(images + bad)
    assert len(forwards) == 1  # one forward over both images' patches
    assert "cannot read image file '/no/such.png'" in str(bad[0].error)
    assert "uint8 tensor [H, W, 3], not a torch.float32 tensor of shape [4, 4, 3]" in str(
        bad[1].error
    )
    embeds = []
    for call, ref in zip(images, references, strict=True):
        assert call.finished and call.error is None
        [(port, value)] = call.emitted
        rows, grid = unpack_image(value, merge_size=2)
        assert port == "hidden" and torch.equal(grid, ref.image_grid_thw)
        embeds.append(value)

    lm = TransformersAR(llm, "cpu")
    calls = []
    for (inputs, _), value in zip(cases, embeds, strict=True):
        streams = {"prompt": InputStream("chat"), "embeds": InputStream("hidden")}
        call = Call("r", {"max_tokens": MAX_TOKENS}, streams)
        call.inputs["prompt"].push([{"role": "user", "content": inputs["prompt"]}], end=True)
        call.inputs["embeds"].push(value, end=True)
        calls.append(call)
    tokens = [[] for _ in calls]
    widest = 0
    while not all(c.finished for c in calls):
        lm.step([c for c in calls if not c.finished and lm.ready(c)])
        widest = max(widest, len(lm.rows))
        for got, call in zip(tokens, calls, strict=True):
            got += [int(v) for port, v in call.emitted if port == "tokens"]
            call.emitted.clear()
    assert widest == 2  # both requests decoded in the same forwards
    for got, ref in zip(tokens, references, strict=True):
        assert got == ref.text_ids.tolist()


def test_packing_round_trips_large_grids_in_bfloat16():
    embeds = torch.randn(300, 8).to(torch.bfloat16)
    grid = (1, 2, 600)  # grid sizes past 256 travel as two base-256 digits
    rows, got = unpack_image(pack_image(embeds, grid), merge_size=2)
    assert got.tolist() == [list(grid)] and torch.equal(rows, embeds)


def test_media_headers_are_read_from_their_leading_columns_alone():
    # A reader may copy just MEDIA_HEADER_COLUMNS of each row to the host (Qwen3-Omni's
    # talker does, with its prompt's markers): every header a writer makes fits in them.
    video = MediaItem("video", torch.randn(3, 64), (3, 1, 2, 6, 2_000_000))
    clip = MediaItem("audio", torch.randn(2, 64), (2, 50))
    packed = pack_media([video, clip], 64, torch.bfloat16)
    got = unpack_media(packed)
    assert [(i.kind, i.meta) for i in got] == [("video", video.meta), ("audio", clip.meta)]
    assert read_media_header(packed[0, 0, :MEDIA_HEADER_COLUMNS]) == ("video", video.meta)
    with pytest.raises(VisionBackendError, match="do not fit"):
        media_header("video", (1,) * (MAX_MEDIA_INTEGERS + 1), 64, torch.bfloat16)


def test_a_chat_with_an_image_part_puts_the_image_there(interpreter, cases, references):
    """The chat may place the image itself; where the default puts it, the same answer."""
    inputs, _ = cases[0]
    content = [{"type": "image"}, {"type": "text", "text": inputs["prompt"]}]
    out = run(interpreter.run, {**inputs, "prompt": [{"role": "user", "content": content}]})
    assert_matches(out, references[0])
    two = [{"role": "user", "content": [{"type": "image"}, *content]}]
    with pytest.raises(RequestFailed, match="2 image part.*1 image"):
        run(interpreter.run, {**inputs, "prompt": two})


def test_run_cli_answers_about_an_image_file(tmp_path, cases, references):
    code = main(["run", str(GRAPH), "--tiny", "--mode", "inprocess", "--input", f"image={cases[0][0]['image']}",
                 "--input", f"prompt={cases[0][0]['prompt']}", "--param", f"max_tokens={MAX_TOKENS}",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert (tmp_path / "text.txt").read_text() == references[0].text


def test_a_chat_without_an_image_is_plain_text():
    """The language model alone (no embeds input): 1-D positions, the model's own text-only
    `generate`."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    plan = compile_source(
        """
        pipeline chat {
          model "tiny:qwen2.5-vl"
          stage llm = ar(component="language_model", max_tokens=12)
          input prompt: chat -> llm
          llm.tokens -> output tokens [stream]
        }
        """
    )
    out = Interpreter(plan).run({"prompt": "Tell me a short story."})
    path = build_tiny("qwen2.5-vl")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with quiet():
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    messages = [{"role": "user", "content": "Tell me a short story."}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).input_ids
    want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert out["tokens"].reshape(-1).tolist() == want.tolist()
