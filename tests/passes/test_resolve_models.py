import pytest

from omniflow.errors import GraphError, ModelConfigError, PassError
from tests.passes.helpers import run_until


def test_each_stage_gets_its_component_config():
    graph = run_until("resolve_models", "omni_chat")
    thinker, talker, code2wav = (
        graph.node(n).meta["model"].config for n in ("thinker", "talker", "code2wav")
    )
    assert thinker.component == "thinker" and thinker.hidden_size == 3584
    assert talker.component == "talker"
    assert code2wav.category == "vocoder"


def test_unknown_model_fails_in_this_pass_at_its_model_line():
    src = 'pipeline p { model "nobody/nothing-7B"\n stage lm = ar()\n input x: chat -> lm\n lm.text -> output t }'
    with pytest.raises(PassError, match="pass 'resolve_models'") as info:
        run_until("resolve_models", src)
    cause = info.value.cause
    assert isinstance(cause, GraphError) and isinstance(cause.__cause__, ModelConfigError)
    assert "unknown model 'nobody/nothing-7B'" in cause.message
    assert (cause.span.line, cause.span.col) == (1, 14)  # `model "..."`


@pytest.mark.parametrize(
    "stage, col, says",
    [('ar(model="nobody/nothing-7B", component="thinker")', 22, "unknown model"),
     ('ar(component="thinkr")', 26, "did you mean 'thinker'")],
)  # fmt: skip
def test_a_stages_model_or_component_that_does_not_exist_is_named_where_it_is_given(
    stage, col, says
):
    """The stage's own `model=` or `component=` argument, with a caret under its value."""
    src = (
        f'pipeline p {{ model "Qwen/Qwen2.5-Omni-7B"\n stage lm = {stage}\n'
        " input x: chat -> lm\n lm.text -> output t }"
    )
    with pytest.raises(PassError) as info:
        run_until("resolve_models", src)
    cause = info.value.cause
    assert says in cause.message and (cause.span.line, cause.span.col) == (2, col)
    assert str(cause).splitlines()[2].strip().startswith("^")
