"""What the frontend checks before any executor starts: that the plan's devices exist on
this machine, that every model it names can be loaded here, which speakers those
models have, and what their families check of a request against their checkpoints (so
admission can refuse an unknown speaker or a task a checkpoint does not do without asking
a stage).

Each check fails in seconds with an error that names what is missing and the ways to
provide it; without them a missing model would surface as an executor's traceback after
its other stages had spent their time loading. A model the hub can give but this machine
lacks is downloaded here, in the front process, with the hub's progress bars on the
terminal (an executor's output goes to its log): a first download of real weights is
gigabytes and minutes, and a person should see it move.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omniflow.catalog.components import cached_snapshot
from omniflow.catalog.resolve import TINY_SCHEME, model_path
from omniflow.errors import OmniflowError
from omniflow.ir.values import Param
from omniflow.plan import Plan, StagePlan
from omniflow.runtime.python_backend import import_function
from omniflow.runtime.requests import Check, FamilyCheck, Voice

HUB_TIMEOUT_S = 10.0


class PreflightError(OmniflowError):
    """The plan cannot run on this machine as it stands (a device or a model is missing)."""


def preflight(plan: Plan) -> tuple[Check, ...]:
    """Check the plan against this machine; what admission checks its requests with: the
    speaker-valued request fields, and its stages' families' own checks."""
    check_devices(plan)
    paths = {model: locate_model(model) for model in {s.model for s in plan.stages if s.model}}
    return plan_voices(plan, paths) + family_checks(plan, paths)


def check_devices(plan: Plan) -> None:
    wanted = sorted({d for s in plan.stages for d in s.devices if d.startswith("cuda")})
    if not wanted:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in wanted if int(d.partition(":")[2] or 0) >= have]
    if missing:
        found = f"only {have} CUDA device(s)" if have else "no CUDA device"
        raise PreflightError(
            f"the plan places stages on {', '.join(missing)} but this machine has {found}; "
            "compile it for this machine's devices (e.g. --devices cpu)"
        )


def local_checkpoint(model: str | None) -> str | None:
    """Where `model`'s checkpoint is on this machine (a tiny one, built on first use, a
    local folder, the Hugging Face cache), else None."""
    if model is None:
        return None
    if model.startswith(TINY_SCHEME) or Path(model).expanduser().is_dir():
        return model_path(model)
    snapshot = cached_snapshot(model)
    return None if snapshot is None else str(snapshot[1])


def locate_model(model: str) -> str:
    """Where `model` loads from: this machine (`local_checkpoint`), or the hub when it can
    be reached (downloaded into the cache now)."""
    local = local_checkpoint(model)
    if local is not None:
        return local
    reason = _hub_unreachable(model)
    if reason is None:
        return download(model)
    raise PreflightError(
        f"model '{model}' is not on this machine and cannot be downloaded ({reason}); "
        f"provide it in one of these ways: run with --tiny (the built-in tiny model of the "
        f"same architecture, random weights); download it where there is network "
        f"(`huggingface-cli download {model}`) and copy the Hugging Face cache here "
        f"(HF_HOME); or name a local checkpoint folder as the model in the .omni file"
    )


# Weights for other frameworks that some repositories carry beside the torch ones: never
# loaded here, and as large as the torch weights.
OTHER_FRAMEWORKS = [
    "*.msgpack",
    "*.h5",
    "*.ckpt.index",
    "*.onnx",
    "*.onnx_data",
    "*.tflite",
    "*.ot",
]


def download(model: str) -> str:
    """`model` from the hub into its cache, saying so on stderr as it starts and when it
    is done; the hub's own progress bars show the files as they come."""
    import huggingface_hub

    print(f"omniflow: downloading {model} from the Hugging Face hub (first use) ...",
          file=sys.stderr, flush=True)  # fmt: skip
    began = time.perf_counter()
    try:
        path = huggingface_hub.snapshot_download(model, ignore_patterns=OTHER_FRAMEWORKS)
    except Exception as err:  # the network, the disk: one line, not a traceback
        raise PreflightError(f"could not download model '{model}': {err}") from err
    took = time.perf_counter() - began
    print(f"omniflow: downloaded {model} in {took:.0f} s: {path}", file=sys.stderr, flush=True)
    return path


def _hub_unreachable(model: str) -> str | None:
    """Why the hub cannot give `model` now, or None if it can."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    import huggingface_hub

    try:
        huggingface_hub.model_info(model, timeout=HUB_TIMEOUT_S)
    except huggingface_hub.errors.RepositoryNotFoundError:
        return "the hub has no such model"
    except Exception as err:  # no network, a proxy, a gated repo: the hub cannot serve it here
        return f"the hub is unreachable: {type(err).__name__}"
    return None


def stage_speakers(stage: StagePlan, path: str) -> tuple[str, ...] | None:
    """The speakers of the stage's checkpoint at `path`, as its model family reads them
    (None: the family has no reader, or the checkpoint is not local)."""
    reader = stage.family.speakers if stage.family is not None else ""
    if not reader or not Path(path).is_dir():
        return None
    return import_function(reader)(path)


def plan_voices(plan: Plan, paths: dict[str, str]) -> tuple[Voice, ...]:
    """The pipeline parameters (`speaker=$p`) and inputs (into a `voice` port) whose values
    name a speaker of the model they reach."""
    voices = []
    for stage in plan.stages:
        speakers = stage_speakers(stage, paths[stage.model]) if stage.model else None
        if not speakers:
            continue
        speaker = stage.params.get("speaker")
        if isinstance(speaker, Param):
            voices.append(Voice(speaker.name, False, speakers))
        inputs = {i.name for i in plan.inputs}
        voices += [
            Voice(c.src, True, speakers)
            for c in plan.channels
            if c.dst == stage.name and c.dst_port == "voice" and c.src in inputs
        ]
    return tuple(dict.fromkeys(voices))


def family_checks(plan: Plan, paths: dict[str, str]) -> tuple[FamilyCheck, ...]:
    """Each stage's family's checks of a request against its local checkpoint
    (`Family.admission`), where it has some. A port fed by an encoder stage that one
    pipeline input feeds is checked as that input's value, what the encoder encodes (a
    voice clone's reference audio)."""
    inputs = {i.name for i in plan.inputs}
    encoded = {}  # encoder stage -> the one pipeline input it encodes
    for stage in plan.stages:
        sources = {c.src for c in plan.channels if c.dst == stage.name}
        if stage.kind == "encoder" and len(sources) == 1 and sources <= inputs:
            encoded[stage.name] = next(iter(sources))
    checks = []
    for stage in plan.stages:
        reader = stage.family.admission if stage.family is not None else ""
        path = paths.get(stage.model or "")
        if not reader or path is None or not Path(path).is_dir():
            continue
        checker = import_function(reader)(stage, path)
        if checker is None:
            continue
        feeds = {
            c.dst_port: encoded.get(c.src, c.src)
            for c in plan.channels
            if c.dst == stage.name and (c.src in inputs or c.src in encoded)
        }
        checks.append(FamilyCheck(stage, feeds, checker))
    return tuple(checks)
