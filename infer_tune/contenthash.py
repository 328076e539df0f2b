"""Content identities for fingerprints: the sha256 of a file's bytes or of a folder's files.

Two runs are the same measurement only if they read the same bytes, wherever those bytes live, so
fingerprints hold these digests instead of paths. Hashing a model's weights costs about a second per
GB once; digests are then cached in `$INFER_TUNE_HOME/content-hashes.json`, keyed by the file's
real path, size, modification time (ns), inode and device: any rewrite of the file changes the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

CACHE_NAME = "content-hashes.json"
CACHE_MIN_BYTES = 1 << 20  # smaller files are hashed every time (cheaper than a cache entry)
_lock = threading.Lock()
_cache: dict[str, dict] | None = None


def _cache_file() -> Path | None:
    from infer_tune import paths

    try:
        return paths.home() / CACHE_NAME
    except Exception:  # an unusable home only costs re-hashing
        return None


def _load_cache() -> dict[str, dict]:
    global _cache
    if _cache is None:
        _cache = {}
        file = _cache_file()
        if file is not None:
            try:
                loaded = json.loads(file.read_text(encoding="utf-8"))
                _cache = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                pass
    return _cache


def _store(key: str, entry: dict) -> None:
    from infer_tune import atomic

    cache = _load_cache()
    cache[key] = entry
    file = _cache_file()
    if file is not None:
        try:
            atomic.write_json(file, cache)
        except OSError:
            pass


def sha256_of(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read now (no cache: for checks that must see the file as it is)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, from the cache when the file is unchanged."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
    with _lock:
        entry = _load_cache().get(real)
        if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    value = sha256_of(real)
    if st.st_size >= CACHE_MIN_BYTES:
        with _lock:
            _store(real, {"stat": stamp, "sha256": value})
    return value


def tree_digest(folder: str | Path) -> str:
    """sha256 over (relative name, file digest) of every regular file under `folder` (hidden names
    and staging leftovers excluded), in name order."""
    root = Path(folder)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        digest.update(f"{rel.as_posix()}\0{file_digest(file)}\n".encode())
    return digest.hexdigest()
