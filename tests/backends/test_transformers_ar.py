"""The transformers `ar` backend on tiny:qwen2, driven step by step: continuous batching
gives each request what it gets alone (and what transformers' `generate` gives), with one
decoder forward per decode step; seeded sampling is per request; max_tokens, EOS, stop
ids and stop strings end requests; streamed text never splits a character and adds up to
the decoded tokens. Every test of the `backend` fixture runs on both decode paths: the
dynamic cache ("eager", the CPU default) and the static cache ("static": the step that
CUDA graphs capture, run eagerly). On a GPU, graph replay gives what the eager static
step gives, and nothing is captured after load."""

import contextlib
import dataclasses
import itertools
import re
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omniflow.backends import static_decode, transformers_ar
from omniflow.backends.transformers_ar import (
    ARBackendError,
    TextStream,
    TransformersAR,
    prefill_groups,
)
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_source
from omniflow.hf_logging import quiet
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.loop import StageRunner
from omniflow.runtime.stage import Call, StageSpec
from tests.backends.ar_requests import (
    PROMPTS,
    check_bad_parameters_fail_only_their_request,
    join_and_cancel,
    request,
)
from tests.gpu_wiring import stage_spec
from tests.runtime.test_readback import land_late

torch.set_num_threads(1)

SOURCE = """
pipeline chat {
  model "tiny:qwen2"
  param max_tokens = 12
  param temperature = 0.0
  stage lm = ar(max_batch=4, max_tokens=$max_tokens, temperature=$temperature)
  input prompt: chat -> lm
  lm.text -> output text [stream]
  lm.tokens -> output tokens [stream]
  lm.hidden -> output hidden [stream]
}
"""
# Of PROMPTS (different lengths), greedy, the third ends with EOS after 4 tokens and the
# fourth after 10 (found by search), the others run to max_tokens.
EOS_AFTER = {2: 4, 3: 10}


@pytest.fixture(scope="module")
def plan():
    return compile_source(SOURCE, devices="cpu")


def with_decode(plan, decode: str, name: str = "lm", **settings):
    """The stage `name` of `plan` with its `decode` setting (and `settings`) replaced."""
    stage = plan.stage(name)
    return dataclasses.replace(stage, settings={**stage.settings, "decode": decode, **settings})


def make_backend(plan, decode: str, device: str = "cpu", **settings) -> TransformersAR:
    return TransformersAR(stage_spec(plan, "lm", decode=decode, **settings), device)


@pytest.fixture(scope="module", params=["eager", "static"])
def backend(plan, request):
    return make_backend(plan, request.param)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny("qwen2"))


class Outputs:
    """What one request emitted, and its text after each step."""

    def __init__(self):
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.hidden: list[torch.Tensor] = []
        self.text_by_step: list[tuple[int, str]] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def wait_for_device(backend) -> None:
    """Where `backend` has device work in flight on a GPU, wait for it: a test's steps then
    count turns that make progress, as on the CPU, where a step's tokens land at once (a
    turn that found the last step's tokens still on their way would move the steps a
    request joins, is held or is dropped at)."""
    if backend.in_flight() and backend.device.startswith("cuda"):
        torch.cuda.synchronize()


def run(
    backend,
    calls: list[Call],
    joins: list[int] | None = None,
    held: dict[int, set[int]] | None = None,
    cancel: dict[int, int] | None = None,
) -> list[Outputs]:
    """Step the backend until every call has finished: call i is first offered at step
    joins[i], is left out of the steps in held[i] (as a runner with more ready requests
    than max_batch leaves some out), and is dropped before step cancel[i]. Checks that no
    request is left behind in the batched cache."""
    joins = joins or [0] * len(calls)
    held, cancel = held or {}, cancel or {}
    outs = {c.request_id: Outputs() for c in calls}
    live: list[Call] = []
    for step in itertools.count():
        join_and_cancel(backend, calls, live, step, joins, cancel)
        wait_for_device(backend)
        offered = [c for c in live if step not in held.get(calls.index(c), ())]
        ready = [c for c in offered if backend.ready(c)]
        if not live and step > max(joins):
            break
        backend.step(ready)
        for call in ready:
            out = outs[call.request_id]
            for port, value in call.emitted:
                if port == "tokens":
                    out.tokens.append(int(value))
                elif port == "text":
                    out.pieces.append(value)
                else:
                    out.hidden.append(value)
            call.emitted.clear()
            out.text_by_step.append((len(out.tokens), out.text))
            if call.finished or call.error is not None:
                backend.drop(call)
                live.remove(call)
    assert backend.rows == [] and backend.cache is None
    return [outs[c.request_id] for c in calls]


def alone(backend, prompt: str, **params) -> Outputs:
    return run(backend, [request(prompt, **params)])[0]


def test_greedy_matches_transformers_generate(backend, tokenizer):
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(build_tiny("qwen2")).eval()
    for prompt in PROMPTS[:3]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, return_tensors="pt").input_ids
        want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        got = alone(backend, prompt)
        assert got.tokens == want.tolist()
        assert got.text == tokenizer.decode(want, skip_special_tokens=True)


