"""What the profiler's tests (and the runtime's) share: chains of python identity stages
(`identity_chain`; `SPLIT`, two fused into one executor, one on its own) and a way to
profile one for real; how to start headless Chromium."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

from omniflow.compiler import compile_source
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.engine import Engine


def identity_chain(name: str, max_batch: int, ab_chunk: int, bc_chunk: int, *more: str) -> str:
    """Pipeline `name`: python identity stages a -> b -> c (each batching up to `max_batch`)
    from tokens on input x to output y, streaming `ab_chunk` and `bc_chunk` tokens a chunk
    between them, and the lines `more` (more outputs)."""
    identity = f"python(fn=omniflow.runtime.builtin_stages.identity, max_batch={max_batch})"
    lines = [
        *(f"  stage {stage} = {identity}" for stage in "abc"),
        "  input x: tokens -> a",
        f"  a.out -> b.in [stream, chunk={ab_chunk}]",
        f"  b.out -> c.in [stream, chunk={bc_chunk}]",
        "  c.out -> output y [stream]",
        *(f"  {line}" for line in more),
    ]
    return f"pipeline {name} {{\n" + "\n".join(lines) + "\n}"


# a and b stream per token (fused: one executor); c reads chunks of 8 (its own executor).
SPLIT = identity_chain("split", 4, 1, 8, "b.out -> output z [stream, chunk=2]")

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def profile(mode: str, requests: int, concurrency: int = 4, tokens=lambda i: 4 + i % 13):
    """(plan, trace) of `requests` requests (request i carries `tokens(i)` tokens) run
    `concurrency` at a time while profiled."""
    plan = compile_source(SPLIT, "split.omni")
    with Engine(plan, mode) as engine:
        engine.generate({"x": [[0]]})  # warm, not profiled
        engine.start_profile(1 << 18)  # returns once every executor records

        def one(i: int) -> None:
            engine.generate({"x": [[i + k] for k in range(tokens(i))]}, request_id=f"r{i}")

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
        profiles = engine.stop_profile()
    return plan, chrome_trace(profiles, plan)


def chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome")
    return next((found for name in names if (found := shutil.which(name))), None)


class Page:
    """A browser page that remembers its console errors, failed scripts and every request it
    made beyond the page itself."""

    def __init__(self, browser, url: str):
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)

    def __getattr__(self, name):
        return getattr(self.page, name)
