"""The vision encoder backend of `encoder` stages with an `image` input: `VisionEncoder`, a
vision-language checkpoint's vision tower alone, and the layout its embeddings travel in.

The tower is what the stage's model family loads (the plan's `StagePlan.family`: e.g.
Qwen2.5-VL's, `omniflow.families.qwen2_5_vl.vision_tower`), from the checkpoint directory
alone: the language model's weights are skipped, and a tower weight the checkpoint lacks is
an error. The image processor is the checkpoint's own, with its largest size
capped so an image gives at most the stage's `max_len` embeddings (the edge's item holds
`1 + max_len` rows): as Qwen's `max_pixels` does, larger images are resized down.

A request's image is a path to an image file (PNG, JPEG, anything PIL opens) or a uint8
tensor `[H, W, 3]`; anything else, or a file that cannot be read, fails that request alone.
Each image goes through the processor on its own; then ONE tower forward runs every image
of the step: Qwen2.5-VL's tower takes the images' patches concatenated with one
`grid_thw` row per image and attends within each image only, so images of different
sizes share the forward.

What a request emits on `hidden`, in the tower's dtype, is one value `[1, 1 + n, H]`
(`pack_image` writes it, `unpack_image` reads it):

- position 0 is a header: the image's patch grid (t, h, w), the `image_grid_thw` row the
  language model's multimodal RoPE needs, each as two base-256 digits —
  `[0, 0, 2i]` = g_i % 256 and `[0, 0, 2i + 1]` = g_i // 256 for g = (t, h, w) (integers
  below 256 are exact in every float dtype); the rest of the header is zero;
- positions 1 .. n are the merged patch embeddings, n = t * h * w / merge_size², in the
  order the language model's image placeholder tokens take them.
"""

from __future__ import annotations

import torch

from omniflow.backends.registry import family_code
from omniflow.catalog.resolve import model_path
from omniflow.dtypes import torch_dtype
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from omniflow.runtime.stage import Backend, Call, StageSpec

# Grid sizes travel as two base-256 digits: integers up to 256 are exact in bfloat16.
_DIGIT = 256
_GRID = 3  # (t, h, w)


class VisionBackendError(OmniflowError):
    """A vision encoder stage cannot load its model, or a request's image cannot be read."""


