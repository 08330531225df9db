"""What the tests of the `ar` backends (transformers, vLLM) share: prompts of different
lengths, a chat request to step a backend with, the requests joining and leaving a stepped
backend, and the check that bad parameters fail only their own request."""

import itertools

from omniflow.runtime.stage import Call, InputStream

PROMPTS = [
    "Tell me a short story.",
    "hi",
    "short long what tell hello the what blue",
    "red hello short short cat small hello world short what big",
]
_ids = itertools.count()


def request(prompt: str, **params) -> Call:
    """A chat request of one user turn, greedy and 12 tokens long unless `params` say else."""
    stream = InputStream("chat")
    stream.push([{"role": "user", "content": prompt}], end=True)
    return Call(
        f"r{next(_ids)}", {"max_tokens": 12, "temperature": 0.0} | params, {"prompt": stream}
    )


def join_and_cancel(backend, calls, live, step: int, joins, cancel: dict[int, int]) -> None:
    """Before step `step` of `backend`: call i joins `live` if joins[i] is that step, and is
    dropped (from the backend and `live`) if cancel[i] is."""
    live += [c for c, at in zip(calls, joins, strict=True) if at == step]
    for i, at in cancel.items():
        if at == step and calls[i] in live:
            backend.drop(calls[i])
            live.remove(calls[i])


def check_bad_parameters_fail_only_their_request(backend, error: type) -> None:
    """One step of `backend` (a text model's) over a request with a negative temperature, one
    with an image and a good one: the first two fail with `error` naming what is wrong, the
    good one emits; all three dropped after."""
    bad = request(PROMPTS[0], temperature=-1.0)
    media = Call("media", {}, {"prompt": InputStream("chat")})
    media.inputs["prompt"].push(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        end=True,
    )
    good = request(PROMPTS[1], max_tokens=2)
    backend.step([bad, media, good])
    assert isinstance(bad.error, error) and "temperature" in str(bad.error)
    assert isinstance(media.error, error) and "image" in str(media.error)
    assert good.error is None and good.emitted
    for call in (bad, media, good):
        backend.drop(call)
