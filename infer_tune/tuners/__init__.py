"""Techniques: one package each, a config dataclass plus one registered entry (see `base`)."""

from infer_tune.tuners.base import (
    TECHNIQUES,
    RunContext,
    Technique,
    TechniqueConfig,
    apply,
    configs_by_technique,
    load_techniques,
    register_technique,
    technique_for,
    unregister_technique,
)

__all__ = ["TECHNIQUES", "RunContext", "Technique", "TechniqueConfig", "apply", "configs_by_technique",
           "load_techniques", "register_technique", "technique_for", "unregister_technique"]
