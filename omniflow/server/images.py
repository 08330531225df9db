"""`POST /v1/images/generations` (JSON) and `POST /v1/images/edits` (multipart), answered
in OpenAI's DALL-E format: `{"created", "data": [{"b64_json"}]}`.

`size` "WxH" sets the pipeline's `width` and `height`; `n` images are `n` requests with
seeds `seed`, `seed + 1`, ... (admitted together or not at all, so at most as many as the
pipeline runs at once); the diffusion fields reach the pipeline's parameters (params.py).
A multipart edit sends every field as a string (`"True"`, `"50"`, `"7.5"`): each is
parsed as the type the field has, or for a pipeline parameter the type of its default.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time

from starlette.datastructures import UploadFile

from omniflow.ir.kinds import SEED_BITS
from omniflow.media import IMAGE_FORMATS, decode_image, image_bytes
from omniflow.server import media_in
from omniflow.server.errors import bad_request
from omniflow.server.params import Params, parse_form_value
from omniflow.server.protocol import ImageGenerationRequest, merge_extra_body, validate
from omniflow.server.run import Run

MAX_IMAGES = 10
# Form fields of an edit and their types (the values arrive as strings).
EDIT_FIELDS = {
    "model": str, "prompt": str, "negative_prompt": str, "size": str, "n": int,
    "num_inference_steps": int, "guidance_scale": float, "true_cfg_scale": float, "seed": int,
    "vae_use_slicing": bool, "vae_use_tiling": bool, "response_format": str,
    "output_format": str, "lora": dict, "extra_body": dict, "quality": str, "background": str,
    "user": str,
}  # fmt: skip
NO_OP_STRINGS = {"quality": ("auto", "standard"), "background": ("auto", "opaque")}


class ImageJob:
    def __init__(self, served, inputs: dict, params: Params, n: int, fmt: str):
        self.served = served
        self.inputs = inputs
        self.params = params
        self.n = n
        self.format = fmt
        self.image_port = served.outputs_of("image")[0]

    def requests(self) -> list[tuple[dict, dict]]:
        """(inputs, params) of each of the n images: seeds seed, seed + 1, ..."""
        params = self.params.result()
        if self.n == 1:
            return [(self.inputs, params)]
        seed = params.get("seed", random.getrandbits(SEED_BITS))
        top = 1 << SEED_BITS
        return [(self.inputs, {**params, "seed": (seed + i) % top}) for i in range(self.n)]


def parse_generation(served, body: dict) -> ImageJob:
    request = validate(ImageGenerationRequest, merge_extra_body(body))
    fields = request.model_dump(exclude_unset=True, exclude={"extra_body"})
    fields.update(request.model_extra or {})
    return _job(served, fields, {})


async def uploaded_image(server, name: str, upload: UploadFile):
    """The image of form file `name`, or a 400 naming it: over the server's media size or
    pixel limit, or not an image."""
    limit = server.config.max_media_bytes
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise bad_request(f"'{name}': the file is over {limit} bytes", param=name)
    return await media_in.decoded(decode_image, data, name, server.config.max_image_pixels)


async def parse_edit(server, served, form) -> ImageJob:
    fields, inputs = {}, {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            port = "image" if name in ("image", "image[]") else name
            if port == "mask" and served.input_named(port, "image") is None:
                raise bad_request(_no_inpainting(server, served), param=name)
            if served.input_named(port, "image") is None:
                raise bad_request(
                    f"'{name}': pipeline '{served.name}' takes no image named '{port}' (its "
                    f"inputs: {', '.join(f'{p.name} ({p.type})' for p in served.plan.inputs)})",
                    param=name,
                )
            if port in inputs:
                raise bad_request(f"'{name}': one image per request", param=name)
            inputs[port] = await uploaded_image(server, name, value)
            continue
        if name in fields:
            raise bad_request(f"'{name}' is given twice", param=name)
        like = EDIT_FIELDS.get(name)
        if like is None:
            param = Params(served).target(name)
            like = type(served.plan.params[param]) if param in served.plan.params else str
        fields[name] = parse_form_value(name, value, like)
    if "image" not in inputs:
        raise bad_request("'image': the image to edit is missing (a multipart file)", param="image")
    if "prompt" not in fields:
        raise bad_request("'prompt' is missing", param="prompt")
    fields.update(merge_extra_body({"extra_body": fields.pop("extra_body", None)}))
    return _job(served, fields, inputs)


def _no_inpainting(server, served) -> str:
    """Why a `mask` cannot be taken: the pipeline does not inpaint; which served ones do."""
    inpainting = [
        s.name for s in server.served.values() if s.input_named("mask", "image") is not None
    ]
    where = (
        f"pipelines served here that inpaint: {', '.join(inpainting)}"
        if inpainting
        else "no pipeline served here inpaints"
    )
    return (
        f"'mask': pipeline '{served.name}' takes no image named 'mask': it does not inpaint "
        f"(a masked edit runs an inpainting pipeline, one with a 'mask' image input; {where})"
    )


def _job(served, fields: dict, inputs: dict) -> ImageJob:
    params = Params(served)
    fields.pop("model", None)
    inputs[served.prompt_input.name] = fields.pop("prompt")
    n = fields.pop("n", None)
    n = 1 if n is None else n
    most = min(MAX_IMAGES, served.limit)
    if not 1 <= n <= most:
        why = ""
        if most < MAX_IMAGES:  # (more would wait in the queue for ever, and all behind them)
            why = (
                f": pipeline '{served.name}' runs {served.limit} requests at once, and n "
                "images are n requests admitted together"
            )
        raise bad_request(f"'n' must be 1 to {most}{why}, not {n}", param="n")
    fmt = fields.pop("output_format", None) or "png"
    if fmt not in IMAGE_FORMATS:
        raise bad_request(
            f"'output_format' {fmt!r} is not supported; use one of {', '.join(IMAGE_FORMATS)}",
            param="output_format",
        )
    response_format = fields.pop("response_format", None) or "b64_json"
    if response_format != "b64_json":
        raise bad_request(
            f"'response_format' {response_format!r} is not supported; this server answers "
            "b64_json (it keeps no files to link to)",
            param="response_format",
        )
    for name, allowed in NO_OP_STRINGS.items():
        if fields.get(name) in allowed:
            fields.pop(name)
    take_fields(served, fields, inputs, params)
    return ImageJob(served, inputs, params, n, fmt)


def take_fields(served, fields: dict, inputs: dict, params: Params) -> None:
    """The fields of an image or video request left once its own are taken: `size` "WxH"
    (or "auto") sets the pipeline's width and height, a field naming one of the pipeline's
    text inputs fills it (into `inputs`), the rest are its parameters (`Params.take_all`)."""
    size = fields.pop("size", None)
    if size not in (None, "auto"):
        _size(params, size)
    for name in list(fields):
        if served.input_named(name, "text") is not None:
            value = fields.pop(name)
            if value is None:
                continue  # null: the input's default, as null is for every other field
            if not isinstance(value, str):
                raise bad_request(f"'{name}' must be a string", param=name)
            inputs[name] = value
    params.take_all(fields)


def ascii_digits(text: str) -> bool:
    """ASCII digits alone (`str.isdigit` takes every script's, which `int` reads too)."""
    return text.isascii() and text.isdigit()


def _size(params: Params, size: str) -> None:
    width, sep, height = size.lower().partition("x")
    if not (sep and ascii_digits(width) and ascii_digits(height)):
        raise bad_request(f"'size' must be WIDTHxHEIGHT, e.g. 512x512, not {size!r}", param="size")
    for name, value in (("width", int(width)), ("height", int(height))):
        if not params.take(name, value, "size"):
            raise bad_request(
                f"'size': pipeline '{params.served.name}' has no '{name}' parameter; its image "
                "size is fixed",
                param="size",
            )


async def answer(job: ImageJob, runs: list[Run]) -> dict:
    async def one(run: Run) -> str:
        image = await run.last(job.image_port.name, "image")
        data = await asyncio.to_thread(image_bytes, image, job.format)
        return base64.b64encode(data).decode()

    tasks = [asyncio.ensure_future(one(run)) for run in runs]
    try:
        images = await asyncio.gather(*tasks)
    finally:  # one failed or the client went away: the others stop too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "created": int(time.time()),
        "data": [{"b64_json": b64} for b64 in images],
        "output_format": job.format,
        "seed": runs[0].seed,
    }
