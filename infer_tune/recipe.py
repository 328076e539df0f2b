"""Recipes: a workload plus a list of technique configs, in YAML (read with `yaml.safe_load`'s loader,
aliases refused).

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

A recipe names its engine (infer_tune/engines, `ENGINES`) with `engine:`; without it the configs run in
this process on the engine each one runs on (torch, or lean for the lean path). An in-process engine must run
every config (`supports`). An engine run from its own settings (`Engine.takes_settings`: llama.cpp, vllm, sglang launched on loopback;
openvino in-process) takes `settings` (its keys: engines/launch.py's tables, engines/openvino.py `Settings`)
and no configs: `bench --recipe` measures it through the engine's scenario, as `bench --engine E --set` does.

```yaml
description: the winner of tune --engine llama.cpp
model: smollm2-135m
engine: llama.cpp
settings: {gguf: q4_0, parallel: "2"}
workload: {suite: chat, limit: 4, max_new_tokens: 32}
provenance: {argv: [...], command: "...", gguf: {...}}   # what produced it: kept, never read
```
One format: the launch files of earlier versions (`engine_launch: {...}`) are refused as unknown keys (write
their engine, model and settings at the top).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from infer_tune.errors import ConfigError
from infer_tune.workload import Protocol, Workload

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few lines; a larger file is refused before it is parsed


class _AliasRefused(Exception):
    """A YAML alias (`*name`) met while composing: refused, so nested aliases cannot expand exponentially."""


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (anchors alone are harmless: nothing is repeated)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(f"*{event.anchor} at line {event.start_mark.line + 1}")
        return super().compose_node(parent, index)


def safe_load(text: str, what: str) -> Any:
    """`yaml.safe_load` without aliases; ConfigError with one line naming `what` on any problem."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader subclass)
    except _AliasRefused as exc:
        raise ConfigError(f"{what} uses a YAML alias ({exc}); aliases are refused (nested ones expand "
                          "exponentially): write the values out") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply") from None


@dataclass
class Recipe:
    name: str
    description: str = ""
    model: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=dict)
    configs: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    engine: str | None = None  # a registered engine (engines/base.py); None: each config's own in-process engine
    settings: dict[str, Any] = field(default_factory=dict)  # a launched engine's settings (engines/launch.py)
    provenance: dict[str, Any] = field(default_factory=dict)  # what produced the recipe (argv, digests): not read


STAGE_KEYS = ("name", "description", "model", "workload", "protocol", "configs")


def expand_stages(recipe: Recipe) -> list[Recipe]:
    """The recipe as a list of stages, each measured against its own baseline: the top-level `configs`
    (when there are any, or when there are no stages) and then every entry of `stages`, whose model,
    workload and protocol default to (and are layered over) the top level's."""
    out = []
    if recipe.configs or not recipe.stages:
        out.append(dataclasses.replace(recipe, stages=[]))
    for i, stage in enumerate(recipe.stages):
        where = f"recipe {recipe.name}: stages[{i}]"
        if not isinstance(stage, dict):
            raise ConfigError(f"{where} must be a mapping with name/model/workload/configs keys")
        unknown = set(stage) - set(STAGE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}; allowed: {', '.join(STAGE_KEYS)}")
        check_types(Recipe, {k: v for k, v in stage.items() if k != "name"}, where)
        name = stage.get("name", str(i))
        if not isinstance(name, str):
            raise ConfigError(f"{where}: name must be a string, got {name!r}")
        out.append(Recipe(name=f"{recipe.name}/{name}", description=stage.get("description", ""),
                          model=stage.get("model") or recipe.model,
                          workload={**recipe.workload, **(stage.get("workload") or {})},
                          protocol={**recipe.protocol, **(stage.get("protocol") or {})},
                          configs=list(stage.get("configs") or []), engine=recipe.engine))
    return out