def pack_image(embeds: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """An image's embeddings `[n, H]` and patch grid (t, h, w) as one `hidden` value
    `[1, 1 + n, H]`: the grid header, then the embeddings."""
    out = embeds.new_zeros(1, 1 + embeds.shape[0], embeds.shape[1])
    for i, g in enumerate(grid):
        out[0, 0, 2 * i], out[0, 0, 2 * i + 1] = g % _DIGIT, g // _DIGIT
    out[0, 1:] = embeds
    return out


def unpack_image(hidden: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_image`'s inverse: the embeddings `[n, H]` (copied out of `hidden`) and the grid,
    an int64 `[1, 3]` `image_grid_thw`. `merge_size` is the tower's spatial merge, which
    says how many embeddings the grid gives."""
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] < 2 * _GRID:
        raise VisionBackendError(
            f"image embeddings of shape {list(hidden.shape)} are not the vision encoder's "
            "[1, 1 + tokens, hidden] layout"
        )
    digits = hidden[0, 0, : 2 * _GRID].double().round().long().view(_GRID, 2)
    grid = digits[:, 0] + _DIGIT * digits[:, 1]
    n = int(grid.prod()) // merge_size**2
    if n < 1 or n != hidden.shape[1] - 1:
        raise VisionBackendError(
            f"image embeddings carry grid {grid.tolist()} ({n} tokens at merge size "
            f"{merge_size}) and {hidden.shape[1] - 1} rows: not the vision encoder's layout"
        )
    return hidden[0, 1:].clone(), grid[None]


def read_image(value):
    """A request's image as the image processor takes it: a path is opened with PIL (as
    RGB), a uint8 `[H, W, 3]` tensor becomes an array."""
    from PIL import Image

    if isinstance(value, str):
        try:
            with Image.open(value) as image:
                return image.convert("RGB")
        except OSError as err:
            raise VisionBackendError(f"cannot read image file '{value}': {err}") from err
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 3
        and value.shape[2] == 3
    ):
        return value.cpu().numpy()
    what = (
        f"a {value.dtype} tensor of shape {list(value.shape)}"
        if isinstance(value, torch.Tensor)
        else type(value).__name__
    )
    raise VisionBackendError(
        f"an image is a path to an image file or a uint8 tensor [H, W, 3], not {what}"
    )


def _load_tower(spec: StageSpec, device: str):
    """The stage's vision tower, alone, and the checkpoint's image processor: what its model
    family's code loads (called with the checkpoint path, the component and the dtype; it
    returns the tower, its loading info and the processor)."""
    plan = spec.plan
    load = family_code(spec, "transformers")
    if load is None:
        family = plan.family.name if plan.family else "no model family"
        raise VisionBackendError(
            f"stage '{plan.name}': {plan.model} ({family}) has no vision tower omniflow can run"
        )
    path = model_path(plan.model)
    dtype = plan.settings.get("dtype")
    try:
        with quiet():
            tower, info, processor = load(
                path, plan.component, torch_dtype(dtype) if dtype else "auto"
            )
    except (OSError, ValueError, KeyError) as err:
        raise VisionBackendError(f"stage '{plan.name}': cannot load {plan.model}: {err}") from err
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise VisionBackendError(
            f"stage '{plan.name}': {plan.model} lacks vision tower weights {', '.join(missing[:5])}"
        )
    config = tower.config
    if (processor.patch_size, processor.merge_size) != (
        config.patch_size,
        config.spatial_merge_size,
    ):
        raise VisionBackendError(
            f"stage '{plan.name}': the image processor's patches ({processor.patch_size} px, "
            f"merge {processor.merge_size}) are not the tower's ({config.patch_size} px, "
            f"merge {config.spatial_merge_size})"
        )
    return tower.to(device).eval(), processor


class VisionEncoder(Backend):
    """A vision-language checkpoint's vision tower: one image per request to its embeddings."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        name = spec.plan.name
        if spec.inputs != {"image": "image"}:
            given = ", ".join(f"{p}: {t}" for p, t in spec.inputs.items())
            raise VisionBackendError(
                f"stage '{name}': the vision encoder takes one image input, not {given}"
            )
        self.tower, self.processor = _load_tower(spec, device)
        max_len = spec.plan.settings["max_len"]
        # The largest image that gives at most max_len embeddings, one per merged patch.
        patch = self.processor.patch_size * self.processor.merge_size
        size = self.processor.size
        self.size = {
            "shortest_edge": size["shortest_edge"],
            "longest_edge": min(size["longest_edge"], max_len * patch * patch),
        }
        if self.size["longest_edge"] < self.size["shortest_edge"]:
            raise VisionBackendError(
                f"stage '{name}': max_len {max_len} is below the image processor's smallest "
                f"image ({size['shortest_edge'] // (patch * patch)} tokens)"
            )

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    @torch.inference_mode()
    def step(self, calls: list[Call]) -> None:
        owners, pixels, grids = [], [], []
        for call in calls:
            try:
                features = self._features(call.inputs["image"].take())
            except VisionBackendError as err:
                call.fail(err)
                continue
            owners.append(call)
            pixels.append(features["pixel_values"])
            grids.append(features["image_grid_thw"])
        if not owners:
            return
        grid = torch.cat(grids).to(self.device)
        embeds = self.tower(
            torch.cat(pixels).to(self.device, self.tower.dtype), grid_thw=grid
        ).pooler_output
        sizes = (grid.prod(-1) // self.tower.spatial_merge_size**2).tolist()
        for call, mine, thw in zip(owners, embeds.split(sizes), grid.tolist(), strict=True):
            call.emit("hidden", pack_image(mine, tuple(thw)))
            call.finish()

    def _features(self, value):
        """The processor's pixel patches and grid of one request's image."""
        image = read_image(value)
        try:
            return self.processor(images=[image], size=self.size, return_tensors="pt")
        except ValueError as err:  # e.g. an aspect ratio above 200
            raise VisionBackendError(f"the image processor refuses the image: {err}") from err
