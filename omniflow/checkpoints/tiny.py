"""Tiny offline checkpoints of real architectures, built once into a cache.

Nothing can be downloaded where omniflow's tests run, so tests use tiny random-weight
models of the real architectures, built from configs by their model family's recipe (a
`TinyModel` of its descriptor; the pieces they share are in `tiny_recipes`) and loaded
through the same `from_pretrained(local_dir)` path as a real checkpoint. Each family's
`checkpoints` module also runs its model unsplit, the way its own code does, as the oracle
that omniflow's staged pipelines are compared against.

- `build_tiny(name)` builds a checkpoint directory, or reuses a complete one, under
  `$OMNIFLOW_CACHE/tiny/<libraries>/<name>` (OMNIFLOW_CACHE defaults to ~/.cache/omniflow;
  `<libraries>` is a short hash of the recipe and library versions, so environments with
  different versions keep their own builds instead of rebuilding each other's). A build
  writes into a temporary sibling directory and renames it into place, and a directory
  counts as complete only with its manifest (written last), so an interrupted build is
  never mistaken for a complete one.
- `list_tiny()` names what can be built (`omniflow.families.tiny_models()` describes each).

A build (not a reuse) says so on stderr, a line as it starts and one with its time and size
when it is done (`announce_build`, which the scaled builds share): a server's first start
builds its tiny models, and a person watching its log should see why it waits.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from omniflow import families
from omniflow.checkpoints.tiny_recipes import RECIPE_VERSION
from omniflow.errors import ModelConfigError
from omniflow.families import TinyModel
from omniflow.hf_logging import quiet
from omniflow.hints import did_you_mean
from omniflow.runtime.python_backend import import_function

# Written last into a finished checkpoint: what built it and every file's size and hash.
MANIFEST = "omniflow_tiny.json"
_TEMP_MARK = ".tmp-"


def list_tiny() -> list[str]:
    """Names `build_tiny` accepts, sorted."""
    return sorted(families.tiny_models())


def cache_root() -> Path:
    """omniflow's build cache: `$OMNIFLOW_CACHE`, by default ~/.cache/omniflow."""
    root = os.environ.get("OMNIFLOW_CACHE") or Path.home() / ".cache" / "omniflow"
    return Path(root).expanduser()


def tiny_cache_dir() -> Path:
    """Where `build_tiny` puts checkpoints by default: `$OMNIFLOW_CACHE/tiny/<libraries>`, one
    folder per set of recipe and library versions (a build's bytes depend on them)."""
    key = hashlib.sha256(json.dumps(_built_with(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "tiny" / key


def build_tiny(name: str, out_dir: str | Path | None = None, progress: bool = False) -> Path:
    """Build the tiny checkpoint `name` (or reuse a complete one) and return its directory.

    `out_dir` defaults to `tiny_cache_dir() / name`. A directory is reused when its
    manifest names the same recipe version and library versions and every file it lists is
    there with its size; otherwise it is rebuilt and replaced. `progress` shows a bar over
    the parts being built.
    """
    final = Path(out_dir).expanduser() if out_dir is not None else tiny_cache_dir() / name
    if is_complete(final, name):  # built already (by any process that knew the recipe)
        return final
    recipe = _recipe(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final)
    temp = final.with_name(f".{final.name}{_TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    temp.mkdir()
    try:
        with announce_build(f"tiny {name}", final):
            with quiet(), _progress_bar(recipe, progress) as start_part:
                for part in import_function(recipe.build)(temp):
                    start_part(part)
            _write_manifest(temp, name)
            _publish(temp, final, name)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


@contextlib.contextmanager
def announce_build(what: str, folder: Path) -> Iterator[None]:
    """Say on stderr that `what` is being built (first use), and, once the block is done,
    how long that took and what `folder` then holds."""
    print(f"omniflow: building {what} (first use) ...", file=sys.stderr, flush=True)
    began = time.perf_counter()
    yield
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(
        f"omniflow: built {what} in {time.perf_counter() - began:.1f} s "
        f"({size / 1e6:.1f} MB): {folder}",
        file=sys.stderr,
        flush=True,
    )


def is_complete(directory: str | Path, name: str) -> bool:
    """Whether `directory` holds a finished build of `name` by this recipe and libraries."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("name") != name or manifest.get("built_with") != _built_with():
        return False
    return all(
        (directory / rel).is_file() and (directory / rel).stat().st_size == entry["bytes"]
        for rel, entry in manifest.get("files", {}).items()
    )


class UnknownTinyModel(ModelConfigError, KeyError):
    """No family has a tiny checkpoint of that name."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return self.args[0]


def _recipe(name: str) -> TinyModel:
    known = families.tiny_models()
    if name not in known:
        hint = did_you_mean(name, known)
        raise UnknownTinyModel(
            f"unknown tiny model '{name}' (known: {', '.join(list_tiny())})"
            + (f"; {hint}" if hint else "")
        )
    return known[name]


def _built_with() -> dict[str, str | int | None]:
    """What a checkpoint's bytes depend on besides its recipe name (None: not installed)."""
    versions: dict[str, str | int | None] = {"recipe_version": RECIPE_VERSION}
    for package in ("torch", "transformers", "diffusers", "tokenizers", "safetensors", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _write_manifest(directory: Path, name: str) -> None:
    files = {
        path.relative_to(directory).as_posix(): {
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    manifest = {"name": name, "built_with": _built_with(), "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _publish(temp: Path, final: Path, name: str) -> None:
    """Move a finished build into place, replacing a stale or incomplete directory.

    If another process published a complete build first, keep theirs.
    """
    if final.exists():
        if is_complete(final, name):
            return
        stale = final.with_name(f".{final.name}{_TEMP_MARK}stale-{uuid.uuid4().hex[:8]}")
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        temp.rename(final)
    except OSError:
        if not is_complete(final, name):
            raise


def _remove_abandoned_builds(final: Path) -> None:
    """Delete temporary build directories of `final` whose building process is gone."""
    for temp in final.parent.glob(f".{final.name}{_TEMP_MARK}*"):
        owner = temp.name.removeprefix(f".{final.name}{_TEMP_MARK}").split("-")[0]
        if not (owner.isdigit() and _process_alive(int(owner))):
            shutil.rmtree(temp, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _progress_bar(recipe: TinyModel, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield `start_part(label)`, which a build calls before each part of the recipe."""
    if not enabled:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    # On stderr: stdout may be a plan's JSON or a checkpoint's path that a script reads.
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"tiny {recipe.name}", total=len(recipe.parts))
        started = 0

        def start_part(label: str) -> None:
            nonlocal started
            bar.update(task, completed=started, description=f"tiny {recipe.name}: {label}")
            started += 1

        yield start_part
        bar.update(task, completed=len(recipe.parts), description=f"tiny {recipe.name}")