def test_continuous_batching_matches_each_request_alone(backend):
    singles = [alone(backend, p) for p in PROMPTS]
    batched = run(backend, [request(p) for p in PROMPTS], joins=[0, 0, 2, 5])
    for i, (one, many) in enumerate(zip(singles, batched, strict=True)):
        assert many.tokens == one.tokens
        assert many.text == one.text
        assert len(many.hidden) == len(many.tokens)
        for a, b in zip(many.hidden, one.hidden, strict=True):
            assert a.shape == (1, 1, 64) and a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert len(one.tokens) == EOS_AFTER.get(i, 12)


def test_rows_left_out_of_a_step_and_dropped_rows_change_nothing(backend):
    singles = [alone(backend, p) for p in PROMPTS]
    # Request 0 sits out steps 3, 4 and 7 and request 3 steps 6 to 8 (their rows idle in
    # the others' forwards); request 1 is cancelled before step 4.
    batched = run(
        backend,
        [request(p) for p in PROMPTS],
        joins=[0, 0, 1, 2],
        held={0: {3, 4, 7}, 3: {6, 7, 8}},
        cancel={1: 4},
    )
    for i in (0, 2, 3):
        assert batched[i].tokens == singles[i].tokens
    # Four tokens, the prefill's and steps 0 to 2's; three on the static path, where a step's
    # tokens are emitted while the next step runs, so the step in flight when the request is
    # dropped emits nothing.
    emitted = 4 if backend.static is None else 3
    assert batched[1].tokens == singles[1].tokens[:emitted]


def test_a_step_whose_tokens_have_not_landed_stays_in_flight_and_the_loop_polls_it(
    plan, monkeypatch
):
    """The static path never waits for the device: a step whose read-back has not landed
    (held back here, as a busy GPU would) leaves its tokens for a later turn, a second step
    is launched meanwhile, a third waits for room; the runner keeps polling the stage
    while anything is in flight; once the read-backs land the tokens come out in order,
    the same as a run that never waited."""
    backend = make_backend(plan, "static")
    want = alone(backend, PROMPTS[0], max_tokens=6).tokens
    late: set[int] = set()  # the launched steps whose read-back has not landed
    busy = [True]  # whether the "device" holds back the read-backs of new launches
    landed = static_decode.Launched.landed
    monkeypatch.setattr(
        static_decode.Launched, "landed", lambda self: id(self) not in late and landed(self)
    )
    launch = backend.static.launch

    def slow_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        if busy[0]:
            late.add(id(launched))
        return launched

    monkeypatch.setattr(backend.static, "launch", slow_launch)
    runner = StageRunner(backend.spec, backend, max_batch=4)
    runner.start("r", {"max_tokens": 6, "temperature": 0.0})
    runner.feed("r", "prompt", [{"role": "user", "content": PROMPTS[0]}], True)

    def tokens(events) -> list[int]:
        return [int(e.value) for e in events if e.port == "tokens"]

    assert tokens(runner.step()) == want[:1]  # the prefill's token (`first`'s: landed)
    assert tokens(runner.step()) == [] and len(backend.launches) == 1
    assert tokens(runner.step()) == [] and len(backend.launches) == 2  # the next one, at once
    assert not backend.ready(runner.calls["r"])  # no room, nothing landed: nothing to do
    assert runner.step() == [] and runner.maybe_ready  # ... but the loop keeps polling
    busy[0] = False
    late.clear()  # the device catches up
    got = want[:1]
    for _ in range(20):  # (a bound: a broken stage would spin forever)
        got += tokens(runner.step())
        if "r" not in runner.calls:
            break
    assert got == want and not backend.launches and not runner.maybe_ready


def test_first_tokens_that_have_not_landed_leave_the_loop_polling_and_come_out_first(
    plan, monkeypatch
):
    """A prefill's first tokens (`StaticDecoder.first`) are read back as a step's are,
    never waited for: while they have not landed the stage emits nothing, the runner keeps
    polling, the request's first step is launched meanwhile, and a second request's prefill
    queues its own; once they land each request's tokens come out in order, the same as
    runs that never waited."""
    backend = make_backend(plan, "static")
    want = [alone(backend, PROMPTS[i], max_tokens=5).tokens for i in (0, 1)]
    late: set[int] = set()  # the first tokens whose read-back has not landed
    landed = static_decode.Launched.landed
    monkeypatch.setattr(
        static_decode.Launched, "landed", lambda self: id(self) not in late and landed(self)
    )
    first = backend.static.first

    def slow_first(*args):
        launched = first(*args)
        late.add(id(launched))
        return launched

    monkeypatch.setattr(backend.static, "first", slow_first)
    runner = StageRunner(backend.spec, backend, max_batch=4)
    got: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for event in runner.step():
            if event.port == "tokens":
                got[event.request_id].append(int(event.value))

    for request_id, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        runner.start(request_id, {"max_tokens": 5, "temperature": 0.0})
        runner.feed(request_id, "prompt", [{"role": "user", "content": prompt}], True)
        step()  # a: its prefill (its first tokens queued); b: its prefill, and a's first step
        assert got == {"a": [], "b": []} and runner.maybe_ready and backend.in_flight()
    assert len(backend.firsts) == 2 and len(backend.launches) == 1
    late.clear()  # the device catches up
    for _ in range(20):  # (a bound: a broken stage would spin forever)
        step()
        if not runner.calls:
            break
    assert [got["a"], got["b"]] == want
    assert not backend.firsts and not backend.launches and not runner.maybe_ready


