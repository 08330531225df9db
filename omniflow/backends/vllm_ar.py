"""The vLLM backend of `ar` stages: `VllmAR`, a vLLM engine in this process, stepped by the
runtime — each `step()` is one step of vLLM's engine, and what that step decoded streams out
of the stage at once.

What it owns:

- Starting the engine: `vllm.LLMEngine` with an in-process engine core (`InprocClient`), so
  `LLMEngine.step()` schedules and runs exactly one batched forward and returns its outputs;
  vLLM's own continuous batching, paged KV cache and sampling do the rest. The model is
  `model_path(plan.model)`; the context length is the stage's `max_len` (capped at the
  model's), the batch is `max_batch`, and the KV cache is the bytes the plan budgeted for it
  (`VLLM_CPU_KVCACHE_SPACE` still overrides it on CPU, as in vLLM). On CPU the engine runs
  eagerly: compiling would cost minutes of start-up for little gain.
- What vLLM can and cannot do here: a `prompt` (a chat through the tokenizer's chat template,
  a text, or token ids) in, `tokens` and `text` out. A plan that wires `hidden`, `codes` or
  `kv` outputs, or any other input, fails at construction: those need the transformers
  backend.
- Requests: per-request `SamplingParams` from the call's parameters (temperature, top_p,
  top_k, max_tokens, seed, repetition_penalty, stop strings and stop token ids; the model's
  generation defaults, then the `ar` kind's, fill the rest), streamed as deltas. Every step
  emits what vLLM decoded for the call since its last step: `tokens` `[n, 1]` int64 and the
  new `text` (vLLM's detokenizer holds back partial characters and possible stop strings).
  vLLM saying finished finishes the call; `drop` aborts a request vLLM still runs.
- Lifetime: engines in one process share vLLM's torch.distributed state, which shutting any
  of them down tears down; so shutdown waits until every engine of the process is closed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from dataclasses import dataclass, field

import torch

from omniflow.backends.sampling_params import SAMPLING_KEYS, Sampling, kind_defaults
from omniflow.catalog.resolve import model_path
from omniflow.errors import OmniflowError
from omniflow.ir.kinds import KINDS
from omniflow.runtime.stage import Backend, Call, StageSpec

# Where a request's vLLM state lives in `call.state`.
_STATE = "vllm"
_OUTPUTS = frozenset({"tokens", "text"})
_PROMPT_TYPES = ("chat", "text", "tokens")
# The KV cache when the plan has no estimate for it.
_DEFAULT_KV_BYTES = 1 << 30


class VllmBackendError(OmniflowError):
    """An `ar` stage cannot run on vLLM, or a request cannot run on it."""


@dataclass(eq=False)
class _Request:
    """One request in vLLM: what it decoded that the call has not emitted yet."""

    rid: str
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: bool = False  # vLLM finished it


class VllmAR(Backend):
    """An `ar` stage on vLLM's engine, one engine step per `step()`."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        _check_ports(spec)
        self.engine = _start_engine(spec, device)
        self._release = weakref.finalize(self, _engine_done, self.engine)
        self.tokenizer = self.engine.get_tokenizer()
        self.defaults = _sampling_defaults(self.engine.model_config)
        self.running: dict[str, _Request] = {}  # vLLM request id -> request, until finished
        self._ids = itertools.count()

    # --- the contract -------------------------------------------------------------------------
    def ready(self, call: Call) -> bool:
        if call.error is not None:
            return False
        req = call.state.get(_STATE)
        if req is None:
            return call.inputs["prompt"].ended
        return bool(req.tokens or req.text) or not req.done

    def step(self, calls: list[Call]) -> None:
        for call in calls:
            if call.error is None and _STATE not in call.state and call.inputs["prompt"].ended:
                self._add(call)
        # Requests the runtime left out of this batch advance too (vLLM batches every running
        # request); what they decode waits in their state until they are stepped.
        if self.running:
            for out in self.engine.step():
                req = self.running.get(out.request_id)
                if req is None:
                    continue
                completion = out.outputs[0]
                req.tokens += completion.token_ids
                if completion.text:
                    req.text.append(completion.text)
                if out.finished:
                    req.done = True
                    del self.running[req.rid]
        for call in calls:
            req = call.state.get(_STATE)
            if req is not None and call.error is None:
                self._emit(call, req)

    def drop(self, call: Call) -> None:
        req = call.state.pop(_STATE, None)
        if req is not None and self.running.pop(req.rid, None) is not None:
            self.engine.abort_request([req.rid])

    def close(self) -> None:
        if self.running:
            self.engine.abort_request(list(self.running))
            self.running.clear()
        self._release()

    # --- requests -------------------------------------------------------------------------------
    def _add(self, call: Call) -> None:
        from vllm.exceptions import VLLMClientError

        rid = f"{call.request_id}-{next(self._ids)}"
        stream = call.inputs["prompt"]
        try:
            params = self._sampling(call.params or {})
            prompt = self._prompt(stream.take(), stream.type)
            self.engine.add_request(rid, prompt, params)
        except (OmniflowError, VLLMClientError, ValueError, TypeError) as err:
            call.fail(err if isinstance(err, OmniflowError) else VllmBackendError(str(err)))
            return
        req = _Request(rid)
        call.state[_STATE] = req
        self.running[rid] = req

    def _sampling(self, params: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = Sampling.of(params, self.defaults, VllmBackendError)
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=list(sampling.stop_strings),
            stop_token_ids=sorted(sampling.stop_ids),
            # Without a text output the detokenizer only matters for stop strings.
            detokenize="text" in self.spec.outputs or bool(sampling.stop_strings),
            output_kind=RequestOutputKind.DELTA,
        )

    def _prompt(self, value, port_type: str) -> dict:
        """vLLM's prompt for a chat (through the chat template, as vLLM's chat API renders
        it), a text (tokenized by vLLM) or token ids."""
        if port_type == "text":
            return {"prompt": value}
        if port_type == "tokens":
            return {"prompt_token_ids": [int(i) for i in torch.as_tensor(value).reshape(-1)]}
        for message in value:
            content = message.get("content")
            if isinstance(content, list) and any(p.get("type") != "text" for p in content):
                kinds = sorted({str(p.get("type")) for p in content} - {"text"})
                raise VllmBackendError(
                    f"this stage takes text-only chats; a message has {', '.join(kinds)} parts"
                )
        text = self.tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens itself.
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def _emit(self, call: Call, req: _Request) -> None:
        if req.tokens and "tokens" in self.spec.outputs:
            call.emit("tokens", torch.tensor(req.tokens, dtype=torch.int64)[:, None])
        text = "".join(req.text)
        if text and "text" in self.spec.outputs:
            call.emit("text", text)
        req.tokens, req.text = [], []
        if req.done:
            call.finish()


