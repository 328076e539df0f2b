"""Techniques: one package each, a config dataclass plus one registered entry (see `base`)."""

from infer_tune.tuners.base import (
    TECHNIQUES,
    Offer,
    RunContext,
    Technique,
    TechniqueConfig,
    TuneAsk,
    Tuning,
    apply,
    configs_by_technique,
    load_techniques,
    register_technique,
    technique_for,
    tuning_entries,
    unregister_technique,
)

__all__ = ["TECHNIQUES", "Offer", "RunContext", "Technique", "TechniqueConfig", "TuneAsk", "Tuning", "apply",
           "configs_by_technique", "load_techniques", "register_technique", "technique_for", "tuning_entries",
           "unregister_technique"]
