"""Make docs/profiling-report.png: omni chat on the tiny models, 20 requests at concurrency 4,
profiled; its report opened in headless Chromium and photographed.

    .venv/bin/python scripts/profile_screenshot.py [OUT_DIR]

OUT_DIR (default out/profile) keeps trace.json and report.html. Needs Chromium
(`apt-get install chromium`) and playwright (the dev extra).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omniflow.compiler import compile_file
from omniflow.profiler import profile_to
from omniflow.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"max_tokens": 16, "max_audio_tokens": 120}
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARGS += ["--disable-component-update", "--disable-sync", "--no-first-run"]


def main(out: Path) -> None:
    plan = compile_file(ROOT / "graphs/omni_chat.omni", tiny=True, progress=True)
    with Engine(plan) as engine:
        engine.generate({"prompt": "Hello!"}, PARAMS)  # warm, not profiled
        with profile_to(out, engine) as files, ThreadPoolExecutor(4) as pool:
            prompts = [f"Hello! Tell me about the number {i}." for i in range(20)]
            list(
                pool.map(
                    lambda i: engine.generate({"prompt": prompts[i]}, PARAMS, f"chat-{i}"),
                    range(20),
                )
            )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
        page.goto(files.report.as_uri())
        page.wait_for_function("() => window.omniflowReport && window.omniflowReport.waterfall")
        page.select_option("#sort", "e2e")
        page.screenshot(path=str(ROOT / "docs/profiling-report.png"), full_page=True)
        browser.close()
    print(files.trace, files.report, ROOT / "docs/profiling-report.png")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/profile"))
