"""Atomic file and directory writes: a reader sees the old state or the whole new one, never half,
and never a moment where the target is missing.

- Files: written to a temp file in the same folder, flushed and fsync'ed, renamed into place, and
  the folder fsync'ed; created readable by the group and others as the umask allows (CI artifacts),
  not 0600 as `mkstemp` would leave them.
- Folders (`staged_dir`): built under a hidden staging name that carries the writer's pid, every file
  fsync'ed, then moved into place: without replacing (`exists="error"`, a run folder), keeping the
  one already there (`"keep"`, two processes converting the same model), or swapped in one atomic
  exchange (`"replace"`, `--overwrite`; Linux renameat2, else two renames).
- Staging folders left by a killed process are removed by `clean_stale` on the next run.
- What is written into `$INFER_TUNE_HOME` (models, GGUFs, caches) is private whatever the umask: folders
  0700, files without group or other bits (under `umask 000` a pulled model was world-writable, and
  infer-tune loads and runs what the home holds).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STAGING_TAG = ".tmp-"
STALE_AFTER_S = 24 * 3600  # a staging folder whose owner cannot be checked is removed after this


def umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _private(path: Path) -> bool:
    from infer_tune import paths

    return paths.in_home(path)


def _make_private(tree: Path) -> None:
    """Take group and other bits off every folder and file under `tree` (symlinks are left alone)."""
    for root, _dirs, files in os.walk(tree):
        os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) & 0o700)
        for name in files:
            item = os.path.join(root, name)
            info = os.lstat(item)
            if stat.S_ISREG(info.st_mode):
                os.chmod(item, stat.S_IMODE(info.st_mode) & 0o700)


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path`: temp file, fsync, rename, fsync of the folder; mode 0666 & ~umask (0600 and
    missing folders 0700 in `$INFER_TUNE_HOME`)."""
    from infer_tune import paths

    path = Path(path)
    private = _private(path)
    if private:
        paths.private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}{STAGING_TAG}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666 & ~umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) atomically, as `write_bytes`."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, document: Any) -> None:
    write_text(path, json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")


def check_free_space(folder: Path, need_bytes: int, what: str) -> None:
    """Refuse (InferTuneError) before writing `need_bytes` into `folder` when the disk lacks room."""
    from infer_tune.errors import InferTuneError

    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need_bytes > free:
        raise InferTuneError(f"not enough disk space for {what} in {folder}: needs about "
                             f"{need_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")


# --------------------------------------------------------------------------- folders
_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False when the system or filesystem does not support it (caller falls back)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _move_into_place(tmp: Path, final: Path, exists: str) -> bool:
    """Move `tmp` to `final` per `exists`; returns False when an existing `final` was kept."""
    if exists == "replace" and final.exists():
        if _renameat2(tmp, final, _RENAME_EXCHANGE):  # one atomic swap: `final` never missing
            shutil.rmtree(tmp, ignore_errors=True)
            return True
        old = final.parent / f".{final.name}.old{STAGING_TAG}{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return True
    try:
        if not _renameat2(tmp, final, _RENAME_NOREPLACE):
            if final.exists():
                raise FileExistsError(errno.EEXIST, "exists", str(final))
            os.rename(tmp, final)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        if exists == "keep":
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        if exists == "replace":
            return _move_into_place(tmp, final, exists)
        raise FileExistsError(errno.EEXIST, f"{final} already exists", str(final)) from None
    return True


@contextmanager
def staged_dir(final: Path, *, exists: str = "replace") -> Iterator[Path]:
    """Yield a hidden staging folder next to `final`; move it into place only if the block succeeds.

    `exists` says what to do when `final` is already there at the end: "replace" (atomically),
    "keep" (discard the new one: another process produced it), "error" (FileExistsError).
    """
    if exists not in ("replace", "keep", "error"):
        raise ValueError(f"exists must be replace, keep or error, got {exists!r}")
    from infer_tune import paths

    final = Path(final)
    private = _private(final)
    if private:
        paths.private_dir(final.parent)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{STAGING_TAG}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700 if private else 0o777 & ~umask())
    try:
        yield tmp
        if private:
            _make_private(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, final, exists)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(folder: Path) -> list[Path]:
    """Remove staging leftovers in `folder` (a killed writer's): those whose pid is gone, and any older
    than a day. Returns what was removed."""
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(".") or STAGING_TAG not in entry.name:
            continue
        owner = entry.name.rsplit(STAGING_TAG, 1)[1].split("-", 1)[0]
        try:
            old = now - entry.lstat().st_mtime > STALE_AFTER_S
        except OSError:
            continue
        if (owner.isdigit() and int(owner) != os.getpid() and not pid_alive(int(owner))) or old:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


ARTIFACTS_PREFIX = "infer-tune-artifacts-"  # a run's scratch (quantized checkpoints: hundreds of MB each)
ARTIFACTS_STALE_UNNAMED_S = 3600


def artifacts_dir() -> Path:
    """A private scratch folder `$TMPDIR/infer-tune-artifacts-<pid>-*` for this run (removed at exit by its caller,
    and at the latest by the next run's `clean_stale_artifacts` once this pid is gone)."""
    clean_stale_artifacts()
    return Path(tempfile.mkdtemp(prefix=f"{ARTIFACTS_PREFIX}{os.getpid()}-"))


@contextmanager
def scratch() -> Iterator[Path]:
    """`artifacts_dir()` for the length of a `with`, removed after it."""
    folder = artifacts_dir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def clean_stale_artifacts(tmpdir: str | None = None) -> list[str]:
    """Remove this user's scratch folders left by runs that were killed: `infer-tune-artifacts-<pid>-*` whose pid
    no longer runs, and pid-less ones (older infer-tune) untouched for an hour. Other users' folders and
    symlinks are never touched. Returns the removed paths."""
    return clean_stale_dirs(ARTIFACTS_PREFIX, ARTIFACTS_STALE_UNNAMED_S, tmpdir)


def clean_stale_dirs(prefix: str, unnamed_after_s: float, tmpdir: str | None = None) -> list[str]:
    """Remove this user's `<prefix><pid>-*` folders in the temp directory whose process no longer runs (never
    this process's), and pid-less `<prefix>*` ones untouched for `unnamed_after_s`. Symlinks and other users'
    folders are never touched. Returns the removed paths."""
    named = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    root = tmpdir or tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        match = named.match(entry.name)
        stale = (int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1)))) if match \
            else time.time() - info.st_mtime > unnamed_after_s
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
