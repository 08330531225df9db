"""omniflow.models: what the compiler knows about the models its stages run.

`catalog` finds a component's configuration (local directory, Hugging Face cache, or the
builtin catalog of published configs, `configs/*.json`) as a `ComponentConfig` with the
shape facts the type pass needs; `costs` turns one into a `StageCost` (parameters, weight /
KV-cache / activation bytes, FLOPs per item) for the memory & cost pass; `resolve` says
where a stage's checkpoint is. None of them touches the network or loads a weight.

What runs a model is not here: its model-specific code is in `omniflow.backends.models`,
and the builders of test checkpoints are in `omniflow.checkpoints`; this package imports
neither (but for `resolve.model_path`, which builds a `tiny:` model on first use).
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
from omniflow.models.costs import StageCost, count_parameters, estimate_cost

__all__ = [
    "FAMILIES",
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
