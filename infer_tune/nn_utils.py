"""Module surgery shared by the techniques that swap layers."""

from __future__ import annotations

from torch import nn


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path `name` by `module`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def shallow_clone(model: nn.Module) -> nn.Module:
    """A second top-level module object over the same parameters and submodules: attributes set on it
    (a replaced `generate`), hooks registered on it and its generation config are its own, so a
    technique that instruments the model in place leaves the original (measured beside it in the same
    rounds) untouched. Costs no weight memory."""
    import copy

    clone = copy.copy(model)
    for name, value in list(vars(model).items()):
        if isinstance(value, dict):  # _modules, _parameters, _buffers and every hook dict: own containers
            vars(clone)[name] = type(value)(value)
    if getattr(model, "generation_config", None) is not None:
        clone.generation_config = copy.deepcopy(model.generation_config)
    return clone
