"""The diffusers stage backends: step-wise denoising (`DiffusionSteps`) and latent decoding
(`VaeDecode`), and what they share with the text encoder (`omniflow.backends.encoders`):
loading some parts of a diffusers pipeline, and the layout prompt embeddings travel in.

The pipelines served are those a model family gives code for (the plan's
`StagePlan.family`, e.g. Qwen-Image's `omniflow.families.qwen_image.pipeline`): what its
`__call__` decides beyond diffusers' helpers (the timestep shift, the transformer's
forward, unpacking, the VAE's latent statistics). Each stage loads the pipeline with only
its own parts and calls the pipeline's own helpers (prompt encoding, input-image encoding,
latent preparation and packing) and the family's, so a request gives what the pipeline's
`__call__` gives for the same prompt, image, seed and settings.

An edit pipeline conditions on an input image twice, both times resized as its `__call__`
resizes it (`condition_image`, at the size the family says, whatever the output size): the
text encoder sees it through the pipeline's processor (`omniflow.backends.encoders`), and
the denoiser encodes it with the pipeline's VAE and attends to those latents, packed
beside the noise latents along the sequence.

`DiffusionSteps` runs one denoising step of every request it is handed per `step()`:

- prepare (a request's first step): its conditioning is copied out of the input chunk; its
  latents are drawn from its own `torch.Generator` seeded with `seed` (0 when the request
  gives none, so every mode agrees) by the pipeline's `prepare_latents`, which for an edit
  also VAE-encodes the input image (the latent distribution's mode: no draw); its scheduler
  is its own copy of the pipeline's, set to the pipeline's sigmas and shift `mu`.
  `FlowMatchEulerDiscreteScheduler` keeps a step index, so a shared one would advance once
  per request and step every request with the wrong sigma.
- denoise: one transformer forward per image size (and input-image size) over every
  request in the batch (the transformer's RoPE takes one set of image shapes per forward, so
  sizes cannot mix). Each request brings its conditional row and, under guidance, its
  unconditional row — two rows of the same forward — each row with its own timestep: the
  transformer embeds a timestep vector, so requests at different steps batch together. Text
  rows are zero-padded to the longest and masked when their lengths differ. An edit's rows
  are its noise latents then its input image's latents; the prediction is the noise part.
- on CUDA, the family may run the transformer's blocks on fused kernels (Qwen-Image's
  `fused_blocks`), computing what diffusers' blocks compute.
- scheduler step: per request, Qwen-Image's true classifier-free guidance (`guidance` > 1
  and a negative prompt): `uncond + guidance * (cond - uncond)`, rescaled to the conditional
  prediction's norm, then its scheduler's step. The flow-matching Euler step is one update,
  `x + (sigma_next - sigma) * v`, so both run as one fused kernel
  (`omniflow.kernels.cfg_euler`) on the request's sigmas; a stochastic scheduler keeps its
  own step, which draws noise from the request's generator.

After its last step a request emits `latents` `[1, C, H/8, W/8]` (the plan's item
`[C, H/8, W/8]`): unpacked from the transformer's 2x2 patches, still normalised — the VAE
stage applies the VAE's latent statistics. `VaeDecode` decodes every request of a batch
that shares a latent size in one forward and emits `image` `[1, H, W, 3]` in [-1, 1].
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from PIL import Image

from omniflow.backends.registry import family_code
from omniflow.backends.vision import VisionBackendError, read_image
from omniflow.catalog.resolve import model_path
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from omniflow.kernels.cfg_euler import cfg_euler_step, guide
from omniflow.runtime.stage import Backend, Call, StageSpec

# Image processors (Qwen2VLProcessor) refuse images whose sides differ by more than this factor.
MAX_ASPECT = 200
# An unseeded request still draws the same noise in every mode and every run.
DEFAULT_SEED = 0
# Prompt lengths travel as two base-256 digits: integers up to 256 are exact in bfloat16.
_DIGIT = 256


class DiffusersBackendError(OmniflowError):
    """A diffusers stage cannot load its model or cannot serve a request."""


def pipeline_code(spec: StageSpec):
    """What the stage's model family gives the diffusers backends (its `PIPELINES` object)."""
    plan = spec.plan
    code = family_code(spec, "diffusers")
    if code is None:
        family = plan.family.name if plan.family else "no model family"
        raise DiffusersBackendError(
            f"stage '{plan.name}': '{plan.model}' ({family}) is not a diffusers pipeline "
            "omniflow can run: a model family gives the diffusers backends its pipeline's code"
        )
    return code


