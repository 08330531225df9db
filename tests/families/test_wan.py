"""Wan2.2 as a family (omniflow/families/wan/) on its tiny checkpoints: the stages give what
diffusers' `WanPipeline.__call__` and `WanImageToVideoPipeline.__call__` give for the same
prompt, image, seed and knobs — latents within 1e-5, frames within one level — for the
A14B two-expert DiT across its boundary (text and image to video) and for TI2V-5B's
per-token timesteps (text and image to video); requests on either expert share one step;
the knobs are per request; the compiler sizes the two experts and a video's latents, as
many as the denoiser makes for any count of frames."""

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline, WanImageToVideoPipeline
from PIL import Image

from omniflow.backends.diffusion import DiffusersBackendError
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_file, compile_source
from omniflow.families.wan.pipeline import PIPELINES
from omniflow.hf_logging import quiet
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from tests.backends.test_diffusion import Stages, output, step_when_ready, to_uint8

torch.set_num_threads(1)

GRAPHS = Path(__file__).parents[2] / "graphs"
T2V, I2V = GRAPHS / "text_to_video.omni", GRAPHS / "image_to_video.omni"
IMAGE = (np.arange(32 * 48 * 3).reshape(32, 48, 3) * 7 % 255).astype(np.uint8)
# 4 steps of UniPC at flow_shift 3: timesteps 999, 900, 750, 500 — two on each side of the
# T2V boundary (875) and of the I2V one (900: 999 on the high-noise expert only).
SMALL = {"steps": 4, "height": 32, "width": 48, "num_frames": 9, "seed": 3}


def ti2v_source(image: bool) -> str:
    """text_to_video.omni on TI2V-5B: one expert, so no boundary or second scale; the
    scheduler's flow_shift left to the checkpoint (5.0); image-to-video with an image input."""
    text = T2V.read_text(encoding="utf-8")
    for old, new in (
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "tiny:wan2.2-ti2v"),
        ("guidance_scale_2=$guidance_scale_2,\n                            ", ""),
        (
            "boundary_ratio=$boundary_ratio, flow_shift=$flow_shift,\n                            ",
            "",
        ),
        ("  param guidance_scale_2 = 3.0\n  param boundary_ratio = 0.875\n", ""),
        ("  param flow_shift = 3.0\n", ""),
    ):
        assert old in text, old
        text = text.replace(old, new)
    if image:
        text = text.replace("  input prompt:", "  input image: image -> dit.image\n  input prompt:")
        text = text.replace("encoder.hidden -> dit\n", "encoder.hidden -> dit.cond\n")
    return text


def load(name: str, cls=DiffusionPipeline):
    with quiet():
        pipe = cls.from_pretrained(build_tiny(name))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, inputs: dict, params: dict, output_type: str = "latent", **knobs):
    """`__call__` with the request's fields as its arguments."""
    image = inputs.get("image")
    args = () if image is None else (Image.fromarray(image.numpy()),)
    with quiet():
        return pipe(
            *args,
            inputs["prompt"],
            negative_prompt=inputs.get("negative_prompt"),
            height=params["height"],
            width=params["width"],
            num_frames=params["num_frames"],
            num_inference_steps=params["steps"],
            generator=torch.Generator().manual_seed(params["seed"]),
            output_type=output_type,
            **knobs,
        ).frames


def denoise(stages: Stages, requests: dict, schedule: list[list[str]]) -> dict:
    """Each request's final latents, its prompts encoded together, denoised per `schedule`."""
    encoded = {
        name: stages.call("encoder", name, {"prompt": r[0]["prompt"]}, r)
        for name, r in requests.items()
    }
    stages.run("encoder", [list(encoded.values())])
    calls = {}
    for name, r in requests.items():
        values = {"cond": output(encoded[name], "hidden")}
        if "image" in r[0]:
            values["image"] = r[0]["image"]
        calls[name] = stages.call("dit", name, values, r)
    stages.run("dit", [[calls[n] for n in batch] for batch in schedule])
    return {name: output(call, "latents") for name, call in calls.items()}


