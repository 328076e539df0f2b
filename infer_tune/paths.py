"""Where infer-tune keeps its cache (converted models, bandwidth readings, prepared suites)."""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

from infer_tune.errors import InferTuneError


def home_path() -> Path:
    """Where `home()` is, without creating it."""
    return Path(os.environ.get("INFER_TUNE_HOME") or Path.home() / ".cache" / "infer-tune").expanduser()


def in_home(path: str | Path) -> bool:
    """Whether `path` lies in `$INFER_TUNE_HOME` (what is written there is private whatever the umask)."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(home_path()))


def home() -> Path:
    """`$INFER_TUNE_HOME` (`~` expanded), default `~/.cache/infer-tune`; created on first use, private (0700)."""
    root = home_path()
    try:
        private_dir(root)
    except OSError as exc:
        raise InferTuneError(f"INFER_TUNE_HOME {root} cannot be created: {exc.strerror or exc}") from None
    return root


def ensure_writable(folder: str | Path, what: str) -> Path:
    """Pre-flight: `folder` (`~` expanded) can be created and written. A test file is written and
    removed, and folders created only for the test are removed again (nothing is left behind).

    Safe when several commands check the same new folder at once: a folder another process made
    first counts as existing, and one it removed again under this check is made once more."""
    folder = Path(folder).expanduser()
    for attempt in range(20):
        try:
            _probe_writable(folder, what)
            return folder
        except FileNotFoundError as exc:  # another pre-flight removed its folder under us: again, a little later
            lost = exc
            time.sleep(0.001 * secrets.randbelow(4 * (attempt + 1)))  # racing twins fall out of step
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
    return private_dir(home() / "models")


def data_dir() -> Path:
    return private_dir(home() / "data")


def private_dir(path: str | Path) -> Path:
    """Make `path` and any missing parents as folders only this user can enter (0700), whatever the umask
    (`mkdir` only clears bits of the mode it is given, so 0700 stays 0700 or less). Existing folders are
    left as they are: `untrusted` judges them."""
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    return path


def untrusted(path: str | Path, root: str | Path | None = None) -> str | None:
    """Why `path` (a file or folder at or under `root`, default `home()`) cannot be trusted to load or run
    as this user, or None. Every path from `root` down to `path` must belong to this user and be writable by
    no one else (group and others: no `w`), or another account could have put its own file there. A symlink
    below `root` is judged by what it points at (the link itself can only be changed through its folder,
    which is checked). docs/hardening.md, "Nothing another account wrote is loaded or run"."""
    path = Path(path)
    root = Path(root) if root is not None else home()
    try:
        relative = path.relative_to(root)
    except ValueError:
        return f"{path} is not under {root}"
    uid = os.getuid()
    chain = [root]
    for part in relative.parts:
        chain.append(chain[-1] / part)
    for item in chain:
        try:
            info = item.stat()
        except OSError as exc:
            return f"{item} cannot be read: {exc.strerror or exc}"
        if info.st_uid != uid:
            return f"{item} belongs to uid {info.st_uid}, not to this user (uid {uid})"
        if info.st_mode & 0o022:
            return f"{item} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def untrusted_anywhere(path: str | Path) -> str | None:
    """Why `path` (a file or folder anywhere, e.g. a source tree a trust file names) cannot be trusted to run
    as this user, or None: it and every folder above it, up to `/`, belong to this user or to root and are
    writable by no one else (group and others: no `w`; a root-owned folder with the sticky bit, like `/tmp`,
    passes: others can add to it but not replace what is ours). docs/hardening.md, "Nothing another account
    wrote is loaded or run"."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    uid = os.getuid()
    for item in [*reversed(path.parents), path]:
        try:
            info = item.stat()
        except OSError as exc:
            return f"{item} cannot be read: {exc.strerror or exc}"
        if info.st_uid not in (uid, 0):
            return f"{item} belongs to uid {info.st_uid}, not to this user (uid {uid}) or root"
        sticky_root = info.st_uid == 0 and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX and item != path
        if info.st_mode & 0o022 and not sticky_root:
            return f"{item} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None