def load_pipeline(spec: StageSpec, device: str, parts: tuple[str, ...], code):
    """The stage's diffusers pipeline with only `parts` loaded, on `device`; `code` is its
    family's (`pipeline_code`).

    The stage's `component` must be the first of `parts`: the pipeline's helpers reach
    their models by those attribute names.
    """
    plan = spec.plan
    if plan.model is None:
        raise DiffusersBackendError(f"stage '{plan.name}' names no model")
    if plan.component is not None and plan.component != parts[0]:
        raise DiffusersBackendError(
            f"stage '{plan.name}': a diffusers {plan.kind} stage runs the pipeline's "
            f"'{parts[0]}', not '{plan.component}'"
        )
    path = model_path(plan.model)
    index = _model_index(plan, path)
    skipped = {
        name: None
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list) and name not in parts
    }
    loaded = {}
    if "processor" in parts and "processor" in index:
        loaded["processor"] = code.load_processor(Path(path) / "processor")
    dtype = plan.settings.get("dtype")
    with quiet():
        pipe = DiffusionPipeline.from_pretrained(
            path, torch_dtype=getattr(torch, dtype) if dtype else None, **skipped, **loaded
        )
    return pipe.to(device)


def edits(spec: StageSpec, pipe, code) -> bool:
    """Whether `pipe` conditions on an input image; a stage of it must take one exactly
    when it does."""
    conditions = code.conditions_on_image(pipe)
    if conditions != ("image" in spec.inputs):
        what = "conditions on an input image" if conditions else "takes no input image"
        raise DiffusersBackendError(
            f"stage '{spec.plan.name}': {spec.plan.model} is a {type(pipe).__name__}, which "
            f"{what}: {'connect' if conditions else 'disconnect'} the stage's 'image' input"
        )
    return conditions


def condition_image(pipe, code, value) -> Image.Image:
    """A request's input image as an edit pipeline's `__call__` conditions on it: opened (a
    path, or a uint8 `[H, W, 3]` tensor), as RGB, resized by the pipeline's image processor
    to the size its family's `condition_size` says."""
    try:
        image = read_image(value)
    except VisionBackendError as err:
        raise DiffusersBackendError(str(err)) from err
    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    width, height = code.condition_size(image.width, image.height)
    if min(width, height) < 32 or max(width, height) > MAX_ASPECT * min(width, height):
        raise DiffusersBackendError(
            f"an input image of {image.width} x {image.height} pixels is too narrow: its sides "
            f"may differ by a factor of at most {MAX_ASPECT}"
        )
    return pipe.image_processor.resize(image, height, width)


def _model_index(plan, path: str) -> dict:
    index_file = Path(path) / "model_index.json"
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DiffusersBackendError(
            f"stage '{plan.name}': '{plan.model}' is not a diffusers pipeline directory "
            f"(cannot read {index_file}: {err})"
        ) from err
    return index


def pack_prompts(rows: list[torch.Tensor]) -> torch.Tensor:
    """Prompt embeddings `[n_i, H]` (prompt, then negative prompt) as one `hidden` value
    `[k, 1 + max n_i, H]`: per row a header (`[0, 0]` = n % 256, `[0, 1]` = n // 256, the
    rest zero) then the embeddings, zero-padded."""
    longest = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), 1 + longest, rows[0].shape[1])
    for i, row in enumerate(rows):
        n = row.shape[0]
        out[i, 0, 0], out[i, 0, 1] = n % _DIGIT, n // _DIGIT
        out[i, 1 : 1 + n] = row
    return out


def unpack_prompts(hidden: torch.Tensor) -> list[torch.Tensor]:
    """`pack_prompts`' inverse: each row's embeddings `[n_i, H]`, copied out of `hidden`."""
    if hidden.dim() != 3 or not 1 <= hidden.shape[0] <= 2 or hidden.shape[1] < 2:
        raise DiffusersBackendError(
            f"conditioning of shape {list(hidden.shape)} is not the diffusers text encoder's "
            "[1 or 2, 1 + tokens, hidden] layout"
        )
    lengths = (hidden[:, 0, 0].double() + _DIGIT * hidden[:, 0, 1].double()).round().long()
    if not all(1 <= n < hidden.shape[1] for n in lengths.tolist()):
        raise DiffusersBackendError(
            f"conditioning headers give {lengths.tolist()} tokens for rows of "
            f"{hidden.shape[1] - 1}: not the diffusers text encoder's layout"
        )
    return [hidden[i, 1 : 1 + n].clone() for i, n in enumerate(lengths.tolist())]


