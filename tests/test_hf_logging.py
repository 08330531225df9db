"""`hf_logging.quiet()` silences transformers' load chatter and its weight-loading bars, but
leaves huggingface_hub's progress bars (what a download of real weights shows) as they were."""

import contextlib
import io
import subprocess
import sys

import huggingface_hub.utils as hub_utils
from transformers import AutoModelForCausalLM

from omniflow.checkpoints.tiny import build_tiny
from omniflow.hf_logging import quiet


def hub_bar_output() -> str:
    """What the hub's own progress bar class (the one its downloads draw) writes."""
    out = io.StringIO()
    with hub_utils.tqdm(total=3, desc="Fetching 3 files", file=out) as bar:
        bar.update(3)
    return out.getvalue()


def load_chatter(path) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        AutoModelForCausalLM.from_pretrained(path)
    return err.getvalue()


def test_quiet_silences_loads_but_not_the_hubs_download_bars():
    path = build_tiny("qwen2")
    assert "Loading weights" in load_chatter(path)  # what quiet() is for
    assert not hub_utils.are_progress_bars_disabled()
    with quiet():
        assert load_chatter(path) == ""
        assert not hub_utils.are_progress_bars_disabled()
        assert "Fetching 3 files" in hub_bar_output()
    assert not hub_utils.are_progress_bars_disabled()
    assert "Loading weights" in load_chatter(path)  # restored


def test_quiet_leaves_hub_bars_off_where_the_user_turned_them_off():
    hub_utils.disable_progress_bars()
    try:
        with quiet():
            assert hub_utils.are_progress_bars_disabled() and hub_bar_output() == ""
        assert hub_utils.are_progress_bars_disabled()
    finally:
        hub_utils.enable_progress_bars()


def test_quiet_imports_no_diffusers_where_nothing_did():
    """A stage that is no diffusers pipeline loads without diffusers' import; a diffusers
    load, which has imported it already, is quieted too."""
    code = (
        "import sys\n"
        "from omniflow.hf_logging import quiet\n"
        "with quiet():\n"
        "    pass\n"
        "assert 'diffusers' not in sys.modules\n"
        "import diffusers.utils.logging as logs\n"
        "with quiet():\n"
        "    assert logs.get_verbosity() == logs.ERROR\n"
    )
    run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