@pytest.fixture(scope="module")
def t2v():
    return Stages(Interpreter(compile_file(T2V, devices="cpu", tiny=True)))


def test_each_stage_holds_only_its_own_models(t2v):
    # diffusers' from_pretrained loads a pipeline's optional components (both experts) even
    # when passed None: the encoder and the VAE stage each held the two DiTs.
    models = {
        stage: {
            name
            for name, part in backend.pipe.components.items()
            if isinstance(part, torch.nn.Module)
        }
        for stage, backend in t2v.backends.items()
        if hasattr(backend, "pipe")
    }
    assert models == {"encoder": {"text_encoder"}, "dit": {"transformer", "transformer_2"}}
    assert isinstance(t2v.backends["vae"].vae, AutoencoderKLWan)


def test_two_experts_across_the_boundary_match_the_pipeline(t2v):
    pipe = load("wan2.2-t2v")
    requests = {
        "a": ({"prompt": "A cat walks on the grass", "negative_prompt": "blurry"},
              {**SMALL, "guidance_scale": 4.0, "guidance_scale_2": 3.0}),
        "b": ({"prompt": "A dog runs along a beach at sunset"},
              {**SMALL, "guidance_scale": 5.0, "guidance_scale_2": 1.5, "seed": 7}),
    }  # fmt: skip
    forwards = []
    hooks = [
        getattr(t2v.backends["dit"].pipe, part).register_forward_pre_hook(
            lambda module, args, kwargs, part=part: forwards.append(
                (part, len(kwargs["hidden_states"]))
            ),
            with_kwargs=True,
        )
        for part in ("transformer", "transformer_2")
    ]
    try:
        # b starts two steps behind a: at a's third step a is on the low-noise expert
        # and b on the high-noise one, two forwards of one step.
        got = denoise(t2v, requests, [["a"], ["a"], ["a", "b"], ["a", "b"], ["b"], ["b"]])
    finally:
        for hook in hooks:
            hook.remove()
    assert forwards == [("transformer", 2)] * 2 + [("transformer_2", 2), ("transformer", 2)] * 2 + [
        ("transformer_2", 2)
    ] * 2  # fmt: skip
    for name, (inputs, params) in requests.items():
        want = reference(
            pipe, inputs, params,
            guidance_scale=params["guidance_scale"], guidance_scale_2=params["guidance_scale_2"],
        )  # fmt: skip
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5)


