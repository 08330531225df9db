"""omniflow: compile `.omni` pipeline descriptions into plans and serve them."""

from omniflow.errors import OmniflowError

__all__ = ["OmniflowError"]
__version__ = "0.1.0"
