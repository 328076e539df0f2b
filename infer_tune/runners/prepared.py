"""What a tuner hands to a runner: the model to run and how to call `generate` on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PreparedModel:
    """A model after a technique was applied.

    `generate_kwargs` carry the technique into `generate` (cache implementation, assistant model,
    prompt lookup...); `metrics` are technique facts known before measuring (e.g. bytes saved);
    `device` is where inputs go.
    """

    model: torch.nn.Module
    tokenizer: Any
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    label: str = "baseline"
    device: str = "cpu"
