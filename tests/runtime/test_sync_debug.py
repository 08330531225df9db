"""OMNIFLOW_SYNC_DEBUG: each stage's step runs under torch's sync debug mode, so a step that
reads a value back from its GPU is named ("warn") or fails its requests ("error"), and
nothing else runs under it.

On a machine without CUDA the same plans run with the variable set and nothing changes (a
process that never used CUDA is left alone); the `gpu` tests are the behaviour."""

import pytest
import torch

from omniflow.errors import OmniflowError
from omniflow.runtime.engine import Engine, RequestFailed
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.readback import HostCopies
from omniflow.runtime.sync_debug import ENV, TORCH_MESSAGE, StepSyncs, mode_from_env
from tests.runtime.test_failures import (  # noqa: F401 (no_leaks: a fixture)
    no_leaks,
    two_text_stages_on_one_gpu,
)


def plan():
    """Two text stages in the one executor of one GPU; a prompt with 'sync' makes them
    read a value back with `.item()` in their steps."""
    return two_text_stages_on_one_gpu("sync_when_asked")


def test_the_variable_takes_warn_or_error_and_names_itself_otherwise(monkeypatch):
    for value, mode in (("", None), ("warn", "warn"), ("ERROR", "error")):
        monkeypatch.setenv(ENV, value)
        assert mode_from_env() == mode
    monkeypatch.setenv(ENV, "loud")
    with pytest.raises(OmniflowError, match="OMNIFLOW_SYNC_DEBUG='loud': expected one of warn"):
        mode_from_env()


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_off_cuda_the_steps_run_as_before(monkeypatch, mode):
    if torch.cuda.is_initialized():
        pytest.skip("this process uses CUDA")
    monkeypatch.setenv(ENV, mode)
    with StepSyncs.from_env() as syncs:
        assert torch.ones(1).sum().item() == 1.0
    assert syncs.before is None  # torch's mode untouched: no CUDA here
    assert Interpreter(plan(), "standin").run({"prompt": "sync now"})["out"] == "SYNC NOW"
    with Engine(plan(), "inprocess", backends="standin") as engine:
        assert engine.generate({"prompt": "sync now"})["out"] == "SYNC NOW"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_with_error_a_step_that_syncs_fails_its_requests_naming_the_sync(
    monkeypatch,
    mode,
    no_leaks,  # noqa: F811
):
    monkeypatch.setenv(ENV, "error")  # (the executor processes inherit it)
    torch.cuda.init()
    with Engine(plan(), mode) as engine:
        assert engine.generate({"prompt": "fine"})["out"] == "FINE"
        with pytest.raises(RequestFailed, match=f"stage 'up' failed: .*{TORCH_MESSAGE}"):
            engine.generate({"prompt": "sync now"})
        assert engine.generate({"prompt": "fine again"})["out"] == "FINE AGAIN"
    assert torch.cuda.get_sync_debug_mode() == 0  # only steps ran under it


@pytest.mark.gpu
def test_with_warn_the_interpreter_names_each_sync_with_its_stack(monkeypatch, capfd):
    monkeypatch.setenv(ENV, "warn")
    torch.cuda.init()
    out = Interpreter(plan()).run({"prompt": "sync now"})["out"]
    assert out == "SYNC NOW"
    err = capfd.readouterr().err
    assert f"host sync in a stage's step ({TORCH_MESSAGE}" in err
    assert "in sync_when_asked" in err and "interpreter.py" in err  # the stack that reached it
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.gpu
def test_with_error_a_wait_for_a_read_back_still_on_its_way_is_named():
    """Torch's mode does not see an event's wait; `HostCopy.wait` names one that would
    block, and lets one that has landed through."""
    torch.cuda.init()
    torch.cuda._sleep(1_000_000_000)  # about half a second queued before the copy
    copy = HostCopies().copy(torch.ones(4, device="cuda"))
    on_its_way = f"{TORCH_MESSAGE}: a read-back still on its way"
    with pytest.raises(RuntimeError, match=on_its_way), StepSyncs("error"):
        copy.wait()
    copy.wait()  # outside a step it waits, as it always did
    with StepSyncs("error"):
        copy.wait()  # landed: no wait
    assert copy.value.tolist() == [1.0] * 4
