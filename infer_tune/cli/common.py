"""Glue every command shares: error handling, thread setup, model loading with a clear message."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import typer

from infer_tune.cli import output
from infer_tune.errors import InferTuneError


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn InferTuneError into one line on stderr and exit code 2 (traceback only with --debug)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        try:
            return func(*args, **kwargs)
        except InferTuneError as exc:
            if debug:
                raise
            output.error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            output.error("interrupted; finished runs are kept, rerun with --resume to continue")
            raise typer.Exit(130) from None

    return wrapper


def setup_threads(threads: int | None) -> int:
    """Apply --threads (default: physical cores) to torch before any work."""
    import psutil
    import torch

    if threads is not None and threads < 1:
        raise InferTuneError(f"--threads must be >= 1, got {threads}")
    n = threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InferTuneError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise InferTuneError(f"unknown --device '{device}': use cpu, cuda or auto")
    return device
