"""Checking a request against a plan: its inputs (with defaults) and parameter overrides."""

from __future__ import annotations

import os

import torch

from omniflow.errors import OmniflowError
from omniflow.plan import Plan, StagePlan, resolve_params


class RequestError(OmniflowError):
    """A request does not fit the pipeline (unknown or missing input, bad parameter)."""


class RequestFailed(OmniflowError):
    """A request failed in a stage, or its executor died; the message says where and why."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def prepare_inputs(plan: Plan, inputs: dict) -> dict:
    """Every input of the pipeline with its value: given, else its default; type-checked."""
    known = {i.name: i for i in plan.inputs}
    unknown = set(inputs) - set(known)
    if unknown:
        raise RequestError(
            f"unknown input(s) {', '.join(sorted(unknown))}; the pipeline takes {', '.join(known)}"
        )
    values = {}
    for name, port in known.items():
        if name in inputs:
            value = inputs[name]
        elif port.default is not None:
            value = port.default
        else:
            raise RequestError(f"missing input '{name}' ({port.type})")
        values[name] = _check(name, port.type, value)
    return values


def _check(name: str, port_type: str, value):
    if port_type == "text":
        if not isinstance(value, str):
            raise RequestError(f"input '{name}' must be a string")
        return value
    if port_type == "chat":
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not (
            isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
        ):
            raise RequestError(f"input '{name}' must be a list of {{role, content}} messages")
        return value
    if port_type == "image" and isinstance(value, (str, os.PathLike)):
        if not os.fspath(value):
            raise RequestError(f"input '{name}' is an empty path")
        # Absolute, so it names the same file in whichever process opens it.
        return os.path.abspath(value)
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RequestError(
            f"input '{name}' must be a tensor-like value ({port_type}): {err}"
        ) from err


def check_params(plan: Plan, params: dict | None) -> dict:
    """Parameter overrides of a request: only declared pipeline parameters, of the default's type."""
    params = dict(params or {})
    for name, value in params.items():
        if name not in plan.params:
            raise RequestError(
                f"unknown parameter '{name}'; the pipeline has {', '.join(plan.params) or 'none'}"
            )
        default = plan.params[name]
        numeric = isinstance(default, float) and isinstance(value, int)
        if isinstance(value, bool) != isinstance(default, bool) or not (
            isinstance(value, type(default)) or numeric
        ):
            raise RequestError(
                f"parameter '{name}' must be {type(default).__name__}, not {value!r}"
            )
    return params


def stage_params(plan: Plan, stage: StagePlan, overrides: dict, inputs: dict) -> dict:
    return resolve_params(stage.params, plan.params, overrides, inputs)
