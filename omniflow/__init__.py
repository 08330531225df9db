"""omniflow: compile `.omni` pipeline descriptions into plans and serve them."""

from omniflow.errors import OmniflowError
from omniflow.ir.builder import Pipeline, auto, param

__all__ = ["OmniflowError", "Pipeline", "auto", "param"]
__version__ = "0.1.0"