def _param(spec: StageSpec, call: Call, key: str):
    """A request's value of a stage parameter, else its compiled one."""
    value = call.params.get(key)
    return spec.plan.settings[key] if value is None else value


@dataclass
class _Denoising:
    """One request's state between steps."""

    prompts: list[torch.Tensor]  # [tokens, H]: the prompt's, then the negative prompt's
    guidance: float
    height: int
    width: int
    generator: torch.Generator
    scheduler: object
    timesteps: torch.Tensor
    latents: torch.Tensor  # packed, [1, patches, C * 4]
    # (frames, rows, columns) of transformer patches: the output's, then an edit's input image's.
    shapes: tuple[tuple[int, int, int], ...]
    image_latents: torch.Tensor | None = None  # an edit's input image, packed as `latents`
    index: int = 0

    @property
    def guided(self) -> bool:
        return self.guidance > 1 and len(self.prompts) == 2


class DiffusionSteps(Backend):
    """The denoising loop of a diffusers pipeline, one step per `step()`, batched across
    requests at any step."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        name = spec.plan.name
        unknown = set(spec.inputs) - {"cond", "image"}
        if unknown or "cond" not in spec.inputs:
            given = ", ".join(sorted(spec.inputs)) or "nothing"
            raise DiffusersBackendError(
                f"stage '{name}': the diffusers denoiser takes 'cond' (text conditioning) and, "
                f"for an edit pipeline, 'image', not {given}"
            )
        # An edit's input image is VAE-encoded here, as the pipeline's prepare_latents does.
        parts = ("transformer", "scheduler") + (("vae",) if "image" in spec.inputs else ())
        self.code = pipeline_code(spec)
        self.pipe = load_pipeline(spec, device, parts, self.code)
        self.edits = edits(spec, self.pipe, self.code)
        self.transformer = self.pipe.transformer
        if self.transformer.config.guidance_embeds:
            raise DiffusersBackendError(
                f"stage '{name}': guidance-distilled transformers "
                "(guidance_embeds=True) are not supported"
            )
        self.code.accelerate(self.transformer, device)
        # The pipeline derives this from the VAE, which this stage may not load.
        self.pipe.vae_scale_factor = self.code.vae_scale_factor(model_path(spec.plan.model))
        # Image pixels per side of one transformer patch: sizes must be multiples of it.
        self.patch_pixels = self.pipe.vae_scale_factor * 2

    def ready(self, call: Call) -> bool:
        return "denoising" in call.state or call.inputs_ended()

    def step(self, calls: list[Call]) -> None:
        with torch.no_grad():
            running = [c for c in calls if "denoising" in c.state or self._prepare(c)]
            groups = defaultdict(list)
            for call in running:
                groups[call.state["denoising"].shapes].append(call)
            for group in groups.values():
                self._denoise(group)

    def drop(self, call: Call) -> None:
        call.state.pop("denoising", None)

    def _prepare(self, call: Call) -> bool:
        """Set up `call`'s latents and scheduler; False (and the call failed) if it cannot run."""
        try:
            hidden = call.inputs["cond"].take()
            if hidden is None:
                raise DiffusersBackendError("no conditioning arrived")
            prompts = [p.to(self.device, self.transformer.dtype) for p in unpack_prompts(hidden)]
            steps, height, width = (
                _param(self.spec, call, k) for k in ("steps", "height", "width")
            )
            guidance = float(_param(self.spec, call, "guidance"))
            self._check(steps, height, width)
            image = (
                condition_image(self.pipe, self.code, call.inputs["image"].take())
                if self.edits
                else None
            )
        except DiffusersBackendError as err:
            call.fail(err)
            return False
        seed = call.params.get("seed")
        generator = torch.Generator().manual_seed(DEFAULT_SEED if seed is None else seed)
        shapes = ((1, height // self.patch_pixels, width // self.patch_pixels),)
        size = (1, self.transformer.config.in_channels // 4, height, width)
        dtype = self.transformer.dtype
        if image is None:
            latents = self.pipe.prepare_latents(*size, dtype, self.device, generator)
            image_latents = None
        else:
            pixels = self.pipe.image_processor.preprocess(image, image.height, image.width)
            latents, image_latents = self.pipe.prepare_latents(
                pixels.unsqueeze(2), *size, dtype, self.device, generator
            )
            patch = self.patch_pixels
            shapes += ((1, image.height // patch, image.width // patch),)
        scheduler = self.pipe.scheduler.__class__.from_config(self.pipe.scheduler.config)
        timesteps = self.code.timesteps(scheduler, steps, latents.shape[1], self.device)
        scheduler.set_begin_index(0)
        call.state["denoising"] = _Denoising(
            prompts,
            guidance,
            height,
            width,
            generator,
            scheduler,
            timesteps,
            latents,
            shapes,
            image_latents,
        )
        return True

    def _check(self, steps, height, width) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise DiffusersBackendError(f"steps must be a positive integer, not {steps!r}")
        for name, size in (("height", height), ("width", width)):
            if not isinstance(size, int) or size < self.patch_pixels or size % self.patch_pixels:
                raise DiffusersBackendError(
                    f"{name} must be a positive multiple of {self.patch_pixels} "
                    f"(VAE scale x patch size), not {size!r}"
                )

    def _denoise(self, calls: list[Call]) -> None:
        """One transformer forward over the rows of `calls` (one set of image shapes), then
        each request's guidance and scheduler step."""
        states = [c.state["denoising"] for c in calls]
        rows = [(s, p) for s in states for p in (s.prompts if s.guided else s.prompts[:1])]
        lengths = [p.shape[0] for _, p in rows]
        text = rows[0][1].new_zeros(len(rows), max(lengths), rows[0][1].shape[1])
        mask = torch.zeros(len(rows), max(lengths), dtype=torch.long, device=text.device)
        for i, (_, prompt) in enumerate(rows):
            text[i, : prompt.shape[0]] = prompt
            mask[i, : prompt.shape[0]] = 1
        timesteps = torch.stack([s.timesteps[s.index] for s, _ in rows])
        latents = [s.latents for s, _ in rows]
        if states[0].image_latents is not None:
            latents = [torch.cat([s.latents, s.image_latents], dim=1) for s, _ in rows]
        noise = self.code.forward(
            self.transformer, torch.cat(latents), timesteps, text, mask, states[0].shapes
        )
        # An edit's rows end with its input image's latents: the prediction is the rest.
        noise = noise[:, : states[0].latents.shape[1]]
        row = 0
        for call, state in zip(calls, states, strict=True):
            cond = noise[row : row + 1]
            uncond = noise[row + 1 : row + 2] if state.guided else None
            row += 2 if state.guided else 1
            scheduler = state.scheduler
            if _plain_euler(scheduler):
                # The scheduler's own step is `x + (sigma_next - sigma) * v`; one kernel does
                # it together with the guidance (cfg_euler_step gives its bits off CUDA).
                sigmas = scheduler.sigmas[state.index : state.index + 2]
                state.latents = cfg_euler_step(
                    state.latents,
                    cond,
                    uncond,
                    state.guidance,
                    sigmas[1:] - sigmas[:1],
                    rescale="norm",
                )
            else:
                prediction = cond
                if uncond is not None:
                    prediction = guide(cond, uncond, state.guidance, rescale="norm")
                state.latents = scheduler.step(
                    prediction,
                    state.timesteps[state.index],
                    state.latents,
                    generator=state.generator,
                    return_dict=False,
                )[0]
            state.index += 1
            if state.index == len(state.timesteps):
                latents = self.code.unpack(self.pipe, state.latents, state.height, state.width)
                call.emit("latents", latents.float())
                call.finish()


def _plain_euler(scheduler) -> bool:
    """Whether `scheduler.step` is the deterministic flow-matching Euler update (not the
    stochastic variant, which draws noise from the request's generator)."""
    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and not scheduler.config.get(
        "stochastic_sampling", False
    )


class VaeDecode(Backend):
    """Latents to pixels with the pipeline's VAE, batched across requests of one size."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        if set(spec.outputs) - {"image"}:
            raise DiffusersBackendError(
                f"stage '{spec.plan.name}': the diffusers VAE decodes images only"
            )
        self.code = pipeline_code(spec)
        self.vae = load_pipeline(spec, device, ("vae",), self.code).vae

    def ready(self, call: Call) -> bool:
        return call.inputs["latents"].ended

    def step(self, calls: list[Call]) -> None:
        groups = defaultdict(list)
        for call in calls:
            latents = call.inputs["latents"].take()
            if latents is None or latents.dim() != 4 or latents.shape[0] != 1:
                shape = None if latents is None else list(latents.shape)
                call.fail(DiffusersBackendError(f"expected latents [1, C, h, w], got {shape}"))
                continue
            groups[tuple(latents.shape)].append((call, latents))
        with torch.no_grad():
            for group in groups.values():
                latents = torch.cat([lat for _, lat in group]).to(self.device, self.vae.dtype)
                images = self.code.decode(self.vae, latents)
                for i, (call, _) in enumerate(group):
                    call.emit("image", images[i : i + 1].contiguous())
                    call.finish()
