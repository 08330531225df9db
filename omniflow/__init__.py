"""omniflow: compile `.omni` pipeline descriptions into plans and serve them."""

from omniflow.errors import OmniflowError
from omniflow.ir.python_api import Pipeline, auto, param

__all__ = ["OmniflowError", "Pipeline", "auto", "compile", "launch", "param"]
__version__ = "0.1.0"


def compile(source, devices: str = "cpu", tiny: bool = False):  # noqa: A001 (the verb is the API)
    """A `.omni` path or a Graph -> its Plan."""
    from omniflow.compiler import compile_file, compile_graph
    from omniflow.ir.graph import Graph

    if isinstance(source, Graph):
        return compile_graph(source, devices)
    return compile_file(source, devices, tiny=tiny)


def launch(source, mode: str = "process", devices: str = "cpu", backends: str = "auto"):
    """A running Engine for a `.omni` file, a plan JSON file, a Graph or a Plan (see
    `omniflow.runtime.engine.launch`); imported lazily so that `import omniflow` stays light."""
    from omniflow.runtime.engine import launch as _launch

    return _launch(source, mode=mode, devices=devices, backends=backends)
