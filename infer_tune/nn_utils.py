"""Module surgery shared by the techniques that swap layers."""

from __future__ import annotations

from torch import nn


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path `name` by `module`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