def test_a_step_launched_past_a_requests_end_keeps_no_loop_polling(plan):
    """A request that ends on an end id leaves the step launched while its end was not yet
    known in flight; with no live row in it, the runner stops polling the stage (an idle
    executor sleeps), and the next request settles it and decodes as it would alone."""
    backend = make_backend(plan, "static")
    want = alone(backend, PROMPTS[3]).tokens
    runner = StageRunner(backend.spec, backend, max_batch=4)
    for request_id, prompt in (("ends", PROMPTS[2]), ("next", PROMPTS[3])):
        runner.start(request_id, {"max_tokens": 12, "temperature": 0.0})
        runner.feed(request_id, "prompt", [{"role": "user", "content": prompt}], True)
        got = []
        for _ in range(30):
            got += [int(e.value) for e in runner.step() if e.port == "tokens"]
            if request_id not in runner.calls:
                break
        assert len(got) == (EOS_AFTER[2] if request_id == "ends" else len(want))
        assert not runner.maybe_ready and not backend.in_flight()
        if request_id == "ends":
            assert backend.launches  # the step launched past its end, not settled
    assert got == want


@pytest.mark.gpu
def test_on_the_gpu_a_step_returns_while_the_device_is_busy(plan):
    """A static step on a GPU that is busy for a good while (a spin kernel queued on the
    stage's stream first) returns long before the spin ends: the tokens stay in flight,
    and another stage's work on its own stream runs and finishes meanwhile. Compared
    against the spin's own time, measured on the same stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    backend = make_backend(plan, "static", "cuda:0")
    call = request(PROMPTS[0], max_tokens=8)
    backend.step([call])  # the prefill and first token
    # One decode step first, run to its end: a kernel's first launch in a process loads its
    # module, which may wait for the device (CUDA's lazy loading); the steps after it
    # launch kernels already loaded, as every step of a stage captured at load does.
    backend.step([call])
    # The other stage's work below, once, for the same reason.
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.ones(1024, device="cuda:0").sum()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        began = time.perf_counter()
        torch.cuda._sleep(200_000_000)  # about 0.1 s on a recent GPU
        stream.synchronize()
        spin = time.perf_counter() - began
        torch.cuda._sleep(200_000_000)
        began = time.perf_counter()
        backend.step([call])
        returned = time.perf_counter() - began
        assert backend.in_flight() and returned < spin / 2
    # Another stage's work on its own stream runs meanwhile, and is done long before.
    with torch.cuda.stream(other):
        torch.ones(1024, device="cuda:0").sum()
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert not backend.launches[0].launched.landed()
    stream.synchronize()
    assert backend.ready(call)


def test_when_rows_contend_the_stream_whose_listener_runs_dry_first_steps_first(plan):
    """An `ar` stage whose steps become audio (each token 10 s of it here, as a talker's
    frame is 80 ms) orders what it steps by playback slack: a runner that can step one
    request a turn steps the one that arrived later but has sent less audio (its listener
    runs dry sooner) before the one that arrived first; a request waiting to start goes
    before both. Without a duration a step, arrival order."""
    lm = plan.stage("lm")
    spec = StageSpec.from_channels(lm, plan.channels)
    assert spec.plays == {}  # text: no step plays for a known time
    backend = TransformersAR(dataclasses.replace(spec, plays={"tokens": 10.0}), "cpu")
    runner = StageRunner(backend.spec, backend, max_batch=1)

    def arrive(request_id: str) -> None:
        runner.start(request_id, {"max_tokens": 12, "temperature": 0.0})
        runner.feed(request_id, "prompt", [{"role": "user", "content": PROMPTS[0]}], True)

    def stepped() -> list[str]:
        return sorted({e.request_id for e in runner.step()})

    arrive("first")
    assert [stepped() for _ in range(3)] == [["first"]] * 3  # three tokens: 30 s of audio
    arrive("later")
    assert list(runner.calls) == ["first", "later"]  # arrival order would step "first"
    assert stepped() == ["later"]  # the prefill's token: 10 s, it runs dry 20 s sooner
    assert stepped() == ["later"]  # still sooner: 10 s sent against 30 s
    arrive("new")
    urgent = backend.urgent_first(list(runner.calls.values()))
    assert [c.request_id for c in urgent] == ["new", "later", "first"]
    plain = make_backend(plan, "eager")  # no duration a step: arrival order
    calls = list(runner.calls.values())
    assert plain.urgent_first(calls) == calls
    runner.drop_all()


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_while_a_first_packet_is_on_the_device_streams_that_can_wait_launch_nothing(
    plan, decode, monkeypatch
):
    """Steps that play (10 s a token here): while some stage of the program has a first
    packet on the device (`first_packets_first`, the loop's), a row whose listener has
    audio left launches no step and is not ready, and a request waiting to start still
    starts; once the first packet is out, both go on. On the static path the stage's own
    first tokens in flight (three polls late, injected) are such a first packet, and the
    row they belong to waits for them to land before its next step."""
    spec = StageSpec.from_channels(with_decode(plan, decode), plan.channels)
    backend = TransformersAR(dataclasses.replace(spec, plays={"tokens": 10.0}), "cpu")
    runner = StageRunner(backend.spec, backend, max_batch=4)

    def arrive(request_id: str):
        runner.start(request_id, {"max_tokens": 12, "temperature": 0.0})
        runner.feed(request_id, "prompt", [{"role": "user", "content": PROMPTS[0]}], True)
        return runner.calls[request_id]

    def launched(call) -> int:
        return call.state[transformers_ar._STATE].next_step

    first = arrive("first")
    for _ in range(3):
        runner.step()
    assert launched(first) == 3 and not backend.first_packet_in_flight()
    backend.first_packets_first = True
    runner.step()
    assert launched(first) == 3 and not backend.ready(first)
    new = arrive("new")
    runner.step()  # it starts: its first token leaves, and it can wait too
    assert launched(first) == 3 and launched(new) == 1 and not backend.ready(new)
    backend.first_packets_first = False
    runner.step()
    assert launched(first) == 4 and launched(new) == 2
    runner.drop_all()
    if decode == "eager":
        return
    land_late(monkeypatch, static_decode.Launched)
    late = arrive("late")
    runner.step()  # the prefill: its first token on its way
    assert backend.first_packet_in_flight()
    backend.first_packets_first = True  # (as the loop sets it)
    assert not backend.ready(late)  # its next step waits for the first to land
    for _ in range(5):
        if not backend.first_packet_in_flight():
            break
        runner.step()
    assert not backend.first_packet_in_flight() and launched(late) == 1
    runner.drop_all()


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_the_rows_of_a_request_whose_makers_are_held_launch_nothing_while_others_step(plan, decode):
    """A request whose window a later stage has on the device and holds its makers for
    (`held_requests`, the loop's: slack.py) launches no step and is not ready where no
    other row steps, in a stage whose steps play for no known time too (a thinker); where
    another row steps, the held one steps with it (the step costs no more); once let go,
    it goes on."""
    spec = StageSpec.from_channels(with_decode(plan, decode), plan.channels)
    backend = TransformersAR(spec, "cpu")
    runner = StageRunner(backend.spec, backend, max_batch=4)
    for request_id in ("held", "other"):
        runner.start(request_id, {"max_tokens": 12, "temperature": 0.0})
        runner.feed(request_id, "prompt", [{"role": "user", "content": PROMPTS[0]}], True)
    held, other = runner.calls["held"], runner.calls["other"]

    def launched(call) -> int:
        return call.state[transformers_ar._STATE].next_step

    for _ in range(2):
        runner.step()
    assert launched(held) == launched(other) == 2
    backend.held_requests = frozenset({"held"})
    runner.step()
    assert launched(held) == launched(other) == 3  # "other" steps: "held" goes along
    backend.held_requests = frozenset({"held", "other"})
    for _ in range(2):
        runner.step()
    assert launched(held) == launched(other) == 3 and not backend.ready(held)
    backend.held_requests = frozenset({"other"})
    runner.step()
    assert launched(held) == launched(other) == 4
    runner.drop_all()


@contextlib.contextmanager
def forward_shapes(decoder):
    """The (rows, positions) of each decoder forward while the block runs."""
    shapes, forward = [], decoder.forward

    def counting(*args, **kwargs):
        shapes.append(tuple(kwargs["inputs_embeds"].shape[:2]))
        return forward(*args, **kwargs)

    decoder.forward = counting
    try:
        yield shapes
    finally:
        del decoder.forward


def test_one_decoder_forward_per_decode_step(backend):
    if backend.decode != "eager":
        pytest.skip("the static path's decode step is not the decoder's forward")
    batch = [request(PROMPTS[i], max_tokens=6) for i in (0, 1, 3)]
    with forward_shapes(backend.component.decoder) as calls:
        backend.step(batch)  # three prefills in one forward, padded to the longest prompt
        lengths = [s.length for s in backend.rows]
        assert len(set(lengths)) == 3 and calls == [(3, max(lengths))]
        for _ in range(5):
            calls.clear()
            backend.step([c for c in batch if not c.finished])
            assert calls == [(3, 1)]  # one forward, every request's next token
    assert all(c.finished for c in batch)
    for call in batch:
        backend.drop(call)
    assert backend.rows == []


def test_prefill_batches_new_requests_within_prefill_tokens(plan):
    """Within the budget, new requests share one prefill forward and give each request's
    own tokens; prefill_tokens=1 prefills each alone."""
    assert prefill_groups([5, 9, 3, 20, 4], budget=30) == [[0, 1, 2], [3], [4]]
    assert prefill_groups([40, 2], budget=30) == [[0], [1]]  # a longer prompt runs alone
    assert prefill_groups([5, 9, 3], budget=1) == [[0], [1], [2]]
    for budget in (1, 4096):
        backend = make_backend(plan, "eager", prefill_tokens=budget)
        with forward_shapes(backend.component.decoder) as calls:
            together = run(backend, [request(p) for p in PROMPTS])
        prefills = [rows for rows, positions in calls if positions > 1]
        assert prefills == ([1, 1, 1, 1] if budget == 1 else [4])
        assert [o.tokens for o in together] == [alone(backend, p).tokens for p in PROMPTS]


def test_the_static_path_runs_one_step_per_decode_step_on_compact_rows(plan):
    backend = make_backend(plan, "static")
    static = backend.static
    assert backend.cache is None and static.keys.shape == (2, 4, 2, 4224, 16)
    shapes = []
    run_step = static._run
    static._run = lambda batch, length: (shapes.append((batch, length)), run_step(batch, length))
    try:
        batch = [request(PROMPTS[i], max_tokens=6) for i in (0, 1, 3)]
        backend.step(batch)  # three prefilled together, their first tokens in one first step
        assert shapes == [] and [s.slot for s in backend.rows] == [0, 1, 2]
        assert static.first_steps == 1
        backend.step(batch[:2])  # the third row idles in the step
        assert shapes == [(4, 128)]  # every row, padded to the batch bucket
        backend.drop(batch[0])  # the last row moves into slot 0
        assert [s.call for s in backend.rows] == [batch[2], batch[1]]
        assert [s.slot for s in backend.rows] == [0, 1]
        # The step of batch[1] is still to be settled: its column is filled, not counted.
        assert [s.ahead for s in backend.rows] == [0, 1]
        assert static.length[:2].tolist() == [s.length + s.ahead for s in backend.rows]
        backend.step(batch[1:])
        assert shapes[-1] == (2, 128)
    finally:
        del static._run
    for call in batch:
        backend.drop(call)
    assert backend.rows == [] and static.length.tolist() == [0] * 4


def test_the_capture_plan_captures_each_steps_finish_once_per_batch_bucket(plan):
    """What "graphs" captures (`capture_plan`, read on the CPU without capturing): every
    (batch, length) bucket's LM step, warmed up only at its batch's largest length, one
    finish per batch bucket, every prefill (batch, width) bucket; and what a step dispatches
    (the graphs it would replay): its LM step at its buckets, then its batch's finish."""
    static = make_backend(plan, "static").static
    plan_ = static.capture_plan()
    batches, lengths = static.batch_buckets, static.length_buckets
    assert (batches, lengths) == ([1, 2, 4], [128, 256, 512, 1024, 2048, 4096, 4224])
    steps = [c for c in plan_ if c.kind == "step"]
    assert [c.key for c in steps] == [(b, t) for b in batches[::-1] for t in lengths[::-1]]
    assert [c.key for c in steps if c.warm_up] == [(b, lengths[-1]) for b in batches[::-1]]
    finishes = [c for c in plan_ if c.kind == "finish"]
    assert [c.key for c in finishes] == [(b,) for b in batches[::-1]]
    assert all(c.warm_up for c in plan_ if c.kind != "step")
    prefills = [c.key for c in plan_ if c.kind == "prefill"]
    assert sorted(prefills) == sorted(static.prefill_buckets)  # most positions first:
    assert [b * w for b, w in prefills] == sorted((b * w for b, w in prefills), reverse=True)
    # Largest first: each batch's steps, then its finish.
    kinds = [c.kind for c in plan_ if c.kind != "prefill"]
    assert kinds == (["step"] * len(lengths) + ["finish"]) * len(batches)
    work = static.capture_work()
    assert work.graphs == len(plan_) == len(prefills) + len(batches) * (len(lengths) + 1)
    assert work.warm_ups == len(prefills) + 2 * len(batches)
    # No frames here: the same positions captured, but each length warmed up no more.
    steps = len(batches) * len(lengths)
    assert (work.captured, work.whole_step_captured) == (len(prefills) + steps,) * 2
    assert work.warmed == len(prefills) + len(batches) < work.whole_step_warmed
    assert f"{work.graphs} graphs" in work.line()
    # Nothing is captured off CUDA; what a step dispatches is the same.
    backend = make_backend(plan, "static")
    static = backend.static
    assert static.captures == static.warm_ups == static.replays == 0
    calls = [request(PROMPTS[i], max_tokens=4) for i in (0, 1, 3)]
    backend.step(calls)  # prefilled together: one first step, at batch bucket 4
    assert static.dispatched == {("finish", (4,)): 1}
    backend.step(calls)
    assert list(static.dispatched.items()) == [(("finish", (4,)), 2), (("step", (4, 128)), 1)]
    for call in calls:
        backend.drop(call)
    static.dispatched.clear()
    alone(backend, PROMPTS[0], max_tokens=3)  # its first token, then two steps at batch 1
    assert static.dispatched == {("finish", (1,)): 3, ("step", (1, 128)): 2}


def test_the_static_path_crosses_length_buckets_as_the_dynamic_one_decodes(plan):
    """A prompt just short of the first length bucket: its decode crosses from 128 to 256
    columns and gives the dynamic path's tokens and hidden states."""
    prompt = " ".join(["short long what tell hello the what blue"] * 7)  # 121 positions
    eager = alone(make_backend(plan, "eager"), prompt, max_tokens=24)
    backend = make_backend(plan, "static")
    shapes = []
    run_step = backend.static._run
    backend.static._run = lambda b, t: (shapes.append(t), run_step(b, t))
    static = alone(backend, prompt, max_tokens=24)
    assert shapes == [128] * 7 + [256] * 16
    assert static.tokens == eager.tokens and len(eager.tokens) == 24
    for a, b in zip(static.hidden, eager.hidden, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def qwen3_lm() -> transformers_ar.CausalLM:
    """A random-weight Qwen3 LM of tiny:qwen2's dimensions and tokenizer (Qwen3's layers:
    per-head q/k RMSNorms before the rotary), as a plain causal LM component."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = build_tiny("qwen2")
    with quiet():
        qwen2 = AutoModelForCausalLM.from_pretrained(path)
    c = qwen2.config
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that greedy tokens vary
        for param in model.parameters():
            param.normal_(0.0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.generation_config = qwen2.generation_config
    return transformers_ar.CausalLM(model, AutoTokenizer.from_pretrained(path))


def test_a_qwen3_decoder_decodes_on_the_static_path_as_on_the_dynamic_one(plan):
    """Qwen3's layers (q/k norms before the rotary) run on the static path, and give the
    dynamic path's greedy tokens, batched at different steps with a row leaving."""
    lm = qwen3_lm()
    assert static_decode.unsupported(lm.decoder) is None and static_decode.fusable(lm.decoder)

    def decode(mode: str) -> list[list[int]]:
        backend = TransformersAR(stage_spec(plan, "lm", decode=mode), "cpu", lm)
        calls = [request(p, max_tokens=12) for p in PROMPTS]
        return [o.tokens for o in run(backend, calls, joins=[0, 1, 1, 3], cancel={1: 6})]

    want, got = decode("eager"), decode("static")
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    # The dropped row: its tokens until then (the static path's step in flight emits none).
    assert got[1] == want[1][: len(got[1])] and len(got[1]) >= 4
    assert len({tuple(t) for t in want}) == len(want) and max(map(len, want)) == 12


def test_the_static_path_takes_routed_moe_blocks_and_refuses_other_routers(plan):
    """A sparse MoE block of the Qwen-MoE shape (a router that picks and weighs as
    `fused_moe.route` does, stacked SwiGLU experts) runs on the static path, with no host
    readback, and gives the dynamic path's greedy tokens; a router of another rule
    (Mixtral's: no `norm_topk_prob`) keeps the decoder off it."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    lm = qwen3_lm()
    layer = lm.decoder.layers[1]
    sizes = {"hidden_size": 64, "num_experts_per_tok": 2}
    torch.manual_seed(0)
    layer.mlp = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, **sizes)
    ).eval()
    with torch.no_grad():
        for param in layer.mlp.parameters():
            param.normal_(0.0, 0.2)
    assert static_decode.unsupported(lm.decoder) is None and static_decode.fusable(lm.decoder)

    def decode(mode: str) -> list[list[int]]:
        backend = TransformersAR(stage_spec(plan, "lm", decode=mode), "cpu", lm)
        calls = [request(p, max_tokens=8) for p in PROMPTS[:3]]
        return [o.tokens for o in run(backend, calls, joins=[0, 1, 1])]

    want = decode("eager")
    assert decode("static") == want and len({tuple(t) for t in want}) == len(want)
    mixtral = MixtralConfig(intermediate_size=32, num_local_experts=4, **sizes)
    layer.mlp = MixtralSparseMoeBlock(mixtral)
    assert "nor a sparse MoE block" in static_decode.unsupported(lm.decoder)
    assert not static_decode.fusable(lm.decoder)


def test_the_static_cache_is_sized_from_the_plan_and_refuses_what_cannot_fit(plan):
    short_plan = compile_source(SOURCE, devices="cpu", settings=["lm.max_len=16"])
    backend = make_backend(short_plan, "static")  # 16 + 12 columns: one quantum
    assert backend.static.columns == 128 and backend.static.length_buckets == [128]
    # A lone prompt's prefill widths: powers of two from 16, within the columns, to 1024.
    assert static_decode.prefill_widths(128) == [16, 32, 64, 128]
    assert static_decode.prefill_widths(4224)[-1] == 1024
    long = request(" ".join(["hello"] * 150))
    short = request(PROMPTS[1], max_tokens=2)
    backend.step([long, short])
    assert isinstance(long.error, ARBackendError) and "cache columns" in str(long.error)
    assert "this prompt alone fills them" in str(long.error)
    near = request(" ".join(["hello"] * 10), max_tokens=120)  # fits, with fewer tokens
    backend.step([near])
    message = str(near.error)
    said = re.search(r"a prompt of (\d+) positions and max_tokens=120", message)
    assert said, message
    room = backend.static.columns - int(said.group(1)) + 1
    assert f"ask for at most max_tokens={room}" in message and 0 < room < 120
    backend.drop(near)
    assert short.error is None and short.emitted
    for call in (long, short):
        backend.drop(call)
    stage = with_decode(plan, "static")
    per_token = transformers_ar.static_decode.kv_bytes_per_token(backend.component.decoder)
    room = 4 * per_token * 300  # 4 slots of 300 columns: 256 after rounding down
    tight = dataclasses.replace(
        stage, budget_bytes=stage.weight_bytes + stage.activation_bytes + room
    )
    assert transformers_ar.cache_columns(tight, per_token) == 256
    assert transformers_ar.cache_columns(stage, per_token) == 4224  # max_len 4096 + 12


def test_prompts_are_prefilled_at_a_captured_bucket_unless_they_carry_positions(plan):
    """The fused static path pads prompts' prefill to a power-of-two width and their count to
    a batch bucket (captured at load on CUDA), the padding rows into the free slots after
    the batch's; a component whose every prompt carries positions (a thinker's multimodal
    RoPE) would never replay those graphs, and gets none."""
    component = make_backend(plan, "eager").component

    def decoder() -> static_decode.StaticDecoder:
        return static_decode.StaticDecoder(
            component, slots=4, columns=128, device="cpu", capture=False, extra=False,
            fused=True,
        )  # fmt: skip

    static = decoder()
    assert static.prefill_widths == [16, 32, 64, 128] and static.prefill_batches == [1, 2, 4]
    assert len(static.prefill_buckets) == 3 * 4  # (the cap on positions in all: 4096)
    assert static_decode.StaticDecoder(
        component, slots=16, columns=1024, device="cpu", capture=False, extra=False, fused=True
    ).prefill_buckets[-3:] == [(16, 64), (16, 128), (16, 256)]  # not 16 x 512
    assert static.prefill_bucket([3], 5) == (1, 16)
    assert static.prefill_bucket([1, 2], 17) == (2, 32)
    assert static.prefill_bucket([0, 1, 2], 16) == (4, 16)  # its padding row into slot 3
    assert static.prefill_bucket([1, 2, 3], 16) is None  # padded to 4: no slot 4
    assert static.prefill_bucket([0, 2], 16) is None  # not the next slots from the first
    assert static.prefill_bucket([0], 129) is None  # wider than any width
    component.prompt_positions = True
    assert decoder().prefill_widths == []


def test_decode_graphs_needs_cuda(plan):
    with pytest.raises(ARBackendError, match="needs a CUDA device"):
        make_backend(plan, "graphs")
    # The GPU tests' `make_backend_from`: "auto" decodes on the dynamic cache off CUDA.
    assert make_backend_from(make_backend(plan, "static"), "auto").decode == "eager"


def test_seeded_sampling_is_per_request(backend):
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": 200, "max_tokens": 16}
    first = alone(backend, PROMPTS[0], seed=7, **params)
    assert alone(backend, PROMPTS[0], seed=7, **params).tokens == first.tokens
    # Sharing a batch with other sampled requests does not change a request's draws.
    together = run(
        backend,
        [request(PROMPTS[0], seed=7, **params), request(PROMPTS[1], seed=3, **params)],
        joins=[0, 1],
    )
    assert together[0].tokens == first.tokens
    assert alone(backend, PROMPTS[0], seed=8, **params).tokens != first.tokens
    assert first.tokens != alone(backend, PROMPTS[0], max_tokens=16).tokens  # it did sample


def test_max_tokens_eos_and_stop_ids_end_requests(backend):
    assert len(alone(backend, PROMPTS[0], max_tokens=3).tokens) == 3
    eos = alone(backend, PROMPTS[2], max_tokens=40)
    assert len(eos.tokens) == 4 and eos.tokens[-1] in backend.component.eos_ids
    full = alone(backend, PROMPTS[0])
    stop_id = full.tokens[5]
    stopped = alone(backend, PROMPTS[0], stop=[stop_id])
    assert stopped.tokens == full.tokens[: full.tokens.index(stop_id) + 1]


def test_stop_strings_cut_the_text(backend, tokenizer):
    full = alone(backend, PROMPTS[0], max_tokens=16)
    stop = full.text[6:9]
    cut = alone(backend, PROMPTS[0], max_tokens=16, stop=["no such text", stop])
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.tokens) < len(full.tokens)
    assert cut.tokens == full.tokens[: len(cut.tokens)]
    # The text that went out before the stop string was complete never held part of it.
    assert all(stop not in text for _, text in cut.text_by_step)


def test_streamed_text_adds_up_and_never_splits_a_character(backend, tokenizer):
    for prompt in PROMPTS:
        out = alone(backend, prompt, max_tokens=24)
        assert out.text == tokenizer.decode(out.tokens, skip_special_tokens=True)
        for count, text in out.text_by_step[:-1]:
            assert out.text.startswith(text)
            assert not text.endswith("\ufffd")
            assert tokenizer.decode(out.tokens[:count], skip_special_tokens=True).startswith(text)


def test_text_stream_holds_incomplete_utf8(tokenizer):
    text = "héllo wörld ✓ 你好 — ok"
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    stream = TextStream(tokenizer, ())
    pieces = [stream.add(i) for i in ids]
    assert "" in pieces  # a character's first bytes wait for the rest
    pieces.append(stream.close())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_bad_parameters_fail_only_their_request(backend):
    check_bad_parameters_fail_only_their_request(backend, ARBackendError)
    assert backend.rows == []


def test_runs_in_a_plan_under_the_interpreter(plan, backend):
    out = Interpreter(plan).run({"prompt": PROMPTS[1]}, {"max_tokens": 8})
    want = alone(backend, PROMPTS[1], max_tokens=8)
    assert out["tokens"].reshape(-1).tolist() == want.tokens
    assert out["text"] == want.text
    assert out["hidden"].shape == (8, 1, 64)


def test_the_interpreter_waits_for_a_static_steps_tokens_on_their_way(plan, monkeypatch):
    """On a GPU a static step's tokens land a while after its launch, and the stage is not
    ready meanwhile: the interpreter polls it (as a program loop does), not an error. Here
    each step's tokens land three polls late (the device's latency, injected)."""
    static = compile_source(
        SOURCE.replace("$temperature)", '$temperature, decode="static")'), devices="cpu"
    )
    land_late(monkeypatch, static_decode.Launched)
    out = Interpreter(static).run({"prompt": PROMPTS[1]}, {"max_tokens": 8})
    want = Interpreter(plan).run({"prompt": PROMPTS[1]}, {"max_tokens": 8})
    assert out["tokens"].reshape(-1).tolist() == want["tokens"].reshape(-1).tolist()
    assert len(want["tokens"].reshape(-1)) == 8


# The GPU tests build their backends as the CPU tests do (`make_backend`, `make_backend_from`
# on this module's plan), on cuda:0.


@pytest.fixture(scope="module")
def cuda_backend(plan):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return make_backend(plan, "eager", "cuda:0")  # the dynamic path's sampling on the GPU


@pytest.mark.gpu
def test_on_the_gpu_the_fused_sampler_is_greedy_where_asked_and_replays_its_seeds(
    cuda_backend, monkeypatch
):
    """On CUDA a decode step samples the whole batch in one kernel pass: temperature 0 gives
    the tokens transformers' own row-by-row path gives on the same device (prompts batched
    at different lengths, 64 steps), a seed replays its draws alone or in a batch, and
    another seed draws otherwise."""

    def greedy():
        return [o.tokens for o in run(cuda_backend, [request(p, max_tokens=64) for p in PROMPTS],
                                      joins=[0, 1, 1, 3])]  # fmt: skip

    fused = greedy()
    with monkeypatch.context() as patch:
        patch.setattr(transformers_ar, "_sample_on_device", transformers_ar._sample_row_by_row)
        assert fused == greedy()
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    first = alone(cuda_backend, PROMPTS[0], seed=7, max_tokens=32, **sampled)
    together = run(
        cuda_backend,
        [request(PROMPTS[0], seed=7, max_tokens=32, **sampled), request(PROMPTS[1], seed=3)],
        joins=[0, 1],
    )
    assert together[0].tokens == first.tokens
    assert alone(cuda_backend, PROMPTS[0], seed=8, max_tokens=32, **sampled).tokens != first.tokens


@pytest.fixture(scope="module")
def graphed(plan):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return make_backend(plan, "graphs", "cuda:0")


@pytest.mark.gpu
def test_graph_replay_gives_the_eager_static_steps_tokens_and_never_recaptures(plan, graphed):
    """Greedy over 64 steps (prompts joining at different steps, rows sitting out steps, one
    cancelled), and seeded sampling: replaying the captured graphs gives exactly the tokens
    and hidden states of the same static step run eagerly, every graph was captured at load,
    and serving captures none."""
    static = graphed.static
    captured = static.captures
    steps = len(static.batch_buckets) * (len(static.length_buckets) + 1)
    assert captured == steps + len(static.prefill_buckets)
    # What the stage's load line reports (`captured N CUDA graphs in S s`).
    assert (graphed.captures, graphed.capture_seconds) == (captured, static.capture_seconds)
    assert graphed.capture_seconds > 0
    assert set(static.graphs) == {
        (b, t) for b in static.batch_buckets for t in static.length_buckets
    }
    assert set(static.finish_graphs) == set(static.batch_buckets)  # and a first step's
    assert set(static.prefill_graphs) == set(static.prefill_buckets)  # prompts' prefills
    eager = make_backend(plan, "static", "cuda:0")
    assert eager.static.graphs == {}
    # What capturing took is reported with the load (control.Loaded.captured), and only there.
    assert graphed.capture_seconds == static.capture_seconds > 0
    assert eager.capture_seconds == 0

    def serve(backend):
        greedy = run(
            backend,
            [request(p, max_tokens=64) for p in PROMPTS],
            joins=[0, 1, 1, 3],
            held={0: {5, 6}, 3: {9}},
            cancel={1: 20},
        )
        sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
        seeded = run(
            backend,
            [request(PROMPTS[0], seed=7, max_tokens=32, **sampled), request(PROMPTS[1], seed=3)],
            joins=[0, 2],
        )
        return greedy + seeded

    # Every step replays its LM step's graph and its finish's; a first step its finish's.
    replays = static.replays - 2 * static.launches - static.first_steps
    lone = static.prefill_replays
    want, got = serve(eager), serve(graphed)
    assert static.replays - 2 * static.launches - static.first_steps == replays  # every one
    # Every prefill: the requests that started alone, and the two that started together.
    assert static.prefill_replays - lone == 5
    assert static.captures == captured
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens
        assert a.text == b.text
        for x, y in zip(a.hidden, b.hidden, strict=True):
            assert torch.equal(x, y)


@pytest.mark.gpu
def test_on_the_gpu_graph_replay_gives_the_dynamic_paths_greedy_tokens(graphed):
    """The captured static step and the dynamic cache (float32 tiny model, both on the GPU)
    decode the same greedy tokens over 64 steps."""
    assert make_backend_from(graphed, "auto").decode == "graphs"  # the default on CUDA
    assert graphed.static.fused  # the Triton kernels, not the model's modules
    eager = make_backend_from(graphed, "eager")
    calls = lambda: [request(p, max_tokens=64) for p in PROMPTS]  # noqa: E731
    want = run(eager, calls(), joins=[0, 1, 1, 3])
    got = run(graphed, calls(), joins=[0, 1, 1, 3])
    assert [o.tokens for o in got] == [o.tokens for o in want]


def make_backend_from(backend, decode: str) -> TransformersAR:
    spec = backend.spec
    stage = dataclasses.replace(spec.plan, settings={**spec.plan.settings, "decode": decode})
    return TransformersAR(dataclasses.replace(spec, plan=stage), backend.device)


def test_the_fused_step_accepts_transformers_own_silu_and_refuses_another_activation(plan):
    """The fused decode kernels are used for the decoders the pipelines run (transformers
    names its SiLU `SiLUActivation`, not `torch.nn.SiLU`), and a decoder whose MLP computes
    anything else runs the model's own modules."""
    decoder = make_backend(plan, "static").component.decoder
    assert static_decode.fusable(decoder)
    mlp = decoder.layers[0].mlp
    silu = mlp.act_fn
    try:
        mlp.act_fn = torch.nn.GELU()
        assert not static_decode.fusable(decoder)
    finally:
        mlp.act_fn = silu