# --- the engine -----------------------------------------------------------------------------------


def _check_ports(spec: StageSpec) -> None:
    name = spec.plan.name
    extra = sorted(set(spec.outputs) - _OUTPUTS)
    if extra:
        raise VllmBackendError(
            f"stage '{name}': the vLLM backend produces tokens and text only, and the plan wires "
            f'{", ".join(extra)}; use backend="transformers" for those outputs'
        )
    inputs = dict(spec.inputs)
    if inputs.pop("prompt", None) not in _PROMPT_TYPES or inputs:
        raise VllmBackendError(
            f"stage '{name}': the vLLM backend takes one input, prompt ({' | '.join(_PROMPT_TYPES)}), "
            f'and the plan gives {dict(spec.inputs)}; use backend="transformers" for other inputs'
        )


def _start_engine(spec: StageSpec, device: str):
    """vLLM's engine for the stage, its core in this process."""
    from vllm import EngineArgs, LLMEngine
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    plan = spec.plan
    kind, _, index = device.partition(":")
    if kind != current_platform.device_type or index not in ("", "0"):
        raise VllmBackendError(
            f"stage '{plan.name}' is placed on {device}, and this vLLM runs in-process on "
            f"{current_platform.device_type}{':0' if current_platform.device_type == 'cuda' else ''}"
            ' (make the stage\'s device the first visible one, or use backend="transformers")'
        )
    path = model_path(plan.model)
    on_cpu = kind == "cpu"
    args = EngineArgs(
        model=path,
        dtype=plan.settings.get("dtype", "auto"),
        max_model_len=_max_len(plan, path),
        max_num_seqs=max(1, plan.batch),
        kv_cache_memory_bytes=plan.kv_cache_bytes or _DEFAULT_KV_BYTES,
        enforce_eager=on_cpu,
        disable_log_stats=True,
    )
    # The engine core runs here (multiprocess_mode=False), stepped by LLMEngine.step(). vLLM's
    # CPU platform would still move the model into a worker process unless the environment
    # says multiprocessing is off while it builds the config.
    with _environ(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        try:
            config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
            _check_head_size(plan, config.model_config, on_cpu)
            engine = LLMEngine(
                vllm_config=config,
                executor_class=Executor.get_class(config),
                log_stats=False,
                multiprocess_mode=False,
            )
        except (ValueError, TypeError, OSError) as err:  # a bad model or too little memory
            raise VllmBackendError(
                f"stage '{plan.name}': vLLM cannot run {plan.model}: {err}"
            ) from err
    _open_engines.add(id(engine))
    return engine


def _max_len(plan, path: str) -> int:
    """The stage's `max_len`, or the kind's default capped at the model's context length."""
    if "max_len" in plan.settings:
        return int(plan.settings["max_len"])
    from transformers import AutoConfig

    default = KINDS["ar"].params["max_len"].default
    limit = getattr(
        AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None
    )
    return min(default, limit) if limit else default


def _check_head_size(plan, model_config, on_cpu: bool) -> None:
    """vLLM's CPU attention kernels exist for some head sizes only, and a model with another
    fails at its first forward; say so at construction instead."""
    if not on_cpu:
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size = model_config.get_head_size()
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise VllmBackendError(
            f"stage '{plan.name}': {plan.model} has attention heads of {head_size} dims, and "
            f"vLLM's CPU attention supports {', '.join(map(str, supported))}; "
            'use backend="transformers"'
        )


def _sampling_defaults(model_config) -> dict:
    """The `ar` kind's sampling defaults, overridden by the model's generation config as vLLM
    reads it; `do_sample: false` there means greedy, as transformers' `generate` has it."""
    defaults = kind_defaults()
    defaults.update(
        (k, v) for k, v in model_config.get_diff_sampling_param().items() if k in SAMPLING_KEYS
    )
    if model_config.try_get_generation_config().get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Engines of this process that are not closed, and closed ones waiting for them.
_open_engines: set[int] = set()
_closed_engines: list = []


def _engine_done(engine) -> None:
    """An engine's stage is closed (or garbage): shut it down with the process's last one."""
    _open_engines.discard(id(engine))
    _closed_engines.append(engine)
    if not _open_engines:
        while _closed_engines:
            _closed_engines.pop().engine_core.shutdown()