def builtin_recipes() -> dict[str, str]:
    """Name -> description of the recipes shipped with infer-tune."""
    found = {}
    for entry in resources.files("infer_tune.recipes").iterdir():
        if entry.name.endswith(".yaml"):
            doc = safe_load(entry.read_text(encoding="utf-8"), f"recipe {entry.name}") or {}
            found[entry.name.removesuffix(".yaml")] = str(doc.get("description", ""))
    return found


def _read(path: Path, name_or_path: str) -> str:
    if path.is_dir():
        raise ConfigError(f"recipe {name_or_path} is a directory; give a .yaml file")
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {name_or_path}")
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise ConfigError(f"recipe {name_or_path} is over {MAX_RECIPE_BYTES >> 10} KiB; a recipe is a few lines")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {name_or_path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"recipe {name_or_path} is not readable: {exc.strerror or exc}") from None


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a YAML file; unknown keys and values of the wrong type are refused
    with one line naming the key."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, name = _read(path, name_or_path), path.stem
    else:
        entry = resources.files("infer_tune.recipes").joinpath(f"{name_or_path}.yaml")
        if not entry.is_file():
            known = ", ".join(sorted(builtin_recipes())) or "none"
            raise ConfigError(f"unknown recipe '{name_or_path}': built-in recipes are {known}, or give a .yaml path")
        text, name = entry.read_text(encoding="utf-8"), name_or_path
    doc = safe_load(text, f"recipe {name_or_path}")
    if not isinstance(doc, dict):
        raise ConfigError(f"recipe {name_or_path} must be a mapping with workload/configs keys")
    check_keys(doc, f"recipe {name_or_path}")
    allowed = {f.name for f in dataclasses.fields(Recipe)} - {"name"}
    unknown = set(doc) - allowed
    if unknown:
        raise ConfigError(f"recipe {name_or_path}: unknown keys {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(allowed))}")
    check_types(Recipe, doc, f"recipe {name_or_path}")
    for i, entry in enumerate(doc.get("configs") or []):
        if isinstance(entry, dict):
            check_keys(entry, f"recipe {name_or_path}: configs[{i}]")
    recipe = Recipe(name=name, **doc)
    check_engine(recipe)
    return recipe


def check_engine(recipe: Recipe) -> None:
    """The recipe's engine is registered; a launched engine has settings (checked against its table) and no
    configs; an in-process engine has no settings and runs every config (ConfigError naming the recipe)."""
    if recipe.engine is None:
        if recipe.settings:
            raise ConfigError(f"recipe {recipe.name}: settings are a launched engine's: name it with engine:")
        return
    from infer_tune.engines.base import ENGINES, resolve

    engine = ENGINES[resolve(recipe.engine, where=f"recipe {recipe.name}: engine")]
    if engine.takes_settings:
        if recipe.configs or recipe.stages:
            raise ConfigError(f"recipe {recipe.name}: engine {engine.name} runs from its settings; "
                              "configs and stages run in this process (leave engine: out for them)")
        if not recipe.model:
            raise ConfigError(f"recipe {recipe.name}: engine {engine.name} needs the model it runs (model:)")
        engine.parse_settings(dict(recipe.settings))  # names a bad key or value
        return
    if recipe.settings:
        raise ConfigError(f"recipe {recipe.name}: engine {engine.name} takes no settings (its configs say what "
                          "runs); settings are those of an engine run from them "
                          f"({', '.join(e.name for e in ENGINES.values() if e.takes_settings)})")
    if engine.starts != "in-process":
        raise ConfigError(f"recipe {recipe.name}: engine {engine.name} is measured as it runs: "
                          "use bench --endpoint URL")


def engine_settings(recipe: Recipe, sets: list[str] | tuple[str, ...] = ()) -> tuple[str, dict] | None:
    """(engine, settings) of a recipe whose engine runs from its settings (a launched server, OpenVINO), `--set`
    pairs layered over the recipe's; None for a recipe of in-process configs."""
    if recipe.engine is None:
        return None
    from infer_tune.engines.base import ENGINES, resolve

    engine = ENGINES[resolve(recipe.engine)]
    if not engine.takes_settings:
        return None
    return engine.name, {**engine.parse_settings(dict(recipe.settings)), **engine.parse_settings(sets)}


