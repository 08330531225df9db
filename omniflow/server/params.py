"""Request fields -> a pipeline's parameters, never dropping one silently.

A field reaches the pipeline when the pipeline declares a parameter for it: under the
field's own name (`speaker`, `max_audio_tokens`, `steps`), or through the stage parameter
the field means (`max_completion_tokens` and `max_new_tokens` mean an `ar` stage's
`max_tokens`, `num_inference_steps` a diffusion stage's `steps`, `num_frames` its
`frames`) when exactly one pipeline parameter feeds that stage parameter. A diffusion
stage's guidance knobs are its model's own (Qwen-Image's `true_cfg_scale`, Wan's
`guidance_scale` and `guidance_scale_2`), so those fields reach the parameters of their
own names. A boolean parameter takes the strings "True" and "False" too (the peer's
clients send them). A field the
pipeline has no parameter for is accepted only at its no-op value (`top_p=1`, `n=1`,
`true_cfg_scale=1` ...), where leaving it out changes nothing; any other value is a 400
that names the field and lists what the pipeline takes.

`sampling_params_list` (the peer's per-stage sampling dicts) maps entry i to the
pipeline's stage i (or one entry to every stage), each key through the stage parameter of
that name to the pipeline parameter that feeds it; `seed` is the request's one seed.
"""

from __future__ import annotations

import json
import math

from omniflow.ir.kinds import SEED_PARAM
from omniflow.ir.values import Param, StageSeed
from omniflow.server.errors import bad_request

# Request fields that mean a stage parameter of another name.
STAGE_PARAM_OF = {
    "max_completion_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",
    "num_inference_steps": "steps",
    "num_frames": "frames",
}
# Fields whose value, when the pipeline has no parameter for them, changes nothing.
NO_OP = {
    "top_p": (1,),
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "true_cfg_scale": (1,),
    "vae_use_slicing": (False,),
    "vae_use_tiling": (False,),
    "speed": (1,),
    "negative_prompt": ("",),
    "lora": ({},),
    "mm_processor_kwargs": ({}, {"use_audio_in_video": False}),
    "num_outputs_per_prompt": (1,),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "stream": (False,),
}
# Fields that only describe the request for bookkeeping; they change no output.
METADATA = ("user", "metadata")


def is_no_op(field: str, value) -> bool:
    """`value` is what leaving `field` out means (True and 1 are not the same here)."""
    if value is None:
        return True
    for neutral in NO_OP.get(field, ()):
        if isinstance(neutral, bool) or isinstance(value, bool):
            if value is neutral:
                return True
        elif value == neutral:
            return True
    return False


