"""One self-contained HTML page: every script and style inline, the page's data as JSON in a
`<script type="application/json">`, and a Content-Security-Policy that lets it load nothing
(the live dashboard may fetch from its own server, nothing else).

The scripts are the vendored libraries in `assets/` (see `assets/LICENSES.md`: dagre lays
out graphs, Chart.js draws charts) and omniflow's own: `common.js` (the graph drawing and
helpers every page shares) and one per page.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources

LIBRARIES = ("dagre.min.js", "chart.umd.min.js")
DATA_ID = "omniflow-data"


@cache
def asset(name: str) -> str:
    return resources.files("omniflow.profiler").joinpath("assets", name).read_text("utf-8")


def _inline_script(text: str) -> str:
    # A script element ends at the first `</script`, whatever the JavaScript around it says.
    if "</script" in text.lower():
        raise ValueError("an inline script must not contain '</script'")
    return f"<script>{text}</script>"


def data_json(data: object) -> str:
    """JSON safe inside a `<script>` element: `</` and `<!--` cannot appear in it."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def page(
    title: str, body: str, script: str, data: object, connect: str = "'none'", subtitle: str = ""
) -> str:
    """The page: a header (`title`, `subtitle`: the scripts may fill it in), `body` (HTML),
    then the libraries, common.js and `script` (an asset's name), with `data` for the scripts
    to read (`omniflow.data()`)."""
    policy = (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        f"img-src data:; connect-src {connect}; base-uri 'none'; form-action 'none'"
    )
    scripts = "\n".join(_inline_script(asset(n)) for n in (*LIBRARIES, "common.js", script))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{asset("style.css")}</style>
</head>
<body>
<header>
  <h1 id="title">{html.escape(title)}</h1>
  <div class="sub" id="subtitle">{html.escape(subtitle)}</div>
</header>
{body}
<script type="application/json" id="{DATA_ID}">{data_json(data)}</script>
{scripts}
</body>
</html>
"""