def engine_launch(recipe: Recipe, sets: list[str] | tuple[str, ...] = ()):
    """The launch (engines/launch.py `Launch`) a recipe of a launched engine names, `--set` pairs layered
    over its settings; None for a recipe of in-process configs or of an in-process engine's settings."""
    found = engine_settings(recipe, sets)
    if found is None:
        return None
    from infer_tune.engines.base import ENGINES

    if ENGINES[found[0]].setting_table is None:
        return None
    from infer_tune.engines import launch

    return launch.Launch(found[0], str(recipe.model), found[1])


def check_supported(recipe: Recipe, configs: list) -> None:
    """An in-process recipe's engine runs each of its configs (`Engine.supports`), else one line why not."""
    if recipe.engine is None:
        return
    from infer_tune.engines.base import ENGINES, resolve

    engine = ENGINES[resolve(recipe.engine)]
    for i, config in enumerate(configs):
        why = engine.supports(config)
        if why:
            raise ConfigError(f"recipe {recipe.name}: configs[{i}]: {why}")


# --------------------------------------------------------------------------- type checks
def check_keys(mapping: dict, where: str) -> None:
    """Every key of a mapping (and of mappings inside it) must be a string."""
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is a {type(key).__name__}; keys must be names (strings)")
        if isinstance(value, dict):
            check_keys(value, f"{where}.{key}")


def _describe(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (list, dict, tuple):
        return {list: "a list", dict: "a mapping", tuple: "a list"}[typing.get_origin(annotation)]
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            Path: "a path"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def matches(value: Any, annotation: Any) -> bool:
    """Whether a YAML value fits a dataclass annotation (bool is not an int; an int is a float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if annotation is type(None) or annotation is None:
        return value is None
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is Literal:
        return value in args
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (str, Path):
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return isinstance(value, list) and (not args or all(matches(v, args[0]) for v in value))
    if origin is dict or annotation is dict:
        return isinstance(value, dict) and (not args or all(matches(v, args[1]) for v in value.values()))
    return True  # an annotation this check does not know: the dataclass validates it itself


def check_types(cls: type, values: dict, where: str) -> None:
    """Each value of `values` must fit the annotation of `cls`'s field of that name (ConfigError naming
    the key, the expected type and the value otherwise)."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key in hints and not matches(value, hints[key]):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(f"{where}: {key} must be {_describe(hints[key])}, got {shown} "
                              f"({type(value).__name__})")


def build_workload(recipe: Recipe, overrides: dict[str, Any]) -> Workload:
    """The recipe's workload with command-line values layered on top (only those the user set)."""
    fields = {f.name for f in dataclasses.fields(Workload)}
    unknown = set(recipe.workload) - fields
    if unknown:
        raise ConfigError(f"recipe {recipe.name}: unknown workload keys {', '.join(sorted(unknown))}")
    check_types(Workload, recipe.workload, f"recipe {recipe.name}: workload")
    return Workload(**{**recipe.workload, **overrides})


def build_protocol(recipe: Recipe, overrides: dict[str, Any]) -> Protocol:
    fields = {f.name for f in dataclasses.fields(Protocol)}
    unknown = set(recipe.protocol) - fields
    if unknown:
        raise ConfigError(f"recipe {recipe.name}: unknown protocol keys {', '.join(sorted(unknown))}")
    check_types(Protocol, recipe.protocol, f"recipe {recipe.name}: protocol")
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
        if not isinstance(technique, str):
            raise ConfigError(f"recipe {recipe.name}: configs[{i}] technique must be a name, got {technique!r}")
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
        check_types(cls, params, f"recipe {recipe.name}: configs[{i}] ({technique})")
        try:
            configs.append(cls(**params))
        except (TypeError, ValueError) as exc:  # a config's own validation that is not a ConfigError
            raise ConfigError(f"recipe {recipe.name}: configs[{i}] ({technique}): {exc}") from None
    check_supported(recipe, configs)
    return configs