class Params:
    """The pipeline parameters one request sets, and which field set each."""

    def __init__(self, served):
        self.served = served
        self.plan = served.plan
        self.values: dict = {}
        self.source: dict[str, str] = {}
        # Pipeline inputs filled from a request field of another name (speech's `input`).
        self.input_fields: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return list(self.plan.limits)

    def target(self, field: str) -> str | None:
        """The pipeline parameter `field` sets, if the pipeline has one."""
        key = STAGE_PARAM_OF.get(field, field)
        for name in (field, key):
            if name in self.plan.limits:
                return name
        feeds = {
            value.name
            for stage in self.plan.stages
            for name, value in stage.params.items()
            if name == key and isinstance(value, Param)
        }
        return feeds.pop() if len(feeds) == 1 else None

    def set(self, param: str, value, field: str) -> None:
        if param in self.values and self.values[param] != value:
            raise bad_request(
                f"'{field}' and '{self.source[param]}' both set parameter '{param}', to "
                f"{value!r} and {self.values[param]!r}; give one",
                param=field,
            )
        self.values[param] = value
        self.source[param] = field

    def take(self, field: str, value, where: str | None = None) -> bool:
        """Apply one request field; False if the pipeline has no parameter for it and the
        value is not a no-op (the caller reports it, with the other unknown fields)."""
        where = where or field
        if value is None:
            return True
        param = self.target(field)
        if param is not None:
            if isinstance(self.plan.params.get(param), bool) and isinstance(value, str):
                value = parse_form_value(where, value, bool)
            self.set(param, value, where)
            return True
        return field in METADATA or is_no_op(field, value)

    def take_all(self, fields: dict, prefix: str = "") -> None:
        unknown = [f for f, v in fields.items() if not self.take(f, v, prefix + f)]
        if unknown:
            raise self.unknown(unknown, prefix)

    def unknown(self, fields: list[str], prefix: str = ""):
        names = ", ".join(f"'{prefix}{f}'" for f in fields)
        return bad_request(
            f"unknown field{'s' if len(fields) > 1 else ''} {names} for pipeline "
            f"'{self.served.name}': it has no parameter of that name (its parameters: "
            f"{', '.join(self.names)})",
            param=prefix + fields[0],
            code="unknown_field",
        )

    def sampling_params_list(self, entries) -> None:
        """The peer's per-stage sampling dicts: one per generating stage, in the plan's
        stage order, or one for every stage (a bare dict counts as one). Encoder stages
        have no entry: the peer runs a model's encoders inside the stage they feed, so its
        clients send one entry per stage that generates."""
        if isinstance(entries, dict):
            entries = [entries]
        stages = [s for s in self.plan.stages if s.kind != "encoder"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise bad_request(
                "'sampling_params_list' must be a list of objects", param="sampling_params_list"
            )
        if len(entries) not in (1, len(stages)):
            raise bad_request(
                f"'sampling_params_list' has {len(entries)} entries; pipeline "
                f"'{self.served.name}' has {len(stages)} stages "
                f"({', '.join(s.name for s in stages)}): give one entry per stage, or one for all",
                param="sampling_params_list",
            )
        for i, entry in enumerate(entries):
            mine = stages if len(entries) == 1 else [stages[i]]
            for key, value in entry.items():
                where = f"sampling_params_list[{i}].{key}"
                if value is None or (key == SEED_PARAM and value == -1):  # -1: "not sent"
                    continue
                params = {self._stage_target(stage, key) for stage in mine} - {None}
                stage_key = any(
                    STAGE_PARAM_OF.get(key, key) in s.params for s in stages if s not in mine
                )
                if not params and (
                    key == SEED_PARAM or (key in self.plan.limits and not stage_key)
                ):
                    params = {key}  # the request's one seed, or a parameter by its own name
                if not params and not is_no_op(key, value):
                    takes = sorted(
                        {k for s in mine for k, v in s.params.items() if _per_request(v)}
                    )
                    names = ", ".join(s.name for s in mine)
                    raise bad_request(
                        f"{where}: stage{'s' if len(mine) > 1 else ''} {names} "
                        f"take{'' if len(mine) > 1 else 's'} no '{key}' a request can set "
                        f"(per request: {', '.join(takes) or 'nothing'}; pipeline parameters: "
                        f"{', '.join(self.names)})",
                        param=where,
                        code="unknown_field",
                    )
                for param in params:
                    self.set(param, value, where)

    @staticmethod
    def _stage_target(stage, key: str) -> str | None:
        value = stage.params.get(STAGE_PARAM_OF.get(key, key))
        return value.name if isinstance(value, Param) else None

    def result(self) -> dict:
        """What `engine.admit` gets: the server's defaults (`--param`), then the request's."""
        return {**self.served.defaults, **self.values}


def _per_request(value) -> bool:
    return isinstance(value, (Param, StageSeed))


# --- multipart values: everything arrives as a string --------------------------------------
def parse_form_value(field: str, text: str, like):
    """A multipart field's string as the type of `like` (a default or a type): `"True"`,
    `"false"` and `"1"` as booleans, `"50"` as an int, `"7.5"` as a float, JSON for
    objects; a 400 naming the field when it does not parse."""
    kind = like if isinstance(like, type) else type(like)
    stripped = text.strip()
    try:
        if kind is bool:
            lowered = stripped.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(stripped)
        if kind is float:
            value = float(stripped)
            if not math.isfinite(value):
                raise ValueError
            return value
        if kind in (dict, list):
            value = json.loads(stripped)
            if not isinstance(value, kind):
                raise ValueError
            return value
    except (ValueError, RecursionError):  # (JSON nested past what the parser recurses)
        what = {bool: "a boolean (True or False)", int: "an integer", float: "a number"}.get(
            kind, f"a JSON {kind.__name__}"
        )
        raise bad_request(f"'{field}' must be {what}, not {text!r}", param=field) from None
    return text
