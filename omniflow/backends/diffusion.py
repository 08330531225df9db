"""The diffusers stage backends: step-wise denoising (`DiffusionSteps`) and latent decoding
(`VaeDecode`), and what they share with the text encoder (`omniflow.backends.encoders`):
loading some parts of a diffusers pipeline, the layout prompt embeddings travel in, and
`Denoising`, one request's state between steps.

The pipelines served are those a model family gives code for (the plan's
`StagePlan.family`: Qwen-Image's `omniflow.families.qwen_image.pipeline`, Wan's
`omniflow.families.wan.pipeline`): what its `__call__` decides beyond diffusers' helpers.
Each stage loads the pipeline with only its own parts and calls the pipeline's own helpers
and the family's, so a request gives what the pipeline's `__call__` gives for the same
prompt, image, seed and settings. The sampling knobs are the model's own, under its names
(`true_cfg_scale` for Qwen-Image, `guidance_scale` and `guidance_scale_2` for Wan2.2): the
family declares them (`Family.stage_params`) and reads them (`prepare`).

The family's pipeline object (its `PIPELINES`) gives the denoiser:

- `denoiser_parts(image)`: the pipeline parts the stage loads (the transformer first);
  `pipeline_class(index, image)`: the pipeline class to load them with, or None for the
  index's own; `conditions_on_image(pipe, kind)`: whether a stage of `kind` of it takes
  an input image; `setup(pipe, path, device)`: what the pipeline's `__init__` would derive
  from parts the stage does not load; `fuse_blocks(pipe, attend)` (optional): the
  transformers' blocks on the family's fused kernels, their attention on `attend`
  (`omniflow.backends.dit_blocks.Attention`), which the stage's `blocks` setting turns on
  (`auto`: on CUDA) and whose kernel its `attention` setting picks;
- `prepare(pipe, Prepare) -> Denoising`: a request's latents, scheduler and timesteps,
  drawn and set as its `__call__` does, from its knobs (the stage's settings overlaid with
  the request's parameters); a `DiffusersBackendError` fails that request alone;
- `forward(pipe, group, hidden, timesteps, text, mask) -> noise`: the transformer's
  prediction for a batch of rows that share the group `Denoising.group()` gives (image
  shapes, and for a two-expert DiT the expert); `cache_layout(pipe, group)`: where the
  step cache (`omniflow.backends.step_cache`) may split that forward.

and the VAE: `decode(vae, latents)`, a batch's whole decode, and optionally
`decode_in_steps(vae, latents) -> FrameDecoding`: a video's decode a latent frame a step.

`DiffusionSteps` runs one denoising step of every request it is handed per `step()`:

- start: a request is ready once its inputs are in and its conditioning's header (each
  row's prompt length) has come to the host: copied there without waiting, as reading it
  on the device would stall every stage of the process (`in_flight` keeps the loop polling).
- prepare (a request's first step): its conditioning is copied out of the input chunk; its
  latents are drawn from its own `torch.Generator` seeded with `seed` (0 when the request
  gives none, so every mode agrees); its scheduler is its own copy of the pipeline's, set
  to the pipeline's timesteps (`FlowMatchEulerDiscreteScheduler` and UniPC keep a step
  index and a multistep history: a shared one would step every request wrongly).
- denoise: one transformer forward per group over every request in the batch. Each request
  brings its conditional row and, where it is guided this step, its unconditional row —
  two rows of the same forward — each row with its own timestep, so requests at different
  steps batch together. Text rows are zero-padded to the longest and masked when their
  lengths differ.
- scheduler step: per request, its family's guidance (Qwen-Image's true CFG, rescaled to
  the conditional prediction's norm; Wan's plain CFG at the current expert's scale), then
  its scheduler's step. The flow-matching Euler step is one update, `x + (sigma_next -
  sigma) * v`, so both run as one fused kernel (`omniflow.kernels.cfg_euler`); any other
  scheduler keeps its own step.
- step caching (`cache_threshold` > 0, `omniflow.backends.step_cache`): a request whose
  first block's output barely moved since its last computed step skips the other blocks
  and reuses their residual; each request's steps computed and reused are counted
  (`Call.counters`: `--log-stats` and the profile show them).

After its last step a request emits `latents`: an image's `[1, C, H/8, W/8]` or a video's
`[1, C, F', H/8, W/8]`, still normalised — the VAE stage applies the VAE's latent
statistics. `VaeDecode` decodes a video a latent frame a step where its family can
(`decode_in_steps`, without tiling or slicing): minutes of decode on a slow device then
report their progress between frames (`progress`, what a video job's progress reads), and
other requests' frames interleave. Otherwise it decodes every request of a batch that
shares a latent size and decode options (`vae_use_tiling`, `vae_use_slicing`) in one
forward. It emits `image` `[1, H, W, 3]` or `video` `[1, F, H, W, 3]` in [-1, 1].
"""

