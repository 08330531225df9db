"""Choosing a stage's backend: stand-ins on request, `python` stages' own functions, and the
model backends by kind."""

from __future__ import annotations

from omniflow.errors import OmniflowError
from omniflow.runtime.python_backend import python_backend
from omniflow.runtime.stage import Backend, StageSpec
from omniflow.runtime.standins import standin_backend

# "auto": each stage's own backend; "standin": deterministic stand-ins for every model stage.
CHOICES = ("auto", "standin")


def load_backend(spec: StageSpec, device: str, choice: str = "auto") -> Backend:
    if choice not in CHOICES:
        raise OmniflowError(f"unknown backend choice '{choice}'; use one of {', '.join(CHOICES)}")
    if choice == "standin":
        return standin_backend(spec, device)
    if spec.plan.kind == "python":
        return python_backend(spec, device)
    raise OmniflowError(
        f"stage '{spec.plan.name}': no model backend for kind '{spec.plan.kind}' is installed; "
        "run with backends='standin' to use deterministic stand-ins"
    )
