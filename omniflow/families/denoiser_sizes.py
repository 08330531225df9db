"""A denoiser's image size, checked at admission for the diffusion families (their
`Family.admission`): height and width must be positive multiples of the VAE's spatial scale
times the transformer's patch, as their pipelines' code requires of a request
(`omniflow.backends.diffusion.check_sizes`). A size the stage would refuse is then a 400
naming the request's field, before any stage runs. Torch-free: the multiple comes from the
checkpoint's component configs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from omniflow.plan import StagePlan

SIZES = ("height", "width")


def component_config(path: str, component: str) -> dict:
    """`component/config.json` of the diffusers checkpoint at `path` ({} if it has none)."""
    file = Path(path) / component / "config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def patch_width(transformer: dict) -> int:
    """The transformer's patch along the width (a 3-D patch is (frames, height, width))."""
    patch = transformer.get("patch_size", 1)
    return int(patch[-1] if isinstance(patch, (list, tuple)) else patch)


def size_check(stage: StagePlan, multiple: int) -> Callable[[dict, dict], None] | None:
    """A check of a diffusion stage's `height` and `width` against `multiple` (None for any
    other stage)."""
    from omniflow.runtime.requests import StageRequestError

    if stage.kind != "diffusion":
        return None

    def check(params: dict, inputs: dict) -> None:
        for name in SIZES:
            value = params.get(name)
            if isinstance(value, int) and (value < multiple or value % multiple):
                raise StageRequestError(
                    f"{name} must be a positive multiple of {multiple} (the VAE's scale x the "
                    f"transformer's patch), not {value}",
                    name,
                )

    return check