def test_image_to_video_matches_the_pipeline():
    stages = Stages(Interpreter(compile_file(I2V, devices="cpu", tiny=True)))
    inputs = {"prompt": "A red balloon floats over a city street", "negative_prompt": "blurry",
              "image": torch.from_numpy(IMAGE)}  # fmt: skip
    params = {**SMALL, "guidance_scale": 4.0, "guidance_scale_2": 2.0}
    got = denoise(stages, {"r": (inputs, params)}, [["r"]] * 4)["r"]
    want = reference(load("wan2.2-i2v"), inputs, params, guidance_scale=4.0, guidance_scale_2=2.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
def test_ti2v_per_token_timesteps_match_the_pipeline(image):
    stages = Stages(Interpreter(compile_source(ti2v_source(image), devices="cpu")))
    inputs = {"prompt": "dance monkey"}
    if image:
        inputs["image"] = torch.from_numpy(np.ascontiguousarray(IMAGE[:, :32]))
    params = {**SMALL, "steps": 3, "width": 32, "guidance_scale": 4.0}
    got = denoise(stages, {"r": (inputs, params)}, [["r"]] * 3)["r"]
    cls = WanImageToVideoPipeline if image else DiffusionPipeline
    want = reference(load("wan2.2-ti2v", cls), inputs, params, guidance_scale=4.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_frames_match_the_pipeline_in_the_engine():
    plan = compile_file(T2V, devices="cpu", tiny=True)
    inputs = {"prompt": "A cat walks on the grass", "negative_prompt": "blurry"}
    params = {**SMALL, "steps": 3}
    with Engine(plan, "inprocess") as engine:
        video = engine.generate(inputs, params)["video"]
    assert video.shape == (1, 9, 32, 48, 3) and video.dtype == torch.uint8
    want = reference(load("wan2.2-t2v"), inputs, params, "np", guidance_scale=4.0,
                     guidance_scale_2=3.0)  # fmt: skip
    want = to_uint8(torch.from_numpy(want))
    assert (video.int() - want.int()).abs().max() <= 1
    assert video.float().std() > 5  # not flat


@pytest.mark.parametrize("name", ["wan2.2-t2v", "wan2.2-ti2v"])
def test_the_vae_decodes_a_frame_a_step_as_it_decodes_whole(name):
    """A video decoded a latent frame a step (what lets a long decode report progress) is
    its whole decode to the bit, with two videos' steps interleaved (each has its own
    causal cache); TI2V-5B's VAE patchifies."""
    with quiet():
        vae = AutoencoderKLWan.from_pretrained(build_tiny(name), subfolder="vae")
    generator = torch.Generator().manual_seed(0)
    videos = [torch.randn(1, vae.config.z_dim, 3, 4, 6, generator=generator) for _ in range(2)]
    with torch.no_grad():
        whole = [PIPELINES.decode(vae, latents) for latents in videos]
        decodings = [PIPELINES.decode_in_steps(vae, latents) for latents in videos]
        assert [d.total for d in decodings] == [3, 3]
        for _ in range(3):
            for decoding in decodings:
                decoding.advance()
        for decoding, want in zip(decodings, whole, strict=True):
            assert decoding.done == 3
            torch.testing.assert_close(decoding.result(), want, rtol=0, atol=0)


def test_knobs_are_per_request(t2v):
    base = ({"prompt": "a cat"}, {**SMALL, "steps": 2})
    shifted = ({"prompt": "a cat"}, {**SMALL, "steps": 2, "flow_shift": 8.0})
    calls = {
        n: t2v.call("dit", n, {"cond": None}, r) for n, r in (("base", base), ("shift", shifted))
    }
    encoded = {n: t2v.call("encoder", n, {"prompt": "a cat"}, base) for n in calls}
    t2v.run("encoder", [list(encoded.values())])
    for name, call in calls.items():
        call.inputs["cond"].push(output(encoded[name], "hidden"), end=True)
    step_when_ready(t2v.backends["dit"], list(calls.values()))
    steps = {n: c.state["denoising"].timesteps.tolist() for n, c in calls.items()}
    assert steps["base"] != steps["shift"] and steps["base"][0] == steps["shift"][0] == 999


def test_a_second_scale_or_a_boundary_needs_two_experts():
    stages = Stages(Interpreter(compile_source(ti2v_source(False), devices="cpu")))
    dit = stages.backends["dit"]
    for knob in ({"guidance_scale_2": 2.0}, {"boundary_ratio": 0.5}):
        call = stages.call("dit", "r", {"cond": torch.zeros(1, 3, 32)}, ({"prompt": "x"}, SMALL))
        call.params.update(knob)
        step_when_ready(dit, [call])
        assert isinstance(call.error, DiffusersBackendError), knob


def test_the_compiler_sizes_both_experts_and_a_video():
    plan = compile_file(T2V, devices="1xH200")
    dit, vae = plan.stage("dit"), plan.stage("vae")
    # Two 14.29 B experts in bf16; 81 frames at 832 x 480: 21 latent frames of 60 x 104.
    assert dit.weight_bytes == 2 * 14_288_491_584 * 2
    latents = next(c for c in plan.channels if c.src == "dit")
    assert latents.item_shape == [16, 21, 60, 104]
    video = next(c for c in plan.channels if c.src == "vae")
    assert video.type == "video" and video.item_shape == [81, 480, 832, 3]
    assert vae.weight_bytes > 0
    out = next(o for o in plan.outputs if o.name == "video")
    assert out.attrs.get("fps") == 16


@pytest.mark.parametrize("frames", [80, 82])
def test_the_compiler_sizes_the_latents_the_denoiser_makes(frames):
    """A count of frames that is not 4k + 1 is made `frames // 4 * 4 + 1` (80 make 81, 82
    make 81): the plan's latents and video are those the denoiser makes and decodes."""
    sizes = {"frames": frames, "height": SMALL["height"], "width": SMALL["width"]}
    plan = compile_file(T2V, tiny=True, settings=[f"dit.{k}={v}" for k, v in sizes.items()])
    request = ({"prompt": "a cat"}, {**SMALL, "steps": 1})
    latents = denoise(Stages(Interpreter(plan)), {"r": request}, [["r"]])
    planned = next(c for c in plan.channels if c.src == "dit").item_shape
    assert [*latents["r"].shape[1:]] == planned
    video = next(c for c in plan.channels if c.src == "vae").item_shape
    assert video[0] == frames // 4 * 4 + 1 == (planned[1] - 1) * 4 + 1


@pytest.mark.parametrize(
    "model", ["Wan-AI/Wan2.2-T2V-A14B-Diffusers", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"]
)
def test_the_real_size_builds_have_the_published_parameter_counts(model):
    """What `build_scaled` makes at depth 1, counted on the meta device, is the catalog's
    count of each part; at depth 0.5 the experts and the text encoder have half the layers."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from omniflow.catalog.components import load_component_config
    from omniflow.families.wan.checkpoints import scaled_configs

    configs = scaled_configs(model, 1.0)
    with torch.device("meta"):
        parts = {
            "text_encoder": UMT5EncoderModel(configs["text_encoder"]),
            "transformer": WanTransformer3DModel(**configs["transformer"]),
            "vae": AutoencoderKLWan(**configs["vae"]),
        }
    for part, module in parts.items():
        counted = sum(p.numel() for p in module.parameters())
        assert counted == load_component_config(model, part).config["num_parameters"], part
    half = scaled_configs(model, 0.5)
    assert half["transformer"]["num_layers"] == configs["transformer"]["num_layers"] // 2
    assert half["text_encoder"].num_layers == 12
    assert (half["transformer_2"] is None) == (configs["transformer_2"] is None)


@pytest.mark.parametrize("name", ["wan2.2-t2v", "wan2.2-ti2v"])
def test_the_dit_cost_formula_counts_the_forward(name):
    """The catalog's Wan DiT count: parameters exactly, and a forward's FLOPs as torch's flop
    counter counts them, plus attention (self over the video's tokens, cross over the text's),
    which the counter does not see in the CPU attention kernel."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    from omniflow.catalog.components import load_component_config
    from omniflow.catalog.costs import estimate_cost

    path = build_tiny(name)
    with quiet():
        dit = WanTransformer3DModel.from_pretrained(path, subfolder="transformer").eval()
    c = dit.config
    frames, height, width, text = 3, 4, 6, 512
    tokens = frames * (height // 2) * (width // 2)
    timestep = torch.full((1, tokens), 500.0) if name.endswith("ti2v") else torch.tensor([500.0])
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        dit(hidden_states=torch.randn(1, c.in_channels, frames, height, width),
            timestep=timestep, encoder_hidden_states=torch.randn(1, text, c.text_dim),
            return_dict=False)  # fmt: skip
    cost = estimate_cost(
        load_component_config(str(path), "transformer"), max_batch=1, max_len=tokens,
        context_len=text,
    )  # fmt: skip
    width_ = c.num_attention_heads * c.attention_head_dim
    attention = 4 * c.num_layers * width_ * tokens * (tokens + text)
    assert cost.params == sum(p.numel() for p in dit.parameters())
    assert cost.flops_per_item in (counter.get_total_flops() + attention, counter.get_total_flops())


@pytest.mark.parametrize("name", ["wan2.2-t2v", "wan2.2-ti2v"])
def test_rebuilding_gives_identical_bytes(tmp_path, name):
    """Seeded weights and the T5 tokenizer (its trainer's thread order undone) rebuild to
    the same files."""
    import json

    from omniflow.checkpoints.tiny import MANIFEST

    def files(path: Path) -> dict:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]

    assert files(build_tiny(name, tmp_path / name)) == files(build_tiny(name))