from __future__ import annotations

import abc
import importlib
import inspect
import json
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from omniflow.backends.dit_blocks import Attention, AttentionError, attention_for
from omniflow.backends.registry import family_code
from omniflow.backends.step_cache import StepCache
from omniflow.backends.vision import VisionBackendError, read_image
from omniflow.catalog.resolve import model_path
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from omniflow.kernels.cfg_euler import cfg_euler_step, guide
from omniflow.runtime.readback import Awaited, HostCopy, to_host, upload
from omniflow.runtime.stage import Backend, Call, StageSpec

# Image processors (Qwen2VLProcessor) refuse images whose sides differ by more than this factor.
MAX_ASPECT = 200
# An unseeded request still draws the same noise in every mode and every run.
DEFAULT_SEED = 0
# Prompt lengths travel as two base-256 digits: integers up to 256 are exact in bfloat16.
_DIGIT = 256
_COND = "diffusion:cond"  # a request's conditioning and its header's copy to the host


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


def load_pipeline(spec: StageSpec, device: str, parts: tuple[str, ...], code, image=False):
    """The stage's diffusers pipeline with only `parts` loaded, on `device`; `code` is its
    family's (`pipeline_code`), which may name the class to load it with (`image`: the
    stage takes an input image).

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
    path = Path(model_path(plan.model))
    index = _model_index(plan, path)
    dtype = plan.settings.get("dtype")
    chooser = getattr(code, "pipeline_class", None)
    cls = (chooser(index, image) if chooser else None) or _pipeline_class(plan, index)
    # The pipeline is built from its parts, not by `from_pretrained`, which loads a pipeline's
    # optional components even when passed None: each stage of Wan2.2-A14B held both experts.
    components = {
        name: None
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list)
    }
    config = {
        name: value
        for name, value in index.items()
        if not name.startswith("_") and not isinstance(value, list)
    }
    with quiet():
        for name in parts:
            if name == "processor" and name in index:
                components[name] = code.load_processor(path / name)
            elif index.get(name, [None])[0] is not None:
                components[name] = _load_part(path, name, index[name], dtype)
        accepted = inspect.signature(cls.__init__).parameters
        pipe = cls(**{k: v for k, v in {**components, **config}.items() if k in accepted})
    return pipe.to(device)


def _pipeline_class(plan, index: dict):
    """The diffusers pipeline class a folder's model_index names."""
    name = index.get("_class_name")
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise DiffusersBackendError(
            f"stage '{plan.name}': '{plan.model}' names no diffusers pipeline class in its "
            f"model_index.json (_class_name: {name!r})"
        )
    return cls


def _load_part(path: Path, name: str, entry: list, dtype: str | None):
    """The pipeline folder's component `name` (its model_index `entry`: library, class), in
    `dtype` where it is a model."""
    library, class_name = entry
    part = getattr(importlib.import_module(library), class_name)
    kwargs = {}
    if dtype and issubclass(part, torch.nn.Module):
        # transformers calls it `dtype`, diffusers `torch_dtype`
        kwargs["dtype" if library == "transformers" else "torch_dtype"] = getattr(torch, dtype)
    return part.from_pretrained(path / name, **kwargs)


def edits(spec: StageSpec, pipe, code) -> bool:
    """Whether a stage of `pipe` takes an input image; it must have one exactly when it does."""
    conditions = code.conditions_on_image(pipe, spec.plan.kind)
    if conditions != ("image" in spec.inputs):
        what = "conditions on an input image" if conditions else "takes no input image"
        raise DiffusersBackendError(
            f"stage '{spec.plan.name}': {spec.plan.model} is a {type(pipe).__name__}, whose "
            f"{spec.plan.kind} stage {what}: "
            f"{'connect' if conditions else 'disconnect'} the stage's 'image' input"
        )
    return conditions


