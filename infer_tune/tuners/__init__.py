"""One module per technique: a config dataclass plus a registered apply function."""

from infer_tune.tuners.base import (
    CONFIG_CLASSES,
    TUNERS,
    TechniqueConfig,
    apply,
    config_from_dict,
    configs_by_technique,
    register_tuner,
)

__all__ = ["CONFIG_CLASSES", "TUNERS", "TechniqueConfig", "apply", "config_from_dict", "configs_by_technique",
           "register_tuner"]
