"""Recipes: a workload plus a list of technique configs, in YAML (read with `yaml.safe_load`).

```yaml
description: INT8 and bf16 against the fp32 baseline on chat prompts
workload: {suite: chat, limit: 4, max_new_tokens: 32}
protocol: {warmup: 1, min_iterations: 2, min_duration_s: 5}
configs:
  - {technique: quantize, method: int8-dynamic}
  - {technique: quantize, method: bf16}
```
Each config names a registered technique; its other keys are that technique's config fields.
Built-in recipes ship inside the wheel (`infer_tune.recipes`); a path to a .yaml file works too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from infer_tune.errors import ConfigError
from infer_tune.workload import Protocol, Workload


@dataclass
class Recipe:
    name: str
    description: str = ""
    model: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=dict)
    configs: list[dict[str, Any]] = field(default_factory=list)


def builtin_recipes() -> dict[str, str]:
    """Name -> description of the recipes shipped with infer-tune."""
    found = {}
    for entry in resources.files("infer_tune.recipes").iterdir():
        if entry.name.endswith(".yaml"):
            doc = yaml.safe_load(entry.read_text(encoding="utf-8")) or {}
            found[entry.name.removesuffix(".yaml")] = str(doc.get("description", ""))
    return found


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a YAML file; unknown keys are refused with the allowed ones."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {name_or_path}")
        text, name = path.read_text(encoding="utf-8"), path.stem
    else:
        entry = resources.files("infer_tune.recipes").joinpath(f"{name_or_path}.yaml")
        if not entry.is_file():
            known = ", ".join(sorted(builtin_recipes())) or "none"
            raise ConfigError(f"unknown recipe '{name_or_path}': built-in recipes are {known}, or give a .yaml path")
        text, name = entry.read_text(encoding="utf-8"), name_or_path
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {name_or_path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"recipe {name_or_path} must be a mapping with workload/configs keys")
    allowed = {f.name for f in dataclasses.fields(Recipe)} - {"name"}
    unknown = set(doc) - allowed
    if unknown:
        raise ConfigError(f"recipe {name_or_path}: unknown keys {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(allowed))}")
    recipe = Recipe(name=name, **doc)
    if not isinstance(recipe.configs, list):
        raise ConfigError(f"recipe {name_or_path}: configs must be a list")
    return recipe


def build_workload(recipe: Recipe, overrides: dict[str, Any]) -> Workload:
    """The recipe's workload with command-line values layered on top (only those the user set)."""
    fields = {f.name for f in dataclasses.fields(Workload)}
    unknown = set(recipe.workload) - fields
    if unknown:
        raise ConfigError(f"recipe {recipe.name}: unknown workload keys {', '.join(sorted(unknown))}")
    return Workload(**{**recipe.workload, **overrides})


def build_protocol(recipe: Recipe, overrides: dict[str, Any]) -> Protocol:
    fields = {f.name for f in dataclasses.fields(Protocol)}
    unknown = set(recipe.protocol) - fields
    if unknown:
        raise ConfigError(f"recipe {recipe.name}: unknown protocol keys {', '.join(sorted(unknown))}")
    return Protocol(**{**recipe.protocol, **overrides})


def build_configs(recipe: Recipe) -> list:
    """Technique configs from the recipe, through the tuner registry (only registered techniques)."""
    from infer_tune import tuners

    by_technique = tuners.configs_by_technique()
    configs = []
    for i, entry in enumerate(recipe.configs):
        if not isinstance(entry, dict) or "technique" not in entry:
            raise ConfigError(f"recipe {recipe.name}: configs[{i}] needs a 'technique' key")
        technique = entry["technique"]
        cls = by_technique.get(technique)
        if cls is None:
            raise ConfigError(f"recipe {recipe.name}: configs[{i}] technique '{technique}' is not one of "
                              f"{', '.join(sorted(by_technique))}")
        fields = {f.name for f in dataclasses.fields(cls)}
        params = {k: v for k, v in entry.items() if k != "technique"}
        unknown = set(params) - fields
        if unknown:
            raise ConfigError(f"recipe {recipe.name}: configs[{i}] ({technique}) unknown fields "
                              f"{', '.join(sorted(unknown))}; allowed: {', '.join(sorted(fields))}")
        configs.append(cls(**params))
    return configs
