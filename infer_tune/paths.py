"""Where infer-tune keeps its cache (converted models, bandwidth readings, prepared suites)."""

from __future__ import annotations

import os
import secrets
import stat
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
    removed, and folders created only for the test are removed again (nothing is left behind).

    Safe when several commands check the same new folder at once: a folder another process made
    first counts as existing, and one it removed again under this check is made once more."""
    folder = Path(folder).expanduser()
    for _ in range(5):
        try:
            _probe_writable(folder, what)
            return folder
        except FileNotFoundError as exc:  # another pre-flight removed its folder under us: again
            lost = exc
    raise InferTuneError(f"{what} {folder} is not writable: {lost.strerror or lost}") from None


def _probe_writable(folder: Path, what: str) -> None:
    missing: list[Path] = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if _is_file(probe):
        raise InferTuneError(f"{what} {folder}: {probe} is a file, not a folder")
    created: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
                created.append(path)
            except FileExistsError:
                if _is_file(path):
                    raise InferTuneError(f"{what} {folder}: {path} is a file, not a folder") from None
        test = folder / f".infer-tune-write-test-{os.getpid()}-{secrets.token_hex(4)}"
        test.write_bytes(b"")
        test.unlink()
    except FileNotFoundError:
        raise  # ensure_writable tries again
    except OSError as exc:
        raise InferTuneError(f"{what} {folder} is not writable: {exc.strerror or exc}") from None
    finally:
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                pass


def _is_file(path: Path) -> bool:
    """Something other than a folder is at `path` (one stat: a folder removed meanwhile is not)."""
    try:
        return not stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        return False


def models_dir() -> Path:
    path = home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    path = home() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path
