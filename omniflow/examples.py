"""The example graphs (graphs/*.omni): where they are, and a pipeline named by its stem.

A checkout keeps them in its top-level graphs/; an installed omniflow carries the same files
as package data in omniflow/graphs/ (pyproject.toml maps the one onto the other), so
`omniflow run` with no pipeline, and `omniflow run qwen3_tts`, work from either.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# Installed first: in site-packages, the folder beside the package is nobody's graphs/.
GRAPH_FOLDERS = (PACKAGE / "graphs", PACKAGE.parent / "graphs")
DEFAULT_GRAPH = "omni_chat"  # what `omniflow run` serves when given no pipeline


def graphs_folder() -> Path | None:
    """The folder that holds the example graphs, or None where none shipped."""
    return next((folder for folder in GRAPH_FOLDERS if folder.is_dir()), None)


def example_graphs() -> dict[str, Path]:
    """Every example graph by its stem (`qwen3_tts`), sorted."""
    folder = graphs_folder()
    return {p.stem: p for p in sorted(folder.glob("*.omni"))} if folder else {}


def find_pipeline(name: str) -> Path | None:
    """`name` as a file, else the example graph a bare name gives (`qwen3_tts`,
    `qwen3_tts.omni`, or `graphs/qwen3_tts.omni` outside a checkout); None for neither."""
    if Path(name).is_file():
        return Path(name)
    path = Path(name)
    if path.parent not in (Path("."), Path("graphs")) or path.suffix not in ("", ".omni"):
        return None
    return example_graphs().get(path.stem)
