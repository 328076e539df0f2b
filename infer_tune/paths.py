"""Where infer-tune keeps its cache (converted models, bandwidth readings, prepared suites)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from infer_tune.errors import InferTuneError


def home() -> Path:
    """`$INFER_TUNE_HOME` (`~` expanded), default `~/.cache/infer-tune`; created on first use."""
    root = Path(os.environ.get("INFER_TUNE_HOME") or Path.home() / ".cache" / "infer-tune").expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InferTuneError(f"INFER_TUNE_HOME {root} cannot be created: {exc.strerror or exc}") from None
    return root


def ensure_writable(folder: str | Path, what: str) -> Path:
    """Pre-flight: `folder` (`~` expanded) can be created and written. A test file is written and
    removed, and folders created only for the test are removed again (nothing is left behind)."""
    folder = Path(folder).expanduser()
    created: list[Path] = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise InferTuneError(f"{what} {folder}: {probe} is a file, not a folder")
    try:
        for path in reversed(created):
            path.mkdir()
        test = folder / f".infer-tune-write-test-{os.getpid()}-{secrets.token_hex(4)}"
        test.write_bytes(b"")
        test.unlink()
    except OSError as exc:
        raise InferTuneError(f"{what} {folder} is not writable: {exc.strerror or exc}") from None
    finally:
        for path in created:
            try:
                path.rmdir()
            except OSError:
                pass
    return folder


def models_dir() -> Path:
    path = home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    path = home() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path
