"""The set-up scripts say what they install: scripts/pip-steps.sh's `pip_steps` (what
scripts/setup-venv.sh, behind `make setup`, and scripts/vllm-env.sh install through) prints a
line a package it fetches, pip's summary and what was there already, and keeps pip's exit
status and errors. Offline: wheels made here, installed into a folder of the test's own."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def wheel(folder: Path, name: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel of `name` 1.0."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "")
        archive.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return path


def pip_steps(*args: str) -> subprocess.CompletedProcess:
    script = 'source scripts/pip-steps.sh && pip_steps "$@"'
    return subprocess.run(
        ["bash", "-c", script, "pip_steps", sys.executable, "--no-index", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_pip_steps_prints_a_line_a_package_and_what_it_installed(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "tinyapp", ("tinydep",))
    wheel(wheels, "tinydep")
    done = pip_steps("--find-links", str(wheels), "--target", str(tmp_path / "site"), "tinyapp")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "  Processing tinyapp-1.0-py3-none-any.whl",
        "  Processing tinydep-1.0-py3-none-any.whl (from tinyapp)",
        "  Successfully installed tinyapp-1.0 tinydep-1.0",
    ]
    assert (tmp_path / "site" / "tinydep" / "__init__.py").is_file()


def test_pip_steps_counts_what_was_there_and_keeps_pips_failures():
    there = pip_steps("pytest", "rich")  # both in this environment: nothing to do
    assert there.returncode == 0, there.stderr
    lines = there.stdout.splitlines()
    assert len(lines) == 1 and lines[0].endswith("requirement(s) already installed"), lines
    assert int(lines[0].split()[0]) >= 2  # the two, and their own requirements
    missing = pip_steps("no-such-package-omniflow-test")
    assert missing.returncode != 0 and missing.stdout == ""
    assert "No matching distribution found for no-such-package-omniflow-test" in missing.stderr


def test_the_setups_install_through_pip_steps():
    """Each install step of make's set-up and the vLLM environment goes through pip_steps:
    no bare, silent `pip install -q` left."""
    for script in ("scripts/setup-venv.sh", "scripts/vllm-env.sh"):
        text = (ROOT / script).read_text()
        assert "source" in text and "pip-steps.sh" in text and "pip_steps " in text, script
        assert "pip install" not in text.replace("pip_steps", ""), script
    assert "scripts/setup-venv.sh" in (ROOT / "Makefile").read_text()


def test_ab_files_keeps_another_revisions_files_out_of_git(tmp_path):
    """scripts/ab_files.sh REV PATH... (what gpu_session.sh's `ab` part swaps in): each
    PATH as at REV under .ab/, the revision in .ab/REV, and .ab/ excluded from git."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "ab_files.sh").write_bytes((ROOT / "scripts" / "ab_files.sh").read_bytes())
    (repo / "pkg").mkdir()

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=repo, capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout.strip()

    git("init", "-q")
    (repo / "pkg" / "mod.py").write_text("before\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    base = git("rev-parse", "--short", "HEAD")
    (repo / "pkg" / "mod.py").write_text("after\n")
    git("commit", "-qam", "two")
    done = subprocess.run(["bash", "scripts/ab_files.sh", base, "pkg/mod.py"], cwd=repo,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (repo / ".ab" / "pkg" / "mod.py").read_text() == "before\n"
    assert (repo / "pkg" / "mod.py").read_text() == "after\n"
    assert (repo / ".ab" / "REV").read_text().strip() == base
    assert git("status", "--porcelain") == ""  # .ab/ is excluded
    usage = subprocess.run(["bash", "scripts/ab_files.sh", base], cwd=repo,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert usage.returncode == 2 and "usage" in usage.stderr
