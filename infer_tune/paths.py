"""Where infer-tune keeps its cache (converted models, bandwidth readings, prepared suites)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """`$INFER_TUNE_HOME`, default `~/.cache/infer-tune`; created on first use."""
    root = Path(os.environ.get("INFER_TUNE_HOME") or Path.home() / ".cache" / "infer-tune")
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    path = home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    path = home() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path
