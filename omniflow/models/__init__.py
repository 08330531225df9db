"""omniflow.models: what the compiler knows about the models its stages run.

`catalog` finds a component's configuration (local directory, Hugging Face cache, or the
builtin catalog of published configs) as a `ComponentConfig` with the shape facts the type
pass needs; `costs` turns one into a `StageCost` (parameters, weight / KV-cache / activation
bytes, FLOPs per item) for the memory & cost pass. Neither touches the network or loads a
weight.
"""

from omniflow.models.catalog import (
    FAMILIES,
    ComponentConfig,
    builtin_files,
    count_checkpoint_parameters,
    hub_cache_dir,
    known_models,
    load_component_config,
)
from omniflow.models.costs import (
    DTYPE_BYTES,
    StageCost,
    count_parameters,
    dtype_bytes,
    estimate_cost,
)

__all__ = [
    "DTYPE_BYTES",
    "FAMILIES",
    "ComponentConfig",
    "StageCost",
    "builtin_files",
    "count_checkpoint_parameters",
    "count_parameters",
    "dtype_bytes",
    "estimate_cost",
    "hub_cache_dir",
    "known_models",
    "load_component_config",
]
