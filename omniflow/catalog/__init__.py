"""omniflow.catalog: what the compiler knows about the models its stages run.

`components` finds a component's configuration (local directory, Hugging Face cache, or the
builtin catalog of published configs, which the model families carry) as a
`ComponentConfig` with the shape facts the type pass needs; `costs` turns one into a
`StageCost` (parameters, weight / KV-cache / activation bytes, FLOPs per item) for the
memory & cost pass; `resolve` says where a stage's checkpoint is. None of them touches the
network or loads a weight.

What a model family says of its checkpoints (how their components sit in the config files,
the formulas of its architectures' costs, their tiny counterparts) comes from its descriptor
in `omniflow.families`; what runs a model is the family's run-time half, which this package
never imports.
"""

from omniflow.catalog.components import (
    CATEGORIES,
    ComponentConfig,
    builtin_files,
    count_checkpoint_parameters,
    hub_cache_dir,
    known_models,
    load_component_config,
)
from omniflow.catalog.costs import StageCost, count_parameters, estimate_cost

__all__ = [
    "CATEGORIES",
    "ComponentConfig",
    "StageCost",
    "builtin_files",
    "count_checkpoint_parameters",
    "count_parameters",
    "estimate_cost",
    "hub_cache_dir",
    "known_models",
    "load_component_config",
]
