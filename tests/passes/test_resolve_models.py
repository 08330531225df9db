import pytest

from omniflow.errors import ModelConfigError, PassError
from tests.passes.helpers import run_until


def test_each_stage_gets_its_component_config():
    graph = run_until("resolve_models", "omni_chat")
    thinker, talker, code2wav = (
        graph.node(n).meta["model"].config for n in ("thinker", "talker", "code2wav")
    )
    assert thinker.component == "thinker" and thinker.hidden_size == 3584
    assert talker.component == "talker"
    assert code2wav.category == "vocoder"


def test_unknown_model_fails_in_this_pass():
    src = 'pipeline p { model "nobody/nothing-7B"\n stage lm = ar()\n input x: chat -> lm\n lm.text -> output t }'
    with pytest.raises(PassError, match="pass 'resolve_models'") as info:
        run_until("resolve_models", src)
    assert isinstance(info.value.cause, ModelConfigError)
