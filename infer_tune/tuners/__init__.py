"""Techniques: one package each, a config dataclass plus one registered entry (see `base`).

Importing this package tells `models` how to fill its registries (built models, saved-directory loaders):
by importing every technique package (`load_techniques`), so models names no technique and imports none.
"""

from infer_tune import models as _models
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

_models.add_registry_filler(load_techniques)