def open_image(value) -> Image.Image:
    """A request's input image (a path, or a uint8 `[H, W, 3]` tensor) as an RGB PIL image."""
    try:
        image = read_image(value)
    except VisionBackendError as err:
        raise DiffusersBackendError(str(err)) from err
    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    return image


def condition_image(pipe, code, value) -> Image.Image:
    """A request's input image as an edit pipeline's `__call__` conditions on it: opened (a
    path, or a uint8 `[H, W, 3]` tensor), as RGB, resized by the pipeline's image processor
    to the size its family's `condition_size` says."""
    image = open_image(value)
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


def prompt_header(hidden: torch.Tensor) -> HostCopy:
    """`pack_prompts`' headers of `hidden` (each row's length) on their way to the host, for
    `unpack_prompts`; checked for the layout first."""
    if hidden.dim() != 3 or not 1 <= hidden.shape[0] <= 2 or hidden.shape[1] < 2:
        raise DiffusersBackendError(
            f"conditioning of shape {list(hidden.shape)} is not the diffusers text encoder's "
            "[1 or 2, 1 + tokens, hidden] layout"
        )
    return to_host(hidden[:, 0, :2])


def unpack_prompts(hidden: torch.Tensor, header: torch.Tensor) -> list[torch.Tensor]:
    """`pack_prompts`' inverse: each row's embeddings `[n_i, H]`, copied out of `hidden`,
    by its `header` on the host (`prompt_header`'s copy)."""
    lengths = (header[:, 0].double() + _DIGIT * header[:, 1].double()).round().long().tolist()
    if not all(1 <= n < hidden.shape[1] for n in lengths):
        raise DiffusersBackendError(
            f"conditioning headers give {lengths} tokens for rows of "
            f"{hidden.shape[1] - 1}: not the diffusers text encoder's layout"
        )
    return [hidden[i, 1 : 1 + n].clone() for i, n in enumerate(lengths)]


