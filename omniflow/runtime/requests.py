"""Admission: a request checked against its plan before any stage sees it.

`admit` resolves a request once -- every input's value (given, else its default), every
pipeline parameter's value, and its seed -- and refuses, with a `RequestError` that says
what to change, anything the plan was not compiled for: unknown or missing inputs and
parameters, wrong types, numbers outside the plan's limits, image files that cannot be
read, payloads larger than their ring's slot, speakers the models do not have, and
what a model family checks of its own checkpoints (`FamilyCheck`). It runs in
the caller's thread and touches no executor, so a bad request costs microseconds and
never reaches a stage.

Seeds. Every request has one: the `seed` parameter if given, else the pipeline's declared
default, else a random one (reported back so the request can be replayed). A stage that
names `$seed` gets it as is; every other sampling stage gets its own stream derived from
it (`stage_seed`), so one number replays the whole pipeline.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from omniflow.errors import OmniflowError
from omniflow.ir.kinds import SEED_BITS, SEED_PARAM, number_text
from omniflow.ir.values import InputRef, Param, StageSeed
from omniflow.plan import Plan, StagePlan
from omniflow.runtime.port_values import MEDIA_TYPES, encode
from omniflow.sampling import KNOBS

# The integers a request may set (`_check_limit`): what a signed 64-bit integer holds.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class RequestError(OmniflowError):
    """A request does not fit the pipeline (unknown or missing input, bad parameter);
    `field` names the input or parameter at fault (None: the request as a whole)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestFailed(OmniflowError):
    """A request failed in a stage, or its executor died; the message says where and why."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Admitted:
    """A request that fits its plan: every input's value and every parameter's, the seed
    included; `wire`: each input as it travels (encoded once, here)."""

    inputs: dict
    params: dict
    wire: dict = field(default_factory=dict, compare=False, repr=False)
    # Optional inputs the request left out: their edges end with nothing on them.
    absent: frozenset = frozenset()
    # The stages it runs (None: all): a request for some of the outputs runs only the
    # stages they depend on (`admit`'s `outputs`), and the others never start it.
    scope: frozenset | None = None

    @property
    def seed(self) -> int:
        return self.params[SEED_PARAM]


class StageRequestError(RequestError):
    """A model family's admission check refusing one of a stage's values: `field` names
    the stage's parameter or input port (`FamilyCheck` names the request's field)."""


@dataclass(frozen=True)
class Voice:
    """A request value that must name one of a model's speakers: the pipeline parameter or
    input `name` (`is_input`), and the speakers the model it reaches has. A speaker is
    matched in any letter case and goes on spelled as the model spells it; an empty text
    (no voice: the model's own) passes."""

    name: str
    is_input: bool
    speakers: tuple[str, ...]

    def check(self, admitted: Admitted) -> None:
        values = admitted.inputs if self.is_input else admitted.params
        value = values.get(self.name)
        if value is None or value == "" or value in self.speakers:
            return
        spelled = {s.lower(): s for s in self.speakers}
        if isinstance(value, str) and value.lower() in spelled:
            values[self.name] = spelled[value.lower()]
            if self.is_input:
                admitted.wire[self.name] = encode("text", values[self.name])
            return
        what = "input" if self.is_input else "parameter"
        raise RequestError(
            f"{what} '{self.name}': unknown speaker {value!r}; "
            f"the model has {', '.join(self.speakers)}",
            self.name,
        )


@dataclass(frozen=True)
class FamilyCheck:
    """A model family's own checks of each request against a stage's checkpoint
    (`Family.admission`: a task the checkpoint does not do, a language it does not speak),
    made at admission like the plan's own. `check_stage(params, inputs)` sees the stage's
    parameters for the request and the values of its input ports that pipeline inputs
    feed (`feeds`: port -> input; an optional input the request leaves out is not there);
    the StageRequestError it raises names a stage parameter or port, which the error names
    as the request's parameter or input that set it."""

    stage: StagePlan
    feeds: dict[str, str]
    check_stage: Callable[[dict, dict], None]

    def check(self, admitted: Admitted) -> None:
        params = stage_params(self.stage, admitted)
        inputs = {
            p: admitted.inputs[src] for p, src in self.feeds.items() if src in admitted.inputs
        }
        try:
            self.check_stage(params, inputs)
        except StageRequestError as err:
            source = self.stage.params.get(err.field or "")
            if isinstance(source, Param):
                field_ = source.name
            elif isinstance(source, InputRef):
                field_ = source.input
            else:
                field_ = self.feeds.get(err.field or "", err.field)
            raise RequestError(str(err), field_) from None


class Check(Protocol):
    """What admission checks a request with beyond the plan (`preflight` finds them)."""

    def check(self, admitted: Admitted) -> None: ...


def admit(
    plan: Plan,
    inputs: dict,
    params: dict | None = None,
    checks: tuple[Check, ...] = (),
    outputs: frozenset[str] | None = None,
) -> Admitted:
    """The request resolved against `plan`, or a RequestError naming what does not fit.
    With `outputs` (some of the plan's), it runs only the stages they depend on and takes
    only the inputs those stages read; the others are left out."""
    scope = None
    needed = None
    if outputs is not None:
        known = {o.name for o in plan.outputs}
        if not outputs or not outputs <= known:
            raise RequestError(
                f"unknown output(s) {', '.join(sorted(outputs - known)) or '(none)'}; "
                f"the pipeline has {', '.join(sorted(known))}"
            )
        scope = plan.upstream(outputs)
        needed = {c.src for c in plan.channels if c.dst in scope | outputs} | {
            v.input  # a guidance companion: an input a stage's parameter names
            for s in plan.stages
            if s.name in scope
            for v in s.params.values()
            if isinstance(v, InputRef)
        }
    values = _check_params(plan, dict(params or {}))
    given, wire = _prepare_inputs(plan, inputs, needed)
    # Left out: optional inputs not given; in a scoped request, every input it does not read.
    absent = frozenset(
        i.name for i in plan.inputs if i.name not in given and (i.optional or scope is not None)
    )
    admitted = Admitted(given, values, wire, absent, scope)
    check_request(admitted, checks)
    return admitted


def check_request(admitted: Admitted, checks: tuple[Check, ...]) -> None:
    """Refuse what the models themselves would (a speaker a model does not have, a task its
    checkpoint does not do): each check raises a RequestError naming the field. A stage's
    checks pass over a request that does not run it."""
    for check in checks:
        stage = getattr(check, "stage", None)
        if admitted.scope is None or stage is None or stage.name in admitted.scope:
            check.check(admitted)


def _prepare_inputs(plan: Plan, inputs: dict, needed: set[str] | None) -> tuple[dict, dict]:
    """Every input of the pipeline (of those `needed`, if given) with its value (given,
    else its default), checked, and as it travels."""
    known = {i.name: i for i in plan.inputs}
    unknown = set(inputs) - set(known)
    if unknown:
        raise RequestError(
            f"unknown input(s) {', '.join(sorted(unknown))}; the pipeline takes {', '.join(known)}",
            sorted(unknown)[0],
        )
    values = {}
    for name, port in known.items():
        if needed is not None and name not in needed:
            continue  # read by no stage the request runs
        if name in inputs and inputs[name] is None and port.optional:
            continue  # left out: its edges end empty
        if name in inputs:
            value = inputs[name]
        elif port.default is not None:
            value = port.default
        elif port.optional:
            continue
        else:
            raise RequestError(f"missing input '{name}' ({port.type})", name)
        values[name] = _check_input(name, port.type, value)
    wire = {name: encode(known[name].type, value) for name, value in values.items()}
    for channel in plan.channels:
        if channel.src in values and channel.kind != "local" and channel.type != "text":
            size = wire[channel.src].nbytes
            if size > channel.slot_bytes:
                raise RequestError(_past_buffer(channel, values[channel.src], size), channel.src)
    return values, wire


def _past_buffer(channel, value, size: int) -> str:
    """Why an input of `size` bytes does not fit its channel's buffer: in pixels for an
    image (a photo's size says more to a client than its decoded bytes)."""
    slot = channel.slot_bytes
    if channel.type == "image" and isinstance(value, torch.Tensor) and value.dim() == 3:
        height, width = value.shape[:2]
        return (
            f"input '{channel.src}' is an image of {width} x {height} pixels; the plan's buffer "
            f"for it holds {slot // 3} pixels (RGB, {slot} bytes): send a smaller image"
        )
    return (
        f"input '{channel.src}' is {size} bytes; the plan's buffer for it holds {slot} bytes "
        "per message"
    )


def _check_input(name: str, port_type: str, value):
    if port_type in MEDIA_TYPES and isinstance(value, (list, tuple)):
        # Several items of one request (two images of one chat), each checked alone.
        if not value:
            raise RequestError(f"input '{name}' is an empty list of {port_type}s", name)
        return [_check_input(f"{name}[{i}]", port_type, v) for i, v in enumerate(value)]
    if port_type == "video" and isinstance(value, (str, os.PathLike, bytes)):
        # A video file travels as its bytes; the stage decodes and samples it.
        if isinstance(value, bytes):
            data = value
        else:
            path = os.fspath(value)
            try:
                with open(path, "rb") as file:
                    data = file.read()
            except OSError as err:
                raise RequestError(
                    f"input '{name}': no readable video file at '{path}': {err.strerror}", name
                ) from None
        if not data:
            raise RequestError(f"input '{name}' is an empty video file", name)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if port_type == "text":
        if not isinstance(value, str):
            raise RequestError(f"input '{name}' must be a string", name)
        return value
    if port_type == "chat":
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not (
            isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
        ):
            raise RequestError(f"input '{name}' must be a list of {{role, content}} messages", name)
        return value
    if port_type == "image" and isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not path:
            raise RequestError(f"input '{name}' is an empty path", name)
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise RequestError(f"input '{name}': no readable image file at '{path}'", name)
        # Absolute, so it names the same file in whichever process opens it.
        return os.path.abspath(path)
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RequestError(
            f"input '{name}' must be a tensor-like value ({port_type}): {err}", name
        ) from err


def _check_params(plan: Plan, overrides: dict) -> dict:
    """Every pipeline parameter's value for this request (overrides checked), and the seed."""
    for name, value in overrides.items():
        if name not in plan.limits:
            raise RequestError(
                f"unknown parameter '{name}'; the pipeline has {', '.join(plan.limits)}", name
            )
        default = plan.params.get(name, 0 if name == SEED_PARAM else None)
        numeric = isinstance(default, float) and isinstance(value, int)
        if isinstance(value, bool) != isinstance(default, bool) or not (
            isinstance(value, type(default)) or numeric
        ):
            raise RequestError(
                f"parameter '{name}' must be {type(default).__name__}, not {value!r}", name
            )
        _check_limit(plan, name, value)
    values = {**plan.params, **overrides}
    values.setdefault(SEED_PARAM, random.getrandbits(SEED_BITS))
    return values


def _check_limit(plan: Plan, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    limit = plan.limits[name]
    if value != value:  # NaN, which every comparison lets through
        raise RequestError(f"parameter '{name}' must be a number, not NaN", name)
    # An integer travels to the executors as a 64-bit one (control messages, the stages'
    # tensors): one past that stopped the engine where it was sent.
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        bound = f"at most {INT64_MAX}" if value > 0 else f"at least {INT64_MIN}"
        raise RequestError(f"parameter '{name}' must be {bound} (64 bits), not {value}", name)
    if limit.low is not None and value < limit.low:
        raise RequestError(
            f"parameter '{name}' must be at least {number_text(limit.low)}, not {value!r}", name
        )
    if limit.high is not None and value > limit.high:
        if limit.why:
            raise RequestError(
                f"parameter '{name}' = {value!r} is above {number_text(limit.high)}: {limit.why} and its "
                f"memory and buffers were sized for that; recompile with a larger default "
                f"(`param {name} = {value!r}`)",
                name,
            )
        raise RequestError(
            f"parameter '{name}' must be at most {number_text(limit.high)}, not {value!r}", name
        )
    for knob in limit.knobs:
        if problem := KNOBS[knob].problem(value):
            raise RequestError(f"parameter '{name}' is out of its domain: {problem}", name)


def stage_seed(seed: int, stage: str) -> int:
    """A stage's own seed, drawn from the request's: independent streams per stage."""
    digest = hashlib.blake2b(f"{seed}/{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def stage_params(stage: StagePlan, request: Admitted) -> dict:
    """`stage`'s parameters for one admitted request: each reference replaced by the value
    of the parameter, the stage's own seed, or the value of the input it names."""

    def value(v):
        if isinstance(v, Param):
            return request.params[v.name]
        if isinstance(v, StageSeed):
            return stage_seed(request.seed, v.stage)
        if isinstance(v, InputRef):
            return request.inputs[v.input]
        return v

    return {k: value(v) for k, v in stage.params.items()}
