"""The tuner registry: `apply(loaded, config)` dispatches on `type(config)` through one dict.

A technique module defines a `TechniqueConfig` subclass (a dataclass that validates itself in
`__post_init__` and names the field, the allowed values and what it received) and registers its
apply function with `@register_tuner(ConfigClass)`. No string if/elif chains.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, ClassVar

from infer_tune.errors import ConfigError
from infer_tune.models import LoadedModel
from infer_tune.runners.prepared import PreparedModel

# Technique modules, imported on first use so that their configs register themselves.
TECHNIQUE_MODULES = ("infer_tune.tuners.quantize", "infer_tune.tuners.kv_cache")

ApplyFn = Callable[[LoadedModel, "TechniqueConfig"], PreparedModel]
TUNERS: dict[type, ApplyFn] = {}
CONFIG_CLASSES: dict[str, type] = {}


@dataclasses.dataclass
class TechniqueConfig:
    """Base of every technique config; `technique` is the result's `technique` value."""

    technique: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}

    def label(self) -> str:
        """Short human summary for leaderboards and run ids."""
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v is not None)


def register_tuner(config_cls: type) -> Callable[[ApplyFn], ApplyFn]:
    """Register `apply(loaded, config) -> PreparedModel` for `config_cls`."""

    def decorator(fn: ApplyFn) -> ApplyFn:
        TUNERS[config_cls] = fn
        CONFIG_CLASSES[config_cls.__name__] = config_cls
        return fn

    return decorator


def load_techniques() -> None:
    for name in TECHNIQUE_MODULES:
        importlib.import_module(name)


def apply(loaded: LoadedModel, config: TechniqueConfig) -> PreparedModel:
    load_techniques()
    try:
        fn = TUNERS[type(config)]
    except KeyError:
        raise ConfigError(f"no tuner registered for {type(config).__name__}") from None
    return fn(loaded, config)


def configs_by_technique() -> dict[str, type]:
    """Technique name -> its config class (the class a recipe's `technique:` key selects)."""
    load_techniques()
    return {cls.technique: cls for cls in TUNERS if getattr(cls, "technique", "")}


def config_from_dict(data: dict[str, Any]) -> TechniqueConfig:
    """Rebuild a config from `to_dict()` output; only registered classes are accepted."""
    load_techniques()
    kind = data.get("kind")
    cls = CONFIG_CLASSES.get(kind)
    if cls is None:
        raise ConfigError(f"unknown config kind {kind!r}; known: {', '.join(sorted(CONFIG_CLASSES)) or 'none'}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields - {"kind"}
    if unknown:
        raise ConfigError(f"{kind}: unknown fields {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(fields))}")
    return cls(**{k: v for k, v in data.items() if k != "kind"})