def latent_moments(config, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A VAE's latent mean and std, `[1, C, 1, 1, 1]` on `device` as `dtype`, sent without
    waiting for the stage's queued work (`readback.upload`)."""
    shape = (1, config.z_dim, 1, 1, 1)
    mean, std = (
        upload(torch.tensor(values).view(shape), device, dtype)
        for values in (config.latents_mean, config.latents_std)
    )
    return mean, std


def latent_statistics(config, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A VAE's latent mean and the reciprocal of its std (`latent_moments`): the pipelines'
    decoders divide by the reciprocal; so do their callers, for the same bits."""
    mean, std = latent_moments(config, device, dtype)
    return mean, 1.0 / std


def knobs(spec: StageSpec, call: Call) -> dict:
    """A request's stage parameters: the stage's compiled settings, overlaid with what the
    request resolved (a knob whose default is the model's own is absent when unset)."""
    return {**spec.plan.settings, **{k: v for k, v in call.params.items() if v is not None}}


def check_steps(steps) -> int:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise DiffusersBackendError(f"steps must be a positive integer, not {steps!r}")
    return steps


def check_sizes(multiple: int, **sizes) -> None:
    """Each of `sizes` (height=..., width=...) must be a positive multiple of `multiple`."""
    for name, size in sizes.items():
        if not isinstance(size, int) or size < multiple or size % multiple:
            raise DiffusersBackendError(
                f"{name} must be a positive multiple of {multiple} "
                f"(VAE scale x patch size), not {size!r}"
            )


def timesteps_on(scheduler, device) -> torch.Tensor:
    """The timesteps of `scheduler`, set on the host (`set_timesteps(..., device="cpu")`), sent
    to `device` without waiting (`readback.upload`) and kept as its own. Set there with
    `device=`, they would be copied from pageable memory, which waits for the stream's queued
    work (the denoising steps of every other request): a host sync at each request's start.
    Its sigmas stay on the host (UniPC keeps its own there anyway); `Denoising` sends up the
    fused Euler step's once."""
    scheduler.timesteps = upload(scheduler.timesteps, device)
    return scheduler.timesteps


@dataclass
class Prepare:
    """What a family's `prepare` makes a request's `Denoising` from."""

    prompts: list[torch.Tensor]  # [tokens, H] on the device: the prompt's, then the negative's
    knobs: dict  # the stage's settings overlaid with the request's parameters
    image: object | None  # an image-conditioned stage's input image (a path or a tensor)
    generator: torch.Generator
    device: str
    dtype: torch.dtype  # the transformer's


class Denoising(abc.ABC):
    """One request's denoising between steps. A family's `prepare` returns its subclass,
    which says what this step's forward rows are (`group`, `guided`, `model_input`) and
    what the request emits at its end (`result`); `advance` is the guided scheduler step.

    `scale` and `rescale` are the guidance at this step (`rescale` as `cfg_euler`'s: "norm"
    for Qwen-Image's true CFG, "none" for plain CFG)."""

    rescale = "none"

    def __init__(self, prompts, scheduler, timesteps, latents, generator):
        self.prompts = prompts
        self.scheduler = scheduler
        self.timesteps = timesteps
        self.latents = latents
        self.generator = generator
        self.index = 0
        self.cache = None  # the step cache's state for this request (step_cache.py)
        # The fused Euler step's sigmas, sent up once (the scheduler's stay on the host:
        # `timesteps_on`); None where the scheduler takes its own steps.
        self.sigmas = upload(scheduler.sigmas, latents.device) if _plain_euler(scheduler) else None
        self._step_kwargs = (
            {"generator": generator}
            if "generator" in inspect.signature(scheduler.step).parameters
            else {}
        )

    # --- what a family's subclass says ---
    @abc.abstractmethod
    def group(self) -> Hashable:
        """Requests of one group may share this step's forward."""

    @abc.abstractmethod
    def scale(self) -> float:
        """The guidance scale at this step."""

    @abc.abstractmethod
    def guided(self) -> bool:
        """Whether this step computes the unconditional row too."""

    @abc.abstractmethod
    def model_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's transformer input `[1, ...]` and timestep `[1]` (or `[1, tokens]`)."""

    @abc.abstractmethod
    def result(self) -> torch.Tensor:
        """What the request emits on `latents` after its last step."""

    # --- what every family shares ---
    @property
    def done(self) -> bool:
        return self.index == len(self.timesteps)

    def rows(self) -> list[torch.Tensor]:
        """This step's text rows: the prompt's, and the negative prompt's when guided."""
        return self.prompts if self.guided() else self.prompts[:1]

    def advance(self, cond: torch.Tensor, uncond: torch.Tensor | None) -> None:
        """The guided prediction, then the scheduler's step from this step's latents."""
        scheduler, i = self.scheduler, self.index
        if _plain_euler(scheduler) and cond.shape == self.latents.shape:
            # The scheduler's own step is `x + (sigma_next - sigma) * v`; one kernel does
            # it together with the guidance (cfg_euler_step gives its bits off CUDA).
            sigmas = self.sigmas[i : i + 2]
            dt = sigmas[1:] - sigmas[:1]
            self.latents = cfg_euler_step(
                self.latents, cond, uncond, self.scale(), dt, rescale=self.rescale
            )
        else:
            prediction = cond
            if uncond is not None:
                prediction = guide(cond, uncond, self.scale(), rescale=self.rescale)
            self.latents = scheduler.step(
                prediction, self.timesteps[i], self.latents, return_dict=False, **self._step_kwargs
            )[0]
        self.index += 1


class FrameDecoding(abc.ABC):
    """One video's VAE decode between steps, a latent frame at a time: `advance` decodes
    the next, `result` is the video once all `total` are (`done`)."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0

    @abc.abstractmethod
    def advance(self) -> None:
        """Decode the next latent frame."""

    @abc.abstractmethod
    def result(self) -> torch.Tensor:
        """The frames `[1, F, H, W, 3]` in [-1, 1], once every latent frame is decoded."""


def _plain_euler(scheduler) -> bool:
    """Whether `scheduler.step` is the deterministic flow-matching Euler update (not the
    stochastic variant, which draws noise from the request's generator)."""
    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and not scheduler.config.get(
        "stochastic_sampling", False
    )


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
                f"for an image-conditioned pipeline, 'image', not {given}"
            )
        self.code = pipeline_code(spec)
        image = "image" in spec.inputs
        self.pipe = load_pipeline(spec, device, self.code.denoiser_parts(image), self.code, image)
        self.edits = edits(spec, self.pipe, self.code)
        self.transformer = self.pipe.transformer
        self.code.setup(self.pipe, model_path(spec.plan.model), device)
        self.attention = self._fuse_blocks(spec.plan.settings, device)
        self.cache = StepCache(self.pipe, self.code)
        self.headers = Awaited()  # requests' conditioning headers on their way to the host

    def _fuse_blocks(self, settings: dict, device: str) -> Attention | None:
        """The family's fused blocks (`fuse_blocks(pipe, attend)`), as the stage's `blocks`
        setting says, on its `attention` kernel; the kernel, or None for diffusers' blocks."""
        blocks = settings.get("blocks", "auto")
        fusable = getattr(self.code, "fuse_blocks", None)
        if blocks == "modules" or (blocks == "auto" and torch.device(device).type != "cuda"):
            return None
        if fusable is None:
            if blocks == "fused":
                raise DiffusersBackendError(
                    f"stage '{self.spec.plan.name}': blocks='fused', but "
                    f"{self.spec.plan.model} has no fused blocks (use 'auto' or 'modules')"
                )
            return None
        config = self.transformer.config
        try:
            attend = attention_for(
                settings.get("attention", "auto"), config.num_attention_heads,
                config.attention_head_dim, self.transformer.dtype, device,
            )  # fmt: skip
        except AttentionError as err:
            raise DiffusersBackendError(f"stage '{self.spec.plan.name}': {err}") from err
        fusable(self.pipe, attend)
        return attend

    def ready(self, call: Call) -> bool:
        """Denoising, or its inputs in and its conditioning's header on the host (`_COND`:
        the conditioning taken and the header's copy started on the first ask; a step fails
        the request whose conditioning has none or is not the encoder's layout)."""
        if "denoising" in call.state:
            return True
        if not call.inputs_ended():
            return False

        def conditioning() -> tuple:
            hidden = call.inputs["cond"].take()
            try:
                if hidden is None:
                    raise DiffusersBackendError("no conditioning arrived")
                return hidden, prompt_header(hidden)
            except DiffusersBackendError as err:
                return hidden, err

        return self.headers.landed(call, _COND, conditioning)

    def in_flight(self) -> bool:
        return self.headers.in_flight()

    def step(self, calls: list[Call]) -> None:
        with torch.no_grad():
            running = [c for c in calls if "denoising" in c.state or self._prepare(c)]
            groups = defaultdict(list)
            for call in running:
                groups[call.state["denoising"].group()].append(call)
            for group, members in groups.items():
                self._denoise(group, members)

    def drop(self, call: Call) -> None:
        call.state.pop("denoising", None)

    def progress(self, call: Call) -> tuple[int, int] | None:
        state = call.state.get("denoising")
        return None if state is None else (state.index, len(state.timesteps))

    def _prepare(self, call: Call) -> bool:
        """Set up `call`'s latents and scheduler; False (and the call failed) if it cannot run."""
        hidden, header = self.headers.take(call, _COND)
        try:
            if isinstance(header, DiffusersBackendError):
                raise header
            prompts = unpack_prompts(hidden, header.value)
            prompts = [upload(p, self.device, self.transformer.dtype) for p in prompts]
            settings = knobs(self.spec, call)
            check_steps(settings.get("steps"))
            image = call.inputs["image"].take() if self.edits else None
            seed = call.params.get("seed")
            generator = torch.Generator().manual_seed(DEFAULT_SEED if seed is None else seed)
            prepare = Prepare(
                prompts, settings, image, generator, self.device, self.transformer.dtype
            )
            state = self.code.prepare(self.pipe, prepare)
            state.cache = self.cache.start(settings)
        except DiffusersBackendError as err:
            call.fail(err)
            return False
        call.state["denoising"] = state
        return True

    def _denoise(self, group, calls: list[Call]) -> None:
        """One transformer forward over the rows of `calls` (one group), then each
        request's guidance and scheduler step."""
        states = [c.state["denoising"] for c in calls]
        rows = [(s, p) for s in states for p in s.rows()]
        lengths = [p.shape[0] for _, p in rows]
        text = rows[0][1].new_zeros(len(rows), max(lengths), rows[0][1].shape[1])
        mask = torch.zeros(len(rows), max(lengths), dtype=torch.long, device=text.device)
        for i, (_, prompt) in enumerate(rows):
            text[i, : prompt.shape[0]] = prompt
            mask[i, : prompt.shape[0]] = 1
        inputs = {id(s): s.model_input() for s in states}
        hidden = torch.cat([inputs[id(s)][0] for s, _ in rows])
        timesteps = torch.cat([inputs[id(s)][1] for s, _ in rows])
        owners = [s for s, _ in rows]
        # No token is padding where every row is as long as the longest: no mask, decided
        # here from the host's lengths (asking the device's mask would be a host sync a step).
        if min(lengths) == max(lengths):
            mask = None
        noise = self.cache.forward(group, owners, hidden, timesteps, text, mask)
        row = 0
        for call, state in zip(calls, states, strict=True):
            guided = state.guided()
            cond = noise[row : row + 1]
            uncond = noise[row + 1 : row + 2] if guided else None
            row += 2 if guided else 1
            state.advance(cond, uncond)
            self.cache.count(state, call.counters)
            if state.done:
                call.emit("latents", state.result().float())
                call.finish()


class VaeDecode(Backend):
    """Latents to pixels with the pipeline's VAE, batched across requests of one size and
    decode options: an image `[1, H, W, 3]` or a video's frames `[1, F, H, W, 3]`."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        outputs = set(spec.outputs)
        if len(outputs) != 1 or not outputs <= {"image", "video"}:
            raise DiffusersBackendError(
                f"stage '{spec.plan.name}': the diffusers VAE decodes an image or a video "
                f"(one of its outputs), not {', '.join(sorted(outputs)) or 'nothing'}"
            )
        self.port = outputs.pop()
        self.code = pipeline_code(spec)
        self.vae = load_pipeline(spec, device, ("vae",), self.code).vae
        self.rank = 5 if self.port == "video" else 4

    def ready(self, call: Call) -> bool:
        return call.inputs["latents"].ended

    def progress(self, call: Call) -> tuple[int, int] | None:
        decoding = call.state.get("decoding")
        return None if decoding is None else (decoding.done, decoding.total)

    def step(self, calls: list[Call]) -> None:
        groups = defaultdict(list)
        with torch.no_grad():
            for call in calls:
                decoding = call.state.get("decoding")
                if decoding is None:
                    latents = call.inputs["latents"].take()
                    if latents is None or latents.dim() != self.rank or latents.shape[0] != 1:
                        shape = None if latents is None else list(latents.shape)
                        want = "[1, C, F, h, w]" if self.rank == 5 else "[1, C, h, w]"
                        call.fail(DiffusersBackendError(f"expected latents {want}, got {shape}"))
                        continue
                    settings = knobs(self.spec, call)
                    options = (
                        bool(settings.get("vae_use_tiling")),
                        bool(settings.get("vae_use_slicing")),
                    )
                    decoding = self._in_steps(latents, options)
                    if decoding is None:
                        groups[tuple(latents.shape), options].append((call, latents))
                        continue
                    call.state["decoding"] = decoding
                decoding.advance()
                if decoding.done == decoding.total:
                    call.emit(self.port, decoding.result().contiguous())
                    call.state.pop("decoding")
                    call.finish()
            for (_, (tiling, slicing)), group in groups.items():
                latents = torch.cat([lat for _, lat in group]).to(self.device, self.vae.dtype)
                with decode_options(self.vae, tiling, slicing):
                    pixels = self.code.decode(self.vae, latents)
                for i, (call, _) in enumerate(group):
                    call.emit(self.port, pixels[i : i + 1].contiguous())
                    call.finish()

    def _in_steps(self, latents: torch.Tensor, options: tuple[bool, bool]):
        """A video's decode a frame a step, where its family decodes so and neither tiling
        nor slicing is asked for (diffusers' own decode does those); else None."""
        in_steps = getattr(self.code, "decode_in_steps", None)
        if in_steps is None or self.rank != 5 or any(options):
            return None
        return in_steps(self.vae, latents.to(self.device, self.vae.dtype))


class decode_options:
    """The VAE decodes in tiles (`enable_tiling`) and one sample at a time (`enable_slicing`)
    inside, as diffusers' pipelines do when asked; off again after."""

    def __init__(self, vae, tiling: bool, slicing: bool):
        self.vae, self.tiling, self.slicing = vae, tiling, slicing

    def __enter__(self):
        if self.tiling:
            self.vae.enable_tiling()
        if self.slicing:
            self.vae.enable_slicing()
        return self.vae

    def __exit__(self, *exc):
        if self.tiling:
            self.vae.disable_tiling()
        if self.slicing:
            self.vae.disable_slicing()
        return False
