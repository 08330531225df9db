"""Choosing a stage's backend: stand-ins on request, `python` stages' own functions, and the
model backends by stage kind and the stage's `backend=` parameter; and, within a model
backend, the model family's code for the stage (`family_code`).

Model backends live in `omniflow.backends`, their model-specific halves in the model
families (`omniflow.families`), whose dotted paths the plan carries; both are imported only
when a stage needs them, so an executor never imports diffusers to run a language model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from omniflow.errors import OmniflowError
from omniflow.runtime.python_backend import import_function, python_backend
from omniflow.runtime.stage import Backend, StageSpec
from omniflow.runtime.standins import standin_backend

# "auto": each stage's own backend; "standin": deterministic stand-ins for every model stage.
CHOICES = ("auto", "standin")

# (stage kind, backend name) -> "module:class"; the first listed for a kind is its default.
MODEL_BACKENDS: dict[tuple[str, str], str] = {
    ("ar", "transformers"): "omniflow.backends.transformers_ar:TransformersAR",
    ("ar", "vllm"): "omniflow.backends.vllm_ar:VllmAR",
    ("encoder", "diffusers"): "omniflow.backends.encoders:TextEncoder",
    ("encoder", "transformers"): "omniflow.backends.vision:encoder_backend",
    ("diffusion", "diffusers"): "omniflow.backends.diffusion:DiffusionSteps",
    ("vae", "diffusers"): "omniflow.backends.diffusion:VaeDecode",
    ("vocoder", "transformers"): "omniflow.backends.vocoders:Vocoder",
}


def family_code(spec: StageSpec, backend: str) -> Callable | None:
    """What the stage's model family gives the `backend` model backend, imported (None: the
    family gives it nothing, or no family knows the model)."""
    family = spec.plan.family
    target = family.code.get(backend) if family is not None else None
    return import_function(target) if target else None


def backend_name(spec: StageSpec) -> str:
    """The backend a model stage runs on: the one it asks for, else vLLM for plain text
    generation where it is installed (a prompt in, tokens and text out: vLLM does not expose
    hidden states or take embeddings), else for an encoder the vision tower of a
    transformers checkpoint when its one input is an image and a diffusers pipeline's text
    encoder when it has a prompt (an edit pipeline's also takes the image), else the kind's
    default."""
    kind = spec.plan.kind
    asked = spec.plan.settings.get("backend", "auto")
    if asked != "auto":
        return asked
    if kind == "encoder":
        media = set(spec.inputs) <= {"image", "video", "audio"}
        return "transformers" if spec.inputs and media else "diffusers"
    plain_lm = set(spec.inputs) <= {"prompt"} and set(spec.outputs) <= {"tokens", "text"}
    if kind == "ar" and plain_lm and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    return next(name for k, name in MODEL_BACKENDS if k == kind)


def load_backend(spec: StageSpec, device: str, choice: str = "auto") -> Backend:
    if choice not in CHOICES:
        raise OmniflowError(f"unknown backend choice '{choice}'; use one of {', '.join(CHOICES)}")
    if choice == "standin":
        return standin_backend(spec, device)
    if spec.plan.kind == "python":
        return python_backend(spec, device)
    name = backend_name(spec)
    target = MODEL_BACKENDS.get((spec.plan.kind, name))
    if target is None:
        usable = [b for k, b in MODEL_BACKENDS if k == spec.plan.kind]
        raise OmniflowError(
            f"stage '{spec.plan.name}': no '{name}' backend for {spec.plan.kind} stages; use {', '.join(usable)}"
        )
    return import_function(target)(spec, device)
